"""Test-only: change one request's GDN state at a chosen step, layer and kind inside a real engine.

Independent of ``statescope.patches.faults`` (the instruments must be tested against corruptions
the project did not plant with its own injector). Written from facts of vLLM 0.28.0's source, no
code taken from it: each Qwen3.5 Gated DeltaNet layer module is registered in the model runner's
``compilation_config.static_forward_context`` under its prefix (``model.layers.N.linear_attn``);
its ``kv_cache`` is ``[conv_state, recurrent_state]`` with blocks ``(state_len, conv_dim)`` (SD
layout) and ``(heads, value_dim, key_dim)``; the decoder layer calls the module once per engine
step; a request's Mamba block row for group ``g`` is ``runner.requests[id].block_ids[g]`` and its
running column in align mode ``runner.mamba_state_idx[id]``.

``install(engine, [Perturbation, ...])`` replaces the ``forward`` of each target layer module (an
instance attribute, removed by ``uninstall``) with one that calls the original and, in the step
the perturbation names (the request's own step counter, counted here from the layer's forward
calls, as the capture counts ``req_step``), applies ``op`` to the block ``column`` columns after
the running one — just ``before`` the original forward (what the step reads) or ``after`` it
(what the step wrote, before sampling and the post-process copy). ``op`` ``"raise"`` raises
instead: an engine that dies mid-run. Every application is logged in ``Perturbation.applied``
with the request id, step, computed tokens and block, so a test can check it hit what it named.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

KIND_INDEX = {"conv": 0, "ssm": 1}


@dataclass
class Perturbation:
    prompt_ids: list[int]  # the request's prompt token ids (how it is found in the runner)
    req_step: int  # the request's own step counter (0 = its first scheduled step)
    layer: int  # the model's layer number N of model.layers.N.linear_attn
    kind: str  # "conv" | "ssm"
    op: Callable[[torch.Tensor], Any] | str  # in place on the block, or "raise"
    column: int = 0  # columns after the running one
    when: str = "after"  # "before" | "after" the layer's forward
    applied: list = field(default_factory=list)

    @property
    def layer_name(self) -> str:
        return f"model.layers.{self.layer}.linear_attn"


def _group_of(runner: Any, name: str) -> int:
    for g, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if name in group.layer_names:
            return g
    raise KeyError(name)


def _wrap(runner: Any, module: Any, mine: list[Perturbation]) -> Callable:
    original = module.forward
    steps: dict[str, int] = {}  # request id -> steps seen by this layer

    def due(rid: str, when: str) -> list[Perturbation]:
        req = runner.requests.get(rid)
        if req is None:
            return []
        return [p for p in mine if p.when == when and p.req_step == steps.get(rid, 0)
                and list(req.prompt_token_ids or []) == p.prompt_ids and not p.applied]

    def apply(p: Perturbation, rid: str) -> None:
        if p.op == "raise":
            p.applied.append({"req_id": rid, "req_step": p.req_step, "raised": True})
            raise RuntimeError(f"test perturbation: engine error at step {p.req_step} of {rid}")
        g = _group_of(runner, p.layer_name)
        col = runner.mamba_state_idx[rid] + p.column
        block = runner.requests[rid].block_ids[g][col]
        state = module.kv_cache[KIND_INDEX[p.kind]]
        before = state[block].clone()
        p.op(state[block])
        p.applied.append({"req_id": rid, "req_step": p.req_step, "column": col, "block": block,
                          "num_computed_tokens": runner.requests[rid].num_computed_tokens,
                          "changed": int((state[block] != before).sum()),
                          "zeros_before": int((before == 0).sum())})

    def forward(*args: Any, **kwargs: Any) -> Any:
        from vllm.forward_context import get_forward_context

        live = get_forward_context().attn_metadata is not None  # not a profiling/dummy run
        batch = list(runner.input_batch.req_ids) if live else []
        for rid in batch:
            for p in due(rid, "before"):
                apply(p, rid)
        out = original(*args, **kwargs)
        for rid in batch:
            for p in due(rid, "after"):
                apply(p, rid)
            steps[rid] = steps.get(rid, 0) + 1
        return out

    return forward


def install(engine: Any, perturbations: list[Perturbation]) -> None:
    def setup(worker: Any) -> None:
        runner = worker.model_runner
        ctx = runner.compilation_config.static_forward_context
        for name in {p.layer_name for p in perturbations}:
            module = ctx[name]
            module.forward = _wrap(runner, module, [p for p in perturbations
                                                    if p.layer_name == name])

    engine.llm.collective_rpc(setup)


def uninstall(engine: Any) -> None:
    def teardown(worker: Any) -> None:
        for module in worker.model_runner.compilation_config.static_forward_context.values():
            if "forward" in getattr(module, "__dict__", {}):
                del module.forward

    engine.llm.collective_rpc(teardown)
