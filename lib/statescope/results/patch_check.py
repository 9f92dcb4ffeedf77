"""Read round 4 of the GPU results (``data/results/gpu/e2e_round4/``): does the H-accept patch remove
the corruption round 3 detected?

Round 4 ran round 3's eager trigger twice at once on the H200 — unpatched, and with the statescope
runtime patch ``accept_sync`` (``statescope.patches.accept_sync``) — on the same 576 requests. The controls
are round 3's (async off, prefix caching off, MTP off). ``patch_verdicts`` recomputes each trigger
against each control with the verdict machinery of every other round (``statescope.verdict.rejudge.verdict_rows``);
``patch_table`` counts, per arm, the requests and episodes whose output differs from each control
and whether the departed set is round 3's; ``patched_vs_unpatched`` is the one-sided Fisher test of
the two triggers against each other (episode unit), with both arms' engagement counters.

``overhead_table`` reads round 4's capture-overhead probes (``data/results/gpu/overhead_round4/``:
rows made when the engine idles, the digest launched eagerly or replayed as a CUDA graph) per
random hybrid and mode: throughput ratios to capture off, the capture's host milliseconds per step
in the step's hooks and in the flusher, the deferred emission's cost, and whether graph and eager
digests agreed.

What it deliberately does not do: claim the patch is upstream's fix (it is a statescope runtime
wrapper; docs/history/gpu-campaigns.md, round 4, says what it changes and what it costs), or
re-run anything.
"""
from __future__ import annotations

from pathlib import Path

from statescope.results import e2e as gr
from statescope.errors import InputError
from statescope.results.factors import R3_DIR
from statescope.records import rows_by_request

R4_DIR = gr.E2E_DIR.parent / "e2e_round4"
ARMS = {"unpatched": "tiny-gui", "accept_sync": "tiny-gui-accept-sync"}  # name -> records label


def _arm(d: Path, label: str) -> tuple[dict, list[dict]]:
    metas = [m for m in gr.arms(d) if m.get("label") == label]
    if len(metas) != 1:
        raise InputError(f"{d}: expected one arm meta labelled {label!r} in arms_*.jsonl, found {len(metas)}")
    recs = gr.records(label, d)
    if not recs:
        raise InputError(f"{d}: records_{label}.jsonl is missing or empty")
    return metas[0], recs


def _controls(r3: Path) -> tuple[list[dict], list[dict]]:
    metas = [m for m in gr.arms(r3) if m.get("label") == "tiny-gui" and m["arm"] != "trigger"]
    keys = {(m["arm"], m["key"]) for m in metas}
    recs = [r for r in gr.records("tiny-gui", r3) if (r["build"], r["config_hash"]) in keys]
    return metas, recs


def patch_verdicts(d: Path = R4_DIR, r3: Path = R3_DIR) -> list[dict]:
    """Each round-4 trigger (unpatched, accept_sync) vs each of round 3's one-factor controls."""
    from statescope.verdict.rejudge import verdict_rows

    cmetas, crecs = _controls(r3)
    cmetas = [dict(m, source=str(r3)) for m in cmetas]
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


def patch_table(d: Path = R4_DIR, r3: Path = R3_DIR) -> list[dict]:
    """Per arm and control: requests/episodes whose output tokens differ, and whether the departed
    requests are exactly round 3's trigger's (the race is deterministic on an unchanged load)."""
    from statescope.results.factors import departures

    r3_set = {(x["episode"], x["step"]) for x in departures(r3)}
    cmetas, crecs = _controls(r3)
    rows = []
    for name, label in ARMS.items():
        meta, recs = _arm(d, label)
        for cm in cmetas:
            ctl = rows_by_request(crecs, cm["arm"], cm["key"])
            diff = _departed(recs, ctl, f"{label} ({d})", f"{cm['arm']} ({r3})")
            m = meta["metrics"]
            rows.append({"trigger": name, "control": cm["arm"], "requests": len(recs),
                         "differ": len(diff), "episodes_differ": len({e for e, _ in diff}),
                         "same_as_round3": diff == r3_set,
                         "prefix_cache_hit_rate": round(m["prefix_cache_hit_rate"], 4),
                         "spec_acceptance_rate": round(m["spec_acceptance_rate"], 4),
                         "workload_s": round(meta["workload_s"], 2)})
    return rows


def patched_vs_unpatched(d: Path = R4_DIR, r3: Path = R3_DIR) -> dict:
    """One-sided Fisher, unpatched trigger's failed episodes vs the patched one's, where an episode
    fails when any of its requests differs from round 3's async-off control."""
    from statescope.verdict.stats import fisher_exact_one_sided

    cmetas, crecs = _controls(r3)
    cm = next(m for m in cmetas if m["arm"] == "no_async")
    ctl = rows_by_request(crecs, cm["arm"], cm["key"])
    counts = {}
    for name, label in ARMS.items():
        _, recs = _arm(d, label)
        episodes = {r["episode"] for r in recs}
        counts[name] = (len({e for e, _ in _departed(recs, ctl, f"{label} ({d})", f"no_async ({r3})")}),
                        len(episodes))
    (k1, n1), (k2, n2) = counts["unpatched"], counts["accept_sync"]
    return {"unpatched_failed_episodes": k1, "unpatched_episodes": n1,
            "patched_failed_episodes": k2, "patched_episodes": n2,
            "fisher_p_one_sided": fisher_exact_one_sided(k1, n1, k2, n2)}


