"""Batched Bayesian bisection: which probes to start when several workers are free at once.

What it does: ``BatchedSearch`` is the state of a Bayesian bisection whose probes run
concurrently: the posterior over the change location (``statescope.bisect.model``) built from the
probes that have *finished*, plus the probes still in flight. ``choose(n_free)`` fills the free
workers greedily by expected information: each pick maximises the information its probe is
expected to add *given* the probes already in flight or picked, whose outcomes are unknown --
estimated by averaging the single-probe information over ``fantasies`` joint outcomes of those
probes drawn from the posterior predictive (whole hypotheses (c, before-rate, after-rate) are drawn
from ``ChangePointPosterior.joint``, so outcomes of probes in flight are correlated as they should
be). The same item may be picked twice (two seeds of one build). The draws are seeded from the
state itself, so a choice is a function of (finished counts, probes in flight) and a resumed
driver makes the same one. The posterior depends only on the summed counts per item, so it is
the same whatever order results arrive in. ``exact_batch_information`` computes I(c; K_1..K_B)
by enumerating outcomes (small batches only), the yardstick the greedy choice is tested against.

What it deliberately does not do: run probes (``statescope.cluster.bisect`` on Ray,
``statescope.cluster.sim`` on a simulated clock), or model more than one change.
"""
from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
from scipy import special, stats

from statescope.bisect.model import ChangePointPosterior, RatePrior
from statescope.errors import InputError

MIN_GAIN_BITS = 1e-9  # below this a probe tells nothing (the sequential search's threshold)
EXACT_OUTCOMES = 1000  # joint outcomes of the probes in flight enumerated exactly up to this
CHUNK = 512  # hypotheses or outcomes per vectorised step (bounds memory)


@dataclass
class Pick:
    """One probe chosen for a free worker: the item and the information it was expected to add."""
    index: int
    gain_bits: float


@dataclass
class BatchedSearch:
    """A Bayesian bisection with probes in flight; stop rules as ``statescope.bisect.bayesian_bisect``."""
    n_items: int
    mode: str = "regression"
    requests_per_probe: int = 20
    confidence: float = 0.95
    budget: int | None = None
    prior: RatePrior | None = None
    fantasies: int = 512
    min_gain_bits: float = MIN_GAIN_BITS  # a free worker stays idle rather than run a probe worth less
    in_flight: dict[str, int] = field(default_factory=dict)  # probe token -> item index
    skipped: set[int] = field(default_factory=set)
    used: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.requests_per_probe, int) or self.requests_per_probe < 1:
            raise InputError(f"requests_per_probe={self.requests_per_probe!r}: expected an integer >= 1")
        if not 0 < self.confidence < 1:
            raise InputError(f"confidence={self.confidence!r}: expected a probability in (0, 1)")
        if not isinstance(self.fantasies, int) or self.fantasies < 1:
            raise InputError(f"fantasies={self.fantasies!r}: expected an integer >= 1")
        self.posterior = ChangePointPosterior(self.n_items, self.mode, self.prior)

    # -- results ------------------------------------------------------------------------------
    def start(self, token: str, index: int) -> None:
        if token in self.in_flight or not 0 <= index < self.n_items:
            raise InputError(f"BatchedSearch.start({token!r}, {index}): expected a new token and "
                             f"0 <= index < {self.n_items}")
        self.in_flight[token] = index

    def observe(self, token: str | None, index: int, n: int, k: int) -> None:
        """A finished probe's counts (``token`` None: a result from before, e.g. a resumed run)."""
        if token is not None:
            if self.in_flight.get(token) != index:
                raise InputError(f"BatchedSearch.observe: probe {token!r} of item {index} is not in flight")
            del self.in_flight[token]
        self.posterior.add(index, n, k)
        self.used += n

    def abandon(self, token: str, *, skip_item: bool) -> None:
        """A probe that gave no counts (cancelled, or its build failed: ``skip_item``)."""
        index = self.in_flight.pop(token)
        if skip_item:
            self.skipped.add(index)

    # -- decisions ----------------------------------------------------------------------------
    def marginal(self) -> np.ndarray:
        return self.posterior.marginal()

    def stop_reason(self) -> str | None:
        """Why no new probe may start: 'confident', 'budget', or None."""
        if self.marginal().max() >= self.confidence:
            return "confident"
        if self.budget is not None and \
                self.used + self.requests_per_probe * (len(self.in_flight) + 1) > self.budget:
            return "budget"
        return None

    def choose(self, n_free: int) -> list[Pick]:
        """Up to ``n_free`` probes to start now, each the best given those in flight and picked
        before it; fewer when the stop rules bite or no probe is informative."""
        picks: list[Pick] = []
        if self.marginal().max() >= self.confidence:
            return picks
        pending = list(self.in_flight.values())
        for _ in range(max(0, n_free)):
            if self.budget is not None and \
                    self.used + self.requests_per_probe * (len(pending) + 1) > self.budget:
                break
            gain = conditional_information(self.posterior, pending, self.requests_per_probe,
                                           self.fantasies)
            gain[sorted(self.skipped)] = -1.0
            j = int(np.argmax(gain))
            if gain[j] < max(self.min_gain_bits, MIN_GAIN_BITS):
                break
            picks.append(Pick(j, float(gain[j])))
            pending.append(j)
        return picks


def _seed_for(post: ChangePointPosterior, pending: list[int]) -> int:
    """A seed that is a function of the state: the same state makes the same choice."""
    text = f"{post.n.tolist()}|{post.k.tolist()}|{sorted(pending)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _hypotheses(post: ChangePointPosterior) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(weights, c, before-rate index, after-rate index) of every hypothesis with mass > 0."""
    joint = post.joint()
    keep = np.flatnonzero(joint.ravel() > 1e-14 * joint.max())
    c0, b, a = np.unravel_index(keep, joint.shape)
    w = joint.ravel()[keep]
    return w / w.sum(), c0 + 1, b, a  # axis 0 of the joint is c = 1..N-1


def _mean_gain(post: ChangePointPosterior, extra_n: np.ndarray, extra_k: np.ndarray,
               weights: np.ndarray, n_requests: int) -> np.ndarray:
    total = np.zeros(post.n_items)
    for lo in range(0, len(weights), CHUNK):
        hi = lo + CHUNK
        gains = post.information_gain_with(extra_n[lo:hi], extra_k[lo:hi], n_requests)
        total += weights[lo:hi] @ gains
    return total


def conditional_information(post: ChangePointPosterior, pending: list[int], n_requests: int,
                            fantasies: int = 512) -> np.ndarray:
    """Expected bits about c from one more probe on each item, given probes ``pending`` (items,
    ``n_requests`` each) whose outcomes are not known yet: E over their joint outcome of the
    single-probe information. Exact (every outcome, weighted by its posterior predictive
    probability) when the pending probes have at most ``EXACT_OUTCOMES`` joint outcomes (probes of
    one item add up: only per-item totals matter); else the mean over ``fantasies`` outcomes drawn
    with whole hypotheses (c, before-rate, after-rate), so pending outcomes stay correlated."""
    if not pending:
        return post.information_gain(n_requests)
    items = sorted(set(pending))
    totals = [n_requests * pending.count(i) for i in items]
    w, change, b, a = _hypotheses(post)
    after = np.array(items)[None, :] >= change[:, None]  # (H, items): item in the after regime
    rate_index = np.where(after, a[:, None], b[:, None])
    n_outcomes = math.prod(t + 1 for t in totals)
    extra_n = np.zeros(post.n_items, dtype=np.int64)
    extra_n[items] = totals
    if n_outcomes <= EXACT_OUTCOMES:
        grid = np.array(list(itertools.product(*(range(t + 1) for t in totals))))  # (V, items)
        prob = np.zeros(len(grid))
        tables = [post.binomial_table(t) for t in totals]
        for lo in range(0, len(w), CHUNK):  # P(outcome) = sum_h w_h prod_i Binom(k_i; rate_i(h))
            part = w[lo:lo + CHUNK, None] * np.ones((1, len(grid)))
            for j, table in enumerate(tables):
                part *= table[rate_index[lo:lo + CHUNK, j]][:, grid[:, j]]
            prob += part.sum(0)
        extra_k = np.zeros((len(grid), post.n_items), dtype=np.int64)
        extra_k[:, items] = grid
        return _mean_gain(post, np.broadcast_to(extra_n, extra_k.shape), extra_k,
                          prob / prob.sum(), n_requests)
    rng = np.random.default_rng(_seed_for(post, pending))
    draws = rng.choice(len(w), size=fantasies, p=w)
    extra_k = np.zeros((fantasies, post.n_items), dtype=np.int64)
    extra_k[:, items] = rng.binomial(np.array(totals)[None, :], post.rates[rate_index[draws]])
    return _mean_gain(post, np.broadcast_to(extra_n, extra_k.shape), extra_k,
                      np.full(fantasies, 1.0 / fantasies), n_requests)


def exact_batch_information(post: ChangePointPosterior, items: list[int], n_requests: int) -> float:
    """I(c; K_1..K_B) in bits for probes of ``n_requests`` on ``items``, by enumerating outcomes."""
    outcomes = (n_requests + 1) ** len(items)
    if not items or outcomes > 2_000_000:
        raise InputError(f"exact_batch_information: expected 1 <= (n+1)^B <= 2e6 outcomes, got "
                         f"{outcomes} (B={len(items)}, n={n_requests})")
    joint = post.joint()  # (c, before, after)
    pmf = post.binomial_table(n_requests)  # (m, n+1)

    def outer(rows: list[int]) -> np.ndarray:  # (m, V): prod over these probes of P(k_i | rate)
        table = np.ones((pmf.shape[0], 1))
        for _ in rows:
            table = (table[:, :, None] * pmf[:, None, :]).reshape(pmf.shape[0], -1)
        return table

    p_c = joint.sum((1, 2))
    h_k_given_c, p_k = 0.0, np.zeros(outcomes)
    for c0 in range(joint.shape[0]):
        if p_c[c0] <= 0:
            continue
        before = [j for j, i in enumerate(items) if i < c0 + 1]
        after = [j for j, i in enumerate(items) if i >= c0 + 1]
        # P(k_before, k_after | c) = T_before^T . P(rates | c) . T_after, then back to item order
        table = outer(before).T @ (joint[c0] / p_c[c0]) @ outer(after)
        shape = (n_requests + 1,) * len(items)
        table = table.reshape(shape).transpose(np.argsort(before + after)).ravel()
        h_k_given_c += p_c[c0] * -special.xlogy(table, table).sum()
        p_k += p_c[c0] * table
    h_k = -special.xlogy(p_k, p_k).sum()
    return max(float(h_k - h_k_given_c), 0.0) / math.log(2)


def best_batch(post: ChangePointPosterior, size: int, n_requests: int) -> tuple[tuple[int, ...], float]:
    """The batch of ``size`` items (repeats allowed) with the most exact information (small N only)."""
    best, best_bits = (), -1.0
    for items in itertools.combinations_with_replacement(range(post.n_items), size):
        bits = exact_batch_information(post, list(items), n_requests)
        if bits > best_bits:
            best, best_bits = items, bits
    return best, best_bits
