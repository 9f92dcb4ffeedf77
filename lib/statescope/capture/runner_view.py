"""Model Runner V2 seen through the V1 runner's attributes that the capture reads.

What it does: ``V2RunnerView(runner)`` wraps a V2 ``GPUModelRunner`` (``vllm.v1.worker.gpu.
model_runner``, vLLM 0.29+) and offers what ``statescope.capture.run.RunCapture`` reads from a V1
runner, so one run, one record format and one emitter serve both runners:

- ``input_batch.req_id_to_index``: request -> batch row of the step's V2 ``InputBatch`` (caught
  from ``GPUModelRunner.prepare_inputs`` by ``note_batch``). V2 orders a batch by
  ``sort_batch_req_ids``; its per-request device arrays live in *request slots*
  (``req_states.req_id_to_index``) and ``InputBatch.idx_mapping`` maps batch row -> slot.
- ``requests[req_id]``: ``prompt_token_ids`` (from the scheduler's ``NewRequestData``),
  ``num_computed_tokens`` (``req_states.num_computed_tokens_np``: the scheduler's count, which V2
  keeps as the host mirror) and ``block_ids`` per KV-cache group. V2 keeps block ids on the device
  only (``BlockTables.block_tables[g]`` are ``StagedWriteTensor``s); ``note_blocks`` mirrors every
  ``BlockTables.append_block_ids(slot, ids, overwrite)`` on the host, the same lists V1 keeps in
  ``CachedRequestState.block_ids``.
- ``mamba_state_idx``: request -> running column (align mode). V2 keeps it per slot on the device
  (``MambaHybridModelState._mamba_state_idx_gpu``), advanced in the step by
  ``preprocess_mamba_align_fused_kernel`` to ``ceil((computed + scheduled) / bs) - 1``;
  ``note_schedule`` applies that rule to the scheduler's counts on the host.
  ``device_running_cols`` gathers the device's own column for the same requests (one index
  upload and one gather, no host read) so every step row also carries ``running_col_device``:
  where the two differ (the scheduler's count is optimistic under async scheduling) the digest
  is of the host-derived column and the row says so.
- the configs (``vllm_config``, ``kv_cache_config``, ``compilation_config``, ``cache_config``,
  ``model_config``) from the runner itself.

What it deliberately does not do: install hooks (``statescope.capture.hooks``), read a device
value on the host, or change the runner (it only reads it; the view holds a weak reference).
"""
from __future__ import annotations

import weakref
from typing import Any

V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
V2_BLOCK_TABLE_MODULE = "vllm.v1.worker.gpu.block_table"
V2_MAMBA_STATE_MODULE = "vllm.v1.worker.gpu.model_states.mamba_hybrid"
_DELEGATED = ("vllm_config", "kv_cache_config", "compilation_config", "cache_config",
              "model_config")
MIRROR_ATTR = "_statescope_block_ids"  # on a V2 BlockTables: slot -> [group -> block ids]


def note_blocks(block_tables: Any, req_index: int, new_block_ids: Any, overwrite: bool) -> None:
    """Mirror one ``BlockTables.append_block_ids`` call (after it ran) on the host."""
    mirror = block_tables.__dict__.setdefault(MIRROR_ATTR, {})
    redirect = bool(getattr(block_tables, "redirect_writes_to_null_block", False))
    lists = [[0] * len(ids) if redirect else [int(b) for b in ids] for ids in new_block_ids]
    row = mirror.get(int(req_index))
    if overwrite or row is None:
        mirror[int(req_index)] = lists
    else:
        for have, more in zip(row, lists):
            have.extend(more)


class _BatchIndex:
    """What ``RunCapture`` reads from V1's ``input_batch``: ``req_id_to_index`` only (no
    ``block_table``: ``statescope.capture.facts.TableSource`` then reads ``requests``)."""

    def __init__(self) -> None:
        self.req_id_to_index: dict[str, int] = {}


class _RequestView:
    __slots__ = ("prompt_token_ids", "num_computed_tokens", "block_ids")

    def __init__(self, prompt: list, computed: int, block_ids: list) -> None:
        self.prompt_token_ids, self.num_computed_tokens, self.block_ids = prompt, computed, block_ids


class _Requests:
    """``requests[req_id]`` for the V2 runner's live requests (those with a request slot).

    A view is made once per request and step (``clear`` at each schedule and batch): the step's
    record reads each request two or three times, and on a host-bound GPU step that Python is
    the capture's cost (H200, 0.32.0: ``data/results/gpu/capture_overhead_0.32.0/``)."""

    def __init__(self, view: "V2RunnerView") -> None:
        self._view = view
        self._memo: dict[str, _RequestView] = {}

    def clear(self) -> None:
        self._memo.clear()

    def _slot(self, rid: str) -> int | None:
        runner = self._view.runner_ref()
        states = getattr(runner, "req_states", None)
        return None if states is None else states.req_id_to_index.get(rid)

    def __contains__(self, rid: object) -> bool:
        return isinstance(rid, str) and self._slot(rid) is not None

    def __getitem__(self, rid: str) -> _RequestView:
        got = self._memo.get(rid)
        if got is not None:
            return got
        slot = self._slot(rid)
        if slot is None:
            raise KeyError(rid)
        runner = self._view.runner_ref()
        mirror = getattr(runner.block_tables, "__dict__", {}).get(MIRROR_ATTR, {})
        ngroups = len(runner.kv_cache_config.kv_cache_groups)
        blocks = mirror.get(slot) or [[] for _ in range(ngroups)]
        computed = int(runner.req_states.num_computed_tokens_np[slot])
        got = self._memo[rid] = _RequestView(self._view.prompts.get(rid, []), computed, blocks)
        return got


class V2RunnerView:
    """One per V2 runner (``view_of``); the recorder keys its run by this object."""

    statescope_runner_version = "V2"

    def __init__(self, runner: Any) -> None:
        self.runner_ref = weakref.ref(runner)
        self.statescope_runner_class = f"{type(runner).__module__}.{type(runner).__name__}"
        self.input_batch = _BatchIndex()
        self.requests = _Requests(self)
        self.prompts: dict[str, list] = {}
        self.mamba_state_idx: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:  # only for names not set on the view
        if name in _DELEGATED:
            runner = self.runner_ref()
            if runner is not None:
                return getattr(runner, name)  # AttributeError before the KV cache exists
        raise AttributeError(name)

    # ---- fed by the V2 hooks -------------------------------------------------------------------

    def note_schedule(self, so: Any) -> None:
        """Before the step: prompts of new requests, finished ones dropped, and each scheduled
        request's running column by the V2 pre-process rule (align mode)."""
        self.requests.clear()
        for rid in so.finished_req_ids:
            self.prompts.pop(rid, None)
            self.mamba_state_idx.pop(rid, None)
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.prompts[new.req_id] = list(new.prompt_token_ids or [])
            computed[new.req_id] = int(new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for rid, comp in zip(cached.req_ids, cached.num_computed_tokens):
            computed[rid] = int(comp)
        bs = self.mamba_block_size()
        if bs:
            for rid, comp in computed.items():
                end = comp + int(so.num_scheduled_tokens.get(rid, 0))
                self.mamba_state_idx[rid] = max(0, -(-end // bs) - 1)

    def note_batch(self, input_batch: Any) -> None:
        """The step's ``InputBatch`` (V2): batch rows of its ``req_ids``."""
        self.requests.clear()
        self.input_batch.req_id_to_index = {rid: i for i, rid in enumerate(input_batch.req_ids)}

    # ---- read by the capture -------------------------------------------------------------------

    def mamba_block_size(self) -> int | None:
        """The Mamba groups' block size in align mode (what the pre-process kernel divides by:
        ``MambaSpec.block_size``); None in other modes or before the KV cache exists."""
        runner = self.runner_ref()
        cache = getattr(runner, "cache_config", None)
        if cache is None or getattr(cache, "mamba_cache_mode", None) != "align":
            return None
        if "_block_size" not in self.__dict__:
            kvc = getattr(runner, "kv_cache_config", None)
            if kvc is None:
                return None
            from statescope.capture.adapters import mamba_groups

            self._block_size = int(mamba_groups(kvc)[1].block_size)
        return self._block_size

    def device_running_cols(self, req_ids: list) -> Any:
        """The device's running column (``_mamba_state_idx_gpu``) of ``req_ids``, gathered on the
        device (int64); None outside align mode."""
        runner = self.runner_ref()
        cols = getattr(getattr(runner, "model_state", None), "_mamba_state_idx_gpu", None)
        if cols is None or not req_ids:
            return None
        import torch

        from statescope.capture.digest import host_to_device

        slots = [runner.req_states.req_id_to_index[rid] for rid in req_ids]
        idx = host_to_device(torch.tensor(slots, dtype=torch.int64), cols.device)
        return cols.index_select(0, idx).to(torch.int64)


def view_of(runner: Any) -> V2RunnerView:
    """The runner's view (made once, kept on the runner so its identity is stable)."""
    view = runner.__dict__.get("_statescope_v2_view")
    if view is None:
        view = V2RunnerView(runner)
        runner.__dict__["_statescope_v2_view"] = view
    return view

