"""Where the capture's throughput cost goes on a GPU (issue 7): one device call, one JSON file.

    python3 scripts/gpu_overhead_probe.py --out DIR [--sizes 1p3b,7b] [--rounds 6] [--max-tokens 160]

For each random-weight hybrid of ``gpu_e2e.LARGE_SIZES`` (compiled, CUDA graphs, async scheduling,
prefix caching + align + MTP(2): the trigger configuration), on one engine:

1. interleaved timed rounds of three modes: ``off`` (no hooks), ``hooks`` (capture installed with
   a spec that selects no request: every hook and the per-step bookkeeping run, no digest is
   taken) and ``digest``; per round the capture's own thread-CPU seconds split by sink method
   (``drain`` = the flusher thread's emission, off the step's thread);
2. one ``digest`` round under ``cProfile`` (the engine's thread only): the top statescope
   functions by own time, so the in-step host cost has names;
3. one ``digest`` round with ``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing CUDA
   call whose Python stack passes through statescope, with that stack (a sync in a hook would
   cancel async scheduling's overlap, which a host-time clock does not show).

What it deliberately does not do: decide anything (the ratios are read in docs/benchmarks.md),
or run the tiny model (its overhead is part of the trigger arm in gpu_e2e.py).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODES = ("off", "hooks", "digest", "digest_eager", "digest_bg")
# digest: CUDA-graph digest (STATESCOPE_DIGEST_GRAPH=1), rows made when the engine idles;
# digest_eager: the digest launched eagerly (the default), rows at idle; digest_bg: CUDA-graph
# digest, rows made by the flusher thread while the engine steps (emit "background", as round 3).


def spec_for(mode: str, run_id: str) -> dict:
    spec = {"output_dir": str(Path(tempfile.gettempdir()) / "statescope_probe"), "run_id": run_id,
            "mode": "digest"}
    if mode == "hooks":  # a request id no offline request has: hooks run, nothing is selected
        spec["requests"] = {"ids": ["no-such-request"]}
    if mode == "digest_bg":
        spec["emit"] = "background"
    return spec


def timed_round(runner, prompts: list, mode: str, run_id: str, max_tokens: int) -> dict:
    from statescope.capture import recorder as capture
    import bench_capture

    from statescope.capture.digest_graph import ENV_GRAPH

    clock = None
    os.environ[ENV_GRAPH] = "0" if mode == "digest_eager" else "1"  # read when the run starts
    # (round 4 ran with graphs on by default: digest and digest_bg as here, digest_eager off)
    if mode != "off":
        rec = capture.install(spec_for(mode, run_id))
        clock = bench_capture.CaptureClock()
        bench_capture.CLOCK[:] = [clock]
        clock.attach(rec)
    runner.reset_prefix_cache()
    t0 = time.perf_counter()
    recs = runner.generate(prompts, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    dt = time.perf_counter() - t0
    row = {"mode": mode, "seconds": dt, "tokens": sum(len(r.output_token_ids) for r in recs)}
    if mode != "off":
        t1 = time.perf_counter()
        dirs = capture.uninstall()  # with emit "idle" the rows are made here, after the timed work
        row["close_s"] = time.perf_counter() - t1
        row["capture_host_s"] = clock.seconds
        row["by_name_ms"] = {k: round(v * 1e3, 2) for k, v in sorted(clock.by_name.items())}
        if dirs:
            from statescope.capture.store import CaptureRun

            run = CaptureRun(dirs[-1])
            man = run.manifest
            row["engine_steps"], row["digest_kernel"] = man.get("engine_steps"), man.get("digest_kernel")
            # the capture really ran (the probe runs with hook errors non-fatal): status, rows
            row.update(status=man.get("status"), hook_errors=int(man.get("error_count") or 0),
                       block_table_source=man.get("block_table_source"))
            if mode != "hooks":
                digests = run.digests()
                row["digest_rows"] = 0 if digests is None else len(digests)
            row.update(digest_graph=man.get("digest_graph"), emit=man.get("emit"),
                       emit_ms_total=man.get("emit_ms_total"), run_dir=str(dirs[-1]))
    return row


def summarize(rows: list[dict], modes: tuple = MODES) -> dict:
    by = {m: [r for r in rows if r["mode"] == m] for m in modes}
    off = [r["tokens"] / r["seconds"] for r in by["off"]]
    out = {}
    for m, rs in by.items():
        rates = [r["tokens"] / r["seconds"] for r in rs]
        paired = [a / b for a, b in zip(rates, off)]  # round k of this mode over round k of off
        out[m] = {"median_tok_s": statistics.median(rates), "ratio_median": statistics.median(rates) / statistics.median(off),
                  "ratio_best": max(rates) / max(off), "paired_ratio_median": statistics.median(paired),
                  "paired_ratios": [round(x, 4) for x in paired]}
        if m != "off" and len(paired) >= 6:  # order-statistic interval of the paired median
            from statescope.verdict.stats import median_interval

            lo, hi, cov = median_interval(paired)
            out[m]["paired_ratio_ci"] = {"lo": round(lo, 4), "hi": round(hi, 4), "coverage": round(cov, 4)}
        closes = [r["close_s"] for r in rs if r.get("close_s") is not None]
        if closes:
            out[m]["close_s_median"] = statistics.median(closes)
            out[m]["emit_ms_per_step"] = statistics.median(
                (r.get("emit_ms_total") or 0) / r["engine_steps"] for r in rs if r.get("engine_steps"))
            out[m]["digest_graph"] = sorted({str(r.get("digest_graph")) for r in rs})
        steps = [r.get("engine_steps") for r in rs if r.get("engine_steps")]
        if steps:
            out[m]["capture_host_ms_per_step"] = statistics.median(
                r["capture_host_s"] * 1e3 / r["engine_steps"] for r in rs if r.get("engine_steps"))
            names = {k for r in rs for k in r["by_name_ms"]}
            out[m]["by_name_ms_per_step"] = {k: round(statistics.median(
                r["by_name_ms"].get(k, 0) / r["engine_steps"] for r in rs if r.get("engine_steps")), 4)
                for k in sorted(names)}
    return out


def profile_round(runner, prompts: list, max_tokens: int) -> list[dict]:
    from statescope.capture import recorder as capture

    capture.install(spec_for("digest", "profile"))
    runner.reset_prefix_cache()
    prof = cProfile.Profile()
    prof.enable()
    runner.generate(prompts, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    prof.disable()
    capture.uninstall()
    st = pstats.Stats(prof)
    rows = []
    for (fname, line, func), (cc, nc, tt, ct, _) in st.stats.items():
        if "statescope" in fname:
            rows.append({"fn": f"{Path(fname).name}:{line}:{func}", "calls": nc, "own_ms": round(tt * 1e3, 2),
                         "cum_ms": round(ct * 1e3, 2)})
    # what statescope's code calls outside itself (torch's CUDA ops, numpy, pickle): own time
    # spent on behalf of a statescope caller, per callee (cProfile keeps it per caller)
    for (fname, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        if "statescope" in fname:
            continue
        mine = [v for (cf, _, _), v in callers.items() if "statescope" in cf  # the capture's code,
                and not cf.endswith(("capture_hooks.py", "runners.py", "engine.py"))]  # not vLLM under it
        if mine:
            rows.append({"fn": f"{Path(fname).name}:{line}:{func}", "calls": sum(v[1] for v in mine),
                         "own_ms": round(sum(v[2] for v in mine) * 1e3, 2),
                         "cum_ms": round(sum(v[3] for v in mine) * 1e3, 2), "called_by_statescope": True})
    rows.sort(key=lambda r: -r["own_ms"])
    total = sum(v[2] for v in st.stats.values())
    return [{"profile_total_own_s": round(total, 3)}] + rows[:60]


def sync_round(runner, prompts: list, max_tokens: int) -> dict:
    import torch
    from statescope.capture import recorder as capture

    hits: dict[str, int] = {}
    stacks: dict[str, str] = {}
    orig = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if "statescope" in f.filename]
        if ours:
            key = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}"
            hits[key] = hits.get(key, 0) + 1
            stacks.setdefault(key, "".join(traceback.format_list(stack[-8:])) + str(message)[:200])

    capture.install(spec_for("digest", "sync"))
    runner.reset_prefix_cache()
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                runner.generate(prompts, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = orig
        capture.uninstall()
    return {"statescope_sync_sites": hits, "stacks": stacks}


def same_digests(rows: list[dict]) -> dict | None:
    """The last digest round (graph) vs the last digest_eager round: checksums per (prompt, request
    step, layer, kind) — the graph replay must see exactly what the eager launches see."""
    from statescope.capture.store import CaptureRun

    last = {r["mode"]: r["run_dir"] for r in rows if r.get("run_dir")}
    if not {"digest", "digest_eager"} <= set(last):
        return None
    key = ["prompt_sha", "req_step", "layer", "kind", "column_offset"]
    try:
        a, b = (CaptureRun(last[m]).digests().set_index(key)["checksum"] for m in ("digest", "digest_eager"))
    except Exception as exc:  # a probe result must not be lost to its own check
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    both = a.to_frame("graph").join(b.to_frame("eager"), how="inner")
    return {"rows_graph": len(a), "rows_eager": len(b), "rows_compared": len(both),
            "identical": int((both["graph"] == both["eager"]).sum())}


def gui_prompts(vocab: int, groups: int = 4, per_group: int = 8, prefix: int = 2048, suffix: int = 384,
                seed: int = 11) -> list[list[int]]:
    """The workbook's shape at random tokens: ``groups`` agents, each with ``per_group`` steps that
    share a ``prefix``-token history and differ in a ``suffix``-token observation (long prompts,
    prefix-cache hits, short answers)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        head = [rng.randrange(0, vocab - 8) for _ in range(prefix)]
        out += [head + [rng.randrange(0, vocab - 8) for _ in range(suffix)] for _ in range(per_group)]
    return out


def probe_size(name: str, size: dict, rounds: int, max_tokens: int, deadline: float,
               cpu: bool = False, modes: tuple = MODES, workloads: tuple = ("decode",),
               gui_max_tokens: int = 64) -> dict:
    """``workloads``: "decode" (32 one-block prompts, ``max_tokens`` each: short steps, the worst
    case for a per-step cost) and/or "gui" (``gui_prompts``: 32 prompts of 2,432 tokens in 4 shared
    -prefix groups, ``gui_max_tokens`` each). The first workload's results stay at the top level
    (as before); every workload's are under ``workloads``."""
    import gpu_e2e as script
    from statescope.gpu import e2e_arms as gpu_e2e

    runner, res = script.large_runner(cpu=cpu, **({} if cpu else size))
    try:
        vocab = runner.engine.llm.get_tokenizer().vocab_size
        bs = int(res["resolved"].get("mamba_block_size") or res["resolved"].get("block_size"))
        res["workloads"] = {}
        for i, wl in enumerate(workloads):
            wl_deadline = time.time() + (deadline - time.time()) / (len(workloads) - i)  # a fair share
            if wl == "gui":
                prompts = gui_prompts(vocab, **({"prefix": 96, "suffix": 32} if cpu else {}))
                mt = max_tokens if cpu else gui_max_tokens
            else:
                prompts = [ids for _, _, ids in gpu_e2e.sweep_prompts(bs, vocab, blocks=(1,), offsets=tuple(range(32)), seed=7)]
                mt = max_tokens
            for mode in modes:  # warm-up round per mode (Triton compile, pinned pools, graphs)
                timed_round(runner, prompts, mode, f"warm-{wl}-{mode}", mt)
            rows = []
            for r in range(rounds):
                if time.time() > wl_deadline - (60 if wl == workloads[-1] else 10):
                    res["workloads"].setdefault(wl, {})["stopped_early_after_rounds"] = r
                    break
                for mode in modes:
                    rows.append(dict(timed_round(runner, prompts, mode, f"{wl}-{mode}{r}", mt), round=r))
            part = dict(rows=rows, summary=summarize(rows, modes), prompts=len(prompts),
                        prompt_tokens=sorted({len(p) for p in prompts}), max_tokens=mt,
                        graph_vs_eager=same_digests(rows))
            res["workloads"].setdefault(wl, {}).update(part)
            if wl == workloads[0]:
                res.update(part)
            print(name, wl, json.dumps({m: {k: v for k, v in s.items() if k not in ("by_name_ms_per_step", "paired_ratios")}
                                        for m, s in part["summary"].items()}), flush=True)
        if time.time() < deadline - 40:
            res["profile"] = profile_round(runner, prompts, max_tokens)
        if time.time() < deadline - 30 and not cpu:  # sync debug mode is CUDA's
            res["sync"] = sync_round(runner, prompts, max_tokens)
        res["metrics"] = runner.metrics()
    finally:
        runner.close()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", default="1p3b,7b")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--cpu", action="store_true", help="shake-out on the CPU build (a 4-layer hybrid)")
    p.add_argument("--modes", default=",".join(MODES), help=f"subset of {MODES} (off first)")
    p.add_argument("--workloads", default="decode", help="decode and/or gui (see probe_size)")
    a = p.parse_args()
    modes = tuple(a.modes.split(","))
    if not set(a.workloads.split(",")) <= {"decode", "gui"}:
        p.error(f"--workloads: expected decode and/or gui, got {a.workloads!r}")
    if modes[0] != "off" or not set(modes) <= set(MODES):
        p.error(f"--modes: expected 'off' first, then any of {MODES}")
    import gpu_e2e as script

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + a.budget_s
    results = {"env": {k: os.environ.get(k) for k in ("STATESCOPE_DIGEST_TRITON",)}, "modes": list(modes)}
    for name in a.sizes.split(","):
        if time.time() > deadline - 150:
            results[name] = {"skipped": "device time"}
            continue
        t0 = time.time()
        try:
            results[name] = probe_size(name, script.LARGE_SIZES[name], a.rounds, a.max_tokens, deadline,
                                        cpu=a.cpu, modes=modes, workloads=tuple(a.workloads.split(",")))
        except Exception:
            results[name] = {"error": traceback.format_exc()[-3000:]}
        results[name]["wall_s"] = time.time() - t0
        (out / "overhead_probe.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        summ = results[name].get("summary", {})
        print(name, json.dumps({m: {k: v for k, v in s.items() if k != "by_name_ms_per_step"}
                                for m, s in summ.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
