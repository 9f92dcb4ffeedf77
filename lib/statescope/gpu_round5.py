"""Read round 5 of the GPU capture-overhead probes (``data/results/gpu/overhead_round5/``).

Round 5 measured the CUDA-graph digest built once per engine (``statescope.digest_graph``, now the
CUDA default) on the 6.7 B random hybrid with real vLLM 0.26.0 on the H200 (compiled, CUDA graphs,
async scheduling, prefix caching + align + MTP(2)), on two workloads: ``decode`` (32 one-block
prompts of ~2,100 tokens, 160 tokens each: short steps, the worst case for a per-step cost) and
``gui`` (the workbook's shape: 4 agents x 8 steps, 2,432-token prompts sharing 2,048 tokens, 64
tokens each). Each probe file is one device call; ``overhead_rows`` gives one row per (file,
workload, mode) with the paired-median throughput ratio to capture off, its distribution-free
interval (``statescope.stats.median_interval`` over the paired rounds, recomputed here, not read),
the ratio of medians, and the capture's host milliseconds per step in the step and in the flusher.
``goal_check`` says, per workload, whether the issue's goal (digest mode at most 3 % slower than
capture off) is shown: only if the whole interval is at or above 0.97.

What it deliberately does not do: pool rounds across calls (different engines, different machine
load), or re-run anything.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from statescope import gpu_results as gr
from statescope.errors import InputError
from statescope.stats import median_interval

R5_DIR = gr.E2E_DIR.parent / "overhead_round5"
PROBES = ("probe_7b_call3.json", "probe_7b_call6.json", "probe_7b_call9.json", "probe_7b_call10.json")
GOAL = 0.97  # digest mode: at most 3 % throughput loss (issue 7)


def _load(path: Path) -> dict:
    if not path.is_file():
        raise InputError(f"{path}: missing (scripts/gpu_overhead_probe.py writes it; see docs/gpu.md)")
    res = json.loads(path.read_text()).get("7b")
    if not isinstance(res, dict) or "summary" not in res:
        raise InputError(f"{path}: field '7b.summary' missing (expected a probe of the 6.7 B hybrid)")
    return res


def _workloads(res: dict) -> dict:
    """Round-5 files of the first two calls predate workloads: their top level is ``decode``."""
    return res.get("workloads") or {"decode": res}


def overhead_rows(d: Path = R5_DIR) -> list[dict]:
    rows = []
    for name in PROBES:
        res = _load(Path(d) / name)
        for wl, part in _workloads(res).items():
            off = [r["tokens"] / r["seconds"] for r in part["rows"] if r["mode"] == "off"]
            for mode, s in part["summary"].items():
                if mode == "off":
                    continue
                rates = [r["tokens"] / r["seconds"] for r in part["rows"] if r["mode"] == mode]
                paired = [a / b for a, b in zip(rates, off)]
                lo, hi, cov = median_interval(paired)
                by = s.get("by_name_ms_per_step", {})
                agree = part.get("graph_vs_eager") or {}
                rows.append({
                    "file": name, "workload": wl, "mode": mode, "rounds": len(paired),
                    "prompt_tokens": f"{min(part.get('prompt_tokens') or [0])}-{max(part.get('prompt_tokens') or [0])}",
                    "max_tokens": part.get("max_tokens"),
                    "paired_median": round(statistics.median(paired), 3),
                    "ci_lo": round(lo, 3), "ci_hi": round(hi, 3), "ci_coverage": round(cov, 3),
                    "ratio_of_medians": round(statistics.median(rates) / statistics.median(off), 3),
                    "host_ms_in_step": round(sum(v for k, v in by.items() if k != "drain"), 3),
                    "host_ms_flusher": round(by.get("drain", 0.0), 3),
                    "digest_graph": ",".join(s.get("digest_graph") or []),
                    "graph_vs_eager_identical": (f"{agree['identical']}/{agree['rows_compared']}"
                                                 if "identical" in agree else None)})
    return rows


def goal_check(d: Path = R5_DIR) -> list[dict]:
    """Per (file, workload) of the CUDA-graph digest: is ``GOAL`` shown (interval >= 0.97),
    ruled out (interval below it), or open (the interval straddles it)?"""
    out = []
    for r in overhead_rows(d):
        if r["mode"] != "digest":
            continue
        verdict = ("met" if r["ci_lo"] >= GOAL else "not met" if r["ci_hi"] < GOAL else
                   "not shown (interval straddles 0.97)")
        out.append({"file": r["file"], "workload": r["workload"], "rounds": r["rounds"],
                    "paired_median": r["paired_median"], "interval": f"{r['ci_lo']}-{r['ci_hi']}",
                    "ratio_of_medians": r["ratio_of_medians"], "goal": verdict})
    return out
