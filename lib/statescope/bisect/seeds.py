"""Seed sets of a bisection's probes, drawn from a pool so that a failure that is deterministic per
seed is seen.

What it does: ``SeedPool(pool, set_size, rng_seed, first)`` hands out seed sets. On this model a
failure is deterministic for a given workload (on the H200 seeds 0-5 never fail and seeds 6-11
hold every failure of seeds 0:12), so probing every build with the same first seeds, or shifting
them by a fixed span, can miss it everywhere. ``draw(item)`` gives a set of ``set_size`` seeds
the item has never run (never a repeated seed set on one item), taken from the pool in a
shuffled order fixed by ``rng_seed`` (the first set is ``first`` when given); ``calibrated`` is
the set on which the known-bad end failed, and ``for_item(item)`` offers it first to every other
item (the paired probe: under per-seed determinism a still-bad build fails on the same seeds),
then fresh sets.

What it deliberately does not do: run anything, or judge counts (``statescope.bisect.confirmed``).
"""
from __future__ import annotations

import random
from typing import Sequence

from statescope.errors import InputError

DEFAULT_POOL = range(0, 48)
DEFAULT_SET_SIZE = 3


class SeedPool:
    """Seed sets for probes: disjoint per item, shuffled from a pool, the calibrated set first."""

    def __init__(self, pool: Sequence[int] = DEFAULT_POOL, set_size: int = DEFAULT_SET_SIZE, *,
                 rng_seed: int = 0, first: Sequence[int] | None = None) -> None:
        self.pool = list(dict.fromkeys(int(s) for s in pool))
        if not isinstance(set_size, int) or set_size < 1:
            raise InputError(f"seed set size {set_size!r}: expected an integer >= 1")
        if len(self.pool) < set_size:
            raise InputError(f"seed pool of {len(self.pool)} seeds: expected at least one set of "
                             f"{set_size} (--seed-pool A:B with B - A >= {set_size})")
        self.set_size = set_size
        self.order = list(self.pool)
        random.Random(rng_seed).shuffle(self.order)
        if first:
            first = [int(s) for s in first]
            self.order = first + [s for s in self.order if s not in first]
        self.used: dict[int, set[int]] = {}
        self.calibrated: list[int] | None = None

    def draw(self, item: int) -> list[int] | None:
        """The next ``set_size`` seeds in the pool's order that ``item`` never ran; None when the
        pool has no such set left."""
        seen = self.used.setdefault(item, set())
        fresh = [s for s in self.order if s not in seen][:self.set_size]
        if len(fresh) < self.set_size:
            return None
        seen.update(fresh)
        return fresh

    def for_item(self, item: int) -> list[int] | None:
        """The calibrated set if ``item`` has not run it yet, else a fresh set (None: pool spent)."""
        seen = self.used.setdefault(item, set())
        if self.calibrated is not None and not seen & set(self.calibrated):
            seen.update(self.calibrated)
            return list(self.calibrated)
        return self.draw(item)

    def sets_left(self, item: int) -> int:
        return (len(self.order) - len(self.used.get(item, ()))) // self.set_size
