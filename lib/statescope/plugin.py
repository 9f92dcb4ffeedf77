"""statescope's vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls ``register()`` once in every process it starts (front end, engine core, workers) before
the worker is built. It applies the CPU import shims and, on a CPU build, installs statescope's CPU
implementations of the fused align-mode copy kernels (``statescope.patches.cpu_kernels``). A planted test
fault (``STATESCOPE_FAULT``, ``statescope.patches.faults``) and capture (``STATESCOPE_CAPTURE``) are
installed here too when their variables are set, and a device profile's in-process patches
(``STATESCOPE_PROFILE``, set by statescope for the servers it starts: ``statescope.patches.device_profiles``).

Deliberately a no-op beyond that: with no statescope settings in the environment it changes nothing
vLLM computes on a GPU build.
"""
from __future__ import annotations

import os


def register() -> None:
    """Entry point; must not raise for a GPU build or a missing optional piece."""
    from statescope.patches import shims

    shims.apply()
    if os.environ.get("STATESCOPE_PROFILE"):  # a statescope-started server: the profile's patches
        from statescope.patches.device_profiles import apply_in_process, choose_profile

        apply_in_process(choose_profile())
    from statescope.capture.recorder import install_from_env

    install_from_env()  # no-op unless STATESCOPE_CAPTURE names a spec; raises on unsupported vLLM
    if os.environ.get("STATESCOPE_CPU_KERNELS", "1") != "0":
        from statescope.patches.cpu_kernels import install_cpu_kernels

        install_cpu_kernels()
    if os.environ.get("STATESCOPE_FAULT"):
        from statescope.patches.faults import install_fault

        install_fault()  # planted test faults: labelled as planted wherever they are recorded
