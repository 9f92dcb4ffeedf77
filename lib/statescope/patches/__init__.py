"""Patches: code that changes vLLM from inside — CPU import shims, CPU align-mode kernels, planted
faults, the overlap-safe copy, the accepted-count sync, the Qwen3.5 registration, and the registry
that names them.
"""
from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "install_cpu_kernels": "cpu_kernels", "FaultSpec": "faults", "install_fault": "faults",
    "uninstall_fault": "faults", "install_overlap_safe_copy": "overlap_safe",
    "overlap_safe_batch_memcpy": "overlap_safe", "uninstall_overlap_safe_copy": "overlap_safe",
    "enable_qwen35_text": "qwen35_mtp_compat", "PATCHES": "registry", "Patch": "registry",
    "apply_patches": "registry", "parse_patch": "registry",
})
