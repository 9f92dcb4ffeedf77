"""Verdict: did corruption happen? — arms, degenerate-output detection, exact intervals, Fisher and
sequential tests, engagement guards, and the build x setting matrix.
"""
from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "classify_output": "detect", "label_records": "detect", "label_requests": "detect",
    "Experiment": "experiment",
    "cell_config": "matrix", "config_matrix": "matrix", "Arm": "reproduce", "ArmRun": "reproduce",
    "label_rows": "reproduce", "reproduce_with_capture": "reproduce",
    "run_arm": "reproduce", "standard_arms": "reproduce", "summarize_arm": "reproduce",
    "ArmSummary": "stats", "ArmVerdict": "stats", "CONTROL_BROKEN": "stats",
    "CORRUPTION_DETECTED": "stats", "ENGINE_BROKEN": "stats", "GEOMETRY_NOT_EXERCISED": "stats",
    "NO_EVIDENCE": "stats", "SPRT": "stats", "clopper_pearson": "stats", "decide": "stats",
    "fisher_exact_one_sided": "stats", "fisher_exact_two_sided": "stats",
    "median_interval": "stats", "requests_for_detection": "stats", "two_arm_sample_size": "stats",
    "arm_run_from_records": "rejudge", "verdict_rows": "rejudge",
})
