"""First divergence by token position, in tolerance units, against a replay or the oracle.

What it does: ``position_report(run, reference, tolerance)`` compares a full-mode capture run
(``replay.CapturedStates``) with a reference source (``replay.ReplayStates``,
``replay.OracleStates`` or another ``CapturedStates``) at the same (request, token position) with
``noise.compare_states``, scales every difference by the calibrated ``noise.Tolerance`` and, per
request, reports the first request step (in position order) where any GDN layer's conv window or
recurrent state leaves tolerance: its token position, the layers there in model order (the first
is the ``origin_layer``; ``per_layer`` has each), and for the origin layer the state kinds, the
conv rows (row 0 = the live window's leading/oldest row) and recurrent heads beyond tolerance, the magnitude in
tolerance units (and absolute), NaN/Inf, the recurrent state's lag in steps, and the events of that
step and the one before (``diverge.step_events``). The result is a ``diverge.DivergenceReport``
(``unit="tolerance units"``), so ``hypotheses.hypothesis_table`` and the views take it unchanged.
``clean_check(report)`` states the no-fault expectation: nothing beyond tolerance anywhere.

What it deliberately does not do: record runs, replays or calibrations (``statescope.diverge.replay``,
``statescope.diverge.noise``), or judge mechanisms (``statescope.diverge.hypotheses``).
"""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

from statescope.diverge.digest_diff import sorted_layers
from statescope.diverge.report import EVENT_WINDOW, DivergenceReport, step_events
from statescope.diverge.noise import Tolerance, compare_states, in_units
from statescope.diverge.replay import CapturedStates


def _first(g: pd.DataFrame, run: CapturedStates) -> dict[str, Any]:
    rec: dict[str, Any] = {"prompt_sha": g["prompt_sha"].iloc[0], "req_id": g["req_id"].iloc[0],
                           "steps_compared": int(g["req_step"].nunique()), "first_step": None,
                           "position": None, "kinds": [], "layers": [], "conv_rows": [],
                           "heads": [], "origin_layer": None, "per_layer": [], "magnitude": 0.0,
                           "magnitude_abs": 0.0,
                           "max_units_seen": float(g["units"].max()), "nan_or_inf": False,
                           "ssm_lag": None, "events": {}}
    bad = g[g["out"]]
    if bad.empty:
        return rec
    first = int(bad["req_step"].min())
    at = bad[bad["req_step"] == first]
    per_layer = []
    for layer in sorted_layers(at["layer"]):  # model order: the first is the origin
        g = at[at["layer"] == layer]
        per_layer.append({
            "layer": layer, "kinds": sorted(g["kind"].unique()),
            "conv_rows": sorted({i for rows in g[g["kind"] == "conv"]["parts_out"] for i in rows}),
            "heads": sorted({i for rows in g[g["kind"] == "ssm"]["parts_out"] for i in rows}),
            "magnitude": float(g["units"].max())})
    origin = per_layer[0]
    mine = bad[bad["layer"] == origin["layer"]]
    bad_ssm = mine[mine["kind"] == "ssm"]["req_step"]
    rec.update(first_step=first, position=int(at["position"].min()),
               origin_layer=origin["layer"], kinds=origin["kinds"],
               layers=[x["layer"] for x in per_layer], per_layer=per_layer,
               conv_rows=origin["conv_rows"], heads=origin["heads"],
               magnitude=float(at["units"].max()), magnitude_abs=float(at["max_abs"].max()),
               nan_or_inf=bool(at["nan_or_inf"].any()),
               ssm_lag=(int(bad_ssm.min()) - first) if len(bad_ssm) else None,
               events=step_events(run.run, rec["req_id"],
                                  list(range(max(0, first - EVENT_WINDOW), first + 1))))
    for key in ("magnitude", "magnitude_abs", "max_units_seen"):
        if math.isinf(rec[key]):
            rec[key] = "inf"  # JSON has no infinity
    return rec


def position_report(run: Any, reference: Any, tolerance: Tolerance,
                    reference_label: str | None = None) -> DivergenceReport:
    """Per-request first divergence of ``run`` from ``reference`` beyond ``tolerance``."""
    states = run if isinstance(run, CapturedStates) else CapturedStates(run)
    frame = in_units(compare_states(states, reference), tolerance)
    label = reference_label or getattr(reference, "label", type(reference).__name__)
    report = DivergenceReport(str(states.run.path), label, conv_window=states.window,
                              unit="tolerance units", tolerance=tolerance.to_dict(),
                              pairing="token position")
    if frame.empty:
        return report
    report.gdn_layers = int(frame["layer"].nunique())
    report.cells = frame.assign(magnitude=frame["units"])[
        ["prompt_sha", "req_id", "req_step", "position", "layer", "kind", "magnitude", "max_abs"]]
    report.requests = [_first(g, states) for _, g in frame.groupby("prompt_sha")]
    report.requests.sort(key=lambda r: (r["first_step"] is None, r["first_step"] or 0, r["req_id"]))
    return report


def clean_check(report: DivergenceReport) -> dict[str, Any]:
    """The no-fault expectation: no request leaves tolerance; the largest excursion seen."""
    worst = max((r["max_units_seen"] for r in report.requests
                 if not isinstance(r["max_units_seen"], str)), default=0.0)
    return {"requests": len(report.requests), "diverged": len(report.diverged),
            "max_units": worst, "clean": not report.diverged}
