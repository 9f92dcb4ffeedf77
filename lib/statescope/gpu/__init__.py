"""GPU: questions only an accelerator answers — the copy-kernel race probe, kernel agreement with the
CPU kernels, the build decision and the end-to-end arms on the device.
"""
from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "CopyRaceOracle": "build_decision", "decide_builds": "build_decision",
    "e2e_trace": "e2e_arms", "run_one_arm": "e2e_arms", "agreement_table": "kernel_agreement",
    "load_kernel_source": "racecheck", "preset_shift_classes": "racecheck",
    "racecheck_table": "racecheck", "sweep_shift_classes": "racecheck",
})
