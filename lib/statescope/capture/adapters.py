"""Which vLLM versions the capture instrument covers, and the few places where they differ.

What it does: ``adapter_for(version)`` returns a ``VllmAdapter`` for a covered version after
checking that every attribute the hooks wrap really exists (``EnvironmentBroken`` names the
version and each missing piece), or raises ``EnvironmentBroken`` for a recognised-but-uncovered
version (saying why) and for an unknown one. ``mamba_groups(kv_cache_config)`` normalises
``get_mamba_groups`` (a (list, spec) tuple up to 0.28, a {spec: [ids]} dict in 0.32).

Covered:
- 0.28.0, V1 ``GPUModelRunner`` (and the CPU build's ``CPUModelRunner``, its subclass): pre-copy
  on the fused path when speculative decoding + align (``run_fused_precopy``), else scalar
  (``collect_mamba_copy_meta`` -> ``do_mamba_copy_block``); post-process fused
  (``run_fused_postprocess``).
- 0.26.0, V1 ``GPUModelRunner`` on GPU: scalar pre-copy always; fused post-process.

Recognised, not covered: 0.32.0 (see ``NOT_COVERED``).

What it deliberately does not do: install anything (``statescope.capture.hooks``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from statescope.errors import EnvironmentBroken

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
MAMBA_MODULE = "vllm.v1.worker.mamba_utils"

_COMMON = [
    (RUNNER_MODULE, "GPUModelRunner.execute_model"),
    (RUNNER_MODULE, "GPUModelRunner.sample_tokens"),
    (RUNNER_MODULE, "GPUModelRunner._update_states_after_model_execute"),
    (MAMBA_MODULE, "get_mamba_groups"),
    (MAMBA_MODULE, "collect_mamba_copy_meta"),
    (MAMBA_MODULE, "do_mamba_copy_block"),
    (MAMBA_MODULE, "MambaSpecDecodeGPUContext.run_fused_postprocess"),
]

NOT_COVERED = {
    "0.32.0": ("recognised but not covered by statescope capture: on a GPU it runs models on the V2 "
               "model runner by default (vllm/v1/worker/gpu/model_runner.py, Mamba state handling "
               "in vllm/v1/worker/gpu/model_states/mamba_hybrid.py, post-process via "
               "MambaSpecDecodeGPUContext.run_fused_postprocess_align with an idx_mapping), "
               "which these hooks do not wrap; get_mamba_groups returns a {MambaSpec: [group ids]} "
               "dict; and its CPU build's V1 runner has not been verified against these hooks. "
               "Capture on 0.26.0 or 0.28.0, or extend statescope.capture.adapters for the V2 "
               "runner"),
}


@dataclass(frozen=True)
class VllmAdapter:
    version: str
    fused_precopy: bool  # the runner may call MambaSpecDecodeGPUContext.run_fused_precopy
    notes: str

    def to_dict(self) -> dict:
        return {"version": self.version, "fused_precopy": self.fused_precopy, "notes": self.notes}


COVERED = {
    "0.28.0": (True, "V1 GPUModelRunner/CPUModelRunner; fused or scalar pre-copy, fused post-process"),
    "0.26.0": (False, "V1 GPUModelRunner; scalar pre-copy, fused post-process"),
}


def _resolve(module: str, dotted: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def missing_pieces(required: list[tuple[str, str]]) -> list[str]:
    out = []
    for module, dotted in required:
        try:
            _resolve(module, dotted)
        except (ImportError, AttributeError) as exc:
            out.append(f"{module}.{dotted} ({type(exc).__name__}: {exc})")
    return out


def adapter_for(version: str) -> VllmAdapter:
    """The adapter for ``version``; ``EnvironmentBroken`` says what is missing or unsupported."""
    if version in NOT_COVERED:
        raise EnvironmentBroken(f"statescope capture: vLLM {version} is {NOT_COVERED[version]}")
    if version not in COVERED:
        known = ", ".join(sorted(COVERED)) + "; recognised: " + ", ".join(sorted(NOT_COVERED))
        raise EnvironmentBroken(f"statescope capture: vLLM {version} is not supported (covered: "
                                f"{known}); refusing to start rather than record nothing")
    fused_precopy, notes = COVERED[version]
    required = list(_COMMON)
    if fused_precopy:
        required.append((MAMBA_MODULE, "MambaSpecDecodeGPUContext.run_fused_precopy"))
    missing = missing_pieces(required)
    if missing:
        raise EnvironmentBroken(f"statescope capture: vLLM {version} lacks what the capture hooks "
                                f"wrap: {'; '.join(missing)}")
    return VllmAdapter(version, fused_precopy, notes)


def mamba_groups(kv_cache_config: Any) -> tuple[list[int], Any]:
    """(Mamba group ids, their MambaSpec) from vLLM's ``get_mamba_groups``, any covered version."""
    mu = importlib.import_module(MAMBA_MODULE)
    got = mu.get_mamba_groups(kv_cache_config)
    if isinstance(got, dict):  # 0.32.0 shape: {spec: [ids]}
        specs = list(got)
        ids = sorted({i for v in got.values() for i in v})
        return ids, specs[0]
    ids, spec = got
    return list(ids), spec
