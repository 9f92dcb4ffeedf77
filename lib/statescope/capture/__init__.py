"""Capture: what runs inside vLLM while it serves — per request, step and GDN layer digests and
snapshots of the recurrent state and conv window, the copy census, prefix-cache hits and accepted
counts.
"""
from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "census_report": "census", "Digester": "digest", "install_from_env": "recorder",
    "boundary_prompts": "session", "perturbation_report": "session", "record": "session",
    "CaptureSpec": "spec", "recover": "spool", "CaptureRun": "store", "QWEN35_27B": "store",
    "estimate_capture_bytes": "store", "find_runs": "store", "gdn_geometry": "store",
    "snapshot_bytes": "store",
    "CaptureClock": "clock", "overhead_ratios": "overhead", "overhead_rounds": "overhead",
    "timed_round": "overhead", "probe_engine": "overhead_probe",
})
