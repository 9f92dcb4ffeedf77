"""Ordered accepted counts: a runtime patch for the H-accept race in vLLM's GPU model runner.

The race (vLLM 0.26.0, hybrid model + speculative decoding + ``mamba_cache_mode="align"`` + async
scheduling). After sampling, the fused post-process copies each request's accepted count into the
pinned host array ``input_batch.num_accepted_tokens_cpu`` with a non-blocking copy and records
``num_accepted_tokens_event``. The next step's ``_update_states`` then reorders the batch —
``condense()`` moves rows, ``swap_states()`` swaps them (e.g. to put decodes before a new prefill)
— and both move that same host array, while the copy may still be in flight. ``_prepare_inputs``
waits for the event only afterwards and remaps the array from the previous step's row order
(``prev_positions``). If the copy landed after the moves, it overwrote them and the remap is right;
if it landed before, the moves were applied and the remap moves the values a second time: a request
whose row moved gets another row's count — the new prefill's 1 where it accepted 3, so the GDN
conv update shifts its window by one token instead of three. That is what the H200 runs measured
(``data/results/gpu/e2e/localization.json``: wrong shifts only on moved rows in batches with
prefill rows).

What it does: ``install_accept_sync()`` wraps ``GPUModelRunner._update_states``. Where the runner
uses async scheduling and the align cache mode (the only place the remap runs on async counts), the
wrapper waits for the accepted-count event first, keeps a copy of the host array, calls the
original, and puts the copy back — so ``_prepare_inputs`` always remaps values that are in the
previous step's order, whichever way the copy raced. New requests' rows are set to 1 by the remap
itself. When no previous request is left in the batch (``prev_req_id_to_index`` empty: vLLM then
reads the array directly, new order, new rows at 1), the array is left as the original made it.
``uninstall_accept_sync()`` restores the original; both are idempotent. Measured on the H200 with
vLLM 0.26.0 (``data/results/gpu/e2e_patch_check/``, ``statescope.results.patch_check``): the eager trigger departs
on 17 of 576 requests (11/96 episodes) unpatched and on 0 with this patch, the cache and drafts
engaged alike.

What it deliberately does not do: touch runners without async scheduling (nothing races there),
the non-align modes (vLLM skips the host counts under async there), or hide its cost: it waits
for the previous step's post-process event at the start of ``_update_states`` instead of in
``_prepare_inputs`` (a little less host/device overlap).
"""
from __future__ import annotations

import functools
import importlib
from typing import Any

from statescope.errors import EnvironmentBroken

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
_ORIGINAL_ATTR = "_statescope_original_update_states"


def _applies(runner: Any) -> bool:
    return (bool(getattr(runner, "use_async_scheduling", False))
            and getattr(runner, "num_accepted_tokens_event", None) is not None
            and getattr(getattr(runner, "cache_config", None), "mamba_cache_mode", None) == "align")


def ordered_update_states(original: Any) -> Any:
    """``_update_states`` that keeps the host accepted counts in the previous step's row order."""
    @functools.wraps(original)
    def wrapper(self: Any, scheduler_output: Any) -> Any:
        if not _applies(self):
            return original(self, scheduler_output)
        self.num_accepted_tokens_event.synchronize()  # the previous step's copy has landed
        batch = self.input_batch
        previous_order = batch.num_accepted_tokens_cpu.copy()
        try:
            return original(self, scheduler_output)
        finally:
            # Only where _prepare_inputs will remap from the previous order (some previous request
            # is still in the batch): there the row moves must not reach these values. Otherwise
            # it reads the array as it is, in the new order (new requests set to 1): leave it.
            if getattr(batch, "prev_req_id_to_index", None):
                batch.num_accepted_tokens_cpu[:] = previous_order
    wrapper.statescope_patch = "accept_sync"
    return wrapper


def install_accept_sync() -> None:
    """Wrap vLLM's ``GPUModelRunner._update_states`` (process-wide; idempotent)."""
    try:
        mod = importlib.import_module(RUNNER_MODULE)
    except ImportError as exc:
        raise EnvironmentBroken(f"accept_sync: cannot import {RUNNER_MODULE} ({exc})") from exc
    cls = getattr(mod, "GPUModelRunner", None)
    if cls is None or not hasattr(cls, "_update_states"):
        raise EnvironmentBroken(f"accept_sync: {RUNNER_MODULE}.GPUModelRunner._update_states not found "
                                "in this vLLM build")
    if hasattr(cls, _ORIGINAL_ATTR):
        return
    setattr(cls, _ORIGINAL_ATTR, cls._update_states)
    cls._update_states = ordered_update_states(cls._update_states)


def uninstall_accept_sync() -> None:
    mod = importlib.import_module(RUNNER_MODULE)
    cls = mod.GPUModelRunner
    if hasattr(cls, _ORIGINAL_ATTR):
        cls._update_states = getattr(cls, _ORIGINAL_ATTR)
        delattr(cls, _ORIGINAL_ATTR)
