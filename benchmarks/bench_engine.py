"""Engine start-up (cold vs warm compile cache, eager vs compiled), workload throughput and peak RSS.

Each measurement runs in a fresh subprocess (so peak RSS and "cold" mean something); the cold runs
get an empty VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR, the warm runs re-use the one the cold run
filled. Prints one JSON line per run and a summary with ratios measured in this one invocation.

    .venv/bin/python benchmarks/bench_engine.py [--model DIR] [--skip-compiled]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import statescope
from statescope.engine.offline import EngineConfig, OfflineEngine, default_model
from statescope.workload.episodes import run_episodes, shared_prefix_episodes
cfg = EngineConfig(model=sys.argv[1] or str(default_model()), enforce_eager=sys.argv[2] == "eager")
t1 = time.perf_counter()
eng = OfflineEngine(cfg)
t2 = time.perf_counter()
rows = run_episodes(eng, shared_prefix_episodes(n_episodes=8, n_steps=4), max_tokens=24)
t3 = time.perf_counter()
m = eng.metrics()
print("RESULT " + json.dumps({"import_s": t1 - t0, "startup_s": t2 - t1, "workload_s": t3 - t2,
      "requests": len(rows), "prompt_tokens": m["prompt_tokens"],
      "generated_tokens": m["generation_tokens"],
      "req_per_s": len(rows) / (t3 - t2), "gen_tok_per_s": m["generation_tokens"] / (t3 - t2),
      "prefix_cache_hit_rate": m["prefix_cache_hit_rate"], "acceptance": m["spec_acceptance_rate"]}))
"""


def run_child(model: str, mode: str, cache: str) -> dict:
    env = dict(os.environ, VLLM_CACHE_ROOT=cache, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "ind"),
               VLLM_LOGGING_LEVEL="ERROR")
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model, mode], env=env, capture_output=True,
                          text=True, timeout=1800)
    wall = time.perf_counter() - t0
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        errors = [l for l in proc.stderr.splitlines() if "Error" in l]
        return {"mode": mode, "failed": (errors or ["exit %d" % proc.returncode])[-1][-300:],
                "wall_s": wall}
    out = json.loads(line[7:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out.update(mode=mode, wall_s=wall, peak_rss_mib=round(max(peak, before) / 1024, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="")
    ap.add_argument("--skip-compiled", action="store_true")
    args = ap.parse_args()
    results = {}
    modes = ["eager"] + ([] if args.skip_compiled else ["compiled"])
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="ss-bench-") as cache:
            for temp in ("cold", "warm"):
                r = run_child(args.model, mode, cache)
                results[f"{mode}/{temp}"] = r
                print(json.dumps({"run": f"{mode}/{temp}", **r}), flush=True)
                if "failed" in r:
                    break
    print("\nsummary (one invocation, {} cores):".format(os.cpu_count()))
    for key, r in results.items():
        if "failed" in r:
            print(f"  {key:<15} FAILED: {r['failed']}")
            continue
        print(f"  {key:<15} start {r['startup_s']:6.1f} s   workload {r['req_per_s']:5.2f} req/s "
              f"{r['gen_tok_per_s']:6.1f} gen tok/s   peak RSS (max so far) {r['peak_rss_mib']} MiB")
    for mode in modes:
        c, w = results.get(f"{mode}/cold", {}), results.get(f"{mode}/warm", {})
        if "startup_s" not in c or "startup_s" not in w:
            continue
        print(f"  {mode}: warm/cold start-up ratio {w['startup_s'] / c['startup_s']:.2f}")
    if "startup_s" in results.get("compiled/warm", {}):
        print("  compiled/eager throughput ratio (warm) "
              f"{results['compiled/warm']['gen_tok_per_s'] / results['eager/warm']['gen_tok_per_s']:.2f}")


if __name__ == "__main__":
    main()
