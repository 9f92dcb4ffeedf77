"""SIMULATED batched bisection: what W workers buy on a virtual clock, with synthetic flaky builds.

What it does: ``simulate_batched`` runs ``statescope.cluster.batches.BatchedSearch`` against a
``statescope.bisect.sim.FlakyOracle`` with ``workers`` probes in flight, each taking a random time
(a cell's device-hours), results arriving in finishing order; when the posterior reaches its
confidence the probes still running are cancelled (their time so far is counted). It returns the
answer, the device-hours spent (all cells, cancelled ones included) and the wall-clock hours.
``compare_workers`` averages that over seeds for several worker counts (1 worker is the sequential
search: the same choices as ``statescope.bisect.bayesian_bisect``).

What it deliberately does not do: run engines or Ray; every figure it makes is SIMULATED.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from statescope.bisect.sim import FlakyOracle
from statescope.cluster.batches import MIN_GAIN_BITS, BatchedSearch
from statescope.errors import InputError


@dataclass
class SimulatedBisection:
    answer_index: int
    confidence: float
    stopped: str
    probes: int
    cancelled: int
    device_hours: float
    wall_hours: float


def simulate_batched(oracle: FlakyOracle, *, workers: int, requests_per_probe: int = 48,
                     cell_hours: float = 1.0, cell_hours_sigma: float = 0.25,
                     confidence: float = 0.95, budget: int | None = None, mode: str = "regression",
                     min_gain_bits: float = MIN_GAIN_BITS, seed: int = 0) -> SimulatedBisection:
    """One SIMULATED bisection with ``workers`` probes at a time; a probe takes
    lognormal(``cell_hours``, sigma) hours (median ``cell_hours``)."""
    if not isinstance(workers, int) or workers < 1:
        raise InputError(f"simulate_batched workers={workers!r}: expected an integer >= 1")
    rng = np.random.default_rng(seed)
    search = BatchedSearch(oracle.n_items, mode=mode, requests_per_probe=requests_per_probe,
                           confidence=confidence, budget=budget, min_gain_bits=min_gain_bits)
    running: list[tuple[float, int, str, int, float]] = []  # (finish, order, token, item, start)
    clock, device, probes, cancelled, started = 0.0, 0.0, 0, 0, 0
    stopped = "no informative probe"
    while True:
        for pick in search.choose(workers - len(running)):
            token = f"p{started}"
            duration = float(cell_hours * np.exp(cell_hours_sigma * rng.standard_normal()))
            search.start(token, pick.index)
            heapq.heappush(running, (clock + duration, started, token, pick.index, clock))
            started += 1
        if not running:
            stopped = search.stop_reason() or stopped
            break
        finish, _, token, item, start = heapq.heappop(running)
        clock = finish
        search.observe(token, item, requests_per_probe, oracle(item, requests_per_probe))
        device += finish - start
        probes += 1
        if search.marginal().max() >= confidence:  # the answer is in: stop what still runs
            stopped = "confident"
            for _, _, tok, _, st in running:
                search.abandon(tok, skip_item=False)
                device += clock - st
            cancelled = len(running)
            break
    m = search.marginal()
    best = int(np.argmax(m))
    return SimulatedBisection(best, float(m[best]), stopped, probes, cancelled, device, clock)


def compare_workers(*, n_items: int = 7, workers: Sequence[int] = (1, 8), rate_before: float = 0.0,
                    rate_after: float = 0.056, requests_per_probe: int = 48,
                    seeds: Sequence[int] = range(100), cell_hours: float = 1.0,
                    confidence: float = 0.95, budget: int | None = None,
                    min_gain_bits: float = MIN_GAIN_BITS) -> list[dict]:
    """SIMULATED: mean device-hours, wall-clock hours and accuracy per worker count (change drawn
    per seed, the same draws for every worker count)."""
    rows = []
    for w in workers:
        runs = []
        for seed in seeds:
            change = int(np.random.default_rng(10_000 + seed).integers(1, n_items))
            oracle = FlakyOracle(n_items, change, rate_before, rate_after, seed=seed)
            r = simulate_batched(oracle, workers=w, requests_per_probe=requests_per_probe,
                                 cell_hours=cell_hours, confidence=confidence, budget=budget,
                                 min_gain_bits=min_gain_bits, seed=seed)
            runs.append((r.answer_index == change, r))
        rows.append({"workers": w, "min_gain_bits": min_gain_bits, "runs": len(runs),
                     "accuracy": float(np.mean([ok for ok, _ in runs])),
                     "mean_device_hours": float(np.mean([r.device_hours for _, r in runs])),
                     "mean_wall_hours": float(np.mean([r.wall_hours for _, r in runs])),
                     "mean_probes": float(np.mean([r.probes for _, r in runs])),
                     "mean_cancelled": float(np.mean([r.cancelled for _, r in runs])),
                     "label": "SIMULATED"})
    return rows
