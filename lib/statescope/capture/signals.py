"""Close capture runs when the process is sent SIGTERM, then terminate as it would have anyway.

Why: ``vllm serve`` tears down by SIGTERM-ing the engine core and the worker processes; a worker
can die before vLLM calls its shutdown (where capture otherwise closes its runs), leaving a run's
manifest at status "running". ``chain_sigterm(on_term)`` puts a handler in front of the current
one: it calls ``on_term()`` (close the runs: status complete, ``closed_by`` "SIGTERM"), then the
handler it displaced (vLLM's worker handler raises ``SystemExit``), or, when that was the default
action, restores the default and re-sends the signal. Python runs signal handlers on the main
thread between bytecodes, so whatever ``on_term`` locks must be re-entrant.

``sigterm_deferred()`` holds SIGTERM back while a close runs (from the handler, the worker's
shutdown or an explicit close), so the signal cannot cut a close short.

What it deliberately does not do: install anything off the main thread (``signal.signal`` only
works there; the call is then a no-op), handle SIGKILL (nothing can), or handle SIGINT.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any, Callable, Iterator

log = logging.getLogger("statescope.capture.recorder")
_state: dict[str, Any] = {}  # "previous": the displaced handler, "on_term": our callback


def _on_sigterm(signum: int, frame: Any) -> None:
    on_term = _state.get("on_term")
    if on_term is not None:
        try:
            on_term()
        except Exception as exc:  # never keep the process from terminating
            log.warning("statescope capture: close on SIGTERM failed: %s", exc)
    prev = _state.get("previous", signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:  # SIG_DFL, or None (set outside Python): terminate as before
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def chain_sigterm(on_term: Callable[[], None]) -> bool:
    """Put ``on_term`` in front of the current SIGTERM handler; True when ours is (now) first."""
    if threading.current_thread() is not threading.main_thread():
        return False
    _state["on_term"] = on_term
    current = signal.getsignal(signal.SIGTERM)
    if current is not _on_sigterm:
        _state["previous"] = current
        signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def unchain_sigterm() -> None:
    """Give the displaced handler back (when ours is still the installed one)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _on_sigterm and "previous" in _state:
        prev = _state.pop("previous")
        signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
    _state.pop("on_term", None)


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[None]:
    """Hold SIGTERM back (on the main thread) while the body runs: a close that the signal
    interrupted half-way — vLLM's worker handler raises ``SystemExit`` — would leave the run
    unfinished. A SIGTERM that arrives meanwhile is delivered when the body ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def installed() -> bool:
    return signal.getsignal(signal.SIGTERM) is _on_sigterm
