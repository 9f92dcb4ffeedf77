"""Read the committed end-to-end GPU results (``data/results/gpu/e2e/``) and re-derive their tables.

What it does: the tables of an end-to-end results folder (verdicts, guards, the trigger's answers, overhead,
prefix sweep, kernel agreement, the build decision, the localization, the departures), re-derived
from the files ``statescope.results.files`` reads, without a GPU or vLLM, for the notebook and the
tests, which recompute the verdicts from the records and compare them with the committed file.

What it deliberately does not do: run anything on a device, or edit results by hand.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from statescope.errors import InputError
from statescope.results.files import E2E_DIR, MODELS, arms, parts, part, records
from statescope.records import rows_by_request

RATIO_COLUMNS = ("median_tok_s", "best_tok_s", "ratio_median", "ratio_best", "rounds")  # overhead_table


def earlier_overhead(d: Path = E2E_DIR) -> dict:
    """The earlier session's GPU capture-overhead ratios (capture_gpu.json, CUDA graphs on)."""
    old = json.loads((Path(d).parent / "capture_gpu.json").read_text())
    return {"ratio_median": old["ratio_median"], "ratio_best": old["ratio_best"]}


def race_table(d: Path = E2E_DIR) -> Any:
    """batch_memcpy corruption rate per shift, unpatched vs overlap-safe (the race probe's 10^6
    copies per class: ``racecheck/batch_memcpy_1m.csv``)."""
    import pandas as pd

    race = pd.read_csv(Path(d).parent / "racecheck" / "batch_memcpy_1m.csv")
    return race[race.kernel == "batch_memcpy"].pivot_table(index="shift_bytes", columns="patched",
                                                           values="rate")


def verdict_table(d: Path = E2E_DIR) -> list[dict]:
    """Recompute trigger-vs-control verdicts per model from the committed records."""
    from statescope.verdict.rejudge import verdict_rows

    metas = arms(d)
    out = []
    for label in MODELS:
        mine = [m for m in metas if m.get("label") == label]
        if not mine:
            out.append({"model": label, "control": "all", "outcome": "not run"})
            continue
        out += verdict_rows(mine, records(label, d), label=label)
    return out


def guard_table(d: Path = E2E_DIR) -> list[dict]:
    """Trigger-arm engagement per model: vLLM's counters and the capture's hit/draft counts."""
    rows = []
    for m in arms(d):
        if m["arm"] != "trigger":
            continue
        met, cap = m["metrics"], (m.get("after") or {}).get("capture") or {}
        rows.append({"model": m["label"], "prefix_cache_hits": met.get("prefix_cache_hits"),
                     "prefix_cache_queries": met.get("prefix_cache_queries"),
                     "spec_accepted_tokens": met.get("spec_accepted_tokens"),
                     "spec_draft_tokens": met.get("spec_draft_tokens"),
                     "capture_hit_requests": cap.get("hit_requests"),
                     "capture_in_place_shift_requests": cap.get("in_place_shift_requests"),
                     "mamba_block_size": m["resolved"].get("mamba_block_size"),
                     "async_scheduling": m["resolved"].get("async_scheduling"),
                     "enforce_eager": m["resolved"].get("enforce_eager")})
    return rows


def trigger_summary(d: Path = E2E_DIR) -> list[dict]:
    """Per trigger arm, what it exercised and produced, from its records, meta and capture summary:
    degenerate outputs (``reproduce.label_rows`` without a control), valid actions, prefix-cache hits
    per request, MTP acceptance, and the copy census (in-place conv shifts on the GPU)."""
    from statescope.workload import guilang
    from statescope.verdict.rejudge import arm_run_from_records
    from statescope.verdict.reproduce import label_rows

    out = []
    for m in arms(d):
        if m["arm"] != "trigger":
            continue
        run = arm_run_from_records(m, records(m["label"], d))
        labels = label_rows(run, None, action_validator=guilang.is_valid_action)
        cap = (m.get("after") or {}).get("capture") or {}
        met = run.metrics
        out.append({
            "model": m["label"], "requests": len(run.rows),
            "degenerate": sum(l["degenerate"] for l in labels),
            "valid_actions": sum(guilang.is_valid_action(r["text"]) for r in run.rows),
            "requests_with_cache_hit": sum((r["num_cached_tokens"] or 0) > 0 for r in run.rows),
            "cached_token_share": met["prefix_cache_hits"] / met["prefix_cache_queries"]
            if met["prefix_cache_queries"] else None,
            "prefix_cache_source": met["prefix_cache_source"],
            "vllm_prefix_cache_queries": m["metrics"].get("prefix_cache_queries"),
            "spec_acceptance": met.get("spec_acceptance_rate"),
            "capture_hit_requests": cap.get("hit_requests"), "capture_requests": cap.get("requests"),
            "census": (cap.get("census") or {}).get("by_launch_and_state"),
            "in_place_shift_requests": cap.get("in_place_shift_requests"),
            "mamba_block_size": m["resolved"].get("mamba_block_size"),
            "enforce_eager": m["resolved"].get("enforce_eager"),
            "async_scheduling": m["resolved"].get("async_scheduling"),
            "runner": m["resolved"].get("model_runner")})
    return out


def overhead_table(d: Path = E2E_DIR) -> list[dict]:
    """Capture overhead per model from the raw timed rounds (ratios recomputed here)."""
    from statescope.capture.overhead import overhead_ratios

    sources = [(m["label"], (m.get("after") or {}).get("overhead")) for m in arms(d) if m["arm"] == "trigger"]
    names = sorted({p["part"] for p in parts(d) if p["part"].startswith("large_overhead")})
    for name in names:  # large_overhead (the first runs' name), large_overhead_<size>
        large = part(name, d)
        if large:
            sources.append(("random hybrid, %.1f B params" % (large["params"] / 1e9), large))
    out = []
    for label, ov in sources:
        if not ov:
            continue
        for mode, r in overhead_ratios(ov["rows"]).items():
            if mode == "off":
                continue
            rows = [x for x in ov["rows"] if x["mode"] == mode]
            host = [x["capture_host_s"] / x["engine_steps"] for x in rows
                    if x.get("capture_host_s") is not None and x.get("engine_steps")]
            wall = [x["seconds"] / x["engine_steps"] for x in rows if x.get("engine_steps")]
            out.append({"model": label, "mode": mode, **{k: r[k] for k in RATIO_COLUMNS},
                        "capture_host_ms_per_step": 1e3 * sum(host) / len(host) if host else None,
                        "captured_round_ms_per_step": 1e3 * sum(wall) / len(wall) if wall else None})
    return out


def capture_on_off(d: Path = E2E_DIR, off_dir: Path | None = None, label: str = "tiny-gui") -> dict:
    """The trigger arm run twice on the same machine and model, capture on (``d``) and off
    (``off_dir``, default ``e2e_capture_off`` beside it): requests compared text for text and
    token for token, and each run's requests that differ from the first control present."""
    off_dir = Path(off_dir) if off_dir else Path(d).parent / "e2e_capture_off"

    def trigger_rows(where: Path) -> dict:
        m = [a for a in arms(where) if a["label"] == label and a["arm"] == "trigger"]
        if not m:
            raise InputError(f"{where}: no trigger arm of {label} (arms_*.jsonl)")
        return rows_by_request(records(label, where), "trigger", m[-1]["key"])

    on, off = trigger_rows(Path(d)), trigger_rows(off_dir)
    ctl_meta = [a for a in arms(d) if a["label"] == label and a["arm"] != "trigger"]
    ctl = {}
    if ctl_meta:
        c = ctl_meta[0]
        ctl = rows_by_request(records(label, d), c["arm"], c["key"])
    common = sorted(set(on) & set(off))
    return {"requests": len(common),
            "same_text": sum(on[k]["text"] == off[k]["text"] for k in common),
            "same_tokens": sum(on[k]["output_token_ids"] == off[k]["output_token_ids"] for k in common),
            "control": ctl_meta[0]["arm"] if ctl_meta else None,
            "differ_from_control_on": sorted(k for k in common if k in ctl and on[k]["text"] != ctl[k]["text"]),
            "differ_from_control_off": sorted(k for k in common if k in ctl and off[k]["text"] != ctl[k]["text"])}


def sweep_table(d: Path = E2E_DIR) -> list[dict]:
    """Prefix-cache hit blocks vs prompt length in blocks, per model and arm (MTP on/off)."""
    out = []
    for m in arms(d):
        for r in (m.get("after") or {}).get("sweep") or []:
            out.append({"model": m["label"], "arm": m["arm"], **r})
    return out


def kernel_table(d: Path = E2E_DIR) -> list[dict]:
    res = part("kernel_agreement", d)
    return res["rows"] if res else []


def decision_summary(d: Path = E2E_DIR) -> dict | None:
    res = part("gpu_decision", d)
    if not res:
        return None
    b = res["bisect"]
    return {"answer": b["answer"], "answer_meaning": b["answer_meaning"], "confidence": b["confidence"],
            "probes": len(b["probes"]), "requests_used": b["requests_used"], "stopped": b["stopped"],
            "shift_bytes": res["shift_bytes"], "per_build": res["per_build"]}


def bisect_result(d: Path = E2E_DIR) -> Any:
    """The committed decision as a ``statescope.bisect.BisectResult`` (for its figure)."""
    from statescope.bisect import BisectResult, ProbeRecord

    res = part("gpu_decision", d)
    if not res:
        return None
    b = dict(res["bisect"])
    b.pop("answer", None)
    b.pop("answer_meaning", None)
    b["probes"] = [ProbeRecord(**p) for p in b["probes"]]
    return BisectResult(**b)


def localization(d: Path = E2E_DIR) -> dict:
    """``localization.json``: where the compiled trigger's captured states first depart from the
    float64 oracle, and the exact conv-window continuity check (``statescope localize``)."""
    path = Path(d) / "localization.json"
    if not path.is_file():
        raise InputError(f"{path}: missing (written by ``statescope localize``)")
    return json.loads(path.read_text())


def continuity_table(d: Path = E2E_DIR) -> list[dict]:
    """Decode-to-decode transitions after 3 accepted tokens, by whether the request's batch row
    moved and whether the batch also held prefill rows: how many the conv update shifted wrongly."""
    return localization(d)["continuity"]["request_transitions_prev_accepted_3"]


def departure_table(d: Path = E2E_DIR) -> list[dict]:
    """Per request whose text departed from the control: the first step beyond noise and what the
    capture recorded around it (accepted counts, prefill in the batch, prefix hit, shifts)."""
    out = []
    for r in localization(d)["requests"]:
        if not r.get("divergent"):
            continue
        f = r.get("first_oracle_departure") or {}
        ev = f.get("events") or {}
        out.append({"episode": r["episode"], "step": r["step"], "text_differs_at_token": r["first_output_diff"],
                    "first_state_departure_step": f.get("first_step"), "position": f.get("position"),
                    "kinds": f.get("kinds"), "gdn_layers": len(f.get("layers") or []),
                    "units": round(f["magnitude_units"], 1) if f.get("magnitude_units") else None,
                    "accepted_before": ev.get("accepted"), "batch_has_prefill": ev.get("batch_has_prefill"),
                    "prefix_hit_tokens": ev.get("prefix_hit_tokens"),
                    "in_place_shift_steps": r.get("inplace_shift_steps")})
    return out
