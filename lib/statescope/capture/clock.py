"""The capture's own CPU seconds: a clock around the recorder's hook sink and the flusher's emission.

What it does: ``CaptureClock.attach(recorder)`` wraps the sink methods the hooks call on a
``statescope.capture.recorder`` instance (``begin_step``, ``end_step``, ``fused_launch``, ...) and,
once per process, ``RunCapture.drain`` (the flusher thread's emission of finished steps, and the
emission at close), so that every call adds its ``time.thread_time`` to ``seconds`` and to
``by_name[method]`` (``"drain"`` for the emission). Thread time, not wall time: other processes'
load on a shared machine, and the engine's own work on other threads, do not count. ``CLOCK`` is
the one-element list the wrapped ``drain`` reads: set ``CLOCK[:] = [clock]`` for the clock that
should see the emission (``statescope.capture.overhead.timed_round`` does).

What it deliberately does not do: time anything outside the capture (vLLM's step, the digest
kernels on the device), or unwrap: the sink wrappers die with the recorder, and the ``drain``
wrapper only forwards when ``CLOCK`` is empty.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable


class CaptureClock:
    """CPU seconds spent inside the capture (see the module docstring)."""

    SINK = ("begin_step", "end_step", "note_sampled", "note_accepted", "fused_launch",
            "launch_done", "observed_copy", "scalar_meta", "scalar_launch", "prefix_begin",
            "prefix_group", "prefix_end")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_name: dict[str, float] = {}  # per sink method ("drain": the flusher's emission)
        self._lock = threading.Lock()  # the flusher thread and the step's thread both add

    def timed(self, fn: Callable, name: str | None = None) -> Callable:
        """``fn`` wrapped so that its thread time is added under ``name``."""
        name = name or getattr(fn, "__name__", "?")

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.thread_time() - t0
                with self._lock:
                    self.seconds += dt
                    self.by_name[name] = self.by_name.get(name, 0.0) + dt
        return wrapper

    def attach(self, recorder: Any) -> None:
        """Time ``recorder``'s sink methods (the hooks call them through the instance) and the
        emission (``RunCapture.drain``, wrapped once per process, forwarding to ``CLOCK[0]``)."""
        for name in self.SINK:
            setattr(recorder, name, self.timed(getattr(recorder, name), name))
        from statescope.capture import run as capture_run

        if not hasattr(capture_run.RunCapture.drain, "_timed_by_clock"):
            drain = capture_run.RunCapture.drain

            def timed_drain(run: Any, force: bool = False) -> int:
                return CLOCK[0].timed(drain, "drain")(run, force) if CLOCK else drain(run, force)
            timed_drain._timed_by_clock = True  # type: ignore[attr-defined]
            capture_run.RunCapture.drain = timed_drain  # type: ignore[method-assign]


CLOCK: list[CaptureClock] = []
