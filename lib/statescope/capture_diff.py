"""Line two capture runs of one workload up and say where their state digests first differ.

What it does: ``digest_diff(a, b)`` joins the digests of two runs on what is stable across runs —
the prompt (``prompt_sha``), the request's own step counter, layer and state kind — and marks each
pair ``same`` when the exact checksums agree and the float statistics agree within ``rtol``
(the projections make a shifted or permuted state differ even when its checksum does not).
``first_divergence(a, b)`` reduces that to one row per request: the first request-local step
where anything differs, which kinds and layers differ there, and whether the request still
matched at the previous step. ``shifts_by_request(run)`` lists, per request, the steps at which the
census saw an in-place conv shift (``left_shift_same_block`` with bytes to move).

What it deliberately does not do: decide which hypothesis a divergence supports (the verdict
tools do) or compare runs of different workloads (rows that do not join are dropped).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from statescope.capture_store import CaptureRun

KEYS = ["prompt_sha", "req_step", "layer", "kind"]


def digest_diff(a: CaptureRun, b: CaptureRun, rtol: float = 1e-5) -> pd.DataFrame:
    """One row per joined (prompt, request step, layer, kind) with ``same`` and ``stat_rel_diff``."""
    da, db = a.digests(), b.digests()
    if da.empty or db.empty:
        return pd.DataFrame(columns=KEYS + ["same"])
    stats = [c for c in a.manifest.get("digest_stats", []) if c in da.columns and c in db.columns]
    m = da.merge(db, on=KEYS, suffixes=("_a", "_b"))
    va, vb = m[[s + "_a" for s in stats]].to_numpy(), m[[s + "_b" for s in stats]].to_numpy()
    scale = np.maximum(np.maximum(np.abs(va), np.abs(vb)), 1e-30)
    rel = np.where(np.isnan(va) & np.isnan(vb), 0.0, np.abs(va - vb) / scale)
    m["stat_rel_diff"] = np.nan_to_num(rel, nan=np.inf).max(axis=1) if stats else 0.0
    m["same"] = (m["checksum_a"] == m["checksum_b"]) & (m["stat_rel_diff"] <= rtol)
    return m


def first_divergence(a: CaptureRun, b: CaptureRun, rtol: float = 1e-5) -> pd.DataFrame:
    """Per request (prompt): first differing request step, kinds/layers there, steps compared."""
    m = digest_diff(a, b, rtol)
    rows = []
    for sha, g in m.groupby("prompt_sha"):
        bad = g[~g["same"]]
        first = int(bad["req_step"].min()) if len(bad) else None
        at = bad[bad["req_step"] == first] if first is not None else bad
        rows.append({"prompt_sha": sha, "req_id_a": g["req_id_a"].iloc[0],
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
        mine = st[st["req_id"] == rid].set_index("engine_step")["req_step"] if not st.empty else {}
        out.append({"req_id": rid, "engine_steps": steps,
                    "req_steps": [int(mine[s]) for s in steps if s in mine]})
    return pd.DataFrame(out)
