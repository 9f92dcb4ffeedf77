"""Tests for statescope.verdict.stats: the published figures, the SPRT stopping rule, and every verdict."""
from __future__ import annotations

import json
import math

import pytest
from scipy import stats as st

from statescope.errors import InputError, StatescopeError
from statescope.verdict.stats import (CONTROL_BROKEN, CORRUPTION_DETECTED, ENGINE_BROKEN,
                              GEOMETRY_NOT_EXERCISED, NO_EVIDENCE, SPRT, ArmSummary, ArmVerdict,
                              clopper_pearson, decide, fisher_exact_one_sided,
                              fisher_exact_two_sided, requests_for_detection, two_arm_sample_size)


# -- intervals and tests ------------------------------------------------------------------------
def test_clopper_pearson_16_of_288():
    lo, hi = clopper_pearson(16, 288)
    assert lo == pytest.approx(0.0321, abs=5e-4)
    assert hi == pytest.approx(0.0887, abs=5e-4)
    # Exactness: at each bound the tail probability of the observed count is 2.5%.
    assert st.binom.sf(15, 288, lo) == pytest.approx(0.025, rel=1e-6)
    assert st.binom.cdf(16, 288, hi) == pytest.approx(0.025, rel=1e-6)


def test_clopper_pearson_edges_and_bad_input():
    assert clopper_pearson(0, 10)[0] == 0.0
    assert clopper_pearson(10, 10)[1] == 1.0
    lo90, hi90 = clopper_pearson(16, 288, conf=0.90)
    lo95, hi95 = clopper_pearson(16, 288)
    assert lo95 < lo90 < hi90 < hi95
    for bad in [(5, 3), (-1, 3), (1, 0)]:
        with pytest.raises(InputError):
            clopper_pearson(*bad)
    with pytest.raises(InputError, match="conf"):
        clopper_pearson(1, 3, conf=1.5)


def test_fisher_16_of_288_vs_0_of_288():
    p2 = fisher_exact_two_sided(16, 288, 0, 288)
    p1 = fisher_exact_one_sided(16, 288, 0, 288)
    assert p2 == pytest.approx(2.4635e-5, rel=1e-3)  # measured: 2.4635e-05
    assert p1 == pytest.approx(1.2318e-5, rel=1e-3)
    # One-sided p for k vs 0 is C(288, 16) / C(576, 16): every failure falls in the trigger arm.
    assert p1 == pytest.approx(math.comb(288, 16) / math.comb(576, 16), rel=1e-9)
    # Direction matters for the one-sided test.
    assert fisher_exact_one_sided(0, 288, 16, 288) == pytest.approx(1.0)


def test_requests_for_detection():
    assert requests_for_detection(16 / 288) == 53
    # 0.056 itself is just past the boundary: 1 - 0.944**52 = 0.95005.
    assert requests_for_detection(0.056) == 52
    for rate in (0.056, 16 / 288, 0.01, 0.3):
        n = requests_for_detection(rate)
        assert 1 - (1 - rate) ** n >= 0.95 > 1 - (1 - rate) ** (n - 1)
    assert requests_for_detection(1.0) == 1
    with pytest.raises(InputError):
        requests_for_detection(0.0)


def test_two_arm_sample_size_normal_and_exact():
    # Unpooled normal approximation, one-sided alpha 0.05, power 0.9: 144.36 -> 145 per arm.
    n = two_arm_sample_size(0.056, 0.0, alpha=0.05, power=0.9)
    assert n == 145
    assert 140 <= n <= 150
    # Exact Fisher power with that n reaches the target, and the exact search agrees in scale.
    n_exact = two_arm_sample_size(0.056, 0.0, alpha=0.05, power=0.9, method="exact")
    assert 120 <= n_exact <= 170
    # Stricter alpha or more power needs more units.
    assert two_arm_sample_size(0.056, 0.0, alpha=0.01) > n
    assert two_arm_sample_size(0.056, 0.0, power=0.95) > n
    with pytest.raises(InputError):
        two_arm_sample_size(0.01, 0.05)
    with pytest.raises(InputError, match="method"):
        two_arm_sample_size(0.056, 0.0, method="magic")


def test_exact_sample_size_has_the_claimed_power():
    from statescope.verdict.stats import _fisher_power
    n = two_arm_sample_size(0.056, 0.0, method="exact")
    assert _fisher_power(n, 0.056, 0.0, 0.05) >= 0.9 > _fisher_power(n - 1, 0.056, 0.0, 0.05)
    # With p0 = 0 the critical count k is fixed, so power is P(Bin(n, p1) >= k); check one value.
    k = next(k for k in range(1, 50) if math.comb(n, k) / math.comb(2 * n, k) <= 0.05)
    assert _fisher_power(n, 0.056, 0.0, 0.05) == pytest.approx(st.binom.sf(k - 1, n, 0.056))


@pytest.mark.parametrize("n, p1, p0", [(40, 0.2, 0.05), (60, 0.1, 0.0), (30, 0.5, 0.3)])
def test_fisher_power_matches_brute_force(n, p1, p0):
    from statescope.verdict.stats import _fisher_power
    power = 0.0
    for k2 in range(n + 1):
        w = st.binom.pmf(k2, n, p0)
        if w < 1e-12:
            continue
        for k1 in range(n + 1):  # smallest k1 that scipy's own Fisher test rejects
            if st.fisher_exact([[k1, n - k1], [k2, n - k2]], alternative="greater").pvalue <= 0.05:
                power += w * st.binom.sf(k1 - 1, n, p1)
                break
    assert _fisher_power(n, p1, p0, 0.05) == pytest.approx(power, rel=1e-9)


# -- SPRT -----------------------------------------------------------------------------------------
def test_sprt_bad_arm_stops_at_first_failure():
    s = SPRT(p0=0.001, p1=0.056, alpha=0.05, beta=0.05)
    assert s.update(False) == "continue"
    assert s.update(True) == "accept_h1"
    assert (s.n, s.k) == (2, 1)
    assert s.llr >= s.upper
    with pytest.raises(InputError, match="already stopped"):
        s.update(False)


def test_sprt_good_arm_accepts_h0_after_clean_run():
    s = SPRT(p0=0.001, p1=0.056, alpha=0.05, beta=0.05)
    expected = math.ceil(math.log(0.05 / 0.95) / math.log(0.944 / 0.999))
    assert expected == 52  # 2.9444 / 0.056629 = 51.996
    decisions = [s.update(False) for _ in range(expected)]
    assert decisions[:-1] == ["continue"] * (expected - 1)
    assert decisions[-1] == "accept_h0"
    assert s.n == expected == s.clean_observations_to_accept_h0()
    assert 50 <= s.n <= 56
    assert s.bounds == pytest.approx((-math.log(19), math.log(19)))


def test_sprt_mixed_sequence_and_bad_params():
    # With a higher p0 one failure is not enough to accept H1.
    s = SPRT(p0=0.02, p1=0.2, alpha=0.05, beta=0.05)
    assert s.update(True) == "continue"
    assert s.update(True) == "accept_h1"
    with pytest.raises(InputError):
        SPRT(p0=0.1, p1=0.05)


# -- verdicts -------------------------------------------------------------------------------------
def _trigger(**kw) -> ArmSummary:
    base = dict(name="trigger", n_units=288, n_failed_units=16, prefix_cache_queries=1000,
                prefix_cache_hits=400, spec_draft_tokens=5000, spec_accepted_tokens=2000,
                resolved={"enable_prefix_caching": True, "num_speculative_tokens": 2,
                          "async_scheduling": True},
                expect_prefix_cache=True, expect_spec=True, n_requests=288)
    base.update(kw)
    return ArmSummary(**base)


def _control(**kw) -> ArmSummary:
    base = dict(name="control", n_units=288, n_failed_units=0,
                resolved={"enable_prefix_caching": True, "num_speculative_tokens": 2,
                          "async_scheduling": False}, n_requests=288)
    base.update(kw)
    return ArmSummary(**base)


def test_decide_corruption_detected():
    v = decide(_trigger(), _control())
    assert v.outcome == CORRUPTION_DETECTED
    assert v.fisher_p == pytest.approx(fisher_exact_one_sided(16, 288, 0, 288))
    assert v.trigger_ci == clopper_pearson(16, 288)
    assert v.trigger_rate == pytest.approx(16 / 288)
    assert all(g.passed for g in v.guards)
    assert "p=1.23e-05" in v.explanation
    assert v.unit == "request" and "independent" in v.explanation


def test_decide_no_evidence_states_power():
    v = decide(_trigger(n_failed_units=1), _control())
    assert v.outcome == NO_EVIDENCE
    upper = clopper_pearson(1, 288)[1]
    assert f"{upper:.2%}" in v.explanation
    assert v.fisher_p > 0.01


def test_decide_engine_broken_takes_precedence():
    v = decide(_trigger(n_engine_errors=3), _control(n_failed_units=200))
    assert v.outcome == ENGINE_BROKEN
    assert not next(g for g in v.guards if g.name == "engine_ok").passed
    v0 = decide(_trigger(n_units=0, n_failed_units=0), _control())
    assert v0.outcome == ENGINE_BROKEN and v0.fisher_p is None and v0.trigger_ci is None


def test_decide_control_broken():
    v = decide(_trigger(prefix_cache_hits=0), _control(n_failed_units=20))
    assert v.outcome == CONTROL_BROKEN  # checked before the geometry guard
    # The control rate exactly at the limit is still acceptable.
    assert decide(_trigger(), _control(n_failed_units=5, n_units=100)).outcome != CONTROL_BROKEN
    assert decide(_trigger(), _control(n_failed_units=6, n_units=100)).outcome == CONTROL_BROKEN


def test_decide_same_configuration_arms_are_control_broken():
    t = _trigger()
    v = decide(t, _control(resolved=dict(t.resolved)))
    assert v.outcome == CONTROL_BROKEN
    assert "same configuration" in v.explanation


@pytest.mark.parametrize("kw, needle", [
    (dict(prefix_cache_hits=0), "0 hits"),
    (dict(spec_accepted_tokens=0), "0 accepted"),
    (dict(resolved={"enable_prefix_caching": False, "num_speculative_tokens": 2}),
     "enable_prefix_caching=False"),
    (dict(resolved={"enable_prefix_caching": True, "num_speculative_tokens": 0}),
     "num_speculative_tokens=0"),
    (dict(resolved={"enable_prefix_caching": True, "mamba_cache_mode": "none",
                    "num_speculative_tokens": 2}), "mamba_cache_mode"),
])
def test_decide_geometry_not_exercised(kw, needle):
    v = decide(_trigger(**kw), _control())
    assert v.outcome == GEOMETRY_NOT_EXERCISED
    assert needle in v.explanation


def test_decide_unexpected_features_are_not_required():
    v = decide(_trigger(expect_prefix_cache=False, expect_spec=False, prefix_cache_hits=0,
                        spec_accepted_tokens=0), _control())
    assert v.outcome == CORRUPTION_DETECTED


def test_decide_alpha_threshold():
    # 5/100 vs 0/100: one-sided p = C(100,5)/C(200,5) ~ 0.030 -> significant at 0.05, not at 0.01.
    t, c = _trigger(n_units=100, n_failed_units=5), _control(n_units=100)
    assert decide(t, c, alpha=0.05).outcome == CORRUPTION_DETECTED
    assert decide(t, c, alpha=0.01).outcome == NO_EVIDENCE


def test_decide_bad_input():
    with pytest.raises(InputError, match="unit"):
        decide(_trigger(unit="engine_lifetime"), _control())
    with pytest.raises(InputError, match="unit"):
        decide(_trigger(unit="session"), _control(unit="session"))
    with pytest.raises(InputError, match="n_failed_units"):
        decide(_trigger(n_failed_units=300), _control())
    with pytest.raises(InputError, match="prefix_cache_hits"):
        decide(_trigger(prefix_cache_hits=-1), _control())
    assert issubclass(InputError, StatescopeError) and issubclass(InputError, ValueError)


def test_decide_accepts_numpy_counts():
    import numpy as np
    v = decide(_trigger(n_units=np.int64(288), n_failed_units=np.int64(16),
                        prefix_cache_hits=np.int64(4)), _control())
    assert v.outcome == CORRUPTION_DETECTED
    d = v.to_dict()
    assert d["trigger"]["n_units"] == 288 and isinstance(d["trigger"]["n_units"], int)


def test_decide_engine_lifetime_unit():
    v = decide(_trigger(unit="engine_lifetime", n_units=10, n_failed_units=8),
               _control(unit="engine_lifetime", n_units=10))
    assert v.outcome == CORRUPTION_DETECTED and v.unit == "engine_lifetime"
    assert "engine_lifetime is one independent unit" in v.explanation


def test_verdict_to_dict_round_trips_through_json():
    for v in (decide(_trigger(), _control()), decide(_trigger(n_units=0, n_failed_units=0), _control())):
        d = v.to_dict()
        assert json.loads(json.dumps(d)) == d
        assert d["outcome"] == v.outcome
        assert d["trigger"]["n_failed_units"] == v.trigger.n_failed_units
        assert [g["name"] for g in d["guards"]] == [g.name for g in v.guards]


def test_verdict_html():
    v = decide(_trigger(name="<trig>"), _control())
    h = v._repr_html_()
    assert CORRUPTION_DETECTED in h and "#c62828" in h
    assert "16/288" in h and "0/288" in h
    assert "&lt;trig&gt;" in h and "<trig>" not in h
    assert "prefix_cache_engaged" in h
    g = decide(_trigger(prefix_cache_hits=0), _control())._repr_html_()
    assert GEOMETRY_NOT_EXERCISED in g and "FAIL" in g
    assert isinstance(v, ArmVerdict)


def test_sequential_decision_replays_units_in_order():
    from statescope.verdict.reproduce import sequential_decision

    clean = [{"episode": f"e{i}", "step": 0, "failed": False, "lifetime": 0} for i in range(60)]
    seq = sequential_decision(clean, "episode")
    assert seq["decision"] == "accept_h0" and seq["units_used"] == 52
    bad = clean[:3] + [{"episode": "x", "step": 0, "failed": True, "lifetime": 0}] + clean[3:]
    seq = sequential_decision(bad, "episode")
    assert seq["decision"] == "accept_h1" and seq["units_used"] == 4 and seq["failures"] == 1


def test_median_interval_order_statistics():
    from statescope.verdict.stats import median_interval

    lo, hi, cov = median_interval(list(range(1, 11)))  # n=10: [x_(2), x_(9)], 97.9 %
    assert (lo, hi) == (2.0, 9.0) and abs(cov - 0.978515625) < 1e-9
    lo, hi, cov = median_interval([5, 1, 4, 2, 3, 6])  # n=6: only min..max, 96.9 %
    assert (lo, hi) == (1.0, 6.0) and cov > 0.95
    with pytest.raises(InputError, match="5 values"):
        median_interval([1, 2, 3, 4, 5])
