"""AMPLIFIED: make vLLM V1's accepted-count race lose on every step where it can.

The race (``statescope.patches.accept_sync`` tells it in full): after sampling, the align-mode
post-process copies each request's accepted count into the pinned host array
``input_batch.num_accepted_tokens_cpu`` without waiting; the next step's ``_update_states`` moves
rows of that array (``condense()``, ``swap_states()``) and ``_prepare_inputs`` waits for the copy
only afterwards, then remaps the array from the previous step's row order. A copy that lands
*after* the moves overwrites them and the remap is right; one that lands *before* them is moved
and then remapped a second time, so a moved request reads another row's count. On a GPU the copy
usually lands late (the host runs ahead), which is why the H200 saw wrong counts only on moved
rows of batches that also held prefill rows (more host work before the moves).

What it does: ``install()`` wraps ``GPUModelRunner._update_states`` so that, where the race is
possible (async scheduling, align mode, the accepted-count event present), it waits for the
previous step's accepted-count copy *before* the row moves — the ordering that corrupts —
instead of leaving it to timing. An exposed build then corrupts on every step whose batch moves a
row of a request that accepted drafts, and a verdict needs a handful of requests instead of
hundreds. ``engaged()`` counts the waits it forced (0: the wrapped runner never ran — e.g. Model
Runner V2, which keeps the counts on the device and has no such array; or async was off).
Combined with ``accept_sync`` (which restores the previous order whichever way the copy landed)
it must change nothing: that is the amplifier's own control.

``install("delay")`` is the opposite ordering, as vLLM #50021's determinized reproduction did it:
a device-side delay (``torch.cuda._sleep``) on the stream just before the align-mode post-process
(``mamba_utils.postprocess_mamba_align_gpu``, whose last act is the non-blocking copy), so the copy
lands late. By the reading above that ordering is the benign one; running both says which
ordering corrupts on a given build instead of assuming it.

What it deliberately does not do: pass for a real-world rate. Every verdict from an arm with this
patch is labelled AMPLIFIED; it perturbs timing (a host wait on the step's critical path).
"""
from __future__ import annotations

import functools
import importlib
from typing import Any

from statescope.errors import EnvironmentBroken

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
MAMBA_UTILS = "vllm.v1.worker.mamba_utils"
_ORIGINAL_ATTR = "_statescope_unamplified_update_states"
MODES = ("early", "delay")
DELAY_CYCLES = 2_000_000  # ~1 ms at the H200's ~1.98 GHz: longer than a tiny model's step
_state: dict[str, Any] = {"waits": 0, "delays": 0, "original_postprocess": None}


def _exposed(runner: Any) -> bool:
    return (bool(getattr(runner, "use_async_scheduling", False))
            and getattr(runner, "num_accepted_tokens_event", None) is not None
            and getattr(getattr(runner, "cache_config", None), "mamba_cache_mode", None) == "align")


def amplified_update_states(original: Any) -> Any:
    """``_update_states`` that lets the previous accepted-count copy land before any row moves."""
    @functools.wraps(original)
    def wrapper(self: Any, scheduler_output: Any) -> Any:
        if _exposed(self):
            self.num_accepted_tokens_event.synchronize()
            _state["waits"] += 1
        return original(self, scheduler_output)
    wrapper.statescope_patch = "amplify_accept_race"
    return wrapper


def _install_delay() -> None:
    mu = importlib.import_module(MAMBA_UTILS)
    original = getattr(mu, "postprocess_mamba_align_gpu", None)
    if original is None:
        raise EnvironmentBroken(f"amplify_accept_race=delay: {MAMBA_UTILS}.postprocess_mamba_align_gpu "
                                "not found in this vLLM build")
    if _state["original_postprocess"] is not None:
        return

    @functools.wraps(original)
    def delayed(*args: Any, **kwargs: Any) -> Any:
        import torch

        torch.cuda._sleep(DELAY_CYCLES)  # holds the stream: the copy below lands late
        _state["delays"] += 1
        return original(*args, **kwargs)

    _state["original_postprocess"] = original
    mu.postprocess_mamba_align_gpu = delayed


def install(mode: str = "early") -> None:
    """Force the race's ordering (``early``: the copy lands before the row moves; ``delay``: it
    lands late), process-wide and idempotent."""
    if mode not in MODES:
        raise EnvironmentBroken(f"amplify_accept_race mode {mode!r}: expected one of {MODES}")
    if mode == "delay":
        _install_delay()
        return
    try:
        mod = importlib.import_module(RUNNER_MODULE)
    except ImportError as exc:
        raise EnvironmentBroken(f"amplify_accept_race: cannot import {RUNNER_MODULE} ({exc})") from exc
    cls = getattr(mod, "GPUModelRunner", None)
    if cls is None or not hasattr(cls, "_update_states"):
        raise EnvironmentBroken(f"amplify_accept_race: {RUNNER_MODULE}.GPUModelRunner._update_states "
                                "not found in this vLLM build")
    if hasattr(cls, _ORIGINAL_ATTR):
        return
    setattr(cls, _ORIGINAL_ATTR, cls._update_states)
    cls._update_states = amplified_update_states(cls._update_states)


def uninstall() -> None:
    if _state["original_postprocess"] is not None:
        importlib.import_module(MAMBA_UTILS).postprocess_mamba_align_gpu = _state["original_postprocess"]
        _state["original_postprocess"] = None
    try:
        cls = importlib.import_module(RUNNER_MODULE).GPUModelRunner
    except (ImportError, AttributeError):
        return
    if hasattr(cls, _ORIGINAL_ATTR):
        cls._update_states = getattr(cls, _ORIGINAL_ATTR)
        delattr(cls, _ORIGINAL_ATTR)


def engaged() -> dict[str, int]:
    """How many steps the amplifier forced its ordering on in this process (waits / delays)."""
    return {"waits": _state["waits"], "delays": _state["delays"]}
