"""Synthetic flaky oracles for bisection tests, benchmarks and notebooks (labelled SYNTHETIC there).

What it does: ``FlakyOracle`` is a probe whose item i fails each request with ``rate_before`` if
i < ``change_index``, else ``rate_after``; ``compare_methods`` measures accuracy and requests of
Bayesian vs plain bisection over many seeds (the change location drawn per seed).
``SeedOracle`` is a probe of the confirmed bisection (``probe(item, seeds)``) whose failures are
deterministic per seed, as measured on the H200: a bad item fails ``fails_per_seed`` units of
each seed in ``failing_seeds`` and none of the others; a good item fails nothing.

What it deliberately does not do: stand in for real builds anywhere it is not labelled SYNTHETIC or
SIMULATED.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from statescope.bisect.search import bayesian_bisect, plain_bisect
from statescope.errors import InputError


@dataclass
class FlakyOracle:
    """Synthetic probe: item i fails each request with rate_before if i < change_index, else rate_after."""
    n_items: int
    change_index: int
    rate_before: float
    rate_after: float
    seed: int = 0
    calls: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.change_index < self.n_items:
            raise InputError(f"FlakyOracle change_index={self.change_index}: expected 1..{self.n_items - 1}")
        self._rng = np.random.default_rng(self.seed)

    def __call__(self, item: int, n: int) -> int:
        self.calls += 1
        rate = self.rate_before if item < self.change_index else self.rate_after
        return int(self._rng.binomial(n, rate))


@dataclass
class SeedOracle:
    """Synthetic probe, deterministic per seed: items in ``bad_items`` fail ``fails_per_seed`` of
    ``units_per_seed`` units on each seed of ``failing_seeds``, every other (item, seed) none."""
    bad_items: frozenset
    failing_seeds: frozenset
    units_per_seed: int = 8
    fails_per_seed: int = 1
    calls: list = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.bad_items, self.failing_seeds = frozenset(self.bad_items), frozenset(self.failing_seeds)
        self.calls = []

    def __call__(self, item: int, seeds: list) -> tuple[int, int]:
        self.calls.append((item, tuple(seeds)))
        k = sum(self.fails_per_seed for s in seeds if s in self.failing_seeds) \
            if item in self.bad_items else 0
        return self.units_per_seed * len(seeds), k


def compare_methods(*, n_items: int = 64, rate_before: float = 0.0, rate_after: float = 0.056,
                    mode: str = "regression", requests_per_probe: int = 20, budget: int = 2000,
                    seeds: Sequence[int] = range(100), confidence: float = 0.95,
                    plain_requests_per_probe: Sequence[int] = (), bayesian: bool = True) -> list[dict]:
    """Accuracy and requests of Bayesian vs plain bisection on FlakyOracles (change drawn per seed).

    Plain bisection runs with the same requests per probe and with each n in
    ``plain_requests_per_probe``; ``bayesian=False`` runs only those plain arms."""
    arms = ([("bayesian", requests_per_probe)] if bayesian else []) + \
        [("plain", n) for n in dict.fromkeys((requests_per_probe, *plain_requests_per_probe))]
    runs: dict[str, list[tuple[bool, int]]] = {}
    for seed in seeds:
        change = int(np.random.default_rng(10_000 + seed).integers(1, n_items))
        for method, n in arms:
            oracle = FlakyOracle(n_items, change, rate_before, rate_after, seed=seed)
            r = (bayesian_bisect(range(n_items), oracle, mode=mode, requests_per_probe=n,
                                 budget=budget, confidence=confidence) if method == "bayesian"
                 else plain_bisect(range(n_items), oracle, mode=mode, requests_per_probe=n))
            runs.setdefault(f"{method} n={n}", []).append((r.answer_index == change, r.requests_used))
    return [{"method": name, "runs": len(v), "accuracy": float(np.mean([a for a, _ in v])),
             "mean_requests": float(np.mean([u for _, u in v])),
             "max_requests": int(max(u for _, u in v))} for name, v in runs.items()]
