"""Bayesian vs plain bisection on synthetic flaky oracles: accuracy and requests spent.

Usage: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_bisect.py [--seeds 500] [--json out.json]

For each scenario (64 builds, change location drawn per seed): Bayesian bisection with 20 requests
per probe (stop at posterior mass 0.95 or 2000 requests), plain bisection with the same 20 requests
per probe, and plain bisection with as many requests per probe as makes its total equal to the
Bayesian mean (measured in this run), so the comparison at equal cost is fair.
"""
from __future__ import annotations

import argparse
import json
import math
import time

from statescope.bisect import compare_methods

SCENARIOS = [  # (name, mode, rate_before, rate_after)
    ("regression 0 -> 5.6%", "regression", 0.0, 0.056),
    ("fix 5.6% -> 0", "fix", 0.056, 0.0),
    ("regression 0.5% -> 5.6% (flaky good builds)", "regression", 0.005, 0.056),
    ("regression 0 -> 2%", "regression", 0.0, 0.02),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=500)
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--n", type=int, default=20, help="requests per Bayesian probe")
    ap.add_argument("--budget", type=int, default=2000)
    ap.add_argument("--json")
    args = ap.parse_args()
    seeds = range(args.seeds)
    plain_probes = math.ceil(math.log2(args.items - 1))
    out = []
    print(f"{args.items} builds, {args.seeds} seeds, Bayesian {args.n} requests/probe, budget "
          f"{args.budget}, stop at 0.95")
    print(f"{'scenario':<46} {'method':<15} {'accuracy':>8} {'mean req':>9} {'max req':>8}")
    for name, mode, before, after in SCENARIOS:
        t0 = time.perf_counter()
        common = dict(n_items=args.items, rate_before=before, rate_after=after, mode=mode,
                      seeds=seeds, budget=args.budget)
        rows = compare_methods(requests_per_probe=args.n, **common)
        bayes = rows[0]
        matched = max(1, round(bayes["mean_requests"] / plain_probes))
        rows += compare_methods(requests_per_probe=matched, bayesian=False, **common)
        for r in rows:
            print(f"{name:<46} {r['method']:<15} {r['accuracy']:>8.3f} {r['mean_requests']:>9.0f} "
                  f"{r['max_requests']:>8}")
            out.append({"scenario": name, **r})
        print(f"{'':<46} ({time.perf_counter() - t0:.1f} s; plain n={matched} spends the Bayesian "
              f"mean over {plain_probes} probes)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
