"""Did the trigger arm really reach the suspect code path? Engagement counts from the best source.

What it does: ``engagement_metrics(metrics, rows)`` returns vLLM's counters with the two pairs the
guards read — prefix-cache queries/hits and draft/accepted tokens — taken from the best source
available, named in ``prefix_cache_source`` and ``spec_source``:

1. vLLM's own counters (``LLM.get_metrics()`` in-process, ``/metrics`` of a server) when they show
   engagement;
2. else the requests themselves: ``RequestOutput.num_cached_tokens`` per request (the prefix-cache
   hit vLLM served it) and the per-request draft/accepted counts statescope's scheduler tap saw
   (``statescope.capture.spec_tap``), when those show engagement;
3. else the counters as they are (zero), with both sources named, so "not exercised" is said only
   when neither source saw the path taken.

Why: vLLM 0.26.0's in-process engine on the H200 kept every counter at 0 while 46 of 48 trigger
requests had cached tokens; a guard on the counters alone called an engaged run "not exercised".
``lifetime_metrics`` sums the counters of every engine lifetime an arm's records came from (a
resumed or re-run store keeps one entry per lifetime), so resuming never changes the guards.

What it deliberately does not do: decide the verdict (``statescope.verdict.stats.decide``) or
treat speculative acceptance as a corruption signal (acceptance looks *better* on garbage output).
"""
from __future__ import annotations

from typing import Any, Iterable

COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "spec_drafts", "spec_draft_tokens",
            "spec_accepted_tokens", "prompt_tokens", "generation_tokens")


def _prompt_tokens(r: dict) -> int:
    return int(r.get("prompt_tokens") or len(r.get("prompt_token_ids") or []))


def engagement_metrics(metrics: dict, rows: list[dict]) -> dict:
    """``metrics`` with the guard pairs from the best source, and that source named."""
    out = dict(metrics)
    req_hits = sum(int(r.get("num_cached_tokens") or 0) for r in rows)
    req_queries = sum(_prompt_tokens(r) for r in rows)
    if out.get("prefix_cache_hits"):
        out["prefix_cache_source"] = "vLLM counters"
    elif req_hits:
        out.update(prefix_cache_queries=req_queries, prefix_cache_hits=req_hits,
                   prefix_cache_source="per-request num_cached_tokens (vLLM's counters read "
                                       f"{int(metrics.get('prefix_cache_hits') or 0)} hits)")
    else:
        out["prefix_cache_source"] = "vLLM counters and per-request num_cached_tokens (both 0)"
    tapped = [r for r in rows if r.get("spec_draft_tokens") is not None]
    drafts = sum(int(r["spec_draft_tokens"] or 0) for r in tapped)
    accepted = sum(int(r.get("spec_accepted_tokens") or 0) for r in tapped)
    if out.get("spec_accepted_tokens"):
        out["spec_source"] = "vLLM counters"
    elif accepted:
        out.update(spec_draft_tokens=drafts, spec_accepted_tokens=accepted,
                   spec_source=f"per-request scheduler counts of {len(tapped)} requests "
                               "(statescope.capture.spec_tap; vLLM's counters read "
                               f"{int(metrics.get('spec_accepted_tokens') or 0)} accepted)")
    else:
        out["spec_source"] = ("vLLM counters and per-request scheduler counts (both 0)" if tapped
                              else "vLLM counters (no per-request counts: not an in-process engine)")
    q, d = out.get("prefix_cache_queries"), out.get("spec_draft_tokens")
    out["prefix_cache_hit_rate"] = out["prefix_cache_hits"] / q if q else None
    out["spec_acceptance_rate"] = out["spec_accepted_tokens"] / d if d else None
    return out


def lifetime_metrics(lifetimes: Iterable[dict]) -> dict[str, Any]:
    """The counters summed over engine lifetimes (each ``{"metrics": {...}}``), plus how many."""
    out: dict[str, Any] = {k: 0 for k in COUNTERS}
    n = 0
    for life in lifetimes:
        n += 1
        for k in COUNTERS:
            out[k] += int((life.get("metrics") or {}).get(k) or 0)
    out["engine_lifetimes"] = n
    return out
