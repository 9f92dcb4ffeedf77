"""Lesson 6b: the real accepted-count race, step by step, from the H200's 3-request reproducer.

What it does: ``reproducer_steps`` reads the committed capture of the smallest failing workload
found on the H200 (``data/results/gpu/capture_pairs/minimal_at_two_seqs.tar.gz``: vLLM 0.26.0,
Model Runner V1, async scheduling, ``max_num_seqs=2``; three requests, one corrupted) and gives
one row per request and engine step: its batch row, whether it prefilled, the accepted count it
sampled, and for each decode step the conv-window shift the previous step's count asks for beside
the shift the capture observed (layer 0, exact row checksums: ``conv_shift_check``). Requests
are named A, B, C in arrival order. ``check_real_race`` states what the table shows: exactly one
transition broke, and it is the one where a request moved to another batch row in a step that
also ran a prefill.

What it deliberately does not do: run an engine (the capture is committed; the CPU build cannot
run async scheduling, section 6 plants the same mechanism instead) or explain other captures.
Nothing here is planted: this is the real failure.
"""
from __future__ import annotations

import functools
import tarfile
import tempfile
from pathlib import Path

import pandas as pd

from statescope.errors import InputError
from statescope.teach.lesson import LessonCheck

ARCHIVE = (Path(__file__).resolve().parents[3] / "data" / "results" / "gpu" / "capture_pairs"
           / "minimal_at_two_seqs.tar.gz")


@functools.lru_cache(maxsize=4)
def _unpacked(archive: str) -> Path:
    path = Path(archive)
    if not path.is_file():
        raise InputError(f"{path}: no such capture archive (expected a committed capture pair)")
    out = Path(tempfile.mkdtemp(prefix="statescope-real-race-"))
    with tarfile.open(path) as tf:
        tf.extractall(out, filter="data")
    runs = sorted(out.glob("*/trigger/run-*"))
    if len(runs) != 1:
        raise InputError(f"{path}: expected one */trigger/run-* capture, found {len(runs)}")
    return runs[0]


def reproducer_steps(archive: str | Path = ARCHIVE) -> pd.DataFrame:
    """One row per (request, engine step) of the trigger capture, with the shift check."""
    from statescope.capture.store import CaptureRun
    from statescope.diverge.conv_continuity import conv_shift_check

    run = CaptureRun(_unpacked(str(archive)))
    steps = run.steps().sort_values(["engine_step", "batch_row"])
    order = sorted(steps["req_id"].unique(), key=lambda r: int(r.split("-")[0]))
    name = {r: chr(65 + i) for i, r in enumerate(order)}
    shifts = conv_shift_check(run)
    first = shifts[shifts["layer"] == shifts["layer"].iloc[0]] if len(shifts) else shifts
    by_step = {(r.req_id, int(r.engine_step)): r for r in first.itertuples()}
    rows = []
    for s in steps.itertuples():
        check = by_step.get((s.req_id, int(s.engine_step)))
        prefill = int(s.num_scheduled_tokens) > int(s.num_drafts) + 1
        rows.append({
            "engine step": int(s.engine_step), "request": name[s.req_id],
            "batch row": int(s.batch_row), "prefill": prefill,
            "tokens before": int(s.num_computed_tokens),
            "accepted (sampled)": int(s.num_accepted_sampled),
            "shift asked": None if check is None else int(check.expected_shift),
            "shift seen": None if check is None else list(check.observed_shifts),
            "moved row": None if check is None else bool(check.moved),
            "window ok": None if check is None else bool(check.ok)})
    return pd.DataFrame(rows).astype({"shift asked": "Int64"})


def check_real_race(steps: pd.DataFrame) -> LessonCheck:
    """The break: one transition, a row move beside a prefill, the wrong count."""
    decode = steps[steps["window ok"].notna()]
    broken = decode[~decode["window ok"].astype(bool)]
    prefill_steps = set(steps.loc[steps["prefill"], "engine step"])
    ok = (len(broken) == 1 and bool(broken["moved row"].iloc[0])
          and int(broken["engine step"].iloc[0]) in prefill_steps
          and list(broken["shift seen"].iloc[0]) != [int(broken["shift asked"].iloc[0])])
    if len(broken) == 1:
        b = broken.iloc[0]
        detail = (f"request {b['request']} at engine step {b['engine step']}: moved to row "
                  f"{b['batch row']} in a step with a prefill, its window shifted by "
                  f"{b['shift seen']} where its own count asks for {int(b['shift asked'])}; the other "
                  f"{len(decode) - 1} decode transitions are intact (H200 capture, nothing planted)")
    else:
        detail = f"{len(broken)} broken transitions of {len(decode)} (expected exactly one)"
    return LessonCheck("the real race on the H200", ok, detail,
                       {"decode transitions": len(decode), "broken": len(broken)})
