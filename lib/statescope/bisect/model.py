"""The Bayesian change-point model behind statescope's bisection: prior, posterior, information gain.

What it does: items are ordered and the failure rate changes once, at location *c* (the first item
of the "after" regime, 1 <= c <= N-1). ``RatePrior`` puts a grid prior on the (good, bad) failure
rates: the bad rate log-uniform over ``bad_rate_min..0.99``, the good rate 0 with mass
``good_zero_mass`` and otherwise at most ``max_good_to_bad`` of the bad one -- the asymmetry of
flaky bugs (a failure seen is near-certain evidence of "bad"; a clean probe is only probabilistic
evidence of "good", with a strength learnt from the failures seen so far).
``ChangePointPosterior`` integrates both rates out exactly on that grid and gives the marginal
over *c* and the expected information (bits) of a probe of n requests on every item at once
(prefix sums, O(N m^2)). With ``edges=True`` the hypotheses are c = 0..N: c = 0 is "every item
is in the after regime" (find-fix: already good at the first item) and c = N "no item is" (none
is good), so a uniform prior over three items is [0.25, 0.25, 0.25, 0.25], not [0, 0.5, 0.5];
``marginal`` then has N + 1 entries, the last one c = N; ``joint`` is the full (c, before-rate, after-rate) table and ``copy`` an
independent twin, for reasoning about probes still in flight (``statescope.cluster.batches``). ``mode='fix'`` swaps which regime fails more.

What it deliberately does not do: choose or run probes (``statescope.bisect.search``), model more
than one change, or treat requests of one engine lifetime as dependent.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

from statescope.errors import InputError

MODES = ("regression", "fix")


@dataclass(frozen=True)
class RatePrior:
    """Prior over the (good, bad) failure-rate pair, evaluated on a grid of rates."""
    bad_rate_min: float = 0.005
    good_zero_mass: float = 0.8
    max_good_to_bad: float = 0.25
    grid_size: int = 40

    def grid(self) -> tuple[np.ndarray, np.ndarray]:
        """(rates, P[good_index, bad_index]); rates[0] is 0, the rest log-spaced up to 0.99."""
        if not 0 < self.bad_rate_min < 0.99 or not 0 <= self.good_zero_mass <= 1 \
                or not 0 < self.max_good_to_bad < 1 or self.grid_size < 4:
            raise InputError(f"RatePrior {self}: expected 0 < bad_rate_min < 0.99, good_zero_mass in "
                             "[0, 1], max_good_to_bad in (0, 1), grid_size >= 4")
        rates = np.concatenate([[0.0], np.geomspace(min(1e-3, self.bad_rate_min), 0.99, self.grid_size)])
        bad = (rates >= self.bad_rate_min * (1 - 1e-9)).astype(float)  # log-uniform on the grid
        bad /= bad.sum()
        prior = np.zeros((rates.size, rates.size))
        for b in np.flatnonzero(bad):
            ok = (rates > 0) & (rates <= self.max_good_to_bad * rates[b])
            zero = self.good_zero_mass if ok.any() else 1.0
            prior[0, b] = bad[b] * zero
            if ok.any():
                prior[ok, b] = bad[b] * (1 - zero) / ok.sum()
        return rates, prior


def _rate_loglik(k: np.ndarray, n: np.ndarray, rates: np.ndarray) -> np.ndarray:
    """log P(k failures in n | rate) up to the binomial coefficient, shape (len(k), len(rates))."""
    return special.xlogy(k[:, None], rates[None, :]) + special.xlog1py((n - k)[:, None], -rates[None, :])


class ChangePointPosterior:
    """Posterior over the change location given per-item (requests, failures) counts."""

    def __init__(self, n_items: int, mode: str = "regression", prior: RatePrior | None = None,
                 *, edges: bool = False) -> None:
        if not isinstance(n_items, numbers.Integral) or n_items < 2:
            raise InputError(f"bisection items: expected at least 2 ordered items, got {n_items!r}")
        if mode not in MODES:
            raise InputError(f"bisection mode={mode!r}: expected one of {MODES}")
        self.n_items, self.mode, self.prior = int(n_items), mode, prior or RatePrior()
        self.edges = bool(edges)
        self.c_first = 0 if self.edges else 1  # hypotheses c = c_first .. c_last
        self.c_last = self.n_items if self.edges else self.n_items - 1
        self.rates, pair = self.prior.grid()
        # pair is (good, bad); orient it as (before-rate, after-rate) for this mode.
        self.pair = pair if mode == "regression" else pair.T
        self.n = np.zeros(n_items, dtype=np.int64)
        self.k = np.zeros(n_items, dtype=np.int64)
        self._cache: tuple | None = None
        self._lik: dict[int, np.ndarray] = {}

    def add(self, index: int, n: int, k: int) -> None:
        if not 0 <= index < self.n_items or not 0 <= k <= n:
            raise InputError(f"bisection observation: expected 0 <= index < {self.n_items} and "
                             f"0 <= k <= n, got index={index}, n={n}, k={k}")
        self.n[index] += n
        self.k[index] += k
        self._cache = None

    def rate_marginals(self) -> tuple[np.ndarray, np.ndarray]:
        """(P(c, before-rate), P(c, after-rate)) given the data, c = 1..N-1 along axis 0.

        The joint is prior(before, after) * L_before(c, before) * L_after(c, after), so each
        marginal is an elementwise product with one matrix product: O(N m^2) without an N*m*m
        table."""
        if self._cache is None:
            before, after = rate_marginals_of(self.rates, self.pair, self.n[None], self.k[None],
                                              edges=self.edges)
            self._cache = (before[0], after[0])
        return self._cache

    def copy(self) -> "ChangePointPosterior":
        """The same posterior, independent counts (the likelihood tables are shared: same grid)."""
        twin = ChangePointPosterior.__new__(ChangePointPosterior)
        twin.__dict__.update(self.__dict__, n=self.n.copy(), k=self.k.copy(), _cache=None)
        return twin

    def joint(self) -> np.ndarray:
        """P(c, before-rate, after-rate | data), shape (N-1, m, m), c = 1..N-1 along axis 0
        (an explicit table: for sampling whole hypotheses, e.g. unknown outcomes of probes in flight)."""
        cn, ck = np.concatenate([[0], np.cumsum(self.n)]), np.concatenate([[0], np.cumsum(self.k)])
        c = np.arange(self.c_first, self.c_last + 1)
        lb = _rate_loglik(ck[c], cn[c], self.rates)
        la = _rate_loglik(ck[-1] - ck[c], cn[-1] - cn[c], self.rates)
        log_joint = lb[:, :, None] + la[:, None, :]
        table = np.exp(log_joint - log_joint.max()) * self.pair[None, :, :]
        return table / table.sum()

    def marginal(self) -> np.ndarray:
        """P(change at item i) for i = 0..N-1 (item 0 always 0); with ``edges``, i = 0..N (N: no
        change within the items)."""
        m = self.rate_marginals()[0].sum(1)
        return m if self.edges else np.concatenate([[0.0], m])

    def binomial_table(self, n_requests: int) -> np.ndarray:
        """P(k | rate) for k = 0..n, one row per grid rate (cached per n)."""
        lik = self._lik.get(n_requests)
        if lik is None:
            lik = self._lik[n_requests] = stats.binom.pmf(np.arange(n_requests + 1)[None, :],
                                                          n_requests, self.rates[:, None])
        return lik

    def information_gain(self, n_requests: int) -> np.ndarray:
        """Expected information (bits) about c from a probe of n requests on each item."""
        m_before, m_after = self.rate_marginals()
        return information_gain_of(m_before[None], m_after[None], self.binomial_table(n_requests),
                                   c_first=self.c_first)[0]

    def information_gain_with(self, extra_n: np.ndarray, extra_k: np.ndarray,
                              n_requests: int) -> np.ndarray:
        """``information_gain`` after adding each row of (extra_n, extra_k) (shape (F, N)) to the
        counts: F hypothetical futures at once, shape (F, N)."""
        before, after = rate_marginals_of(self.rates, self.pair, self.n[None] + extra_n,
                                          self.k[None] + extra_k, edges=self.edges)
        return information_gain_of(before, after, self.binomial_table(n_requests),
                                   c_first=self.c_first)


def rate_marginals_of(rates: np.ndarray, pair: np.ndarray, n: np.ndarray,
                      k: np.ndarray, *, edges: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``ChangePointPosterior.rate_marginals`` for F count vectors at once: n, k of shape (F, N);
    returns two (F, N-1, m) arrays ((F, N+1, m) with ``edges``: c = 0..N)."""
    cn = np.concatenate([np.zeros((n.shape[0], 1), n.dtype), np.cumsum(n, 1)], 1)
    ck = np.concatenate([np.zeros((k.shape[0], 1), k.dtype), np.cumsum(k, 1)], 1)
    c = np.arange(0, n.shape[1] + 1) if edges else np.arange(1, n.shape[1])

    def loglik(kk: np.ndarray, nn: np.ndarray) -> np.ndarray:  # (F, N-1, m), up to a constant
        return special.xlogy(kk[..., None], rates) + special.xlog1py((nn - kk)[..., None], -rates)

    lb = loglik(ck[:, c], cn[:, c])
    la = loglik(ck[:, -1:] - ck[:, c], cn[:, -1:] - cn[:, c])
    mb, ma = lb.max(2, keepdims=True), la.max(2, keepdims=True)  # finite: rates > 0 exist
    eb, ea = np.exp(lb - mb), np.exp(la - ma)
    scale = np.exp(mb + ma - (mb + ma).max(1, keepdims=True))
    before = eb * (ea @ pair.T) * scale
    after = ea * (eb @ pair) * scale
    total = before.sum((1, 2), keepdims=True)
    return before / total, after / total


def information_gain_of(m_before: np.ndarray, m_after: np.ndarray, lik: np.ndarray, *,
                        c_first: int = 1) -> np.ndarray:
    """Expected bits about c from one probe on each item, for F posteriors at once: the rate
    marginals are (F, C, m) over c = c_first .. c_first + C - 1 (C = N-1 from 1, or N+1 from 0
    with edges), ``lik`` is P(k | rate) (m, n+1); returns (F, N)."""
    wc = m_before.sum(2)  # P(c), (F, N-1)
    q_before, q_after = m_before @ lik, m_after @ lik  # P(c, k) by the probed item's regime

    def cond_entropy(q: np.ndarray) -> np.ndarray:  # -sum_k P(c,k) log P(k|c); 0 where P(c) = 0
        given = np.divide(q, wc[..., None], out=np.ones_like(q), where=wc[..., None] > 0)
        return -special.xlogy(q, given).sum(2)

    h_before, h_after = cond_entropy(q_before), cond_entropy(q_after)

    def prefix(a: np.ndarray) -> np.ndarray:  # prefix[:, j] = sum over c <= j (first j rows)
        return np.concatenate([np.zeros((a.shape[0], 1) + a.shape[2:]), np.cumsum(a, axis=1)], 1)

    # item j is "after" iff c <= j: the first j + 1 - c_first rows of c
    n_items = m_before.shape[1] + 2 * c_first - 1
    cols = np.arange(n_items) + 1 - c_first
    pk = (prefix(q_after) + (q_before.sum(1, keepdims=True) - prefix(q_before)))[:, cols]
    h_k_given_c = (prefix(h_after) + (h_before.sum(1, keepdims=True) - prefix(h_before)))[:, cols]
    h_k = -special.xlogy(pk, pk).sum(2)
    return np.maximum(h_k - h_k_given_c, 0.0) / math.log(2)
