"""Line two capture runs of one workload up and say where their state digests first differ.

What it does: ``digest_diff(a, b)`` joins the digests of two runs on what is stable across runs —
the prompt (``prompt_sha``), the request's own step counter, layer and state kind — and marks each
pair ``same``:

- recurrent state (``ssm``): the exact numbers agree (the word-sum ``checksum`` and, where both
  runs recorded it, the position-keyed word ``hash``) and the float statistics agree within
  ``rtol`` (the projections make a permuted state differ even when its checksum does not);
- conv window (``conv``), by default (``conv="live"``): only the rows the next step will read are
  compared — ``conv_window`` rows from each run's ``conv_live_offset`` — by per-row checksum,
  per-row hash (where recorded) and sum. The other rows of a window hold bytes left by the
  block's previous user, which differ between runs with different histories and mean nothing.
  ``conv="window"`` compares everything.

Which column of a request's block row is compared (``columns``; ``compared_columns`` says which
and why, and the frame carries it in ``attrs["columns"]``):

- ``"all"``: both runs digested every draft column (spec ``draft_columns``): the recurrent state
  of every column (joined on ``column_offset`` too), the conv window of the running column;
- ``"resume"``: the column the next step resumes from (digest column ``resume``, recorded by
  captures since the resume-column digest): the recurrent state after the accepted tokens, the
  conv window's live rows in the running column;
- ``"running"``: the running column only (captures older than the resume-column digest): a
  corruption of the slot the next step resumes from shows one step late, when that step has
  read it.

``"auto"`` (the default) takes the first of these both runs support. ``column_offset=j`` (older
callers) compares the j-th column after the running one, whatever it is.

``first_divergence(a, b)`` reduces that to one row per request: the first request-local step
where anything differs, the layers there (in model order), the origin layer (the first of them:
within a step, information only flows to later layers) and its kinds, and the kinds of any layer.
``shifts_by_request(run)`` lists, per request, the steps at which the census saw an in-place
conv shift (``left_shift_same_block`` with bytes to move).

Runs recorded with different digest versions (``digest_version`` in the manifest: the projections
changed definition in version 2) agree only on exact numbers, so only those are compared and a
``DigestMismatchWarning`` says so; runs digested by different kernels (``digest_kernel``: the CPU
C kernel vs the torch path) compare as usual (their floats agree to ~4e-6 relative, inside the
default ``rtol``) with a warning, since a tighter ``rtol`` would flag kernel noise as divergence.

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
COLUMN_MODES = ("auto", "all", "resume", "running")
COLUMN_NOTES = {
    "all": "every captured column: the recurrent state of the running column and each draft "
           "column, the conv window's live rows in the running column",
    "resume": "the column each step's successor resumes from: the recurrent state after the "
              "accepted tokens, the conv window's live rows",
    "running": "the running column only (a capture without resume-column digests): a corruption "
               "of the slot the next step resumes from shows one step late",
}


class DigestMismatchWarning(UserWarning):
    """Two runs' digests were made by different digest versions or kernels."""


def comparable_stats(a: CaptureRun, b: CaptureRun) -> bool:
    """False when the two runs' float statistics are not comparable (different digest versions);
    warns when only the kernels differ."""
    va, vb = a.manifest.get("digest_version", 1), b.manifest.get("digest_version", 1)
    if va != vb:
        warnings.warn(f"digest_version {va} vs {vb}: comparing exact numbers only (float "
                      "statistics changed definition between versions)", DigestMismatchWarning,
                      stacklevel=3)
        return False
    ka, kb = a.manifest.get("digest_kernel"), b.manifest.get("digest_kernel")
    if ka != kb:
        warnings.warn(f"digest_kernel {ka} vs {kb}: float statistics agree only to ~4e-6 relative; "
                      "keep rtol >= 1e-5", DigestMismatchWarning, stacklevel=3)
    return True


def _has_drafts(run: CaptureRun) -> bool:
    return bool((run.manifest.get("spec") or {}).get("draft_columns"))


def compared_columns(a: CaptureRun, b: CaptureRun, columns: str = "auto") -> str:
    """The column mode two runs are compared in (see the module docstring); an explicit mode
    one of the runs cannot support is an ``InputError`` naming the run."""
    if columns not in COLUMN_MODES:
        raise InputError(f"digest_diff columns={columns!r}: expected one of {COLUMN_MODES}")
    support = {"all": _has_drafts, "resume": lambda r: "digest_columns" in r.manifest,
               "running": lambda r: True}
    if columns != "auto":
        for run in (a, b):
            if not support[columns](run):
                raise InputError(f"capture run {run.path}: cannot compare columns={columns!r} "
                                 f"(its digests lack {'draft columns' if columns == 'all' else 'the resume column'})")
        return columns
    return next(mode for mode in ("all", "resume", "running")
                if support[mode](a) and support[mode](b))


def _digests(run: CaptureRun, mode: str, column_offset: int | None) -> pd.DataFrame:
    d, st = run.digests(), run.steps()
    if d.empty:
        return d
    if "column_offset" not in d.columns:
        d = d.assign(column_offset=0)
    conv = d["kind"] == "conv"
    if column_offset is not None:
        d = d[d["column_offset"] == column_offset]
    elif mode == "resume":  # conv: the running column (its live rows); ssm: the resume column
        d = d[(conv & (d["column_offset"] == 0)) | (~conv & d["resume"].fillna(False).astype(bool))]
    elif mode == "all":
        d = d[~conv | (d["column_offset"] == 0)]
    else:
        d = d[d["column_offset"] == 0]
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


def _exact_same(m: pd.DataFrame) -> pd.Series:
    """Checksums equal, and hashes equal where both rows recorded one."""
    same = m["checksum_a"] == m["checksum_b"]
    if "hash_a" in m and "hash_b" in m:
        both = m["hash_a"].notna() & m["hash_b"].notna()
        same &= ~both | (m["hash_a"] == m["hash_b"])
    return same


def _live_same(r: pd.Series, width: int, rtol: float, with_hash: bool) -> bool:
    oa, ob = r["conv_live_offset_a"], r["conv_live_offset_b"]
    ca, cb = _live(r["row_checksums_a"], oa, width), _live(r["row_checksums_b"], ob, width)
    sa, sb = _live(r["row_sums_a"], oa, width), _live(r["row_sums_b"], ob, width)
    if ca is None or ca != cb or sa is None or len(sa) != len(sb):
        return False
    if with_hash:
        ha, hb = _live(r["row_hashes_a"], oa, width), _live(r["row_hashes_b"], ob, width)
        if ha is not None and hb is not None and ha != hb:
            return False
    return bool((_rel(np.array(sa, float), np.array(sb, float)) <= rtol).all())


def digest_diff(a: CaptureRun, b: CaptureRun, rtol: float = 1e-5, conv: str = "live",
                column_offset: int | None = None, columns: str = "auto") -> pd.DataFrame:
    """One row per joined (prompt, request step, layer, kind[, column offset]) with ``same``;
    ``attrs["columns"]`` says which columns were compared (see the module docstring)."""
    if conv not in ("live", "window"):
        raise InputError(f"digest_diff conv={conv!r}: expected 'live' or 'window'")
    mode = "offset" if column_offset is not None else compared_columns(a, b, columns)
    da, db = _digests(a, mode, column_offset), _digests(b, mode, column_offset)
    if da.empty or db.empty:
        out = pd.DataFrame(columns=KEYS + ["same"])
        out.attrs["columns"] = mode
        return out
    stats = [c for c in a.manifest.get("digest_stats", []) if c in da.columns and c in db.columns]
    if not comparable_stats(a, b):
        stats = []
    keys = KEYS + (["column_offset"] if mode == "all" else [])
    m = da.merge(db, on=keys, suffixes=("_a", "_b"))
    va, vb = m[[s + "_a" for s in stats]].to_numpy(float), m[[s + "_b" for s in stats]].to_numpy(float)
    m["stat_rel_diff"] = _rel(va, vb).max(axis=1) if stats else 0.0
    m["same"] = _exact_same(m) & (m["stat_rel_diff"] <= rtol)
    if conv == "live":
        width = int(a.manifest.get("conv_window", 0))
        is_conv = m["kind"] == "conv"
        with_hash = "row_hashes_a" in m and "row_hashes_b" in m
        live = [_live_same(r, width, rtol, with_hash) for _, r in m[is_conv].iterrows()]
        if live:  # a table without conv rows (e.g. a recurrent-only spec) has nothing to set
            m.loc[is_conv, "same"] = live
    m.attrs["columns"] = mode
    return m


def layer_order(name: str) -> tuple:
    """Sort key: ``model.layers.10.linear_attn`` after ``model.layers.2.linear_attn``."""
    return tuple(int(p) if p.isdigit() else -1 for p in str(name).split(".")), str(name)


def sorted_layers(names) -> list[str]:
    return sorted({str(n) for n in names}, key=layer_order)


def first_divergence(a: CaptureRun, b: CaptureRun, rtol: float = 1e-5,
                     conv: str = "live", columns: str = "auto") -> pd.DataFrame:
    """Per request (prompt): first differing request step, the layers there (model order), the
    origin layer and its kinds, the kinds of any layer (``kinds``), steps compared."""
    m = digest_diff(a, b, rtol, conv, columns=columns)
    rows = []
    for sha, g in m.groupby("prompt_sha"):
        bad = g[~g["same"].astype(bool)]
        first = int(bad["req_step"].min()) if len(bad) else None
        at = bad[bad["req_step"] == first] if first is not None else bad
        layers = sorted_layers(at["layer"])
        origin = layers[0] if layers else None
        rows.append({"prompt_sha": sha, "req_id_a": g["req_id_a"].iloc[0],
                     "req_id_b": g["req_id_b"].iloc[0],
                     "steps_compared": int(g["req_step"].nunique()), "first_step": first,
                     "kinds": sorted(at["kind"].unique()), "layers": layers,
                     "origin_layer": origin,
                     "origin_kinds": sorted(at[at["layer"] == origin]["kind"].unique())})
    out = pd.DataFrame(rows)
    out.attrs["columns"] = m.attrs.get("columns")
    return out


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
