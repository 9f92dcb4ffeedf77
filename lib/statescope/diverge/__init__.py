"""Diverge: where did state first go wrong? — digest comparison with a reference, the first divergence
per request, replay, the noise rule, conv continuity and the hypothesis table.
"""
from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "clean_check": "by_position", "position_report": "by_position",
    "continuity_summary": "conv_continuity", "conv_shift_check": "conv_continuity",
    "run_continuity": "conv_continuity",
    "first_divergence": "digest_diff", "shifts_by_request": "digest_diff",
    "MechanismVerdict": "hypotheses", "RunContext": "hypotheses", "hypothesis_table": "hypotheses",
    "run_context": "hypotheses", "calibrate": "noise", "compare_states": "noise",
    "gdn_states": "oracle", "CapturedStates": "replay", "DivergenceReport": "report",
    "divergence_report": "report", "step_events": "report", "staggered_prompts": "study",
})
