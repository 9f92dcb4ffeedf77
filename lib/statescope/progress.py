"""Progress on stderr for long commands: done / total, elapsed, ETA — and nothing on stdout.

What it does: ``Progress(total, label, unit)`` draws one status line on stderr as work is done
(``advance``): redrawn in place on a terminal (at most 4 times a second), and on a pipe or a log
file one line per tenth of the work (or every 30 s), so CI logs stay short. ``note`` prints a
one-off stage line ("starting the trigger engine") above the bar. ``NullProgress`` has the same
methods and does nothing: library code takes an optional progress object and never prints on its
own, so notebooks show only what they display. ``NotebookProgress`` is the same bar as an HTML
output of a notebook cell, updated in place, for a notebook to pass into a long call.

The ETA is the rate so far times what is left; the rate's clock starts at the first ``advance``
(work done before — a resumed run's, ``start_from`` — does not count) and stops from a ``note``
(an engine starting between arms) to the next ``advance``. It is an estimate, hence the "~".

What it deliberately does not do: decide what counts as work (callers advance it), or write to
stdout (reports and ``--json`` live there).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

BAR_WIDTH = 24


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Progress:
    def __init__(self, total: int, label: str = "", unit: str = "requests", *,
                 stream: TextIO | None = None, tty: bool | None = None,
                 lines_when_piped: bool = True) -> None:
        self.total, self.label, self.unit = max(int(total), 0), label, unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.lines_when_piped = lines_when_piped  # False: off a terminal, only notes are printed
        self.done = 0
        self.t0 = time.monotonic()
        self._rate_t0: float | None = None   # the rate's clock: from the first advance on
        self._rate_done, self._paused_s, self._pause_from = 0, 0.0, None
        self._last_draw, self._last_tenth, self._last_line_t = 0.0, -1, self.t0
        self._drawn, self._printed_done = False, -1
        self._lock = threading.Lock()

    # -- counting -----------------------------------------------------------------------------
    def start_from(self, done: int) -> None:
        """Work already done before this process (a resumed run): counted, not used for the ETA."""
        with self._lock:
            self.done = max(self.done, int(done))
            self._rate_t0, self._rate_done, self._paused_s = None, self.done, 0.0
        self._draw(force=True)

    def add_total(self, n: int) -> None:
        with self._lock:
            self.total += int(n)

    def advance(self, n: int = 1) -> None:
        with self._lock:
            now = time.monotonic()
            self.done += n
            if self._rate_t0 is None:
                self._rate_t0, self._rate_done = now, self.done  # this advance's work is unclocked
            elif self._pause_from is not None:
                self._paused_s += now - self._pause_from
            self._pause_from = None
        self._draw()

    def note(self, text: str) -> None:
        """A stage line above the bar (the bar is redrawn under it on a terminal)."""
        with self._lock:
            self._emit_note(text)
            if self._rate_t0 is not None and self._pause_from is None:
                self._pause_from = time.monotonic()
        self._draw(force=True)

    def _emit_note(self, text: str) -> None:
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[2K")
        self.stream.write(f"{self.label + ': ' if self.label else ''}{text}\n")
        self.stream.flush()
        self._drawn = False

    def close(self) -> None:
        self._draw(force=True, final=True)
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- drawing ------------------------------------------------------------------------------
    def eta_s(self) -> float | None:
        new = self.done - self._rate_done
        if self._rate_t0 is None or new <= 0 or self.total <= self.done:
            return None
        end = self._pause_from if self._pause_from is not None else time.monotonic()
        clocked = max(end - self._rate_t0 - self._paused_s, 1e-3)
        return clocked / new * (self.total - self.done)

    def line(self) -> str:
        total = max(self.total, 1)
        frac = min(self.done / total, 1.0)
        fill = int(round(frac * BAR_WIDTH))
        eta = self.eta_s()
        parts = [f"[{'#' * fill}{'.' * (BAR_WIDTH - fill)}]", f"{self.done}/{self.total} {self.unit}",
                 f"{frac:4.0%}", f"{_clock(time.monotonic() - self.t0)} elapsed"]
        if eta is not None:
            parts.append(f"ETA ~{_clock(eta)}")
        return (f"{self.label}: " if self.label else "") + "  ".join(parts)

    def _draw(self, force: bool = False, final: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            if self.tty:
                if not force and now - self._last_draw < 0.25:
                    return
                self.stream.write("\r\x1b[2K" + self.line())
                self._drawn = True
            elif not self.lines_when_piped:
                return
            else:
                tenth = int(10 * self.done / self.total) if self.total else 10
                due = tenth > self._last_tenth or now - self._last_line_t >= 30
                if not (due or (final and self.done != self._printed_done)):
                    return
                self._last_tenth, self._last_line_t, self._printed_done = tenth, now, self.done
                self.stream.write(self.line() + "\n")
            self._last_draw = now
            self.stream.flush()


class NotebookProgress(Progress):
    """``Progress`` for a notebook cell: the same counting, line and ETA, drawn as one HTML output
    of the running cell (an HTML ``<progress>`` bar, the status line, the last stage notes) that is
    updated in place (a display id) at most 4 times a second. It writes nothing on stderr (no red
    box) and needs no widget manager: a headless run (nbclient, ``statescope render``) keeps its
    last state as plain HTML, so a rendered page shows how long the cell took."""

    NOTES = 3  # stage lines kept under the bar (the latest)

    def __init__(self, total: int, label: str = "", unit: str = "requests") -> None:
        import io

        super().__init__(total, label, unit, stream=io.StringIO(), tty=True)
        self.notes: list[str] = []
        self._handle = None

    def _emit_note(self, text: str) -> None:
        self.notes = (self.notes + [text])[-self.NOTES:]

    def html(self) -> str:
        import html

        value = min(self.done, self.total) if self.total else 0
        notes = "".join(f"<div style='color:#666'>{html.escape(n)}</div>" for n in self.notes)
        return (f"<div class='statescope-progress'><progress value='{value}' "
                f"max='{max(self.total, 1)}' style='width:18em'></progress> "
                f"<code>{html.escape(self.line())}</code>{notes}</div>")

    def _draw(self, force: bool = False, final: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last_draw < 0.25:
                return
            self._last_draw = now
            from IPython.display import HTML, display

            shown = HTML(self.html())
            if self._handle is None:
                self._handle = display(shown, display_id=True)
            else:
                self._handle.update(shown)

    def close(self) -> None:
        self._draw(force=True, final=True)


class NullProgress:
    """The do-nothing progress (library default)."""

    total = done = 0

    def start_from(self, done: int) -> None: ...
    def add_total(self, n: int) -> None: ...
    def advance(self, n: int = 1) -> None: ...
    def note(self, text: str) -> None: ...
    def close(self) -> None: ...

    def __enter__(self) -> "NullProgress":
        return self

    def __exit__(self, *exc: object) -> None: ...


def progress_or_null(progress: Progress | NullProgress | None) -> Progress | NullProgress:
    return NullProgress() if progress is None else progress
