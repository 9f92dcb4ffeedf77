"""A bisection that can say every answer: endpoints first, a calibrated seed set, and an answer
confirmed by probes on both sides of it.

What it does: ``confirmed_bisect(items, probe, mode=...)`` runs ``probe(item, seeds) -> (n, k)``
(units done, failed units) on seed sets from a ``statescope.bisect.seeds.SeedPool``:

1. **Calibrate on the known-bad end** (find-fix: the first item; find-regression: the last):
   seed sets from the pool until one shows a failure (that set is *calibrated*) or
   ``calibration_sets`` sets are clean. All clean: find-fix answers "already good at the first
   build", find-regression "none is bad" (each with the units and seeds it rests on); cut short
   by the budget, the time limit or the pool: "inconclusive (not calibrated)".
2. **Probe the other end**: find-fix "none is good" / find-regression "already bad at the first
   build" when it fails.
3. **Bisect between confirmed ends**: an item is *bad* at its first failing probe (a failure is
   near-certain evidence), *good* after ``good_sets`` clean seed sets, the first of them the
   calibrated one (paired with the failure at the known-bad end; the rest never repeat a set
   the item ran). The answer "first good: X" (find-regression: "first bad: X") is given only with
   X probed good and its predecessor probed bad (mirrored); never an unprobed build.
4. Anything else -- budget, time, pool spent, builds that cannot be probed between the bounds --
   is "inconclusive", with the range the change is still known to lie in.

``BisectResult.outcome`` holds the outcome, the answer (label or None), the reason, each item's
classification and the seeds of every probe; ``posteriors`` are the change-point posterior with
the edge hypotheses (``ChangePointPosterior(edges=True)``: every outcome admitted; reported, not
used to decide). ``EXIT_STATUS`` maps outcomes to the command's exit status.

What it deliberately does not do: choose probes by expected information (``bayesian_bisect``:
that search has no confirmation rule), run builds (``statescope.builds.build_seed_probe``), or
model a failure that is not deterministic per seed beyond "a failure is bad, two clean sets good".
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Sequence

import numpy as np

from statescope.bisect.model import MODES, ChangePointPosterior, RatePrior
from statescope.bisect.result import BisectResult, ProbeRecord
from statescope.bisect.seeds import SeedPool
from statescope.errors import EnvironmentBroken, InputError

SeedProbe = Callable[[Any, list], "tuple[int, int]"]  # (item, seeds) -> (n units, k failed)

OUTCOMES = ("first good", "none is good", "already good at the first build",
            "first bad", "none is bad", "already bad at the first build", "inconclusive")
EXIT_STATUS = {o: (1 if o == "inconclusive" else 0) for o in OUTCOMES}  # bad input: 2 (InputError)


def _words(mode: str) -> dict[str, str]:
    """The outcome words of a mode: find-fix looks for the first good item, find-regression for
    the first bad one (the mirror image)."""
    if mode == "fix":
        return {"first": "first good", "other_end": "none is good",
                "known_end_clean": "already good at the first build", "before": "bad", "after": "good"}
    return {"first": "first bad", "other_end": "already bad at the first build",
            "known_end_clean": "none is bad", "before": "good", "after": "bad"}


class _Run:
    """The probes, classifications and stop conditions of one confirmed bisection."""

    def __init__(self, items, probe, names, mode, pool, budget, stop_when, prior) -> None:
        self.items, self.probe, self.names, self.mode, self.pool = items, probe, names, mode, pool
        self.budget, self.stop_when = budget, stop_when
        self.post = ChangePointPosterior(len(items), mode, prior, edges=True)
        self.prior = self.post.marginal().tolist()
        self.probes: list[ProbeRecord] = []
        self.posteriors: list[list[float]] = []
        self.used = 0
        self.state: dict[int, str] = {}  # item -> bad | good | broken | undecided
        self.skipped: dict[str, str] = {}
        self.stopped: str | None = None

    def _stop_reason(self) -> str | None:
        mean = self.used / len(self.probes) if self.probes else 0
        if self.budget is not None and self.used + mean > self.budget:
            return "budget"
        if self.stop_when is not None and self.stop_when():
            return "time limit"
        return None

    def _probe(self, i: int, seeds: list[int]) -> tuple[int, int] | None:
        self.stopped = self._stop_reason()
        if self.stopped:
            return None
        out = self.probe(self.items[i], list(seeds))
        n, k = (out if not isinstance(out, numbers.Integral) else (None, out))
        if not (isinstance(n, numbers.Integral) and isinstance(k, numbers.Integral) and 0 <= k <= n):
            raise InputError(f"probe of {self.names[i]}: expected (n_done, k) with 0 <= k <= n_done, "
                             f"got {out!r}")
        self.post.add(i, int(n), int(k))
        self.used += int(n)
        m = self.post.marginal()
        best = int(np.argmax(m))
        self.probes.append(ProbeRecord(len(self.probes) + 1, i, self.names[i], int(n), int(k),
                                       self.used, best, float(m[best]), None, list(seeds)))
        self.posteriors.append(m.tolist())
        return int(n), int(k)

    def classify(self, i: int, clean_needed: int, *, calibrating: bool = False) -> str:
        """bad (a failure), good (``clean_needed`` clean sets), broken, or undecided (stopped or
        the pool has no fresh set for this item)."""
        clean = 0
        while clean < clean_needed:
            seeds = self.pool.draw(i) if calibrating else self.pool.for_item(i)
            if seeds is None:
                self.stopped = self.stopped or "seed pool spent"
                self.state[i] = "undecided"
                return "undecided"
            try:
                got = self._probe(i, seeds)
            except EnvironmentBroken as exc:
                self.skipped[self.names[i]] = str(exc)
                self.state[i] = "broken"
                return "broken"
            if got is None:
                self.state[i] = "undecided"
                return "undecided"
            if got[1] > 0:
                if calibrating:
                    self.pool.calibrated = list(seeds)
                self.state[i] = "bad"
                return "bad"
            clean += 1
        self.state[i] = "good"
        return "good"

    def units(self, i: int) -> tuple[int, int, list[int]]:
        mine = [p for p in self.probes if p.index == i]
        return (sum(p.n for p in mine), sum(p.k for p in mine),
                sorted({s for p in mine for s in (p.seeds or [])}))


def confirmed_bisect(items: Sequence, probe: SeedProbe, *, mode: str = "fix",
                     pool: SeedPool | None = None, calibration_sets: int = 4, good_sets: int = 2,
                     budget: int | None = None, stop_when: Callable[[], bool] | None = None,
                     labels: Sequence[str] | None = None,
                     prior: RatePrior | None = None) -> BisectResult:
    """Endpoints first, calibrated seeds, a confirmed answer or "inconclusive" (see the module)."""
    if mode not in MODES:
        raise InputError(f"bisection mode={mode!r}: expected one of {MODES}")
    names = [str(x) for x in items] if labels is None else [str(x) for x in labels]
    if len(items) < 2 or len(names) != len(items):
        raise InputError(f"confirmed bisection: expected at least 2 items and one label each, got "
                         f"{len(items)} items, {len(names)} labels")
    for name, v in (("calibration_sets", calibration_sets), ("good_sets", good_sets)):
        if not isinstance(v, numbers.Integral) or v < 1:
            raise InputError(f"{name}={v!r}: expected an integer >= 1")
    pool = pool or SeedPool()
    run = _Run(list(items), probe, names, mode, pool, budget, stop_when, prior)
    w, last = _words(mode), len(items) - 1
    known, other = (0, last) if mode == "fix" else (last, 0)
    outcome = _search(run, w, known, other, calibration_sets, good_sets)
    n_total = len(items)
    answer = outcome.get("answer_index")
    best = int(np.argmax(run.posteriors[-1])) if run.posteriors else 0
    result = BisectResult(
        "confirmed", mode, names, run.probes, run.prior, run.posteriors,
        answer if answer is not None else min(best, n_total - 1),
        float(run.posteriors[-1][answer if answer is not None else best]) if run.posteriors else 0.0,
        run.used, run.stopped or "answered",
        {"seed_pool": [min(pool.pool), max(pool.pool) + 1], "set_size": pool.set_size,
         "calibration_sets": calibration_sets, "good_sets": good_sets, "budget": budget,
         "posterior_hypotheses": names + ["(no change within the items)"]},
        run.skipped)
    outcome.update(calibrated_seeds=pool.calibrated, exit_status=EXIT_STATUS[outcome["outcome"]],
                   items={names[i]: dict(zip(("units", "failed", "seeds"), run.units(i)),
                                         state=run.state.get(i, "unprobed"))
                          for i in range(n_total)})
    result.outcome = outcome
    return result


def _search(run: _Run, w: dict, known: int, other: int, calibration_sets: int,
            good_sets: int) -> dict:
    names = run.names
    got = run.classify(known, calibration_sets, calibrating=True)
    if got == "good":
        n, _, seeds = run.units(known)
        return {"outcome": w["known_end_clean"], "answer": None, "answer_index": None,
                "reason": f"the known-bad end {names[known]} never failed: 0/{n} units over "
                          f"{len(seeds)} seeds in {calibration_sets} disjoint seed sets"}
    if got != "bad":
        return _inconclusive(run, f"not calibrated: no failure seen at the known-bad end "
                                  f"{names[known]} ({_why(run, known, got)})")
    got = run.classify(other, good_sets)
    if got == "bad":
        return {"outcome": w["other_end"], "answer": None, "answer_index": None,
                "reason": f"the other end {names[other]} fails too "
                          f"({_counts(run, other)}; calibrated at {names[known]}: "
                          f"{_counts(run, known)})"}
    if got != "good":
        return _inconclusive(run, f"the other end {names[other]} is not settled "
                                  f"({_why(run, other, got)})")
    # a: the last item of the before regime known, b: the first of the after regime known
    a, b = (known, other) if known < other else (other, known)
    while b - a > 1:
        open_ = [i for i in range(a + 1, b) if run.state.get(i) not in ("broken", "undecided")]
        if not open_:
            broken = [names[i] for i in range(a + 1, b)]
            return _inconclusive(run, f"the change lies after {names[a]} and at or before "
                                      f"{names[b]}; not probed: {', '.join(broken)}", a, b)
        mid = min(open_, key=lambda i: (abs(i - (a + b) / 2), i))
        got = run.classify(mid, good_sets)
        if got in ("broken",):
            continue
        if got == "undecided":
            return _inconclusive(run, f"{names[mid]} is not settled ({_why(run, mid, got)}); "
                                      f"the change lies after {names[a]} and at or before "
                                      f"{names[b]}", a, b)
        if got == w["before"]:
            a = mid
        else:
            b = mid
    return {"outcome": w["first"], "answer": names[b], "answer_index": b,
            "reason": f"{names[b]} probed {w['after']} ({_counts(run, b)}), its predecessor "
                      f"{names[a]} probed {w['before']} ({_counts(run, a)})"}


def _counts(run: _Run, i: int) -> str:
    n, k, seeds = run.units(i)
    return f"{k}/{n} on seeds {_seed_text(seeds)}"


def _seed_text(seeds: list[int]) -> str:
    return ",".join(map(str, seeds)) if seeds else "none"


def _why(run: _Run, i: int, got: str) -> str:
    if got == "broken":
        return f"it could not be probed: {run.skipped.get(run.names[i])}"
    return f"{_counts(run, i)}; stopped: {run.stopped}"


def _inconclusive(run: _Run, reason: str, a: int | None = None, b: int | None = None) -> dict:
    out = {"outcome": "inconclusive", "answer": None, "answer_index": None, "reason": reason}
    if a is not None:
        out["range"] = [run.names[a], run.names[b]]
    return out
