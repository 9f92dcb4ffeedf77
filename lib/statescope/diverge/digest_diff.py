"""Line two capture runs of one workload up and say where their state digests first differ.

What it does: ``digest_diff(a, b)`` joins the digests of two runs on what is stable across runs —
the prompt (``prompt_sha``), the request's own step counter, layer and state kind — and marks each
pair ``same``:

- recurrent state (``ssm``): exact checksums agree and the float statistics agree within
  ``rtol`` (the projections make a permuted state differ even when its checksum does not);
- conv window (``conv``), by default (``conv="live"``): only the rows the next step will read are
  compared — ``conv_window`` rows from each run's ``conv_live_offset`` — by per-row checksum and
  sum. The other rows of a window hold bytes left by the block's previous user, which differ
  between runs with different histories and mean nothing. ``conv="window"`` compares everything.

``first_divergence(a, b)`` reduces that to one row per request: the first request-local step
where anything differs and which kinds and layers differ there. ``shifts_by_request(run)`` lists,
per request, the steps at which the census saw an in-place conv shift (``left_shift_same_block``
with bytes to move).

Runs recorded with different digest versions (``digest_version`` in the manifest: the projections
changed definition in version 2) agree only on checksums, so only checksums are compared and a
``DigestMismatchWarning`` says so; runs digested by different kernels (``digest_kernel``: the CPU
C kernel vs the torch path) compare as usual (their floats agree to ~4e-6 relative, inside the
default ``rtol``) with a warning, since a tighter ``rtol`` would flag kernel noise as divergence.

Digest rows of draft columns (``column_offset`` > 0, spec ``draft_columns``) are compared only
when asked for (``column_offset=j``); by default the running column is compared.

What it deliberately does not do: decide which hypothesis a divergence supports (the verdict
tools do) or compare runs of different workloads (rows that do not join are dropped).
"""
from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from statescope.capture.store import CaptureRun
from statescope.errors import InputError

KEYS = ["prompt_sha", "req_step", "layer", "kind"]


class DigestMismatchWarning(UserWarning):
    """Two runs' digests were made by different digest versions or kernels."""


def comparable_stats(a: CaptureRun, b: CaptureRun) -> bool:
    """False when the two runs' float statistics are not comparable (different digest versions);
    warns when only the kernels differ."""
    va, vb = a.manifest.get("digest_version", 1), b.manifest.get("digest_version", 1)
    if va != vb:
        warnings.warn(f"digest_version {va} vs {vb}: comparing checksums only (float statistics "
                      "changed definition between versions)", DigestMismatchWarning, stacklevel=3)
        return False
    ka, kb = a.manifest.get("digest_kernel"), b.manifest.get("digest_kernel")
    if ka != kb:
        warnings.warn(f"digest_kernel {ka} vs {kb}: float statistics agree only to ~4e-6 relative; "
                      "keep rtol >= 1e-5", DigestMismatchWarning, stacklevel=3)
    return True


def _with_offsets(run: CaptureRun, column_offset: int = 0) -> pd.DataFrame:
    d, st = run.digests(), run.steps()
    if d.empty:
        return d
    if "column_offset" in d.columns:  # runs recorded with draft columns: one column at a time
        d = d[d["column_offset"] == column_offset]
    off = st[["req_id", "engine_step", "conv_live_offset"]]
    return d.merge(off, on=["req_id", "engine_step"], how="left")


def _live(values, offset, width: int) -> list | None:
    if values is None or offset is None or (isinstance(offset, float) and np.isnan(offset)):
        return None
    values = list(values)
    return values[int(offset):int(offset) + width]


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    scale = np.maximum(np.maximum(np.abs(a), np.abs(b)), 1e-30)
    rel = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b) / scale)
    return np.nan_to_num(rel, nan=np.inf)


def digest_diff(a: CaptureRun, b: CaptureRun, rtol: float = 1e-5,
                conv: str = "live", column_offset: int = 0) -> pd.DataFrame:
    """One row per joined (prompt, request step, layer, kind) with ``same``; ``column_offset``
    picks the running column (0, default) or the j-th draft column after it."""
    if conv not in ("live", "window"):
        raise InputError(f"digest_diff conv={conv!r}: expected 'live' or 'window'")
    da, db = _with_offsets(a, column_offset), _with_offsets(b, column_offset)
    if da.empty or db.empty:
        return pd.DataFrame(columns=KEYS + ["same"])
    stats = [c for c in a.manifest.get("digest_stats", []) if c in da.columns and c in db.columns]
    if not comparable_stats(a, b):
        stats = []
    m = da.merge(db, on=KEYS, suffixes=("_a", "_b"))
    va, vb = m[[s + "_a" for s in stats]].to_numpy(float), m[[s + "_b" for s in stats]].to_numpy(float)
    m["stat_rel_diff"] = _rel(va, vb).max(axis=1) if stats else 0.0
    m["same"] = (m["checksum_a"] == m["checksum_b"]) & (m["stat_rel_diff"] <= rtol)
    if conv == "live":
        width = int(a.manifest.get("conv_window", 0))
        is_conv = m["kind"] == "conv"
        live = []
        for _, r in m[is_conv].iterrows():
            ca = _live(r["row_checksums_a"], r["conv_live_offset_a"], width)
            cb = _live(r["row_checksums_b"], r["conv_live_offset_b"], width)
            sa = _live(r["row_sums_a"], r["conv_live_offset_a"], width)
            sb = _live(r["row_sums_b"], r["conv_live_offset_b"], width)
            ok = ca is not None and ca == cb and len(sa) == len(sb) and bool(
                (_rel(np.array(sa, float), np.array(sb, float)) <= rtol).all())
            live.append(ok)
        if live:  # a table without conv rows (e.g. a recurrent-only spec) has nothing to set
            m.loc[is_conv, "same"] = live
    return m


def first_divergence(a: CaptureRun, b: CaptureRun, rtol: float = 1e-5,
                     conv: str = "live") -> pd.DataFrame:
    """Per request (prompt): first differing request step, kinds/layers there, steps compared."""
    m = digest_diff(a, b, rtol, conv)
    rows = []
    for sha, g in m.groupby("prompt_sha"):
        bad = g[~g["same"].astype(bool)]
        first = int(bad["req_step"].min()) if len(bad) else None
        at = bad[bad["req_step"] == first] if first is not None else bad
        rows.append({"prompt_sha": sha, "req_id_a": g["req_id_a"].iloc[0],
                     "req_id_b": g["req_id_b"].iloc[0],
                     "steps_compared": int(g["req_step"].nunique()), "first_step": first,
                     "kinds": sorted(at["kind"].unique()), "layers": sorted(at["layer"].unique())})
    return pd.DataFrame(rows)


def shifts_by_request(run: CaptureRun) -> pd.DataFrame:
    """Engine steps and request-local steps of in-place conv shifts, one row per request."""
    cp, st = run.copies(), run.steps()
    if cp.empty:
        return pd.DataFrame(columns=["req_id", "engine_steps", "req_steps"])
    hits = cp[(cp["kind"] == "left_shift_same_block") & (cp["nbytes"] > 0)]
    out = []
    for rid, g in hits.groupby("req_id"):
        steps = sorted(int(s) for s in g["engine_step"].unique())
        mine = (st[st["req_id"] == rid].set_index("engine_step")["req_step"]
                if not st.empty else pd.Series(dtype=int))
        out.append({"req_id": rid, "engine_steps": steps,
                    "req_steps": [int(mine[s]) for s in steps if s in mine.index]})
    return pd.DataFrame(out)
