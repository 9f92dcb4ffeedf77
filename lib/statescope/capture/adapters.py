"""Which vLLM versions the capture instrument covers, and the few places where they differ.

What it does: ``adapter_for(version)`` returns a ``VllmAdapter`` for a covered version after
checking that every attribute the hooks wrap really exists (``EnvironmentBroken`` names the
version and each missing piece), or raises ``EnvironmentBroken`` for a recognised-but-uncovered
version (saying why) and for an unknown one. ``mamba_groups(kv_cache_config)`` normalises
``get_mamba_groups`` (a (list, spec) tuple up to 0.28, a {spec: [ids]} dict in 0.32).

Covered, by the runner the engine resolves (``runner_kind``; the capture never picks it):
- 0.28.0, V1 ``GPUModelRunner`` (and the CPU build's ``CPUModelRunner``, its subclass): pre-copy
  on the fused path when speculative decoding + align (``run_fused_precopy``), else scalar
  (``collect_mamba_copy_meta`` -> ``do_mamba_copy_block``); post-process fused
  (``run_fused_postprocess``).
- 0.26.0, V1 ``GPUModelRunner`` on GPU: scalar pre-copy always; fused post-process.
- 0.29.0-0.33.0, V1 ``GPUModelRunner`` as on 0.28.0 (``VLLM_USE_V2_MODEL_RUNNER=0``, or reached
  through a fallback): every function the V1 hooks wrap, the parameters they bind, the calls
  that reach them and the post-process kernel's decision rule the census mirrors are those of
  0.28.0 in each release's source (``tests/test_capture_v1_releases.py``; the differences there
  are the H-copy fix inside the copy kernel, copy functions keyed by Mamba type, and
  ``get_mamba_groups`` returning a dict, which ``mamba_groups`` reads). ``V1_RELEASES``.
- 0.30.0, 0.31.0, 0.32.0, 0.33.0, Model Runner V2 (``vllm.v1.worker.gpu.model_runner``; the GPU
  default for hybrids from 0.29): step from ``execute_model``/``sample_tokens``, the batch from
  ``prepare_inputs``, accepted counts from ``postprocess_sampled``, block ids mirrored from
  ``BlockTables.append_block_ids``, copies from ``MambaSpecDecodeGPUContext.run_fused_precopy``
  and ``run_fused_postprocess_align`` (both with an ``idx_mapping`` batch row -> request slot).
  ``statescope.capture.runner_view`` shows the V2 runner to the capture with V1's attributes.
  0.30.0 and 0.32.0 are the releases read line by line (docs/capture-and-diverge.md, "Model
  Runner V2"); 0.31.0 and 0.33.0 are covered because the same pieces pass the signature tests.
  On these releases both runners' hooks are installed; the manifest says which one ran.

Recognised, not covered: Model Runner V2 on 0.29.0 (its default runner on a GPU): refused at the
first step (``EnvironmentBroken``), never run unrecorded; force V1 there or capture on 0.30.0+.
A V1 runner on a release outside ``COVERED`` would be refused the same way (``V1_NOT_COVERED``).

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

V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
V2_BLOCK_TABLE_MODULE = "vllm.v1.worker.gpu.block_table"
V2_MAMBA_STATE_MODULE = "vllm.v1.worker.gpu.model_states.mamba_hybrid"

_V2 = [
    (V2_RUNNER_MODULE, "GPUModelRunner.execute_model"),
    (V2_RUNNER_MODULE, "GPUModelRunner.sample_tokens"),
    (V2_RUNNER_MODULE, "GPUModelRunner.prepare_inputs"),
    (V2_RUNNER_MODULE, "GPUModelRunner.postprocess_sampled"),
    (V2_BLOCK_TABLE_MODULE, "BlockTables.append_block_ids"),
    (V2_MAMBA_STATE_MODULE, "MambaHybridModelState.preprocess_state"),
    (V2_MAMBA_STATE_MODULE, "MambaHybridModelState.postprocess_state"),
    (MAMBA_MODULE, "get_mamba_groups"),
    (MAMBA_MODULE, "MambaSpecDecodeGPUContext.run_fused_precopy"),
    (MAMBA_MODULE, "MambaSpecDecodeGPUContext.run_fused_postprocess_align"),
]

V1_NOT_COVERED = ("its V1 model runner is not covered by statescope capture (the V1 hooks are "
                  "checked against 0.26.0 and 0.28.0-0.33.0 sources): run the engine on Model "
                  "Runner V2 (VLLM_USE_V2_MODEL_RUNNER unset or 1) or capture on a covered release")
V2_NOT_COVERED = ("Model Runner V2 is not covered on this release (covered: 0.30.0-0.33.0): force "
                  "the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0, `statescope capture --set "
                  "model_runner=v1`) or capture on 0.30.0+")
NOT_COVERED: dict[str, str] = {}  # kept for readers of the old table: no covered release refuses V1


@dataclass(frozen=True)
class VllmAdapter:
    version: str
    fused_precopy: bool  # the V1 runner may call MambaSpecDecodeGPUContext.run_fused_precopy
    notes: str
    runners: tuple = ("V1",)  # the runners whose hooks are installed: "V1", "V2"

    def covers(self, runner_version: str) -> bool:
        return runner_version in self.runners

    def to_dict(self) -> dict:
        return {"version": self.version, "fused_precopy": self.fused_precopy, "notes": self.notes,
                "runners": list(self.runners)}


V1_RELEASES = ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")  # V1 as on 0.28.0 (docstring)
COVERED = {
    "0.28.0": (True, "V1 GPUModelRunner/CPUModelRunner; fused or scalar pre-copy, fused post-process"),
    "0.26.0": (False, "V1 GPUModelRunner; scalar pre-copy, fused post-process"),
    **{v: (True, "V1 GPUModelRunner (forced or through a fallback) as on 0.28.0; fused or scalar "
                 "pre-copy, fused post-process") for v in V1_RELEASES},
}
COVERED_V2 = {
    v: "Model Runner V2: fused pre-copy and align post-process with idx_mapping (request slots)"
    for v in ("0.30.0", "0.31.0", "0.32.0", "0.33.0")}


def runner_kind(runner: Any) -> str:
    """"V2" for Model Runner V2 (a runner, its class, or ``module.Class``), else "V1"."""
    if isinstance(runner, str):
        name = runner
    elif getattr(runner, "statescope_runner_class", None):  # statescope.capture.runner_view view
        name = runner.statescope_runner_class
    else:
        cls = runner if isinstance(runner, type) else type(runner)
        name = f"{cls.__module__}.{cls.__name__}"
    return "V2" if ".v1.worker.gpu." in name else "V1"


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
    if version not in COVERED and version not in COVERED_V2:
        known = ", ".join(sorted(COVERED)) + " (V1), " + ", ".join(sorted(COVERED_V2)) + " (V2)"
        raise EnvironmentBroken(f"statescope capture: vLLM {version} is not supported (covered: "
                                f"{known}); refusing to start rather than record nothing")
    runners, notes, required, fused_precopy = [], [], [], False
    if version in COVERED_V2:
        runners.append("V2")
        notes.append(COVERED_V2[version])
        required += _V2
    if version in COVERED:
        fused_precopy, v1_notes = COVERED[version]
        runners.append("V1")
        notes.append(v1_notes)
        required += _COMMON
        if fused_precopy:
            required.append((MAMBA_MODULE, "MambaSpecDecodeGPUContext.run_fused_precopy"))
    missing = missing_pieces(list(dict.fromkeys(required)))
    if missing:
        raise EnvironmentBroken(f"statescope capture: vLLM {version} lacks what the capture hooks "
                                f"({'/'.join(runners)}) wrap: {'; '.join(missing)}")
    return VllmAdapter(version, fused_precopy, "; ".join(notes), tuple(runners))


def refuse_runner(adapter: VllmAdapter, runner: Any) -> None:
    """``EnvironmentBroken`` when the engine resolved a runner the adapter does not cover."""
    kind = runner_kind(runner)
    if not adapter.covers(kind):
        why = V1_NOT_COVERED if kind == "V1" else V2_NOT_COVERED
        raise EnvironmentBroken(f"statescope capture: vLLM {adapter.version}: {why}")


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
