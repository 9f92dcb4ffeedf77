"""Import speed and memory of ``statescope workload import`` on a 10,000-request log with screenshots.

Writes a synthetic request log shaped like the reported workload — GUI-agent episodes of 6 steps,
every request resending its episode's text history plus the current turn's 1–3 PNG screenshots
(real renders of ``statescope.workload.screenshots``: "each request carries 1–3 screenshots"),
episodes interleaved as concurrent agents fill a log, ids and start/end times — then imports it
in a fresh interpreter
(``python -m statescope.cli.main workload import``) and reports wall time, throughput, and peak
resident memory against the log size and the largest single request:

    python benchmarks/bench_import.py [--requests 10000] [--replay as_logged] [--keep DIR]

Goal (issue 23): < 10 s for 10,000 requests with images, memory bounded by one request (streamed):
``peak_rss_growth_over_log`` far below 1 and flat against a log a tenth the size (the growth is
the per-episode index — a few hashes per open episode — and the arrival intervals, not requests).

What it deliberately does not do: time writing the log, or replay anything.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "lib"))  # a benchmark of this checkout, without installing it

from statescope.workload import guilang  # noqa: E402
from statescope.workload.screenshots import image_part  # noqa: E402

STEPS = 6
MEASURE = r"""
import json, resource, sys, time
t0 = time.perf_counter()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
from statescope.cli.main import build_parser, main
build_parser()  # the subcommands' modules are imported here: their memory is not the import's
import statescope.workload.importer
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t1 = time.perf_counter()
rc = main(sys.argv[1:])
t2 = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"rc": rc, "import_s": t2 - t1, "startup_s": t1 - t0,
                  "rss_after_imports_kib": before, "peak_rss_kib": peak}), file=sys.stderr)
"""


def write_log(path: Path, n_requests: int, seed: int = 0) -> dict:
    """The synthetic log; returns its size and its largest request (bytes)."""
    n_episodes = (n_requests + STEPS - 1) // STEPS
    parts_cache: dict[int, list[dict]] = {}
    largest = written = 0
    t0 = 1_767_000_000.0
    with path.open("w") as fh:
        for k in range(STEPS):
            for e in range(n_episodes):
                if written == n_requests:
                    break
                ep = guilang.generate_episode(seed + e % 97, n_steps=STEPS)  # 97 distinct scripts
                users = guilang.user_turns(ep)
                msgs = [{"role": "system", "content": guilang.SYSTEM_PROMPT}]
                for j in range(k + 1):
                    key = (e % 97) * STEPS + j
                    if key not in parts_cache:
                        parts_cache[key] = [image_part(s) for s in ep.steps[j].screenshots]
                    text = [{"type": "text", "text": f"[agent {e}] " + users[j]}]
                    # the reported shape: 1-3 screenshots per request, the current turn's; earlier
                    # turns are resent as text (agents drop old screenshots from the history)
                    msgs.append({"role": "user", "content": (parts_cache[key] if j == k else []) + text})
                    if j < k:
                        msgs.append({"role": "assistant", "content": ep.steps[j].action})
                start = t0 + 3.0 * k + 0.01 * e
                line = json.dumps({"model": "Qwen3.5-27B-FP8", "messages": msgs, "max_tokens": 64,
                                   "temperature": 0, "id": f"req-{k}-{e}", "timestamp": start,
                                   "end_timestamp": start + 2.5})
                largest = max(largest, len(line))
                fh.write(line + "\n")
                written += 1
    return {"requests": written, "log_bytes": path.stat().st_size, "largest_request_bytes": largest}


def measure(log: Path, out: Path, replay: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib")}
    proc = subprocess.run([sys.executable, "-c", MEASURE, "workload", "import", str(log),
                           "--out", str(out), "--replay", replay, "--json"],
                          capture_output=True, text=True, env=env, timeout=600)
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    if proc.returncode != 0 or stats["rc"] != 0:
        raise SystemExit(f"import failed: {proc.stderr[-2000:]}")
    return {**stats, "manifest": json.loads(proc.stdout)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--replay", default="as_logged")
    ap.add_argument("--keep", default=None, help="write the log and trace here (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        log = write_log(folder / "requests.jsonl", args.requests)
        log["write_log_s"] = round(time.perf_counter() - t0, 1)
        # a tenth of the log too: peak memory must not grow with the log
        small = write_log(folder / "small.jsonl", max(args.requests // 10, STEPS))
        big = measure(folder / "requests.jsonl", folder / "trace.jsonl", args.replay)
        tenth = measure(folder / "small.jsonl", folder / "small_trace.jsonl", args.replay)
    kib = 1024
    growth = (big["peak_rss_kib"] - big["rss_after_imports_kib"]) * kib
    result = {
        "requests": log["requests"], "episodes": big["manifest"]["episodes"],
        "images": big["manifest"]["images"], "replay": args.replay,
        "log_MB": round(log["log_bytes"] / 1e6, 1),
        "largest_request_kB": round(log["largest_request_bytes"] / 1e3, 1),
        "import_s": round(big["import_s"], 2), "interpreter_start_s": round(big["startup_s"], 2),
        "MB_per_s": round(log["log_bytes"] / 1e6 / big["import_s"], 1),
        "requests_per_s": round(log["requests"] / big["import_s"]),
        "peak_rss_MB": round(big["peak_rss_kib"] * kib / 1e6, 1),
        "peak_rss_growth_MB": round(growth / 1e6, 1),
        "peak_rss_growth_over_log": round(growth / log["log_bytes"], 4),
        "peak_rss_growth_over_largest_request": round(growth / log["largest_request_bytes"], 1),
        "tenth_log_peak_rss_growth_MB": round((tenth["peak_rss_kib"]
                                               - tenth["rss_after_imports_kib"]) * kib / 1e6, 1),
        "under_10_s": big["import_s"] < 10.0, "write_log_s": log["write_log_s"],
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
