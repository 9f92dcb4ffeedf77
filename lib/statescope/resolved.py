"""Read back what a running vLLM engine really resolved, and its own counters.

What it does: ``resolve_from_llm`` reports prefix caching, Mamba cache mode and block size, the
attention block size, speculative method and token count, async scheduling as *resolved* (with a
loud ``warnings`` entry when it differs from what was asked — the CPU platform turns it off
silently), chunked prefill, the model runner class and whether it is Model Runner V1 or V2 (read from the
engine, never from ``VLLM_USE_V2_MODEL_RUNNER``), platform and versions. ``metrics_from_llm``
reduces ``LLM.get_metrics()`` to the counters the verdicts' engagement guards need.
``engagement_metrics(metrics, rows)`` takes the guards' two pairs — prefix-cache queries/hits and
draft/accepted tokens — from the best source: vLLM's counters when they show engagement, else the
requests themselves (``RequestOutput.num_cached_tokens``; the per-request draft/accepted counts of
statescope's scheduler tap, ``statescope.capture.spec_tap``), naming it in ``prefix_cache_source``
/ ``spec_source``; "not engaged" only when neither source saw the path taken. Why: vLLM 0.26.0's
in-process engine on the H200 kept every counter at 0 while 46 of 48 trigger requests had cached
tokens. ``lifetime_metrics`` sums the counters of every engine lifetime an arm's records came
from (a resumed or re-run store keeps one entry per lifetime).

What it deliberately does not do: judge anything. Users have run two "A/B" arms that were the same
arm; this module only makes that visible.
"""
from __future__ import annotations

import platform
from typing import Any, Iterable

METRIC_NAMES = {
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:spec_decode_num_drafts": "spec_drafts",
    "vllm:spec_decode_num_draft_tokens": "spec_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "spec_accepted_tokens",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
}


def _runner_class(llm: Any) -> str | None:
    """``module.Class`` of the worker's model runner (V1 and V2 runners share a class name)."""
    try:
        names = llm.collective_rpc(
            lambda self: f"{type(self.model_runner).__module__}.{type(self.model_runner).__name__}")
        return names[0] if names else None
    except Exception:  # multiprocess engines may refuse callables; the class is then unknown
        return None


def runner_version(runner_class: str | None) -> str | None:
    """"V2" for Model Runner V2 (``vllm.v1.worker.gpu.*``), "V1" for the others (the GPU and CPU
    ``*ModelRunner`` of ``vllm.v1.worker``), None when the class is unknown."""
    if not runner_class:
        return None
    return "V2" if ".v1.worker.gpu." in runner_class else "V1"


def resolve_vllm_config(vc: Any, requested: Any = None) -> dict:
    """Resolved settings from a ``VllmConfig`` (works in any process that holds one)."""
    import torch
    import vllm

    cache, sched, spec = vc.cache_config, vc.scheduler_config, vc.speculative_config
    out = {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "device": vc.device_config.device_type if vc.device_config else None,
        "python": platform.python_version(),
        "model": vc.model_config.model,
        "architecture": (vc.model_config.architectures or [None])[0],
        "dtype": str(vc.model_config.dtype).replace("torch.", ""),
        "enable_prefix_caching": bool(cache.enable_prefix_caching),
        "mamba_cache_mode": cache.mamba_cache_mode,
        "mamba_block_size": cache.mamba_block_size,
        "block_size": cache.block_size,
        "mamba_ssm_cache_dtype": cache.mamba_ssm_cache_dtype,
        "speculative_method": spec.method if spec else None,
        "draft_architecture": (spec.draft_model_config.architectures or [None])[0]
        if spec and spec.draft_model_config else None,
        "num_speculative_tokens": spec.num_speculative_tokens if spec else 0,
        "async_scheduling": bool(sched.async_scheduling),
        "enable_chunked_prefill": bool(sched.enable_chunked_prefill),
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_num_seqs": sched.max_num_seqs,
        "enforce_eager": bool(vc.model_config.enforce_eager),
        "warnings": [],
    }
    if requested is not None:
        asked = getattr(requested, "async_scheduling", None)
        if asked and not out["async_scheduling"]:
            out["warnings"].append("ASYNC SCHEDULING FORCED OFF: requested async_scheduling=True "
                                   f"but the {out['device']} platform resolved it to False")
        elif asked is None and not out["async_scheduling"]:
            out["warnings"].append(f"async scheduling resolved to False on {out['device']} "
                                   "(vLLM's default is on; the async race cannot happen here)")
        if requested.enable_prefix_caching != out["enable_prefix_caching"]:
            out["warnings"].append(f"prefix caching requested {requested.enable_prefix_caching} "
                                   f"but resolved {out['enable_prefix_caching']}")
        if requested.speculative and out["num_speculative_tokens"] != requested.num_speculative_tokens:
            out["warnings"].append("num_speculative_tokens requested "
                                   f"{requested.num_speculative_tokens} but resolved "
                                   f"{out['num_speculative_tokens']}")
    return out


def resolve_from_llm(llm: Any, requested: Any = None) -> dict:
    out = resolve_vllm_config(llm.llm_engine.vllm_config, requested)
    out["model_runner"] = _runner_class(llm)
    out["runner_version"] = runner_version(out["model_runner"])
    return out


def metrics_from_llm(llm: Any) -> dict:
    """Cumulative counters; ``spec_accepted_per_pos`` is a list, one entry per draft position."""
    out: dict[str, Any] = {v: 0 for v in METRIC_NAMES.values()}
    out["spec_accepted_per_pos"] = []
    for m in llm.get_metrics():
        if m.name in METRIC_NAMES:
            out[METRIC_NAMES[m.name]] += int(getattr(m, "value", 0))
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["spec_accepted_per_pos"] = [int(v) for v in m.values]
    q, d = out["prefix_cache_queries"], out["spec_draft_tokens"]
    out["prefix_cache_hit_rate"] = out["prefix_cache_hits"] / q if q else None
    out["spec_acceptance_rate"] = out["spec_accepted_tokens"] / d if d else None
    return out


COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "spec_drafts", "spec_draft_tokens",
            "spec_accepted_tokens", "prompt_tokens", "generation_tokens")


def _prompt_tokens(r: dict) -> int:
    return int(r.get("prompt_tokens") or len(r.get("prompt_token_ids") or []))


def engagement_metrics(metrics: dict, rows: list[dict]) -> dict:
    """``metrics`` with the guard pairs from the best source, and that source named."""
    out = {k: 0 for k in ("prefix_cache_queries", "prefix_cache_hits", "spec_draft_tokens",
                          "spec_accepted_tokens")}
    out.update({k: v for k, v in metrics.items() if v is not None})
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
