"""Bayesian bisection: the posterior algebra against brute force, and seeded simulations against
plain bisection on flaky oracles (5.6% failure rate on one side of the change, 0 on the other)."""
from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from scipy import stats

from statescope.bisect import (ChangePointPosterior, FlakyOracle, RatePrior, bayesian_bisect,
                               bisect_settings, compare_methods, plain_bisect)
from statescope.errors import InputError

SEEDS = range(200)
BUDGET = 2000  # total requests a Bayesian run may spend


def _brute_force_joint(post: ChangePointPosterior) -> np.ndarray:
    """P(c, before-rate, after-rate | data) by explicit enumeration (no prefix sums, no matmuls)."""
    rates, pair = post.rates, post.pair
    out = np.zeros((post.n_items - 1, rates.size, rates.size))
    for c, b, a in itertools.product(range(1, post.n_items), range(rates.size), range(rates.size)):
        if pair[b, a] == 0:
            continue
        lik = 1.0
        for i in range(post.n_items):
            p = rates[b] if i < c else rates[a]
            lik *= stats.binom.pmf(post.k[i], post.n[i], p)
        out[c - 1, b, a] = pair[b, a] * lik
    return out / out.sum()


@pytest.mark.parametrize("mode", ["regression", "fix"])
def test_posterior_matches_brute_force(mode):
    post = ChangePointPosterior(5, mode, RatePrior(grid_size=8))
    for i, n, k in ((1, 10, 0), (2, 6, 1), (3, 12, 0), (4, 3, 2)):
        post.add(i, n, k)
    joint = _brute_force_joint(post)
    before, after = post.rate_marginals()
    np.testing.assert_allclose(before, joint.sum(2), atol=1e-12)
    np.testing.assert_allclose(after, joint.sum(1), atol=1e-12)
    np.testing.assert_allclose(post.marginal()[1:], joint.sum((1, 2)), atol=1e-12)


def test_information_gain_matches_brute_force():
    post = ChangePointPosterior(6, "regression", RatePrior(grid_size=8))
    post.add(4, 10, 1)
    post.add(2, 10, 0)
    n = 7
    prior_c = post.marginal()

    def entropy(p):
        p = p[p > 0]
        return -(p * np.log2(p)).sum()

    for j in range(6):
        expected_h = 0.0
        for k in range(n + 1):
            trial = ChangePointPosterior(6, "regression", RatePrior(grid_size=8))
            trial.n, trial.k = post.n.copy(), post.k.copy()
            # P(k) from the brute-force joint: the rate at item j is the after-rate iff c <= j
            joint = _brute_force_joint(post)
            pk = sum(joint[c - 1, b, a] * stats.binom.pmf(k, n, post.rates[a if c <= j else b])
                     for c in range(1, 6) for b in range(post.rates.size)
                     for a in range(post.rates.size))
            trial.add(j, n, k)
            expected_h += pk * entropy(trial.marginal())
        assert post.information_gain(n)[j] == pytest.approx(entropy(prior_c) - expected_h, abs=1e-9)
    # Item 5 is always "after": probing it only sharpens the after-rate, which is worth little here.
    assert post.information_gain(n)[5] < post.information_gain(n)[3]


def test_information_gain_is_finite_when_locations_underflow():
    post = ChangePointPosterior(10)
    for i in range(10):  # overwhelming evidence: every other location has probability 0.0
        post.add(i, 10_000, 3_000 if i >= 5 else 0)
    assert post.marginal()[5] == 1.0
    gain = post.information_gain(20)
    assert np.all(np.isfinite(gain)) and gain.max() < 1e-6


def test_one_failure_is_strong_evidence_a_clean_probe_weak():
    post = ChangePointPosterior(3, "regression")
    post.add(1, 20, 1)  # item 1 failed once: it is (almost surely) after the change
    assert post.marginal()[1] > 0.85
    clean = ChangePointPosterior(3, "regression")
    clean.add(1, 20, 0)  # 20 clean requests only make "before" somewhat more likely
    assert 0.5 < clean.marginal()[2] < 0.8
    many = ChangePointPosterior(3, "regression")
    many.add(1, 200, 0)  # ... and 200 of them much more
    assert many.marginal()[2] > 0.95


def _simulate(mode: str, rate_before: float, rate_after: float) -> dict:
    rows = {r["method"]: r for r in compare_methods(
        n_items=64, rate_before=rate_before, rate_after=rate_after, mode=mode,
        requests_per_probe=20, budget=BUDGET, seeds=SEEDS)}
    bayes, plain = rows["bayesian n=20"], rows["plain n=20"]
    print(f"\n{mode} {rate_before:.3f}->{rate_after:.3f}, 64 builds, 20 requests/probe, "
          f"{len(SEEDS)} seeds: bayesian accuracy {bayes['accuracy']:.3f} mean requests "
          f"{bayes['mean_requests']:.0f} (max {bayes['max_requests']}); plain accuracy "
          f"{plain['accuracy']:.3f} mean requests {plain['mean_requests']:.0f}")
    return {"bayes": bayes, "plain": plain}


def test_simulation_regression_bayesian_beats_plain():
    r = _simulate("regression", 0.0, 0.056)
    assert r["bayes"]["accuracy"] >= 0.95
    assert r["bayes"]["max_requests"] <= BUDGET
    assert r["plain"]["accuracy"] <= r["bayes"]["accuracy"] - 0.3


def test_simulation_find_fix_bayesian_beats_plain():
    r = _simulate("fix", 0.056, 0.0)
    assert r["bayes"]["accuracy"] >= 0.95
    assert r["bayes"]["max_requests"] <= BUDGET
    assert r["plain"]["accuracy"] <= r["bayes"]["accuracy"] - 0.3


def test_deterministic_oracle_takes_about_log2_probes():
    oracle = FlakyOracle(64, 37, 0.0, 1.0)
    r = bayesian_bisect(range(64), oracle, requests_per_probe=5)
    assert r.answer_index == 37 and r.stopped == "confident"
    assert len(r.probes) <= math.ceil(math.log2(63)) + 2
    p = plain_bisect(range(64), FlakyOracle(64, 37, 0.0, 1.0), requests_per_probe=5)
    assert p.answer_index == 37 and len(p.probes) <= 6


def test_budget_stops_and_is_respected():
    r = bayesian_bisect(range(64), FlakyOracle(64, 10, 0.0, 0.02, seed=3), requests_per_probe=20,
                        budget=100)
    assert r.stopped == "budget" and r.requests_used <= 100 and len(r.probes) == 5
    assert r.confidence < 0.95


def test_observations_already_measured_are_used():
    # 16/288 failures measured on the last build tell the model the bad rate before any probe.
    seen = bayesian_bisect(range(16), FlakyOracle(16, 5, 0.0, 0.056, seed=1), requests_per_probe=20,
                           observations={15: (288, 16)}, max_probes=0)
    assert seen.probes == [] and seen.stopped == "max_probes"
    with pytest.raises(InputError):
        bayesian_bisect(range(4), lambda i, n: 0, observations={9: (10, 0)})


def test_settings_bisection_finds_threshold():
    values = [1, 2, 4, 8, 16, 32, 64, 128]
    rng = np.random.default_rng(0)

    def probe(value, n):  # planted: failures only from max_num_seqs >= 16, at 10% per request
        return int(rng.binomial(n, 0.1 if value >= 16 else 0.0))

    r = bisect_settings("max_num_seqs", values, probe, requests_per_probe=20, budget=1000)
    assert r.answer == "max_num_seqs=16" and r.confidence >= 0.95
    assert r.settings["axis"] == "max_num_seqs"
    with pytest.raises(InputError, match="increasing or decreasing"):
        bisect_settings("max_num_seqs", [1, 4, 2], probe)


def test_result_outputs():
    r = bayesian_bisect([f"b{i}" for i in range(12)], lambda b, n: n if int(b[1:]) >= 7 else 0,
                        requests_per_probe=3)
    assert r.answer == "b7"
    d = json.loads(json.dumps(r.to_dict()))
    assert d["answer"] == "b7" and len(d["posteriors"]) == len(r.probes)
    assert all(abs(sum(p) - 1) < 1e-9 for p in d["posteriors"])
    assert "b7" in r._repr_html_()
    fig = r.posterior_figure()
    assert len(fig.data[0].z) == len(r.probes) + 1  # prior + one row per probe


@pytest.mark.parametrize("call, match", [
    (lambda: bayesian_bisect([1], lambda i, n: 0), "at least 2"),
    (lambda: bayesian_bisect([1, 2], lambda i, n: 0, mode="up"), "mode"),
    (lambda: bayesian_bisect([1, 2, 3], lambda i, n: n + 1), "0 <= k <= n_done"),
    (lambda: bayesian_bisect([1, 2, 3], lambda i, n: 0, requests_per_probe=0), "requests_per_probe"),
    (lambda: RatePrior(bad_rate_min=2).grid(), "bad_rate_min"),
])
def test_bad_input(call, match):
    with pytest.raises(InputError, match=match):
        call()


def test_a_build_that_cannot_be_probed_is_skipped():
    from statescope.errors import EnvironmentBroken

    def make_probe(broken: set):
        oracle = FlakyOracle(32, 20, 0.0, 0.3, seed=2)

        def probe(i, n):
            if i in broken or not broken:  # empty set: the first item probed is the broken one
                broken.add(i)
                raise EnvironmentBroken(f"build {i}: install failed (test)")
            return oracle(i, n)
        return probe

    first: set = set()
    r = bayesian_bisect(range(32), make_probe(first), requests_per_probe=10, budget=1000)
    assert r.answer_index == 20 and r.stopped == "confident"
    [broken] = first
    assert list(r.skipped) == [str(broken)] and "install failed" in r.skipped[str(broken)]
    assert all(p.index != broken for p in r.probes) and f"skipped {broken}" in r._repr_html_()
    # The build just before the change cannot be probed: 19 and 20 cannot be told apart.
    r = bayesian_bisect(range(32), make_probe({19}), requests_per_probe=10, budget=1000)
    assert "19" in r.skipped and r.answer_index in (19, 20) and r.confidence < 0.95
    assert r.stopped in ("no informative probe", "budget")
