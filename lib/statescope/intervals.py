"""A distribution-free interval for a median, shared by the verdicts and the capture's cost probe.

What it does: ``median_interval(values, conf)`` gives the order-statistic interval of a median:
``(lo, hi, coverage)`` with ``lo``/``hi`` the k-th smallest/largest value for the largest k whose
exact binomial coverage is still >= ``conf`` (the coverage reached is returned; never below
``conf``). Used for paired throughput ratios, where no noise model is credible.

What it deliberately does not do: model the noise, or accept too few values: with fewer than 6
values a 95 % interval does not exist (even min..max covers less), which is an ``InputError``.
"""
from __future__ import annotations

from statescope.errors import InputError


def median_interval(values: list[float], conf: float = 0.95) -> tuple[float, float, float]:
    """``(lo, hi, coverage)`` of the median of ``values`` at confidence ``conf``."""
    from scipy import stats as _st

    if not isinstance(conf, (int, float)) or isinstance(conf, bool) or not 0 < conf < 1:
        raise InputError(f"median_interval conf: expected a probability in (0, 1), got {conf!r}")
    x = sorted(float(v) for v in values)
    n = len(x)
    best = None
    for k in range(1, n // 2 + 1):  # [x_(k), x_(n-k+1)] covers the median w.p. 1 - 2 P(B <= k-1)
        coverage = 1 - 2 * float(_st.binom.cdf(k - 1, n, 0.5))
        if coverage < conf:
            break
        best = (x[k - 1], x[n - k], coverage)
    if best is None:
        raise InputError(f"median_interval: {n} values cannot give {conf:.0%} coverage "
                         f"(min..max covers {1 - 2 * 0.5 ** n:.1%}); expected more values")
    return best
