"""Deferred emission: a capture run's finished steps kept as an append-only spool until the engine idles.

Why: on a GPU the step is host-bound at small models, so every millisecond of Python the capture
spends while vLLM steps is a millisecond of throughput, whichever thread spends it (one GIL). Turning
a step into table rows (census decode and classification, per-request rows, parquet) is the
largest such cost (1.6-3.2 ms per step on the H200, data/results/gpu/e2e_factors/). With ``emit: "idle"`` (the default
on an accelerator) the flusher only appends each finished step, as host values, to
``spool.bin`` in the run directory — one encoding (``statescope.capture.spool_format``: data only,
never pickle, as a run directory from someone else must be safe to recover) and one ``write`` —
and the rows are made when no engine step has started for ``IDLE_S`` seconds, when
``defer_max_steps`` steps wait, or at flush/close. The spool is a write-ahead log: the manifest's ``spool_emitted`` is the byte offset up
to which its steps are in the tables, so after a crash or kill ``recover(run_dir)`` (CLI
``statescope capture-recover DIR``) emits the rest from the manifest alone.

What it deliberately does not do: decide what is recorded, or make the rows (``RunEmitter``);
and it does not hide the deferred cost — ``emit_ms_total`` in the manifest is the host time the
emission took, wherever it ran.
"""
from __future__ import annotations

import io
import os
import struct
import threading
from pathlib import Path
from typing import Any, Iterator

from statescope.capture import spool_format
from statescope.errors import InputError

SPOOL = "spool.bin"
IDLE_S = 0.25  # no engine step for this long: emit what waits
_HEADER = struct.Struct("<Q")


def host_item(item: dict) -> dict:
    """A step's item without what cannot leave the process (its device fence)."""
    return {k: v for k, v in item.items() if k != "fence"}


class Spool:
    """Append-only, length-prefixed records of finished steps (``run_dir/spool.bin``)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / SPOOL
        self._file = open(self.path, "ab")
        self.offset = self._file.tell()
        self._lock = threading.Lock()

    def append(self, item: dict) -> int:
        return self.append_many([item])

    def append_many(self, items: list) -> int:
        """One length-prefixed record per step, all in one write (the flusher drains several
        steps at a time: one syscall, not one per step)."""
        if not items:
            return self.offset
        out = io.BytesIO()
        for item in items:
            data = spool_format.encode(host_item(item))
            out.write(_HEADER.pack(len(data)))
            out.write(data)
        with self._lock:
            self._file.write(out.getbuffer())
            self._file.flush()  # to the OS: a killed process loses nothing written here
            self.offset = self._file.tell()
            return self.offset

    def truncate(self) -> None:
        """Empty the spool once the manifest records that its steps are in the tables (a crash
        right after leaves the old offset in the manifest and an empty file: nothing to redo)."""
        with self._lock:
            self._file.truncate(0)
            self._file.seek(0)
            self.offset = 0

    def close(self) -> None:
        self._file.close()


def read_spool(run_dir: str | os.PathLike, start: int = 0) -> Iterator[tuple[int, dict]]:
    """(offset after the step, step item) for every complete step from byte ``start`` on; a torn
    last record (the process died mid-write) ends the iteration."""
    path = Path(run_dir) / SPOOL
    if not path.is_file():
        return
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(start)
        while True:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size:
                return
            (n,) = _HEADER.unpack(head)
            if n > spool_format.MAX_RECORD_BYTES:  # checked before reading: no allocation of n
                raise InputError(f"{path}: step record at byte {f.tell() - _HEADER.size} claims "
                                 f"{n} bytes (at most {spool_format.MAX_RECORD_BYTES}); not a "
                                 "statescope spool record")
            if n > size - f.tell():  # a torn last record (the writer died mid-write)
                return
            data = f.read(n)
            if len(data) < n:
                return
            try:
                item = spool_format.decode(data)
            except spool_format.SpoolFormatError as exc:
                raise InputError(f"{path}: step record at byte {f.tell() - n - _HEADER.size} is "
                                 f"not a statescope spool record ({exc})") from None
            if not isinstance(item, dict) or not isinstance(item.get("engine_step"), int):
                raise InputError(f"{path}: step record at byte {f.tell() - n - _HEADER.size} is "
                                 "not a step (expected a dict with an integer 'engine_step')")
            yield f.tell(), item


def recover(run_dir: str | os.PathLike, *, interrupted: str | None = None) -> dict:
    """Emit a run's spooled steps that its tables lack (after a crash or kill), from its manifest,
    and close a run left ``running``: its ``ended`` record says it was recovered, with the
    progress its workload last recorded (``Recorder.checkpoint``), so a killed run reads
    ``incomplete`` unless every planned request had finished. ``interrupted``: the caller knows
    the writer was killed before its close (e.g. a server's teardown), so a run left ``running``
    reads ``incomplete`` whatever its progress says, the reason in ``ended.why``. Returns {"run",
    "steps_emitted", "status", "ended"}; a run already closed with nothing to recover is left
    unchanged."""
    from statescope.capture.ending import run_ending
    from statescope.capture.store import CaptureRun, CaptureWriter

    run = CaptureRun(run_dir)
    man = run.manifest
    done = int(man.get("spool_emitted") or 0)
    # a kill between writing a part's tables and the manifest that records it leaves those steps
    # in both: the tables win (steps are numbered per run)
    written = {int(x) for t in ("steps", "copies") for x in _table_steps(run, t)}
    pending = [(off, it) for off, it in read_spool(run.path, done) if it["engine_step"] not in written]
    status = man.get("status")
    if not pending and status not in (None, "running"):
        return {"run": str(run.path), "steps_emitted": 0, "status": status, "ended": man.get("ended")}
    if pending:
        from statescope.capture.emit import StandaloneEmitter

        em = StandaloneEmitter(run.path, man)
        for _, item in pending:
            em._emit(item)
        writer = em.writer
        writer.note(spool_emitted=pending[-1][0])
    else:
        writer = CaptureWriter.reopen(run.path)
    writer.note(recovered_steps=len(pending))
    if status in (None, "running"):
        steps = max([int(it["engine_step"]) for _, it in pending] + [int(x) for x in written]
                    + [int(man.get("engine_steps") or 0)])
        ended = run_ending(man.get("workload"), man.get("progress"), "capture-recover", steps,
                           int(man.get("error_count") or 0))
        if man.get("progress") is not None and not ended["complete"]:
            ended["why"] = (f"killed before it closed (recovered by statescope capture-recover): "
                            f"{ended['why']}")
        if interrupted:
            # a run without a workload plan would read complete ("completeness not known"):
            # a writer killed mid-close cannot vouch for its last steps
            ended.update(complete=False, interrupted=interrupted,
                         why=f"{interrupted}; recovered: {ended['why']}")
        status = "complete" if ended["complete"] else "incomplete"
        writer.note(ended=ended)
    writer.close(status)
    return {"run": str(run.path), "steps_emitted": len(pending), "status": status,
            "ended": writer.manifest.get("ended")}


def _table_steps(run: Any, table: str) -> list:
    frame = run.table(table)
    return [] if frame is None or frame.empty or "engine_step" not in frame else frame["engine_step"].unique().tolist()

