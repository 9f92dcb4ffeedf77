"""Throughput of the two runners on the embedded default model, and what the driver itself costs.

Runs one small fixed workload (greedy, ``ignore_eos`` so every request makes exactly
``--max-tokens`` tokens) through ``OfflineRunner`` (in-process engine) and ``ServerRunner`` (a
``VllmServer`` on loopback, async client), one after the other, then the same multi-step episodes
through ``run_waves`` (pipelined and lock-step on the server, lock-step offline). Reports
requests/s, output tokens/s and the driver's overhead:

- offline: share of the runner's wall time spent outside ``LLM.generate``;
- server: the client's CPU seconds per wall second, and the share of client-measured request
  latency not accounted for by the server's own end-to-end latency histogram (HTTP, JSON, queueing
  in the client).

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_runners.py [--requests 32]
[--max-tokens 32] [--repeats 3] [--json out.json]``. Deliberately not a load test: one machine,
one small model, numbers comparable only within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import statescope  # noqa: E402,F401  (CPU import shims first)
from statescope.engine.config import EngineConfig
from statescope.engine.runners import OfflineRunner, ServerRunner, episodes_next_step, run_waves  # noqa: E402
from statescope.engine.server import parse_prometheus  # noqa: E402
from statescope.records import ResultsStore  # noqa: E402
from statescope.workload.episodes import shared_prefix_episodes  # noqa: E402

CONFIG = EngineConfig(max_model_len=2048, kv_cache_memory_bytes=256 * 2**20, enforce_eager=True)


def prompts(n: int) -> list[str]:
    return [f"goal: open window {i}\nobservation: button#{i % 7} field#{i % 5} menu#{i}\naction: "
            for i in range(n)]


def server_e2e_sum(runner: ServerRunner) -> float:
    import httpx

    text = httpx.get(runner.url + "/metrics", timeout=30).text
    return sum(v for name, _, v in parse_prometheus(text)
               if name == "vllm:e2e_request_latency_seconds_sum")


def measure(runner, n: int, max_tokens: int, repeats: int) -> dict:
    batch = prompts(n)
    runner.generate(batch[:4], max_tokens=4)  # warm-up: first-request costs are not throughput
    walls, overheads, cpu_shares, unexplained = [], [], [], []
    for _ in range(repeats):
        runner.reset_prefix_cache()
        before = server_e2e_sum(runner) if runner.kind == "server" else 0.0
        t0 = time.perf_counter()
        recs = runner.generate(batch, max_tokens=max_tokens, ignore_eos=True)
        wall = time.perf_counter() - t0
        assert sum(len(r.output_token_ids) for r in recs) == n * max_tokens
        walls.append(wall)
        call = runner.last_call
        if runner.kind == "offline":
            overheads.append((wall - call["engine_s"]) / wall)
        else:
            cpu_shares.append(call["driver_cpu_s"] / wall)
            server_s = server_e2e_sum(runner) - before
            unexplained.append(1 - server_s / call["request_s"])
    wall = statistics.median(walls)
    out = {"runner": runner.kind, "requests": n, "max_tokens": max_tokens, "wall_s": wall,
           "requests_per_s": n / wall, "output_tokens_per_s": n * max_tokens / wall}
    if overheads:
        out["driver_share_of_wall"] = statistics.median(overheads)
    if cpu_shares:
        out["client_cpu_per_wall"] = statistics.median(cpu_shares)
        out["latency_not_in_server_e2e"] = statistics.median(unexplained)
    return out


def waves(runner, mode: str, n_episodes: int, n_steps: int, max_tokens: int) -> dict:
    runner.reset_prefix_cache()
    eps = shared_prefix_episodes(n_episodes=n_episodes, n_steps=n_steps, seed=3)
    with tempfile.TemporaryDirectory() as root:
        store = ResultsStore(root, f"bench-{mode}")
        t0 = time.perf_counter()
        rows = run_waves(runner, [e.episode_id for e in eps], episodes_next_step(eps), store,
                         build="bench", config_hash="bench", max_tokens=max_tokens,
                         ignore_eos=True, all_at_once=(mode != "pipelined"))
        wall = time.perf_counter() - t0
    cached = sum(r["num_cached_tokens"] or 0 for r in rows)
    prompt = sum(len(r["prompt_token_ids"]) for r in rows)
    return {"runner": f"{runner.kind} run_waves {mode}", "requests": len(rows), "wall_s": wall,
            "requests_per_s": len(rows) / wall,
            "output_tokens_per_s": len(rows) * max_tokens / wall,
            "cached_prompt_share": cached / prompt}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    results = []
    with OfflineRunner(CONFIG) as offline:
        results.append(measure(offline, args.requests, args.max_tokens, args.repeats))
        results.append(waves(offline, "lockstep", args.episodes, args.steps, args.max_tokens))
    with ServerRunner.launch(CONFIG, concurrency=32,
                             env={"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}) as server:
        results.append(measure(server, args.requests, args.max_tokens, args.repeats))
        for mode in ("pipelined", "lockstep"):
            results.append(waves(server, mode, args.episodes, args.steps, args.max_tokens))
    print(f"{'runner':34} {'req':>4} {'wall s':>7} {'req/s':>7} {'tok/s':>7}  overhead")
    for r in results:
        extra = "  ".join(f"{k}={r[k]:.3f}" for k in ("driver_share_of_wall", "client_cpu_per_wall",
                                                       "latency_not_in_server_e2e",
                                                       "cached_prompt_share") if k in r)
        print(f"{r['runner']:34} {r['requests']:>4} {r['wall_s']:>7.2f} {r['requests_per_s']:>7.2f} "
              f"{r['output_tokens_per_s']:>7.1f}  {extra}")
    base = results[0]["output_tokens_per_s"]
    srv = next(r for r in results if r["runner"] == "server")
    print(f"server/offline tokens/s ratio: {srv['output_tokens_per_s'] / base:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
