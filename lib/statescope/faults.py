"""Planted state faults: test faults that corrupt a request's GDN state inside a real vLLM engine.

What it does: when ``STATESCOPE_FAULT`` holds a JSON fault spec, ``install_fault()`` (called by the
statescope plugin in the process that holds the model) wraps the V1 model runner's
``execute_model`` so that, just before the step in which a selected request has produced
``at_output_token`` tokens, the state of its running Mamba block is overwritten for the chosen GDN
layers. Kinds:

- ``zero_conv`` / ``zero_ssm``: zero the conv window / recurrent state (a silent wrong answer),
- ``nan_conv`` / ``nan_ssm``: fill it with NaN (NaN logits: greedy argmax gives token id 0, which
  is ``!`` in Qwen vocabularies — the reported ``!!!!`` symptom).

Requests are selected by a seeded hash of the request id (``rate``), so a fault hits the same
share of requests in every run. Every planted fault is logged to ``<out>/faults.jsonl`` when
``out`` is set, so results can be labelled as planted.

What it deliberately does not do: emulate a mechanism (the CPU kernels' ``barrierless_tiles``
semantics emulate the H-copy race; this module plants ground truth for testing the detectors).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from statescope.errors import InputError

FAULT_ENV = "STATESCOPE_FAULT"
KINDS = ("zero_conv", "zero_ssm", "nan_conv", "nan_ssm")


@dataclass
class FaultSpec:
    kind: str
    rate: float = 1.0
    at_output_token: int = 1
    layers: list[int] | None = None  # indices among the GDN layers; None = all
    seed: int = 0
    out: str | None = None
    planted: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"{FAULT_ENV}: field 'kind'={self.kind!r}: expected one of {KINDS}")
        if not 0.0 <= self.rate <= 1.0:
            raise InputError(f"{FAULT_ENV}: field 'rate'={self.rate!r}: expected 0..1")
        if self.at_output_token < 0:
            raise InputError(f"{FAULT_ENV}: field 'at_output_token': expected >= 0")

    def selects(self, req_id: str) -> bool:
        digest = hashlib.sha256(f"{self.seed}:{req_id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.rate

    def to_env(self) -> str:
        return json.dumps({k: v for k, v in self.__dict__.items() if k != "planted"})


def spec_from_env() -> FaultSpec | None:
    raw = os.environ.get(FAULT_ENV)
    if not raw:
        return None
    try:
        return FaultSpec(**json.loads(raw))
    except (TypeError, json.JSONDecodeError) as exc:
        raise InputError(f"{FAULT_ENV}: expected a JSON object with fields kind, rate, "
                         f"at_output_token, layers, seed, out ({exc})") from exc


def gdn_layers(runner) -> list[tuple[int, str]]:
    """(mamba group id, layer name) of every Mamba/GDN layer, in model order."""
    from vllm.v1.kv_cache_interface import MambaSpec

    out = []
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, MambaSpec):
            out += [(gid, name) for name in group.layer_names]
    return sorted(out, key=lambda x: _layer_index(x[1]))


def _layer_index(name: str) -> int:
    digits = [int(p) for p in name.split(".") if p.isdigit()]
    return digits[0] if digits else 0


def running_block(runner, req_id: str, gid: int) -> int:
    """Physical block holding the request's running state (align: ``mamba_state_idx`` column)."""
    block_ids = runner.requests[req_id].block_ids[gid]
    col = getattr(runner, "mamba_state_idx", {}).get(req_id, 0)
    return block_ids[min(col, len(block_ids) - 1)]


def _plant(runner, spec: FaultSpec) -> None:
    ctx = runner.compilation_config.static_forward_context
    layers = gdn_layers(runner)
    chosen = layers if spec.layers is None else [layers[i] for i in spec.layers if i < len(layers)]
    for req_id in list(runner.input_batch.req_ids):
        state = runner.requests.get(req_id)
        if state is None or len(state.output_token_ids) < spec.at_output_token \
                or not spec.selects(req_id) or any(p["req_id"] == req_id for p in spec.planted):
            continue
        for gid, name in chosen:
            block = running_block(runner, req_id, gid)
            tensor = ctx[name].kv_cache[0 if spec.kind.endswith("conv") else 1]
            tensor[block].fill_(float("nan") if spec.kind.startswith("nan") else 0.0)
            record = {"req_id": req_id, "layer": name, "block": int(block), "kind": spec.kind,
                      "output_tokens": len(state.output_token_ids), "planted": True}
            spec.planted.append(record)
            if spec.out:
                Path(spec.out).mkdir(parents=True, exist_ok=True)
                with open(Path(spec.out) / "faults.jsonl", "a") as fh:
                    fh.write(json.dumps(record) + "\n")


_installed: dict = {}


def install_fault(spec: FaultSpec | None = None) -> bool:
    """Wrap ``GPUModelRunner.execute_model`` (the CPU runner inherits it). Idempotent."""
    spec = spec or spec_from_env()
    if spec is None:
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _installed["spec"] = spec
    if "original" in _installed:
        return True
    original = GPUModelRunner.execute_model

    def execute_model_with_fault(self, scheduler_output, *args, **kwargs):
        active = _installed.get("spec")
        if active is not None:
            _plant(self, active)
        return original(self, scheduler_output, *args, **kwargs)

    _installed["original"] = original
    GPUModelRunner.execute_model = execute_model_with_fault
    return True


def uninstall_fault() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if "original" in _installed:
        GPUModelRunner.execute_model = _installed.pop("original")
    _installed.pop("spec", None)
