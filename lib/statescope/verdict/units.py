"""The unit of independence: which labelled requests form one unit, an arm's summary counted in it.

What it does: ``UNITS`` names the units a verdict may count in (request, episode, engine
lifetime); ``failed_units`` folds request labels into units (a unit fails if any of its requests
did); ``summarize_arm`` turns one arm's run and labels into the ``ArmSummary`` the tests read;
``sequential_decision`` replays the units through Wald's SPRT to say where a sequential run would
have stopped.

What it deliberately does not do: run arms, label requests or decide between two arms
(``statescope.verdict.reproduce``, ``detect``, ``stats``).
"""
from __future__ import annotations

from typing import Any

from statescope.errors import InputError
from statescope.verdict.stats import SPRT, ArmSummary

UNITS = ("request", "episode", "engine_lifetime")


def failed_units(labels: list[dict], unit: str) -> dict[Any, bool]:
    """Unit of independence -> failed?, in first-seen order (a unit fails if any request did)."""
    if unit not in UNITS:
        raise InputError(f"unit={unit!r}: expected one of {UNITS}")
    key = {"request": lambda l: (l["episode"], l["step"]), "episode": lambda l: l["episode"],
           "engine_lifetime": lambda l: l["lifetime"]}[unit]
    units: dict[Any, bool] = {}
    for l in labels:
        units[key(l)] = units.get(key(l), False) or l["failed"]
    return units


def summarize_arm(run: Any, labels: list[dict], unit: str) -> ArmSummary:
    units = failed_units(labels, unit)
    m = run.metrics
    return ArmSummary(name=run.arm.name, n_units=len(units), n_failed_units=sum(units.values()),
                      unit=unit, prefix_cache_queries=m.get("prefix_cache_queries", 0),
                      prefix_cache_hits=m.get("prefix_cache_hits", 0),
                      spec_draft_tokens=m.get("spec_draft_tokens", 0),
                      spec_accepted_tokens=m.get("spec_accepted_tokens", 0),
                      resolved=run.resolved, expect_prefix_cache=run.arm.expect_prefix_cache,
                      expect_spec=run.arm.expect_spec, n_requests=len(labels),
                      engagement_sources={k: m[k] for k in ("prefix_cache_source", "spec_source")
                                          if k in m})


def sequential_decision(labels: list[dict], unit: str, p0: float = 0.001, p1: float = 0.056,
                        alpha: float = 0.05, beta: float = 0.05) -> dict:
    """Replay the trigger's units in completion order through Wald's SPRT: where a sequential run
    would have stopped (first failure for a bad arm; ~52 clean units for a good one)."""
    units = failed_units(labels, unit)
    test = SPRT(p0, p1, alpha, beta)
    for failed in units.values():
        if test.update(failed) != "continue":
            break
    return {"decision": test.decision, "units_used": test.n, "failures": test.k,
            "units_available": len(units), "p0": p0, "p1": p1, "alpha": alpha, "beta": beta}
