"""What a trigger-vs-control design can detect, known before any engine starts.

Why: a design of 4 episodes an arm at alpha = 0.01 can never reach a verdict (its best one-sided
Fisher p, 4/4 vs 0/4, is 1/70 = 0.0143) yet used to run for minutes and print "no evidence".
The numbers here depend only on the unit counts and alpha, so a command refuses such a design,
or sizes itself, before it spends an engine start.

What it does: ``best_p(n_t, n_c)`` is the smallest one-sided Fisher p the design can reach (every
trigger unit failed, no control unit); ``critical_failures`` the fewest trigger failures (control
clean) that reach p < alpha; ``detectable_rate`` the smallest trigger failure rate detected with
the given power (control at rate 0: the powered case of a clean control); ``units_needed`` the
units an arm for a rate; ``design_units(trace, unit, episodes_per_lifetime)`` the units a trace
gives; ``power_of(...)`` all of it as a ``DesignPower`` whose ``refusal`` is the one line a
command prints when the design can never answer.

What it deliberately does not do: judge a run (``statescope.verdict.stats.decide`` does), or
model a failing control (the control's own rate only lowers power further).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from scipy import stats as _st

from statescope.errors import InputError

# the reported rate (16 of 288 requests corrupted with async scheduling; /work/shared/CONTEXT.md)
REFERENCE_RATE = 16 / 288
DEFAULT_POWER = 0.9
CELL_ALPHA = 0.01  # the alpha every build or matrix cell's verdict uses (reproduce's default)


def _check(n_trigger: int, n_control: int, alpha: float) -> None:
    for name, n in (("n_trigger", n_trigger), ("n_control", n_control)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InputError(f"design {name}={n!r}: expected an integer >= 0")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise InputError(f"design alpha={alpha!r}: expected a significance level in (0, 1)")


def _p_all_in_trigger(k: int, n_trigger: int, n_control: int) -> float:
    """One-sided Fisher p of k/n_t vs 0/n_c: P(all k failures fall in the trigger) = C(n_t,k)/C(N,k)."""
    return math.comb(n_trigger, k) / math.comb(n_trigger + n_control, k)


def best_p(n_trigger: int, n_control: int) -> float:
    """The smallest one-sided Fisher p reachable: every trigger unit failed, no control unit."""
    _check(n_trigger, n_control, 0.5)
    if n_trigger == 0 or n_control == 0:
        return 1.0
    return _p_all_in_trigger(n_trigger, n_trigger, n_control)


def critical_failures(n_trigger: int, n_control: int, alpha: float) -> int | None:
    """Fewest failed trigger units (control clean) with one-sided Fisher p < alpha; None if none."""
    _check(n_trigger, n_control, alpha)
    if n_control == 0:
        return None
    for k in range(1, n_trigger + 1):
        if _p_all_in_trigger(k, n_trigger, n_control) < alpha:
            return k
    return None


def detectable_rate(n_trigger: int, n_control: int, alpha: float,
                    power: float = DEFAULT_POWER) -> float | None:
    """Smallest trigger failure rate detected with probability ``power`` against a clean control
    (P(Binomial(n_t, rate) >= critical_failures) = power); None when the design cannot answer."""
    crit = critical_failures(n_trigger, n_control, alpha)
    if crit is None:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection: the power rises with the rate
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _st.binom.sf(crit - 1, n_trigger, mid) < power else (lo, mid)
    return hi


def units_needed(rate: float, alpha: float, power: float = DEFAULT_POWER, *,
                 limit: int = 200_000) -> int | None:
    """Fewest units an arm (equal arms, clean control) detecting ``rate`` with ``power``."""
    if not 0 < rate <= 1:
        raise InputError(f"units_needed rate={rate!r}: expected a rate in (0, 1]")
    _check(1, 1, alpha)

    def powered(n: int) -> bool:
        crit = critical_failures(n, n, alpha)
        return crit is not None and _st.binom.sf(crit - 1, n, rate) >= power

    n = 1
    while not powered(n):  # doubling, then a linear pass (the power saw-tooths in n)
        if n >= limit:
            return None
        n *= 2
    for m in range(1 if n <= 4096 else n // 2, n + 1):  # the fewest, not the first doubling
        if powered(m):
            return m
    return n


def design_units(trace: Sequence[Any], unit: str, episodes_per_lifetime: int | None = None) -> int:
    """Units of independence a trace gives: its requests, episodes or engine lifetimes."""
    from statescope.workload.trace import episodes_of

    if unit == "request":
        return len(trace)
    episodes = len(episodes_of(list(trace)))
    if unit == "episode":
        return episodes
    if unit == "engine_lifetime":
        return math.ceil(episodes / episodes_per_lifetime) if episodes_per_lifetime else 1
    raise InputError(f"design unit={unit!r}: expected request, episode or engine_lifetime")


@dataclass
class DesignPower:
    """What one design (units an arm, alpha, power) can detect."""

    unit: str
    n_trigger: int
    n_control: int
    alpha: float
    power: float
    best_p: float
    can_answer: bool
    critical_failures: int | None
    detectable_rate: float | None
    reference_rate: float
    units_for_reference: int | None

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line: the numbers of this design."""
        head = (f"design: {self.n_trigger} trigger vs {self.n_control} control {self.unit}s at "
                f"alpha={self.alpha}: best reachable one-sided Fisher p={self.best_p:.3g}")
        if not self.can_answer:
            return head + " (can never reach alpha)"
        ref = (f"{self.units_for_reference} {self.unit}s an arm" if self.units_for_reference
               else "more units than can be counted")
        return (f"{head}; detects with {self.power:.0%} power a trigger failure rate >= "
                f"{self.detectable_rate:.1%} ({self.critical_failures}+ failed {self.unit}s); the "
                f"reported rate {self.reference_rate:.1%} (16/288) needs {ref}")

    def refusal(self, fixes: str) -> str:
        """The one-line refusal of a design that can never answer; ``fixes`` names the flags."""
        need = next((n for n in range(1, 10_000) if best_p(n, n) < self.alpha), None)
        return (f"the design cannot answer: {self.n_trigger} trigger vs {self.n_control} control "
                f"{self.unit}s reach at best one-sided Fisher p={self.best_p:.3g} (all trigger "
                f"{self.unit}s failed, none of the control's), never below alpha={self.alpha}; "
                f"it needs >= {need} {self.unit}s an arm: {fixes}")


def power_of(n_trigger: int, n_control: int, alpha: float, unit: str, *,
             power: float = DEFAULT_POWER, reference_rate: float = REFERENCE_RATE) -> DesignPower:
    """Every number of ``DesignPower`` for this design."""
    _check(n_trigger, n_control, alpha)
    crit = critical_failures(n_trigger, n_control, alpha)
    return DesignPower(unit=unit, n_trigger=n_trigger, n_control=n_control, alpha=float(alpha),
                       power=power, best_p=best_p(n_trigger, n_control), can_answer=crit is not None,
                       critical_failures=crit,
                       detectable_rate=detectable_rate(n_trigger, n_control, alpha, power),
                       reference_rate=reference_rate,
                       units_for_reference=units_needed(reference_rate, alpha, power))
