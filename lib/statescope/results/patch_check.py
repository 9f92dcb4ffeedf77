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
wrapper; docs/gpu.md says what it changes and what it costs), or re-run anything.
"""
from __future__ import annotations

from pathlib import Path

from statescope.results import e2e as gr
from statescope.errors import InputError
from statescope.results.factors import R3_DIR

R4_DIR = gr.E2E_DIR.parent / "e2e_round4"
OVERHEAD_DIR = gr.E2E_DIR.parent / "overhead_round4"
PROBES = {"probe_1p3b.json": "1p3b", "probe_7b.json": "7b", "probe_7b_eager8.json": "7b"}
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
    out = []
    for name, label in ARMS.items():
        meta, recs = _arm(d, label)
        for row in verdict_rows([meta] + cmetas, recs + crecs, label=label):
            out.append(dict(row, trigger_build=name, patches=meta.get("patches", [])))
    return out


def _departed(recs: list[dict], ctl: dict) -> set:
    return {(r["episode"], r["step"]) for r in recs
            if (r["episode"], r["step"]) in ctl
            and r["output_token_ids"] != ctl[(r["episode"], r["step"])]["output_token_ids"]}


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
            ctl = {(r["episode"], r["step"]): r for r in crecs
                   if r["build"] == cm["arm"] and r["config_hash"] == cm["key"]}
            diff = _departed(recs, ctl)
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
    ctl = {(r["episode"], r["step"]): r for r in crecs
           if r["build"] == cm["arm"] and r["config_hash"] == cm["key"]}
    counts = {}
    for name, label in ARMS.items():
        _, recs = _arm(d, label)
        episodes = {r["episode"] for r in recs}
        counts[name] = (len({e for e, _ in _departed(recs, ctl)}), len(episodes))
    (k1, n1), (k2, n2) = counts["unpatched"], counts["accept_sync"]
    return {"unpatched_failed_episodes": k1, "unpatched_episodes": n1,
            "patched_failed_episodes": k2, "patched_episodes": n2,
            "fisher_p_one_sided": fisher_exact_one_sided(k1, n1, k2, n2)}


def overhead_table(d: Path = OVERHEAD_DIR) -> list[dict]:
    """One row per (probe file, mode): ratios to "off" (median of rounds, paired median), host ms
    per step in the step (hooks) and in the flusher ("drain"), emission ms per step (made at
    idle/close), and the graph-vs-eager digest agreement of that probe."""
    import json

    rows = []
    for name, size in PROBES.items():
        path = Path(d) / name
        if not path.is_file():
            raise InputError(f"{path}: missing (scripts/gpu_overhead_probe.py writes it; see docs/gpu.md)")
        res = json.loads(path.read_text())[size]
        if "summary" not in res:
            raise InputError(f"{path}: field '{size}.summary' missing (the probe failed: {str(res.get('error'))[:200]})")
        agree = res.get("graph_vs_eager") or {}
        for mode, s in res["summary"].items():
            if mode == "off":
                continue
            by = s.get("by_name_ms_per_step", {})
            rows.append({"file": name, "size": size, "mode": mode, "rounds": len(s["paired_ratios"]),
                         "ratio_median": round(s["ratio_median"], 3),
                         "paired_ratio_median": round(s["paired_ratio_median"], 3),
                         "paired_min": min(s["paired_ratios"]), "paired_max": max(s["paired_ratios"]),
                         "host_ms_in_step": round(sum(v for k, v in by.items() if k != "drain"), 3),
                         "host_ms_flusher": round(by.get("drain", 0.0), 3),
                         "emit_ms_per_step": round(s.get("emit_ms_per_step") or 0.0, 3),
                         "digest_graph": ",".join(s.get("digest_graph") or []),
                         "graph_vs_eager_identical": (f"{agree['identical']}/{agree['rows_compared']}"
                                                      if "identical" in agree else None)})
    return rows

