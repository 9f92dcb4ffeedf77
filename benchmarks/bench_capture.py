"""Throughput cost of capture: off vs digest vs full, as ratios measured in one run on one engine.

One in-process engine (the embedded default, trigger configuration: prefix caching + align +
MTP(2)) serves the same workload in interleaved rounds — off, digest, digest+drafts (the spec's
``draft_columns``), full, off, … — with the prefix cache reset before each round, so drift on a
shared machine hits every mode alike (``statescope.capture.overhead.overhead_rounds``, after one
warm-up round per mode; ``statescope capture-overhead`` runs the same rounds on any model). Each
round's time includes the capture's own close at its end (``count_close``: the flusher's last
emission counts too). Prints one JSON line per round and a summary per mode
(``overhead_ratios``): the ratio of its tokens/s to "off" (best-of-N, which resists other
sessions' load on a shared machine, median, and the median of round-paired ratios), the ratio of
tokens per CPU second of the whole process, and ``capture_cpu_share``: the CPU seconds spent inside
the capture itself (``statescope.capture.clock.CaptureClock``: the hook sink, the flusher's
emission, the close — thread CPU time, which other processes' load does not inflate the way it
inflates wall time) over the CPU seconds of an "off" round (medians). Goal: digest within 10%.
``STATESCOPE_DIGEST_NATIVE=0`` measures the torch digest path instead of the C kernel
(``statescope.capture.digest``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_capture.py [--rounds 5] [--requests 12]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import statescope  # noqa: E402,F401  (CPU import shims before vLLM)


MODES = ("off", "digest", "digest+drafts", "full")  # digest+drafts: spec draft_columns=true
ROW_KEYS = ("mode", "round", "seconds", "cpu_seconds", "tokens", "capture_cpu_s", "capture_bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from statescope.capture.overhead import overhead_ratios, overhead_rounds
    from statescope.capture.session import boundary_prompts
    from statescope.engine.config import EngineConfig
    from statescope.engine.offline import OfflineEngine

    engine = OfflineEngine(EngineConfig())
    # prompts ending just before a block boundary: every align-mode copy path runs
    batch = boundary_prompts(engine.resolved()["mamba_block_size"], args.requests)
    out_dir = tempfile.mkdtemp(prefix="statescope-bench-capture-")
    try:
        rows = overhead_rounds(engine, batch, modes=MODES, rounds=args.rounds, max_tokens=args.max_tokens,
                               output_dir=out_dir, label="bench", count_close=True)
    finally:
        engine.close()
    for r in rows:
        print(json.dumps({k: r[k] for k in ROW_KEYS if k in r}))
    summary = {}
    for mode, s in overhead_ratios(rows, MODES).items():
        summary[mode] = {"best_tok_per_s": round(s["best_tok_s"], 2), "ratio_best": round(s["ratio_best"], 3),
                         "ratio_median": round(s["ratio_median"], 3),
                         "paired_ratio_median": round(s["paired_ratio_median"], 3),
                         "ratio_cpu_time": round(s["ratio_cpu_time"], 3),
                         "capture_cpu_share": round(s["capture_cpu_share"], 3),
                         "capture_bytes": s.get("capture_bytes", 0)}
    summary["goal_digest_within_10pct"] = {
        "ratio_best": summary["digest"]["ratio_best"] >= 0.9,
        "capture_cpu_share": summary["digest"]["capture_cpu_share"] <= 0.1}
    try:
        from statescope.capture.digest import native_kernel
    except ImportError:  # an older statescope (comparisons of the same command across versions)
        native_kernel = None

    print(json.dumps({"summary": summary, "rounds": args.rounds, "requests": args.requests,
                      "max_tokens": args.max_tokens, "out_dir": out_dir,
                      # which digest ran: the C kernel in place, or torch gather + reductions
                      "digest_kernel": ("c_in_place" if native_kernel() else "torch")
                      if native_kernel else "torch (older statescope)",
                      "load_avg": [round(x, 2) for x in os.getloadavg()]}, indent=2))


if __name__ == "__main__":
    main()
