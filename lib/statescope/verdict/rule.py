"""One verdict per report: the decision rule, the secondary test beside it, and pooled seed sets.

Why: a report that says ``outcome: no evidence`` (6/96 vs 0/96, Fisher p = 0.0144 > 0.01) and,
in the same JSON, ``sequential.decision: accept_h1`` leaves the reader to pick one. Here the
fixed-sample test is the rule and the sequential test is shown as secondary, with a sentence
whenever the two disagree; and the verdict of several seed sets is given per set and pooled.

What it does: ``DECISION_RULE`` states the rule (guards first, then the one-sided Fisher test at
alpha); ``secondary(outcome, sequential)`` places the SPRT's decision beside the primary outcome
(``agrees`` True / False / None, and the note a report prints); ``pool_summaries`` adds the counts
of several ``ArmSummary`` of one arm (seed sets run apart, e.g. the committed GPU runs);
``seed_set_verdicts`` gives each seed set's verdict of one reproduce run, from its labels.

What it deliberately does not do: change the rule's outcome (``statescope.verdict.stats.decide``
owns it), or pool runs of different arms or configurations (the caller groups them).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from statescope.errors import InputError
from statescope.verdict.stats import CORRUPTION_DETECTED, NO_EVIDENCE, ArmSummary

DECISION_RULE = ("decision rule: the engagement guards first (engine ok, control usable and "
                 "distinct, prefix cache hit and drafts accepted when the trigger expects them), "
                 "then corruption detected iff the one-sided Fisher exact test of failed {unit}s, "
                 "trigger vs control, gives p < alpha={alpha}; the sequential test (Wald SPRT, "
                 "trigger rate p0={p0} vs p1={p1}) is secondary and never changes the outcome")


def decision_rule(unit: str, alpha: float, sequential: dict) -> str:
    """The rule as a sentence for this report's unit, alpha and SPRT rates."""
    return DECISION_RULE.format(unit=unit, alpha=alpha, p0=sequential.get("p0"),
                                p1=sequential.get("p1"))


def secondary(outcome: str, sequential: dict) -> dict:
    """The SPRT's decision beside the primary outcome: ``{"role", "agrees", "note", ...}``."""
    decision, used = sequential.get("decision"), sequential.get("units_used")
    out = {"role": "secondary", **sequential}
    if outcome not in (NO_EVIDENCE, CORRUPTION_DETECTED):
        out.update(agrees=None, note=f"the primary rule stopped at a guard ({outcome}); the "
                   f"sequential test's '{decision}' is no verdict")
    elif decision == "continue":
        out.update(agrees=None, note=f"the sequential test had not decided after {used} units "
                   "(neither agrees nor disagrees)")
    else:
        agrees = (decision == "accept_h1") == (outcome == CORRUPTION_DETECTED)
        if agrees:
            note = f"the sequential test agrees ('{decision}' after {used} units)"
        elif decision == "accept_h1":
            note = (f"DISAGREEMENT: the sequential test accepts a failure rate of p1 after {used} "
                    f"units while the primary Fisher test finds no significant excess; the "
                    f"verdict is the primary one ('{outcome}'): add units (more seeds or seed "
                    "sets, pooled) to settle it")
        else:
            note = (f"DISAGREEMENT: the sequential test accepts the low rate p0 after {used} units "
                    f"while the primary Fisher test detects an excess; the verdict is the primary "
                    f"one ('{outcome}')")
        out.update(agrees=agrees, note=note)
    return out


def pool_summaries(arms: Sequence[ArmSummary]) -> ArmSummary:
    """One arm's summaries of several seed sets, counts added (resolved config: the first's)."""
    if not arms:
        raise InputError("pool_summaries: expected at least one arm summary")
    names, units = {a.name for a in arms}, {a.unit for a in arms}
    if len(names) != 1 or len(units) != 1:
        raise InputError(f"pool_summaries: expected summaries of one arm and unit, got arms "
                         f"{sorted(names)} counting {sorted(units)}")
    counts = {f: sum(int(getattr(a, f) or 0) for a in arms)
              for f in ("n_units", "n_failed_units", "prefix_cache_queries", "prefix_cache_hits",
                        "spec_draft_tokens", "spec_accepted_tokens", "n_engine_errors")}
    n_requests = (sum(a.n_requests for a in arms) if all(a.n_requests is not None for a in arms)
                  else None)
    return dataclasses.replace(arms[0], **counts, n_requests=n_requests)


def summary_from_dict(d: dict) -> ArmSummary:
    """An ``ArmSummary`` back from a report's ``trigger`` / ``control`` entry."""
    fields = {f.name for f in dataclasses.fields(ArmSummary)}
    return ArmSummary(**{k: v for k, v in d.items() if k in fields})


def split_seed_sets(seeds: Sequence[int], n_sets: int) -> list[list[int]]:
    """``seeds`` cut into ``n_sets`` consecutive sets of equal size (``--seed-sets``)."""
    if isinstance(n_sets, bool) or not isinstance(n_sets, int) or n_sets < 1:
        raise InputError(f"--seed-sets {n_sets!r}: expected an integer >= 1")
    if len(seeds) % n_sets:
        raise InputError(f"--seed-sets {n_sets}: the {len(seeds)} seeds of --seeds do not split "
                         f"into {n_sets} equal sets; give a multiple of {n_sets} seeds")
    size = len(seeds) // n_sets
    return [list(seeds[i:i + size]) for i in range(0, len(seeds), size)]


def seed_set_verdicts(result: Any, seed_sets: Sequence[Sequence[int]]) -> list[dict]:
    """Each seed set's verdict of one reproduce run (episodes ``s<seed>-...``), from its labels;
    the guards' engagement counts are the whole run's (the engines served every set)."""
    from statescope.verdict.design import power_of
    from statescope.verdict.units import sequential_decision, summarize_arm
    from statescope.verdict.stats import decide

    unit, alpha, rows = result.verdict.unit, result.verdict.alpha, []
    for seeds in seed_sets:
        prefixes = tuple(f"s{s}-" for s in seeds)

        def keep(labels: list[dict]) -> list[dict]:
            return [l for l in labels if str(l["episode"]).startswith(prefixes)]

        t_lab, c_lab = keep(result.trigger_labels), keep(result.control_labels)
        v = decide(summarize_arm(result.trigger, t_lab, unit),
                   summarize_arm(result.control, c_lab, unit), alpha=alpha)
        seq = sequential_decision(t_lab, unit)
        design = power_of(v.trigger.n_units, v.control.n_units, alpha, unit)
        rows.append({"seeds": f"{seeds[0]}:{seeds[-1] + 1}" if list(seeds) == list(
                        range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds)),
                     "outcome": v.outcome, "trigger": [v.trigger.n_failed_units, v.trigger.n_units],
                     "control": [v.control.n_failed_units, v.control.n_units],
                     "fisher_p": v.fisher_p, "can_answer_alone": design.can_answer,
                     "best_p": design.best_p, "secondary": secondary(v.outcome, seq)})
    return rows
