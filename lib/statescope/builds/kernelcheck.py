"""Per release: does this CPU build need statescope's fused-kernel stand-ins? Checked by running it.

What it does: ``kernel_check(spec)`` runs ``python -m statescope.builds.kernelcheck`` in the
build's own interpreter, which, without statescope's stand-ins installed, (1) tries to launch
each fused align-mode copy kernel the way the runner does (``kernel[grid]``) and records the error,
(2) reads the release's own CPU replacements of Triton kernels (``CPUModelRunner._postprocess_triton``
in 0.28.0/0.29.0, ``CpuPlatform.register_triton_kernel_overrides`` in 0.32.0) and records whether
the fused kernels are among them, (3) records whether Model Runner V2 (which would launch the
V2-only aligned-index kernel) is available without Triton, then (4) installs the stand-ins and
records the release profile they follow. ``kernel_checks`` does it for several releases.

What it deliberately does not do: start an engine (``statescope.builds.releases`` does, per cell),
or patch anything in the build beyond the process it runs in.
"""
from __future__ import annotations

import inspect
import json
import subprocess
import sys
from typing import Sequence

from statescope.builds.spec import REPO, BuildSpec

FUSED = ("precopy_mamba_align_fused_kernel", "postprocess_mamba_fused_kernel")
MARK = "STATESCOPE_KERNEL_CHECK "


def _replacement_source() -> tuple[str, str]:
    """(where, source) of the release's CPU replacements of Triton kernels."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    for owner, name in ((CPUModelRunner, "_postprocess_triton"),
                        (CpuPlatform, "register_triton_kernel_overrides")):
        fn = getattr(owner, name, None)
        if fn is not None:
            return f"{owner.__name__}.{name}", inspect.getsource(fn)
    return "none found", ""


def check_here() -> dict:
    """The checks, in this interpreter (the build's)."""
    import statescope  # noqa: F401  (CPU import shims before vLLM)
    import vllm
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.worker import mamba_utils

    from statescope.patches import cpu_kernels
    from statescope.errors import EnvironmentBroken

    cpu_kernels.uninstall_cpu_kernels()
    out: dict = {"vllm": vllm.__version__, "has_triton": bool(HAS_TRITON), "launch": {}}
    for name in FUSED:
        try:
            getattr(mamba_utils, name)[(1, 1)]
            out["launch"][name] = "launchable"
        except TypeError as exc:  # a plain function where Triton would put a JITFunction
            out["launch"][name] = f"{type(exc).__name__}: {exc}"
    where, source = _replacement_source()
    out["cpu_replacements_in"] = where
    out["cpu_replaces_batch_memcpy"] = "batch_memcpy_kernel" in source
    out["cpu_replaces_fused"] = any(name in source for name in FUSED)
    out["aligned_index_kernel"] = hasattr(mamba_utils, "get_aligned_state_indices_multi_group_kernel")
    out["v2_runner_possible"] = bool(HAS_TRITON)  # V2 needs Triton; CPU builds fall back to V1
    try:
        cpu_kernels.install_cpu_kernels()
        out["stand_ins"], out["profile"] = "installed", cpu_kernels.installed_release()
    except EnvironmentBroken as exc:
        out["stand_ins"], out["profile"] = f"refused: {exc}", None
    out["needs_statescope_kernels"] = (not out["cpu_replaces_fused"]
                                       and all(v != "launchable" for v in out["launch"].values()))
    return out


def kernel_check(spec: BuildSpec | str, timeout_s: float = 600) -> dict:
    """``check_here`` in the build's environment (installed first if needed)."""
    from statescope.builds.install import clean_env, ensure_build

    build = ensure_build(spec)
    proc = subprocess.run([str(build.python), "-m", "statescope.builds.kernelcheck"],
                          capture_output=True, text=True, cwd=REPO, timeout=timeout_s,
                          env=clean_env({"PYTHONPATH": str(REPO / "lib"),
                                          "VLLM_LOGGING_LEVEL": "ERROR"}))
    lines = [l for l in proc.stdout.splitlines() if l.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        from statescope.errors import EnvironmentBroken

        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise EnvironmentBroken(f"kernel check of {build.spec.label} failed (exit "
                                f"{proc.returncode}): {tail[0]}")
    return json.loads(lines[-1][len(MARK):])


def kernel_checks(specs: Sequence[str]) -> list[dict]:
    return [{"build": BuildSpec.parse(s).label, **kernel_check(s)} for s in specs]


if __name__ == "__main__":
    print(MARK + json.dumps(check_here()))
    sys.exit(0)
