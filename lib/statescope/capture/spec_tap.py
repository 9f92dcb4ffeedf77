"""Per-request speculative-decoding counts, read where vLLM's scheduler counts them.

What it does: ``install()`` wraps ``Scheduler.make_spec_decoding_stats`` (the scheduler calls it
once per request and step with the step's draft and accepted token counts; the signature is the
same in vLLM 0.24.0 … 0.33.0) so that, besides doing what it did, it adds the counts to a table by
request id. ``take(request_id)`` pops one request's ``(draft_tokens, accepted_tokens)``. It runs
where the scheduler runs: in-process for the offline engine. Why: vLLM 0.26.0's in-process engine
on the H200 reported 0 in every spec-decode and prefix-cache counter although drafts were
accepted, so a guard reading the counters alone called an engaged arm "not exercised"; the
per-request counts let the guard see the engagement itself (``statescope.resolved``).

What it deliberately does not do: change the scheduler's result or work when vLLM's own stats are
off (it counts before the ``log_stats`` check and returns the original's value), or reach a
scheduler in another process (a server's ``/metrics`` has the counters there).
"""
from __future__ import annotations

import threading
from typing import Any

_counts: dict[str, list[int]] = {}
_lock = threading.Lock()
_state: dict[str, Any] = {"original": None, "cls": None}



def install() -> bool:
    """Wrap the scheduler method (idempotent); False when this vLLM has no such method."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return False
    original = getattr(Scheduler, "make_spec_decoding_stats", None)
    if original is None:
        return False
    if getattr(original, "_statescope_tap", False):
        return True

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id, *args, **kwargs):
        if num_draft_tokens:
            drafts = num_draft_tokens - ((num_invalid_spec_tokens or {}).get(request_id, 0))
            with _lock:
                c = _counts.setdefault(str(request_id), [0, 0])
                c[0] += int(drafts)
                c[1] += int(num_accepted_tokens)
        return original(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                        num_invalid_spec_tokens, request_id, *args, **kwargs)

    make_spec_decoding_stats._statescope_tap = True
    Scheduler.make_spec_decoding_stats = make_spec_decoding_stats
    _state.update(original=original, cls=Scheduler)
    return True


def uninstall() -> None:
    if _state["cls"] is not None:
        _state["cls"].make_spec_decoding_stats = _state["original"]
        _state.update(original=None, cls=None)


def take(request_id: str) -> tuple[int, int] | None:
    """Pop ``(draft_tokens, accepted_tokens)`` of one request (also under a suffixed id)."""
    with _lock:
        hit = _counts.pop(str(request_id), None)
        if hit is None:  # the engine core's id may carry a "-suffix" the front end does not show
            prefix = f"{request_id}-"
            keys = [k for k in _counts if k.startswith(prefix)]
            if len(keys) == 1:
                hit = _counts.pop(keys[0])
    return None if hit is None else (hit[0], hit[1])


def installed() -> bool:
    return _state["cls"] is not None
