"""Delta debugging (Zeller & Hildebrandt's ddmin): the smallest subsequence that still fails.

What it does: ``ddmin(items, fails)`` splits the current failing list into ``n`` chunks, keeps a
chunk or a chunk's complement that still fails (``fails(kept) -> bool``), and doubles ``n`` when
neither does; it ends 1-minimal (removing any one remaining item makes it pass: each such removal
is a recorded trial). Order is kept; every distinct candidate is tested at most once; every test
is recorded (``DdminResult.trials``: kept, removed, failed). ``prepare(candidates)``, when given,
hears a round's untested chunks before the first of them is tested, and their complements (when
there are more than two) before the first complement is: a caller whose test needs a reference answer per
candidate (the shrink's control arm) computes them all in one go instead of one by one.

What it deliberately does not do: run anything, retry a flaky test or assume monotonicity (the
caller's ``fails`` decides, e.g. "fails in every one of K re-runs"), or test the empty list.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


@dataclass
class Trial(Generic[T]):
    kept: list
    removed: list
    failed: bool


@dataclass
class DdminResult(Generic[T]):
    minimal: list
    trials: list = field(default_factory=list)

    def needed(self) -> list[tuple]:
        """(item, trial) for each item of the minimum whose removal alone made it pass."""
        out = []
        for item in self.minimal:
            rest = [x for x in self.minimal if x != item]
            trial = next((t for t in self.trials if t.kept == rest and not t.failed), None)
            if trial is not None:
                out.append((item, trial))
        return out


def _chunks(items: list, n: int) -> list[list]:
    """``items`` cut into ``n`` contiguous, near-equal, non-empty chunks."""
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return [c for c in out if c]


def _tell(prepare: Callable[[list[list]], None], cands: list[list], seen: dict) -> None:
    untested = [c for c in cands if tuple(c) not in seen]
    if untested:
        prepare(untested)


def ddmin(items: Sequence[T], fails: Callable[[list], bool],
          prepare: Callable[[list[list]], None] | None = None) -> DdminResult:
    """A 1-minimal failing subsequence of ``items`` (which must fail as given: not re-tested);
    ``prepare``: told each round's untested candidates first (it must not test them)."""
    current = list(items)
    result = DdminResult(current)
    seen: dict[tuple, bool] = {tuple(current): True}

    def test(kept: list) -> bool:
        key = tuple(kept)
        if key not in seen:
            seen[key] = bool(fails(list(kept)))
            result.trials.append(Trial(list(kept), [x for x in current if x not in kept],
                                       seen[key]))
        return seen[key]

    n = 2
    while len(current) >= 2:
        chunks = _chunks(current, min(n, len(current)))
        reduced = False
        if prepare is not None:
            _tell(prepare, chunks, seen)
        for chunk in chunks:  # a chunk alone
            if test(chunk):
                current, n, reduced = chunk, 2, True
                break
        if not reduced and len(chunks) > 2:  # with two chunks a complement is the other chunk
            if prepare is not None:
                _tell(prepare, [[x for x in current if x not in c] for c in chunks], seen)
            for chunk in chunks:
                rest = [x for x in current if x not in chunk]
                if test(rest):
                    current, n, reduced = rest, max(n - 1, 2), True
                    break
        if not reduced:
            if len(chunks) >= len(current):
                break  # every single removal was tried and passed: 1-minimal
            n = min(len(current), 2 * n)
    result.minimal = current
    return result
