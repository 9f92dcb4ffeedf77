"""Results: readers of committed results, by the question they answer (end-to-end verdicts, the factor
check, the patch check, the capture overhead).
"""
from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "verdict_table": "e2e", "departure_table": "e2e", "factor_table": "factors",
    "arms": "files", "manifest": "files", "records": "files", "read_jsonl": "files",
    "goal_check": "overhead", "overhead_rows": "overhead", "pooled_check": "overhead",
    "patch_table": "patch_check", "patch_verdicts": "patch_check",
})
