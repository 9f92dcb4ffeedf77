"""Verdicts re-judged from stored records: the trigger arm against each control, without an engine.

What it does: an arm that ran elsewhere (on a GPU, in an earlier session) leaves a JSON-able meta
(its name, key, guard expectations, vLLM's counters, the resolved configuration, lifetimes; what
``statescope.gpu.e2e_arms.run_one_arm`` returns) and its records. ``arm_run_from_records`` rebuilds
the ``ArmRun`` from the two; ``verdict_rows`` judges the trigger against each of ``CONTROLS`` that
is present with the same code path ``statescope.verdict.reproduce.reproduce`` uses
(``label_rows``, ``summarize_arm``, ``stats.decide``; action syntax graded by
``statescope.workload.guilang.action_validator_for``), one row per pair with outcome, counts,
Fisher p and guards; the engagement counts come from the best source
(``statescope.resolved.engagement_metrics``: vLLM's counters, else the requests' own counts, and
it says which), and a trigger that shares no request with a control is refused
(``statescope.verdict.reproduce.check_comparable``).

What it deliberately does not do: run arms (``statescope.verdict.reproduce`` and
``statescope.gpu.e2e_arms`` do), or read result folders (``statescope.results`` does).
"""
from __future__ import annotations

from typing import Any

from statescope.resolved import engagement_metrics

CONTROLS = ("no_async", "no_prefix_cache", "no_mtp")


def arm_run_from_records(meta: dict, records: list[dict]) -> Any:
    """The ``ArmRun`` of the arm ``meta`` describes, with its rows picked from ``records`` by
    build name and configuration key."""
    from statescope.engine.config import EngineConfig
    from statescope.verdict.reproduce import Arm, ArmRun

    arm = Arm(meta["arm"], EngineConfig(), expect_prefix_cache=meta["expect_prefix_cache"],
              expect_spec=meta["expect_spec"])
    rows = [r for r in records if r["build"] == meta["arm"] and r["config_hash"] == meta["key"]]
    return ArmRun(arm, rows, engagement_metrics(meta["metrics"], rows), meta["resolved"],
                  meta["lifetimes"], run_dir=meta.get("source"))


def verdict_rows(metas: list[dict], records: list[dict], *, unit: str = "episode",
                 alpha: float = 0.01, label: str = "") -> list[dict]:
    """Trigger vs each control present: one row per pair with outcome, counts, p and guards."""
    from statescope.verdict.reproduce import check_comparable, label_rows
    from statescope.verdict.units import summarize_arm
    from statescope.verdict.stats import decide
    from statescope.workload.guilang import action_validator_for

    by_name = {m["arm"]: m for m in metas}
    if "trigger" not in by_name:
        return [{"model": label, "control": c, "outcome": "not run (trigger arm missing)"}
                for c in CONTROLS]
    trg = arm_run_from_records(by_name["trigger"], records)
    out = []
    for control in CONTROLS:
        if control not in by_name:
            out.append({"model": label, "control": control, "outcome": "not run"})
            continue
        ctl = arm_run_from_records(by_name[control], records)
        check_comparable(trg, ctl)  # refuses arms that share no request (other seeds)
        check = action_validator_for(r["text"] for r in ctl.rows)
        v = decide(summarize_arm(trg, label_rows(trg, ctl, action_validator=check), unit),
                   summarize_arm(ctl, label_rows(ctl, None, action_validator=check), unit), alpha=alpha)
        out.append({"model": label, "control": control, "outcome": v.outcome, "unit": unit,
                    "trigger_failed": v.trigger.n_failed_units, "trigger_units": v.trigger.n_units,
                    "control_failed": v.control.n_failed_units, "control_units": v.control.n_units,
                    "fisher_p": v.fisher_p, "action_syntax_graded": check is not None,
                    "guards": {g.name: g.passed for g in v.guards},
                    "guard_details": {g.name: g.detail for g in v.guards}})
    return out
