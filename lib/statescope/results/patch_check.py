"""Does the H-accept patch remove the corruption? Read ``data/results/gpu/e2e_patch_check/``.

The patch check ran the factor check's eager trigger (``data/results/gpu/e2e_factors/``) twice at
once on the H200 — unpatched, and with the statescope runtime patch ``accept_sync``
(``statescope.patches.accept_sync``) — on the same 576 requests. The controls are the factor
check's (async off, prefix caching off, MTP off; ``statescope.results.factors``). ``patch_verdicts``
recomputes each trigger against each control with the verdict machinery of every other results
folder (``statescope.verdict.rejudge.verdict_rows``); ``patch_table`` counts, per arm, the requests
and episodes whose output differs from each control and whether the departed set is the factor
check's trigger's; ``patched_vs_unpatched`` is the one-sided Fisher test of the two triggers against
each other (episode unit), with both arms' engagement counters. (The capture-overhead probes of
the same session, ``data/results/gpu/overhead_modes/``, are read by
``statescope.results.overhead.deferred_rows_table``.)

What it deliberately does not do: claim the patch is upstream's fix (it is a statescope runtime
wrapper; docs/history/gpu-campaigns.md, round 4, says what it changes and what it costs), or
re-run anything.
"""
from __future__ import annotations

from pathlib import Path

from statescope.results import e2e
from statescope.errors import InputError
from statescope.results.factors import FACTORS_DIR
from statescope.records import rows_by_request

PATCH_CHECK_DIR = e2e.E2E_DIR.parent / "e2e_patch_check"
ARMS = {"unpatched": "tiny-gui", "accept_sync": "tiny-gui-accept-sync"}  # name -> records label


def _arm(d: Path, label: str) -> tuple[dict, list[dict]]:
    metas = [m for m in e2e.arms(d) if m.get("label") == label]
    if len(metas) != 1:
        raise InputError(f"{d}: expected one arm meta labelled {label!r} in arms_*.jsonl, found {len(metas)}")
    recs = e2e.records(label, d)
    if not recs:
        raise InputError(f"{d}: records_{label}.jsonl is missing or empty")
    return metas[0], recs


def _controls(d: Path) -> tuple[list[dict], list[dict]]:
    metas = [m for m in e2e.arms(d) if m.get("label") == "tiny-gui" and m["arm"] != "trigger"]
    keys = {(m["arm"], m["key"]) for m in metas}
    recs = [r for r in e2e.records("tiny-gui", d) if (r["build"], r["config_hash"]) in keys]
    return metas, recs


def patch_verdicts(d: Path = PATCH_CHECK_DIR, controls: Path = FACTORS_DIR) -> list[dict]:
    """Each trigger of the patch check (unpatched, accept_sync) vs each of the factor check's
    one-factor controls (``controls``: its folder)."""
    from statescope.verdict.rejudge import verdict_rows

    cmetas, crecs = _controls(controls)
    cmetas = [dict(m, source=str(controls)) for m in cmetas]
    out = []
    for name, label in ARMS.items():
        meta, recs = _arm(d, label)
        for row in verdict_rows([dict(meta, source=str(d))] + cmetas, recs + crecs, label=label):
            out.append(dict(row, trigger_build=name, patches=meta.get("patches", [])))
    return out


def _departed(recs: list[dict], ctl: dict, where: str = "the trigger", ctl_where: str = "the control") -> set:
    mine = rows_by_request(recs)
    if mine and ctl and not set(mine) & set(ctl):
        raise InputError(f"cannot compare {where} with {ctl_where}: they share no request "
                         f"(e.g. {sorted(mine)[0]} vs {sorted(ctl)[0]}): different seeds or episodes")
    return {k for k, r in mine.items() if k in ctl and r["output_token_ids"] != ctl[k]["output_token_ids"]}


def patch_table(d: Path = PATCH_CHECK_DIR, controls: Path = FACTORS_DIR) -> list[dict]:
    """Per arm and control: requests/episodes whose output tokens differ, and whether the departed
    requests are exactly the factor check's trigger's (``same_as_factors_trigger``: the race is
    deterministic on an unchanged load)."""
    from statescope.results.factors import departures

    factors_departed = {(x["episode"], x["step"]) for x in departures(controls)}
    cmetas, crecs = _controls(controls)
    rows = []
    for name, label in ARMS.items():
        meta, recs = _arm(d, label)
        for cm in cmetas:
            ctl = rows_by_request(crecs, cm["arm"], cm["key"])
            diff = _departed(recs, ctl, f"{label} ({d})", f"{cm['arm']} ({controls})")
            m = meta["metrics"]
            rows.append({"trigger": name, "control": cm["arm"], "requests": len(recs),
                         "differ": len(diff), "episodes_differ": len({e for e, _ in diff}),
                         "same_as_factors_trigger": diff == factors_departed,
                         "prefix_cache_hit_rate": round(m["prefix_cache_hit_rate"], 4),
                         "spec_acceptance_rate": round(m["spec_acceptance_rate"], 4),
                         "workload_s": round(meta["workload_s"], 2)})
    return rows


def patched_vs_unpatched(d: Path = PATCH_CHECK_DIR, controls: Path = FACTORS_DIR) -> dict:
    """One-sided Fisher, unpatched trigger's failed episodes vs the patched one's, where an episode
    fails when any of its requests differs from the factor check's async-off control."""
    from statescope.verdict.stats import fisher_exact_one_sided

    cmetas, crecs = _controls(controls)
    cm = next(m for m in cmetas if m["arm"] == "no_async")
    ctl = rows_by_request(crecs, cm["arm"], cm["key"])
    counts = {}
    for name, label in ARMS.items():
        _, recs = _arm(d, label)
        episodes = {r["episode"] for r in recs}
        counts[name] = (len({e for e, _ in _departed(recs, ctl, f"{label} ({d})", f"no_async ({controls})")}),
                        len(episodes))
    (k1, n1), (k2, n2) = counts["unpatched"], counts["accept_sync"]
    return {"unpatched_failed_episodes": k1, "unpatched_episodes": n1,
            "patched_failed_episodes": k2, "patched_episodes": n2,
            "fisher_p_one_sided": fisher_exact_one_sided(k1, n1, k2, n2)}


