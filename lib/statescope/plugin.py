"""statescope's vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls ``register()`` once in every process it starts (front end, engine core, workers) before
the worker is built. It applies the CPU import shims and, on a CPU build, installs statescope's CPU
implementations of the fused align-mode copy kernels (``statescope.cpu_kernels``). Capture is
enabled here too when ``STATESCOPE_CAPTURE`` names a capture spec.

Deliberately a no-op beyond that: with no statescope settings in the environment it changes nothing
vLLM computes on a GPU build.
"""
from __future__ import annotations

import os


def register() -> None:
    """Entry point; must not raise for a GPU build or a missing optional piece."""
    from statescope import shims

    shims.apply()
    if os.environ.get("STATESCOPE_CPU_KERNELS", "1") != "0":
        try:
            from statescope.cpu_kernels import install_cpu_kernels
        except ImportError:
            return
        install_cpu_kernels()
