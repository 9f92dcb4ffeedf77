"""Planted state faults: test faults that corrupt a request's GDN state inside a real vLLM engine.

What it does: when ``STATESCOPE_FAULT`` holds a JSON fault spec, ``install_fault()`` (called by the
statescope plugin in the process that holds the model) wraps the V1 model runner's
``execute_model`` and ``vllm.v1.worker.mamba_utils.postprocess_mamba_align_gpu`` (the runner calls
it as a module attribute). A fault fires once per selected request, in the first step in which the
request has already produced ``at_output_token`` tokens. Kinds:

- ``zero_conv`` / ``zero_ssm``: zero the running block's conv window / recurrent state before the
  step (a silent wrong answer), for the chosen GDN ``layers``;
- ``nan_conv`` / ``nan_ssm``: fill it with NaN (NaN logits: greedy argmax gives token id 0, which
  is ``!`` in Qwen vocabularies — the reported ``!!!!`` symptom);
- ``perturb_conv_row``: add ``delta`` to one row (``row``: 0 = the leading row of the live window
  the coming step reads) of the running conv window;
- ``permute_accepted``: in the align-mode post-process (spec decode), swap the accepted-token count
  the state update *uses* between the selected request and the first other row whose sampled count
  differs — the H-accept mechanism (a request picks up another request's count). Both rows are
  recorded, with ``num_accepted_sampled`` and ``num_accepted_used``. Rows with equal counts are
  skipped (a swap of equal counts changes nothing); the fault waits for a step with a partner;
- ``drop_postprocess_copy``: in the first step where the post-process copies the selected request's
  state to a block-aligned column, undo that copy (restore the destination block of every chosen
  layer) while keeping the rest of the post-process (the accepted-count reset) — a dropped copy.

Requests are selected by ``prompt_shas`` (``capture_spec.prompt_sha`` of the prompt token ids), by
``req_ids`` (vLLM request ids, matched whole or by the part before the random ``-suffix``), or else
by a seeded hash of the id's counter part (``rate``; the random suffix is left out so a re-run of
a cell plants the same requests); with ``by_prompt`` the seeded hash is of the prompt token ids,
so the fault is deterministic per workload (a workload seed fails the same requests in any cell
and at any position, as the H200's failures do). Every planted fault is kept in
``spec.planted`` and logged to ``<out>/faults.jsonl`` when ``out`` is set, so results can be
labelled as planted.

What it deliberately does not do: emulate copy races (the CPU kernels' ``barrierless_tiles``
semantics emulate H-copy), or fire the two post-process kinds without align-mode speculative
decoding or on a vLLM without ``postprocess_mamba_align_gpu`` (they then never fire, and
``spec.planted`` stays empty — check it before trusting a "no divergence").
"""
from __future__ import annotations

import hashlib
import json
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statescope.errors import InputError

FAULT_ENV = "STATESCOPE_FAULT"
STATE_KINDS = ("zero_conv", "zero_ssm", "nan_conv", "nan_ssm", "perturb_conv_row")
POSTPROCESS_KINDS = ("permute_accepted", "drop_postprocess_copy")
KINDS = STATE_KINDS + POSTPROCESS_KINDS


@dataclass
class FaultSpec:
    kind: str
    rate: float = 1.0
    at_output_token: int = 1
    layers: list[int] | None = None  # indices among the GDN layers; None = all
    seed: int = 0
    out: str | None = None
    req_ids: list[str] | None = None  # explicit selection (overrides ``rate``)
    prompt_shas: list[str] | None = None  # select by prompt (``capture_spec.prompt_sha``)
    row: int = 0  # perturb_conv_row: row of the live window (0 = leading/oldest)
    delta: float = 1.0  # perturb_conv_row: added to every channel of that row
    by_prompt: bool = False  # ``rate`` selection hashes the prompt ids, not the request counter
    planted: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"{FAULT_ENV}: field 'kind'={self.kind!r}: expected one of {KINDS}")
        if not 0.0 <= self.rate <= 1.0:
            raise InputError(f"{FAULT_ENV}: field 'rate'={self.rate!r}: expected 0..1")
        if self.at_output_token < 0:
            raise InputError(f"{FAULT_ENV}: field 'at_output_token': expected >= 0")
        for name in ("req_ids", "prompt_shas"):
            value = getattr(self, name)
            if value is not None and not all(isinstance(r, str) for r in value):
                raise InputError(f"{FAULT_ENV}: field {name!r}: expected a list of strings")

    def selects(self, req_id: str, prompt_token_ids: list[int] | None = None) -> bool:
        if self.prompt_shas is not None:
            from statescope.workload.trace import prompt_sha

            return prompt_token_ids is not None and \
                prompt_sha(list(prompt_token_ids)) in self.prompt_shas
        if self.req_ids is not None:
            return any(req_id == r or req_id.split("-", 1)[0] == r for r in self.req_ids)
        # vLLM's offline ids are "<counter>-<random suffix>": hash the counter, so a re-run of
        # the same cell plants the same requests (server ids have no counter: hash them whole).
        counter = req_id.split("-", 1)[0]
        key = counter if counter.isdigit() else req_id
        if self.by_prompt:
            key = hashlib.sha256(repr(list(prompt_token_ids or [])).encode()).hexdigest()
        digest = hashlib.sha256(f"{self.seed}:{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.rate

    def done(self, req_id: str) -> bool:
        return any(p["req_id"] == req_id for p in self.planted)

    def due(self, runner: Any, req_id: str) -> bool:
        """Selected, not yet planted, and has produced ``at_output_token`` tokens."""
        state = runner.requests.get(req_id)
        return (state is not None and len(state.output_token_ids) >= self.at_output_token
                and not self.done(req_id)
                and self.selects(req_id, list(state.prompt_token_ids or [])))

    def log(self, record: dict) -> None:
        record = dict(record, kind=self.kind, planted=True)
        self.planted.append(record)
        if self.out:
            Path(self.out).mkdir(parents=True, exist_ok=True)
            with open(Path(self.out) / "faults.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\n")

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
                         f"at_output_token, layers, seed, out, req_ids, prompt_shas, by_prompt "
                         f"({exc})") from exc


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


def _chosen(runner, spec: FaultSpec) -> list[tuple[int, str]]:
    layers = gdn_layers(runner)
    return layers if spec.layers is None else [layers[i] for i in spec.layers if i < len(layers)]


def running_block(runner, req_id: str, gid: int) -> int:
    """Physical block holding the request's running state (align: ``mamba_state_idx`` column)."""
    block_ids = runner.requests[req_id].block_ids[gid]
    col = getattr(runner, "mamba_state_idx", {}).get(req_id, 0)
    return block_ids[min(col, len(block_ids) - 1)]


def _ssm_read_blocks(runner, req_id: str, gid: int) -> list[int]:
    """Blocks the coming step may read the recurrent state from. With speculative decoding the
    GDN kernel keeps one state per draft position in ``num_spec + 1`` consecutive blocks from the
    running column and starts from the one the accepted count picks, so a fault written to the
    running block alone would never be read (measured: NaN there changed 0 of 64 answers with
    MTP(2), 64 of 64 without). The conv window has no such copies: its running block only."""
    block_ids = runner.requests[req_id].block_ids[gid]
    col = min(getattr(runner, "mamba_state_idx", {}).get(req_id, 0), len(block_ids) - 1)
    n = 1 + int(getattr(runner, "num_spec_tokens", 0) or 0)
    return list(block_ids[col:col + n])


def _facts(runner, req_id: str) -> dict:
    state = runner.requests[req_id]
    return {"req_id": req_id, "output_tokens": len(state.output_token_ids),
            "num_computed_tokens": int(state.num_computed_tokens)}


def _live_offset(runner, req_id: str) -> int:
    """First live conv row the coming step reads: last step's accepted count (after any reset) - 1."""
    counts = getattr(runner.input_batch, "num_accepted_tokens_cpu", None)
    row = runner.input_batch.req_id_to_index.get(req_id)
    return 0 if counts is None or row is None else max(0, int(counts[row]) - 1)


def _scheduled_computed(scheduler_output, req_id: str) -> int | None:
    """The request's computed tokens as scheduled for the coming step (the runner's own copy is
    only updated inside ``execute_model``)."""
    for new in scheduler_output.scheduled_new_reqs:
        if new.req_id == req_id:
            return int(new.num_computed_tokens)
    cached = scheduler_output.scheduled_cached_reqs
    for rid, comp in zip(cached.req_ids, cached.num_computed_tokens):
        if rid == req_id:
            return int(comp)
    return None


def _in_this_step(scheduler_output, req_id: str) -> bool:
    """Whether the coming step runs ``req_id``. The batch still holds requests that finished in
    the previous step until this step's ``execute_model`` removes them; under async scheduling on
    the H200 that included the previous run's requests (same prompts, other ids), so a fault
    selected by prompt was planted into a finished request's freed block (notebook 06, cell 17)."""
    if scheduler_output is None:
        return True
    if req_id in (getattr(scheduler_output, "finished_req_ids", None) or ()):
        return False
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
    return scheduled is None or req_id in scheduled


def _plant_state(runner, spec: FaultSpec, scheduler_output=None) -> None:
    ctx = runner.compilation_config.static_forward_context
    for req_id in [r for r in runner.input_batch.req_ids
                   if _in_this_step(scheduler_output, r) and spec.due(runner, r)]:
        for gid, name in _chosen(runner, spec):
            block = running_block(runner, req_id, gid)
            tensor = ctx[name].kv_cache[0 if "conv" in spec.kind else 1]
            extra = {}
            if spec.kind == "perturb_conv_row":
                window = tensor[block]  # (rows, channels) "SD" or (channels, rows) "DS"
                at = _live_offset(runner, req_id) + spec.row
                rows_first = window.shape[0] <= window.shape[1]  # rows are few, channels many
                (window[at] if rows_first else window[:, at]).add_(spec.delta)
                extra = {"row": spec.row, "window_row": at, "delta": spec.delta}
            else:
                value = float("nan") if spec.kind.startswith("nan") else 0.0
                blocks = _ssm_read_blocks(runner, req_id, gid) if "ssm" in spec.kind else [block]
                for b in blocks:
                    tensor[b].fill_(value)
                if len(blocks) > 1:
                    extra = {"blocks": [int(b) for b in blocks]}
            facts = _facts(runner, req_id)
            scheduled = None if scheduler_output is None else \
                _scheduled_computed(scheduler_output, req_id)
            if scheduled is not None:  # schedule-time count of the step that reads it
                facts["num_computed_tokens"] = scheduled
            else:  # not in this step's scheduler output (seen on a GPU under async scheduling):
                facts["computed_from"] = "runner"  # the runner's count, before the step
            spec.log(dict(facts, layer=name, block=int(block), **extra))


def _permute(runner, spec: FaultSpec, req_ids: list[str], accepted) -> None:
    """Swap the used accepted counts of a due request and the first row with a different count."""
    counts = accepted[:len(req_ids)].tolist()
    for i, rid in enumerate(req_ids):
        if not spec.due(runner, rid):
            continue
        j = next((j for j, c in enumerate(counts) if j != i and c != counts[i]), None)
        if j is None:
            continue  # every row sampled the same count: a swap would change nothing
        accepted[i], accepted[j] = counts[j], counts[i]
        for a, b in ((i, j), (j, i)):
            spec.log(dict(_facts(runner, req_ids[a]), partner=req_ids[b], batch_row=a,
                          num_accepted_sampled=counts[a], num_accepted_used=counts[b]))
        counts[i], counts[j] = counts[j], counts[i]


def _postprocess_copy(bufs, row: int, accepted: int) -> tuple[int, int, int] | None:
    """(src column, dst column, bias) of the post-process copy of batch ``row``, or None (the same
    decision arithmetic as vLLM's fused post-process, from its staged inputs)."""
    ctx = bufs.postprocess_align
    computed = int(ctx.num_computed_tokens_buf.gpu[row])
    running = computed + int(ctx.num_scheduled_tokens_buf.gpu[row]) \
        - int(ctx.num_draft_tokens_buf.gpu[row])
    bs = int(ctx.block_size)
    aligned = (running + accepted - 1) // bs * bs
    if aligned < running:
        return None
    src, dst = int(ctx.mamba_state_idx_buf.gpu[row]), aligned // bs - 1
    if src == dst and aligned == running:
        return None  # nothing moves
    return src, dst, aligned - running


def _save_dropped(runner, spec: FaultSpec, bufs, req_ids: list[str], accepted) -> list:
    """Clones of the destination blocks of a due request's post-process copy (restored after)."""
    ctx = runner.compilation_config.static_forward_context
    saved = []
    for i, rid in enumerate(req_ids):
        if not spec.due(runner, rid):
            continue
        decision = _postprocess_copy(bufs, i, int(accepted[i]))
        if decision is None:
            continue  # no copy in this step: wait for one
        src, dst, bias = decision
        for gid, name in _chosen(runner, spec):
            block = runner.requests[rid].block_ids[gid][dst]
            for k in (0, 1):
                saved.append((ctx[name].kv_cache[k], block, ctx[name].kv_cache[k][block].clone()))
        spec.log(dict(_facts(runner, rid), batch_row=i, src_col=src, dst_col=dst, bias=bias,
                      in_place=src == dst, num_accepted_sampled=int(accepted[i])))
    return saved


_installed: dict = {}


def install_fault(spec: FaultSpec | None = None) -> bool:
    """Wrap ``GPUModelRunner.execute_model`` (the CPU runner inherits it) and the align-mode
    post-process. Idempotent; the active spec is replaced."""
    spec = spec or spec_from_env()
    if spec is None:
        return False
    from vllm.v1.worker import mamba_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _installed["spec"] = spec
    if "original" in _installed:
        return True
    original = GPUModelRunner.execute_model
    post = getattr(mamba_utils, "postprocess_mamba_align_gpu", None)  # absent outside 0.28-like builds

    def execute_model_with_fault(self, scheduler_output, *args, **kwargs):
        active = _installed.get("spec")
        _installed["runner"] = weakref.ref(self)
        if active is not None and active.kind in STATE_KINDS:
            _plant_state(self, active, scheduler_output)
        return original(self, scheduler_output, *args, **kwargs)

    def postprocess_with_fault(**kwargs):
        active, ref = _installed.get("spec"), _installed.get("runner")
        runner = ref() if ref is not None else None
        if active is None or runner is None or active.kind not in POSTPROCESS_KINDS:
            return post(**kwargs)
        req_ids = list(kwargs["input_batch"].req_ids[:kwargs["num_reqs"]])
        accepted = kwargs["num_accepted_tokens_gpu"]
        if active.kind == "permute_accepted":
            _permute(runner, active, req_ids, accepted)
            return post(**kwargs)
        saved = _save_dropped(runner, active, kwargs["bufs"], req_ids, accepted)
        result = post(**kwargs)
        for tensor, block, before in saved:
            tensor[block].copy_(before)
        return result

    _installed.update(original=original, postprocess=post)
    GPUModelRunner.execute_model = execute_model_with_fault
    if post is not None:
        mamba_utils.postprocess_mamba_align_gpu = postprocess_with_fault
    return True


def uninstall_fault() -> None:
    if "original" in _installed:
        from vllm.v1.worker import mamba_utils
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        GPUModelRunner.execute_model = _installed.pop("original")
        post = _installed.pop("postprocess")
        if post is not None:
            mamba_utils.postprocess_mamba_align_gpu = post
    for key in ("spec", "runner"):
        _installed.pop(key, None)
