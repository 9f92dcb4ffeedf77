"""Exact conv-window continuity: which accepted count each decode step's conv update applied.

What it does: a speculative decode step keeps ``W = kernel - 1 + num_speculative_tokens`` conv rows
per request; the next decode step's conv update reads ``kernel - 1`` of them starting at row
``accepted - 1``, appends its new inputs and writes the last ``W`` rows back, so the new window's
first ``kernel - 2`` rows are the old window's rows ``a .. a + kernel - 3`` bit for bit, where ``a``
is the accepted count it read. ``conv_shift_check(run)`` compares, per (request, decode -> decode
transition, GDN layer), the per-row checksums of the captured windows (digest mode keeps them) and
lists every shift ``s`` with ``old[s:s + carry] == new[:carry]`` (``observed_shifts``) against the
accepted count sampled at the previous step minus the bias of an in-place post-process left
shift there (census ``left_shift_same_block``; ``expected_shift``). At a step whose own digest is
read after such a shift by ``b``, the check is instead that the rows the shift duplicates agree
(row ``j`` == row ``j + b``) and that the surviving carried rows are the expected old rows
(``inplace_shift_intact``). Each row also says whether the request's batch row moved and how many
prefill rows (``num_scheduled_tokens > num_drafts + 1``) of the capture's requests shared the
batch. ``continuity_summary(df)`` counts breaks and tabulates them by expected shift x moved x
prefill-in-batch. No reference run and no tolerance: checksums are compared exactly.

What a break means (``break_kind`` per row, ``transition_kind`` per transition in the summary):
a wrong accepted count is one number per request, so it moves every GDN layer's window by the
same *other* shift (``wrong shift``); carried rows that match no shift at all (``no shift fits``),
or a break in some layers only (``some layers``), are a changed value — a corruption of the rows
themselves — not a wrong shift. Where both runs recorded row hashes (``row_hashes``, since the
word hash) a row must match by checksum *and* hash, so a permutation inside a carried row is seen.

Geometry comes from the manifest (``states[].conv_width``, ``conv_window`` = kernel - 1,
``num_speculative_tokens``), GDN layers from the digests.

What it deliberately does not do: check prefill -> decode or decode -> prefill transitions (a prefill
writes the window whole), transitions where either step scheduled fewer drafts than
``num_speculative_tokens`` (their row alignment was never measured), pre-copies into a new block
(not corrected for), transitions touching a step whose window is all zero in some layer (a block
not written yet) or, on Model Runner V2, a step that moved into a new block (digested before the
block holds the window), or say *why* a shift is wrong (``statescope.diverge.hypotheses`` scores that).
"""
from __future__ import annotations

import os
from typing import Any

import pandas as pd

from statescope.capture.store import CaptureRun
from statescope.diverge.digest_diff import layer_order as _layer_order, unwritten_window
from statescope.errors import InputError


def _open(run: str | os.PathLike | CaptureRun) -> CaptureRun:
    return run if isinstance(run, CaptureRun) else CaptureRun(run)


def window_geometry(run: CaptureRun) -> dict[str, int]:
    """``{"rows": W, "kernel": K, "num_spec": n, "carry": K - 2}`` from the run's manifest."""
    m = run.manifest
    live, spec = m.get("conv_window"), m.get("num_speculative_tokens")
    if live is None or spec is None:
        field = "conv_window" if live is None else "num_speculative_tokens"
        raise InputError(f"capture run {run.path}: manifest lacks {field!r} (needed for the conv "
                         "window geometry)")
    widths = {int(s["conv_width"]) for s in m.get("states", []) if s.get("kind") == "conv"}
    rows = widths.pop() if len(widths) == 1 else int(live) + int(spec)
    if rows != int(live) + int(spec):
        raise InputError(f"capture run {run.path}: manifest states conv_width {rows} != conv_window "
                         f"{live} + num_speculative_tokens {spec}")
    if int(live) < 2 or int(spec) < 1:
        raise InputError(f"capture run {run.path}: conv_window={live}, num_speculative_tokens="
                         f"{spec}: the check needs kernel >= 3 and speculative decoding")
    return {"rows": rows, "kernel": int(live) + 1, "num_spec": int(spec), "carry": int(live) - 1}


def inplace_shift_bias(copies: pd.DataFrame) -> dict[tuple[str, int], int]:
    """``{(req_id, engine_step): bias}`` of the census's in-place (same-block) conv left shifts."""
    if copies.empty or "kind" not in copies:
        return {}
    sh = copies[(copies["kind"] == "left_shift_same_block") & (copies["nbytes"] > 0)]
    return {(r, int(e)): int(b) for r, e, b in zip(sh["req_id"], sh["engine_step"], sh["bias"])}


def _need(run: CaptureRun, frame: pd.DataFrame, table: str, columns: list[str]) -> None:
    missing = [c for c in columns if c not in frame]
    if frame.empty or missing:
        raise InputError(f"capture run {run.path}: {table} table lacks "
                         f"{missing or 'rows'} (conv continuity needs per-row conv checksums "
                         "and accepted counts: a digest-mode capture of a speculative run)")


def conv_shift_check(run: str | os.PathLike | CaptureRun) -> pd.DataFrame:
    """One row per (request, decode -> decode transition, GDN layer); see the module docstring."""
    run = _open(run)
    geo = window_geometry(run)
    rows_w, carry, spec = geo["rows"], geo["carry"], geo["num_spec"]
    steps, dig = run.steps(), run.digests()
    _need(run, steps, "steps", ["req_id", "req_step", "engine_step", "num_drafts",
                                "num_scheduled_tokens", "batch_row"])
    acc_col = next((c for c in ("num_accepted_sampled", "accepted") if c in steps), None)
    if acc_col is None:
        raise InputError(f"capture run {run.path}: steps table lacks 'num_accepted_sampled' "
                         "(or 'accepted'): the accepted counts the check compares with")
    _need(run, dig, "digests", ["req_id", "req_step", "layer", "kind", "row_checksums"])
    conv = dig[dig["kind"] == "conv"]
    if "column_offset" in conv:
        conv = conv[conv["column_offset"] == 0]  # the running column only
    if conv.empty or conv["row_checksums"].isna().all():
        raise InputError(f"capture run {run.path}: digests field 'row_checksums' is empty for "
                         "conv states (no per-row conv checksums recorded)")
    # a row's identity: its checksum, and its hash where the capture recorded one
    hashes = conv["row_hashes"] if "row_hashes" in conv else [None] * len(conv)
    windows = {(r, int(s), l): ([(int(x), int(y)) for x, y in zip(c, h)]
                                if h is not None and not isinstance(h, float)
                                else [int(x) for x in c])
               for r, s, l, c, h in zip(conv["req_id"], conv["req_step"], conv["layer"],
                                        conv["row_checksums"], hashes)
               if c is not None}
    # a step whose window is all zero in some layer digested a block not written yet (no
    # token's conv rows are 0; Model Runner V2 at a block crossing): its transitions are skipped
    unwritten = {(r, int(s)) for r, s, c in zip(conv["req_id"], conv["req_step"],
                                                conv["row_checksums"]) if unwritten_window(c)}
    # Model Runner V2 digests a step that moved into a new block before the new block holds
    # the window (old bytes; the H200 v2_default pair): that step's transitions are skipped
    v2 = run.manifest.get("runner_version") == "V2" and "running_blocks" in steps
    if v2:
        for rid, m in steps.sort_values("req_step").groupby("req_id", sort=False):
            blk = [list(b) for b in m["running_blocks"]]
            for i in range(1, len(blk)):
                if blk[i] != blk[i - 1]:
                    unwritten.add((rid, int(m["req_step"].iloc[i])))
    layers = sorted(conv["layer"].unique(), key=_layer_order)
    bias = inplace_shift_bias(run.copies())
    prefill = steps[steps["num_scheduled_tokens"] > steps["num_drafts"] + 1]
    prefill_rows = prefill.groupby("engine_step").size().to_dict()
    used = "num_accepted_used" in steps
    blocks = "running_blocks" in steps
    out = []
    for rid, m in steps.sort_values("req_step").groupby("req_id", sort=False):
        recs = m.to_dict("records")
        for prev, cur in zip(recs, recs[1:]):
            if int(cur["req_step"]) != int(prev["req_step"]) + 1:
                continue  # a step of the request was not captured
            if int(prev["num_drafts"]) != spec or int(cur["num_drafts"]) != spec:
                continue  # decode -> decode with a full draft set only
            if (rid, int(prev["req_step"])) in unwritten or (rid, int(cur["req_step"])) in unwritten:
                continue  # a window not written yet (see above)
            b_prev = bias.get((rid, int(prev["engine_step"])), 0)
            b_cur = bias.get((rid, int(cur["engine_step"])), 0)
            expected = int(prev[acc_col]) - b_prev
            base = {"req_id": rid, "req_step": int(cur["req_step"]),
                    "engine_step": int(cur["engine_step"]), "engine_step_prev": int(prev["engine_step"]),
                    "accepted_prev": int(prev[acc_col]), "expected_shift": expected,
                    "used_recorded": (int(prev["num_accepted_used"]) if used and
                                      pd.notna(prev["num_accepted_used"]) else None),
                    "inplace_shift_bias_prev": b_prev, "inplace_shift_bias": b_cur,
                    "batch_row_prev": int(prev["batch_row"]), "batch_row": int(cur["batch_row"]),
                    "moved": int(prev["batch_row"]) != int(cur["batch_row"]),
                    "prefill_rows_in_batch": int(prefill_rows.get(int(cur["engine_step"]), 0)),
                    "block_change": (list(prev["running_blocks"]) != list(cur["running_blocks"])
                                     if blocks else None)}
            for layer in layers:
                p = windows.get((rid, int(prev["req_step"]), layer))
                c = windows.get((rid, int(cur["req_step"]), layer))
                if p is None or c is None or len(p) != rows_w or len(c) != rows_w:
                    continue
                shifts = [s for s in range(rows_w - carry + 1) if p[s:s + carry] == c[:carry]]
                intact = None
                if b_cur:  # read after an in-place shift by b_cur: duplicated rows must agree ...
                    dup = [j for j in range(rows_w) if rows_w - 1 - 2 * b_cur < j <= rows_w - 1 - b_cur]
                    intact = all(c[j] == c[j + b_cur] for j in dup)
                    for j in range(max(0, carry - b_cur)):  # ... and carried rows moved up by b_cur
                        if expected + b_cur + j < rows_w:
                            intact = intact and c[j] == p[expected + b_cur + j]
                ok = bool(intact if b_cur else expected in shifts)
                kind = None if ok else ("in-place shift broken" if b_cur else
                                        "other shift" if shifts else "no shift fits")
                out.append({**base, "layer": layer, "observed_shifts": shifts,
                            "inplace_shift_intact": intact, "ok": ok, "break_kind": kind})
    cols = ["req_id", "req_step", "engine_step", "layer", "expected_shift", "observed_shifts", "ok",
            "break_kind"]
    return pd.DataFrame(out) if out else pd.DataFrame(columns=cols)


def continuity_summary(df: pd.DataFrame) -> dict[str, Any]:
    """Counts of a ``conv_shift_check`` frame; a transition (request, step) breaks if any layer does."""
    if df.empty:
        return {"rows_checked": 0, "transitions_checked": 0, "break_transitions": 0,
                "requests_checked": 0, "requests_with_break": 0, "break_engine_steps": [],
                "breaks_per_layer_agree": True, "observed_vs_expected": [], "contingency": [],
                "break_kinds": {}}
    if "break_kind" not in df:  # a frame from before break kinds: derive them
        df = df.assign(break_kind=[None if ok else ("other shift" if o else "no shift fits")
                                   for ok, o in zip(df["ok"], df["observed_shifts"])])
    key = ["req_id", "req_step"]
    tr = df.groupby(key, sort=False).agg(
        ok=("ok", "all"), layers=("ok", "size"), broken_layers=("ok", lambda x: int((~x).sum())),
        engine_step=("engine_step", "first"), expected_shift=("expected_shift", "first"),
        observed=("observed_shifts", lambda x: str(list(x.iloc[0]))),
        moved=("moved", "first"), prefill=("prefill_rows_in_batch", "first")).reset_index()
    kinds = df[~df["ok"]].groupby(key, sort=False)["break_kind"].agg(lambda x: set(x))
    tr["transition_kind"] = [transition_kind(kinds.get((r, q)), b, n) for r, q, b, n in
                             zip(tr["req_id"], tr["req_step"], tr["broken_layers"], tr["layers"])]
    bad = tr[~tr["ok"]]
    tr["prefill_in_batch"] = tr["prefill"] > 0
    table = tr.groupby(["expected_shift", "moved", "prefill_in_batch"]).agg(
        transitions=("ok", "size"), broken=("ok", lambda x: int((~x).sum()))).reset_index()
    obs = bad.groupby(["expected_shift", "observed"]).size().rename("transitions").reset_index()
    return {
        "rows_checked": int(len(df)), "transitions_checked": int(len(tr)),
        "break_transitions": int(len(bad)),
        "break_transitions_moved": int(bad["moved"].sum()),
        "requests_checked": int(tr["req_id"].nunique()),
        "requests_with_break": int(bad["req_id"].nunique()),
        "break_engine_steps": sorted({int(e) for e in bad["engine_step"]}),
        "breaks_per_layer_agree": bool((bad["broken_layers"] == bad["layers"]).all()),
        "break_kinds": {str(k): int(v) for k, v in bad["transition_kind"].value_counts().items()},
        "observed_vs_expected": [{"expected_shift": int(e), "observed_shifts": o, "transitions": int(n)}
                                 for e, o, n in obs.itertuples(index=False)],
        "contingency": [{"expected_shift": int(e), "moved": bool(m), "prefill_in_batch": bool(p),
                         "transitions": int(t), "broken": int(b)}
                        for e, m, p, t, b in table.itertuples(index=False)],
    }


WRONG_SHIFT, NO_SHIFT, SOME_LAYERS, INPLACE = ("wrong shift", "value change (no shift fits)",
                                              "some layers only", "in-place shift broken")


def transition_kind(kinds: set | None, broken: int, layers: int) -> str | None:
    """What a broken transition is: ``wrong shift`` (every layer moved by the same other shift:
    a wrong accepted count), a value change where no shift fits, a break in some layers only, or
    a broken in-place shift; None when it is intact."""
    if not broken:
        return None
    kinds = kinds or set()
    if "no shift fits" in kinds:
        return NO_SHIFT
    if broken < layers:
        return SOME_LAYERS
    return INPLACE if "in-place shift broken" in kinds else WRONG_SHIFT


def run_continuity(run: str | os.PathLike | CaptureRun) -> pd.DataFrame | None:
    """``conv_shift_check(run)``, or None where the run cannot be checked (no speculative
    decoding, no per-row conv checksums): for callers that use the check when it applies."""
    from statescope.errors import InputError

    try:
        return conv_shift_check(run)
    except InputError:
        return None


