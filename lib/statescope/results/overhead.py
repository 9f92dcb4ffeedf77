"""What does capture cost on the GPU? The committed capture-overhead measurements, every set's.

The graph-digest and compact-record probes (``data/results/gpu/overhead_graph_digest/``,
``data/results/gpu/overhead_compact_record/``):

Each folder holds one ``probe_7b_call<N>.json`` per device call of
``scripts/gpu_overhead_probe.py`` on the 6.7 B random hybrid with real vLLM 0.26.0 on the H200
(compiled, CUDA graphs, async scheduling, prefix caching + align + MTP(2)), on two workloads:
``decode`` (32 one-block prompts of ~2,100 tokens, 160 tokens each: short steps, the worst case for
a per-step cost) and ``gui`` (the workbook's shape: 4 agents x 8 steps, 2,432-token prompts sharing
2,048 tokens, 64 tokens each). ``overhead_graph_digest/`` measured the CUDA-graph digest built once
per engine; ``overhead_compact_record/`` the step's compact record (``statescope.capture.facts``).
``overhead_rows`` gives one row per (file, workload, mode), recomputed from the raw timed rounds by
``statescope.capture.overhead.overhead_ratios`` (the code that wrote the probes' summaries), not read:
the paired-median throughput ratio to capture off, its distribution-free interval
(``statescope.verdict.stats.median_interval`` over the paired rounds), the ratio of medians, the
capture's host milliseconds per step in the step and in the flusher, and (compact record) whether
every digest round's capture really ran. ``goal_check`` says, per call and workload,
whether the issue's goal (digest mode at most 3 % slower than capture off) is shown: only if the
whole interval is at or above 0.97. ``pooled_check`` pools the paired rounds of several calls of
the same code — a secondary reading, labelled as one (different engine starts add their spread).

Earlier measurements, in their own file formats: ``digest_bench``, ``triton_overheads`` and
``probe_table`` (``e2e_factors/``: the one-launch Triton digest vs torch, and the probe's host
milliseconds per step); ``deferred_rows_table`` (``overhead_modes/``: five capture modes, rows made
when the engine idles, eager vs CUDA-graph digest).

What it deliberately does not do: re-run anything, or pool calls that ran different code.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from statescope.capture.overhead import overhead_ratios, paired_ratios
from statescope.errors import InputError
from statescope.results import e2e
from statescope.results import files
from statescope.intervals import median_interval
from statescope.results.factors import FACTORS_DIR

OVERHEAD_GRAPH_DIGEST_DIR = e2e.E2E_DIR.parent / "overhead_graph_digest"
OVERHEAD_COMPACT_RECORD_DIR = e2e.E2E_DIR.parent / "overhead_compact_record"
GRAPH_DIGEST_PROBES = ("probe_7b_call3.json", "probe_7b_call6.json", "probe_7b_call9.json", "probe_7b_call10.json")
COMPACT_RECORD_PROBES = ("probe_7b_call3.json", "probe_7b_call6.json", "probe_7b_call7.json")
COMPACT_RECORD_SAME_CODE = ("probe_7b_call6.json", "probe_7b_call7.json")  # 6fe7952 both (call 3: an earlier tree)
GOAL = 0.97  # digest mode: at most 3 % throughput loss (issue 7)


def probe_files(d: Path) -> tuple[str, ...]:
    """The probe files a capture-overhead folder must hold: the ``probe_7b_call<N>.json`` its
    manifest's ``what`` describes, else (no manifest) the graph-digest set."""
    man = Path(d) / "manifest.json"
    if not man.is_file():
        return GRAPH_DIGEST_PROBES
    try:
        what = json.loads(man.read_text()).get("what") or {}
    except ValueError as exc:
        raise InputError(f"{man}: not JSON ({exc})") from None
    named = tuple(k for k in what if re.fullmatch(r"probe_7b_call\d+\.json", k))
    return named or GRAPH_DIGEST_PROBES


def is_overhead_probe_dir(d: Path) -> bool:
    """Whether ``d`` is a capture-overhead probe folder (it holds the first call's probe)."""
    return (Path(d) / GRAPH_DIGEST_PROBES[0]).is_file()


def _load(path: Path) -> dict:
    if not path.is_file():
        raise InputError(f"{path}: missing (scripts/gpu_overhead_probe.py writes it; see docs/gpu.md)")
    res = json.loads(path.read_text()).get("7b")
    if not isinstance(res, dict) or "summary" not in res:
        raise InputError(f"{path}: field '7b.summary' missing (expected a probe of the 6.7 B hybrid)")
    return res


def _workloads(res: dict) -> dict:
    """The graph-digest probe's first two calls predate workloads: their top level is ``decode``."""
    return res.get("workloads") or {"decode": res}


def _capture_ran(part: dict, mode: str) -> str | None:
    """The compact-record probe records, per timed round, whether the capture ran (the probe
    tolerates hook errors): "all N" when every round's run is complete with no hook error and
    digest rows, else which not."""
    rs = [r for r in part["rows"] if r["mode"] == mode]
    if not rs or "status" not in rs[0]:
        return None  # the graph-digest probe did not record it
    bad = [r["round"] for r in rs if r.get("status") != "complete" or r.get("hook_errors")
           or not r.get("digest_rows")]
    return f"all {len(rs)}" if not bad else f"not in rounds {bad}"


def overhead_rows(d: Path = OVERHEAD_GRAPH_DIGEST_DIR) -> list[dict]:
    rows = []
    for name in probe_files(d):
        res = _load(Path(d) / name)
        for wl, part in _workloads(res).items():
            for mode, s in overhead_ratios(part["rows"], list(part["summary"])).items():
                if mode == "off":
                    continue
                paired = paired_ratios(part["rows"], mode)
                lo, hi, cov = median_interval(paired)
                by = s.get("by_name_ms_per_step", {})
                agree = part.get("graph_vs_eager") or {}
                rows.append({
                    "file": name, "workload": wl, "mode": mode, "rounds": len(paired),
                    "prompt_tokens": f"{min(part.get('prompt_tokens') or [0])}-{max(part.get('prompt_tokens') or [0])}",
                    "max_tokens": part.get("max_tokens"),
                    "paired_median": round(s["paired_ratio_median"], 3),
                    "ci_lo": round(lo, 3), "ci_hi": round(hi, 3), "ci_coverage": round(cov, 3),
                    "ratio_of_medians": round(s["ratio_median"], 3),
                    "host_ms_in_step": round(sum(v for k, v in by.items() if k != "drain"), 3),
                    "host_ms_flusher": round(by.get("drain", 0.0), 3),
                    "digest_graph": ",".join(s.get("digest_graph") or []),
                    "graph_vs_eager_identical": (f"{agree['identical']}/{agree['rows_compared']}"
                                                 if "identical" in agree else None),
                    "capture_ran": _capture_ran(part, mode)})
    return rows


def goal_check(d: Path = OVERHEAD_GRAPH_DIGEST_DIR) -> list[dict]:
    """Per (file, workload) of the CUDA-graph digest: is ``GOAL`` shown (interval >= 0.97),
    ruled out (interval below it), or open (the interval straddles it)?"""
    out = []
    for r in overhead_rows(d):
        if r["mode"] != "digest":
            continue
        out.append({"file": r["file"], "workload": r["workload"], "rounds": r["rounds"],
                    "paired_median": r["paired_median"], "interval": f"{r['ci_lo']}-{r['ci_hi']}",
                    "ratio_of_medians": r["ratio_of_medians"], "goal": _verdict(r["ci_lo"], r["ci_hi"])})
    return out


def _verdict(lo: float, hi: float) -> str:
    return ("met" if lo >= GOAL else "not met" if hi < GOAL else
            "not shown (interval straddles 0.97)")


def pooled_check(d: Path = OVERHEAD_COMPACT_RECORD_DIR, files: tuple[str, ...] = COMPACT_RECORD_SAME_CODE) -> list[dict]:
    """Per workload: the digest mode's paired rounds of ``files`` (calls of the same code) pooled,
    with the interval of their median and the goal verdict on it."""
    parts: dict[str, list[float]] = {}
    for name in files:
        for wl, part in _workloads(_load(Path(d) / name)).items():
            parts.setdefault(wl, []).extend(paired_ratios(part["rows"], "digest"))
    out = []
    for wl, paired in parts.items():
        lo, hi, cov = median_interval(paired)
        out.append({"pooled": "+".join(f.removeprefix("probe_7b_").removesuffix(".json") for f in files),
                    "workload": wl, "rounds": len(paired),
                    "paired_median": round(statistics.median(paired), 3),
                    "interval": f"{round(lo, 3)}-{round(hi, 3)}", "ci_coverage": round(cov, 3),
                    "goal": _verdict(round(lo, 3), round(hi, 3))})
    return out


def digest_bench(d: Path = FACTORS_DIR) -> list[dict]:
    """Per step: the torch gather path vs the one-launch Triton digest (host and device ms)."""
    keep = ("layers", "requests", "layout", "bytes_per_step", "checksums_equal", "conv_row_checks_equal",
            "stats_max_rel_diff", "torch_host_ms", "torch_device_ms", "triton_host_ms", "triton_device_ms",
            "triton_GBps")
    path = Path(d) / "bench_digest_gpu.jsonl"
    if not path.is_file():
        raise InputError(f"{path}: missing (written by benchmarks/bench_digest_gpu.py)")
    return [{k: r[k] for k in keep} for r in files.read_jsonl(path)]


def triton_overheads(d: Path = FACTORS_DIR) -> list[dict]:
    """``e2e/``'s large-model overhead measurement repeated with the Triton digest (same script)."""
    return e2e.overhead_table(d)


def probe_table(d: Path = FACTORS_DIR) -> list[dict]:
    """Per hybrid and mode: throughput ratios to capture off, and the capture's host milliseconds per
    engine step split into the step's own thread (hook sinks) and the flusher thread (``drain``)."""
    path = Path(d) / "overhead_probe.json"
    if not path.is_file():
        raise InputError(f"{path}: missing (written by scripts/gpu_overhead_probe.py)")
    probe = json.loads(path.read_text())
    out = []
    for size, res in probe.items():
        if size == "env" or "summary" not in res:
            continue
        off = [r["seconds"] / r["tokens"] for r in res["rows"] if r["mode"] == "off"]
        for mode, s in res["summary"].items():
            names = s.get("by_name_ms_per_step") or {}
            steps = [r["engine_steps"] for r in res["rows"] if r["mode"] == mode and r.get("engine_steps")]
            out.append({"model": f"{size} ({res['params'] / 1e9:.1f} B)", "mode": mode,
                        "ratio_median": s["ratio_median"], "paired_ratio_median": s["paired_ratio_median"],
                        "step_ms_off": 1e3 * statistics.median(off) * res["rows"][0]["tokens"] / steps[0]
                        if steps else None,
                        "host_ms_in_step": sum(v for k, v in names.items() if k != "drain") if names else None,
                        "host_ms_flusher": names.get("drain"),
                        "sync_sites": len((res.get("sync") or {}).get("statescope_sync_sites") or {})
                        if mode == "digest" else None})
    return out


OVERHEAD_MODES_DIR = e2e.E2E_DIR.parent / "overhead_modes"

MODES_PROBES = {"probe_1p3b.json": "1p3b", "probe_7b.json": "7b", "probe_7b_eager8.json": "7b"}


def deferred_rows_table(d: Path = OVERHEAD_MODES_DIR) -> list[dict]:
    """One row per (probe file, mode): ratios to "off" (median of rounds, paired median), host ms
    per step in the step (hooks) and in the flusher ("drain"), emission ms per step (made at
    idle/close), and the graph-vs-eager digest agreement of that probe."""
    import json

    rows = []
    for name, size in MODES_PROBES.items():
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
