"""Right by default (issue 28), without an engine: the design's power, refusals before any engine
starts, one verdict per report, pooled seed sets, the exit status in every ``--help``, the one
override rule and ``statescope.cli.main`` as the entry function.

Every command here runs the real command line (``statescope.cli.main``) on real files; the
committed GPU results are the data of the pooled verdict.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys

import pytest

from statescope.engine.config import EngineConfig
from statescope.errors import InputError
from statescope.verdict.design import (best_p, critical_failures, detectable_rate, power_of,
                                       units_needed)
from statescope.verdict.rule import pool_summaries, secondary, split_seed_sets
from statescope.verdict.stats import (CONTROL_BROKEN, CORRUPTION_DETECTED, NO_EVIDENCE,
                                      ArmSummary, fisher_exact_one_sided)

# --- design power ---------------------------------------------------------------------------


def test_best_p_is_the_fisher_p_of_every_trigger_unit_failed():
    assert best_p(4, 4) == pytest.approx(1 / 70)  # the 0.0143: never below 0.01
    for n_t, n_c in ((4, 4), (5, 5), (8, 8), (6, 9)):
        assert best_p(n_t, n_c) == pytest.approx(fisher_exact_one_sided(n_t, n_t, 0, n_c))
    assert not power_of(4, 4, 0.01, "episode").can_answer
    assert power_of(5, 5, 0.01, "episode").can_answer  # 1/252


def test_critical_failures_and_detectable_rate_match_fisher():
    k = critical_failures(96, 96, 0.01)
    assert fisher_exact_one_sided(k, 96, 0, 96) < 0.01 <= fisher_exact_one_sided(k - 1, 96, 0, 96)
    assert k == 7  # 6/96 vs 0/96 is p = 0.0144: the seed set that needed pooling
    rate = detectable_rate(96, 96, 0.01, 0.9)
    from scipy import stats

    assert stats.binom.sf(k - 1, 96, rate) == pytest.approx(0.9, abs=1e-6)
    assert detectable_rate(4, 4, 0.01) is None


def test_units_needed_for_the_reported_rate():
    n = units_needed(16 / 288, 0.01, 0.9)
    from scipy import stats

    def power(m):
        return stats.binom.sf(critical_failures(m, m, 0.01) - 1, m, 16 / 288)
    assert power(n) >= 0.9 > power(n - 1)
    assert 150 < n < 220  # between the one-arm 53 and the normal approximation's 220


def test_design_summary_and_refusal_lines():
    d = power_of(8, 8, 0.01, "episode")
    line = d.summary()
    assert "8 trigger vs 8 control episodes" in line and "5.6%" in line
    assert f"{d.units_for_reference} episodes an arm" in line
    refusal = power_of(4, 4, 0.01, "episode").refusal("use --seeds 0:2")
    assert "p=0.0143" in refusal and "alpha=0.01" in refusal and ">= 5 episodes" in refusal
    assert refusal.endswith("use --seeds 0:2") and "\n" not in refusal


# --- refusals and sizing through the real command line, before any engine -----------------------

class _Ran:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(*args):
    """The real command line in this process (a fresh interpreter's torch import costs minutes
    on the loaded shared cores); stdout and stderr captured."""
    import contextlib
    import io

    from statescope.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return _Ran(rc, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("argv, fix", [
    (["--seeds", "0"], "--seeds 0:2"),  # 4 episodes an arm at 0.01
    (["--unit", "engine_lifetime"], "--episodes-per-lifetime"),  # one lifetime an arm
    (["--seeds", "0:2", "--alpha", "0.00001"], "--seeds 0:3"),
])
def test_a_design_that_cannot_answer_is_refused_before_any_engine(tmp_path, argv, fix):
    proc = _cli("reproduce", "--fault", "nan_conv", "--runs", str(tmp_path), *argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("statescope reproduce: the design cannot answer:")
    assert "best one-sided Fisher p=" in line and fix in line
    assert not list(tmp_path.iterdir()), "no run may start"


def test_the_default_design_sizes_itself():
    from statescope.cli.reproduce import seeds_that_can_answer

    assert seeds_that_can_answer("smoke", "episode", 0.01, None) == 2  # 8 episodes an arm: best p 7.8e-05
    assert seeds_that_can_answer("smoke", "request", 0.01, None) == 1
    assert seeds_that_can_answer("smoke", "engine_lifetime", 0.01, None) is None  # needs --episodes-per-lifetime


def test_seed_sets_need_seeds_and_split_evenly(tmp_path):
    assert split_seed_sets(list(range(48, 60)), 3) == [[48, 49, 50, 51], [52, 53, 54, 55],
                                                      [56, 57, 58, 59]]
    with pytest.raises(InputError, match="do not split into 5 equal sets"):
        split_seed_sets(list(range(12)), 5)
    proc = _cli("reproduce", "--seed-sets", "3", "--runs", str(tmp_path))
    assert proc.returncode == 2 and "give --seeds too" in proc.stderr


# --- one verdict per report ------------------------------------------------------------------

def test_secondary_test_never_disagrees_silently():
    seq = {"decision": "accept_h1", "units_used": 4, "p0": 0.001, "p1": 0.056}
    s = secondary(NO_EVIDENCE, seq)  # the H200's 6/96 vs 0/96 seed set
    assert s["role"] == "secondary" and s["agrees"] is False
    assert s["note"].startswith("DISAGREEMENT") and "'no evidence'" in s["note"]
    assert secondary(CORRUPTION_DETECTED, seq)["agrees"] is True
    assert secondary(CORRUPTION_DETECTED, {**seq, "decision": "accept_h0"})["agrees"] is False
    assert secondary(NO_EVIDENCE, {**seq, "decision": "continue"})["agrees"] is None
    assert secondary(CONTROL_BROKEN, seq)["agrees"] is None


def test_pool_summaries_adds_counts_of_one_arm():
    sets = [ArmSummary("trigger", 96, k, "episode", prefix_cache_hits=10) for k in (11, 6, 10)]
    pooled = pool_summaries(sets)
    assert (pooled.n_failed_units, pooled.n_units, pooled.prefix_cache_hits) == (27, 288, 30)
    with pytest.raises(InputError, match="one arm and unit"):
        pool_summaries([sets[0], ArmSummary("no_async", 96, 0, "episode")])


def test_gpu_results_pools_the_committed_seed_sets():
    from statescope.results.cli_runs import CLI_DIR, pooled_verdicts

    rows = pooled_verdicts(CLI_DIR)
    pooled = [r for r in rows if r["pooled"] and r["trigger_patch"] == "none"
              and r["control"] == "no_async"]
    assert len(pooled) == 1
    row = pooled[0]
    assert (row["trigger"], row["control_counts"]) == ("27/288", "0/288")
    assert row["outcome"] == CORRUPTION_DETECTED
    assert row["fisher_p"] == pytest.approx(fisher_exact_one_sided(27, 288, 0, 288))
    sets = [r for r in rows if not r["pooled"] and r["trigger_patch"] == "none"
            and r["control"] == "no_async"]
    assert [r["outcome"] for r in sets].count(NO_EVIDENCE) == 1  # 12:24's 6/96 alone says nothing
    proc = _cli("gpu-results", str(CLI_DIR), "--json")
    assert proc.returncode == 1, proc.stderr[-2000:]  # the pooled unpatched verdict
    assert json.loads(proc.stdout)["verdicts"] == json.loads(json.dumps(rows, default=str))


# --- the exit status in every --help --------------------------------------------------------

def _all_subparsers(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + (name,), sub
                yield from _all_subparsers(sub, path + (name,))


def test_every_subcommand_help_states_the_exit_status():
    from statescope.cli.main import build_parser

    subs = list(_all_subparsers(build_parser()))
    assert len(subs) > 20 and ("build", "census") in [p for p, _ in subs]
    for path, sub in subs:
        text = " ".join(sub.format_help().split())
        # the shared rule (statescope.cli.exit_codes), or a command's own statement of it
        # (diverge: "0 no request diverges, 1 some do, 2 bad input ...")
        assert re.search(r"exit status: 0 .+[;,] 1 .+[;,] 2 bad input", text), (path, text[-300:])
    shared = " ".join(build_parser().parse_args(["reproduce"]).func.__module__.split())
    assert shared == "statescope.cli.reproduce"
    from statescope.cli.exit_codes import EXIT_STATUS

    reproduce_help = " ".join(dict(subs)[("reproduce",)].format_help().split())
    assert EXIT_STATUS in reproduce_help


def test_verdict_exit_maps_every_outcome():
    from statescope.cli.exit_codes import verdict_exit
    from statescope.verdict import stats

    assert verdict_exit(stats.NO_EVIDENCE) == 0
    for outcome in (stats.CORRUPTION_DETECTED, stats.GEOMETRY_NOT_EXERCISED, stats.CONTROL_BROKEN,
                    stats.ENGINE_BROKEN):
        assert verdict_exit(outcome) == 1


# --- statescope.cli.main is the entry function -------------------------------------------------

def test_cli_main_is_the_entry_function():
    code = ("import statescope.cli.main; from statescope.cli import main; import statescope.cli; "
            "import inspect; assert inspect.isfunction(main) and main.__name__ == 'main'; "
            "assert statescope.cli.main is main; "
            "from statescope.cli.main import build_parser; assert callable(build_parser); "
            "assert 'main' in statescope.cli.__all__; "
            "import sys; sys.exit(main(['gpu-results', '/nonexistent-dir']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]  # the function ran and refused the folder


# --- one override rule -------------------------------------------------------------------------

@pytest.mark.parametrize("raw, expected", [
    ({"enable-prefix-caching": "false"}, {"enable_prefix_caching": False, "mamba_cache_mode": None}),
    ({"enable_prefix_caching": "False"}, {"enable_prefix_caching": False, "mamba_cache_mode": None}),
    ({"--no-enable-prefix-caching": True}, {"enable_prefix_caching": False,
                                            "mamba_cache_mode": None}),
    ({"no-async-scheduling": "true"}, {"async_scheduling": False}),
    ({"num_speculative_tokens": "0"}, {"speculative_method": None, "num_speculative_tokens": 0}),
    ({"speculative_config": '{"method": "mtp", "num_speculative_tokens": 3}'},
     {"num_speculative_tokens": 3}),
    ({"speculative-config": "null"}, {"speculative_method": None, "num_speculative_tokens": 0}),
    ({"enable_prefix_caching": False, "mamba_cache_mode": "none"},
     {"enable_prefix_caching": False, "mamba_cache_mode": "none"}),
])
def test_with_overrides_reads_vllm_spellings_and_couples_the_same_way(raw, expected):
    base = EngineConfig()
    got = base.with_overrides(raw).to_dict()
    changed = {k: v for k, v in got.items() if v != base.to_dict()[k]}
    assert changed == expected


@pytest.mark.parametrize("raw, message", [
    ({"enable_prefix_caching": "yes"}, "expected true or false"),
    ({"dtype": "fp8"}, "vLLM's choices"),
    ({"mamba_ssm_cache_dtype": "int8"}, "vLLM's choices"),
    ({"mamba_cache_mode": "sometimes"}, "vLLM's choices"),
    ({"max_num_seqs": "2.0"}, "expected an integer"),
    ({"num_spec_tokens": 2}, "NAME one of"),
    ({"speculative_config": '{"method": "mtp", "draft": 1}'}, "'method' and"),
    ({"enable_prefix_caching": True, "mamba_cache_mode": "none"}, "when enable_prefix_caching=True"),
])
def test_with_overrides_refuses_with_the_field_and_what_was_expected(raw, message):
    with pytest.raises(InputError, match="--trigger-set") as exc:
        EngineConfig().with_overrides(raw, where="--trigger-set")
    assert message in str(exc.value)


def test_reproduce_and_a_matrix_cell_resolve_the_same_overrides(tmp_path):
    """The same --trigger-set / --control-set / --model through reproduce's arm builder and
    through the matrix/bisect cell's (cli options -> run_cell request -> cell_config in the
    build's process) give identical resolved configurations."""
    from statescope.cli.builds import cell_options
    from statescope.cli.reproduce import reproduce_arms
    from statescope.verdict.matrix import cell_config
    from statescope.verdict.reproduce import standard_arms

    trigger_set = ["enable-prefix-caching=false", "num_speculative_tokens=0",
                   "no-async-scheduling=true", "max_num_seqs=8"]
    control_set = ["speculative_config={\"method\": \"mtp\", \"num_speculative_tokens\": 1}"]
    for control in ("reference", "no_prefix_cache", "no_async"):
        r_trigger, r_control = reproduce_arms(control, trigger_set, control_set, "tiny-qwen35")
        args = argparse.Namespace(both_set=[], trigger_set=trigger_set, control_set=control_set,
                                  trigger_patch=[], model="tiny-qwen35", cell_seeds=None,
                                  fresh_controls=True, control_cache=None, runs=str(tmp_path))
        opts = json.loads(json.dumps(cell_options(args)))  # as the cell's REQUEST.json carries it
        c_trigger, c_control = standard_arms(control)
        common = {"model": opts["model"]}
        assert r_trigger.config == cell_config(c_trigger.config, {**common, **opts["trigger_set"]})
        assert r_control.config == cell_config(c_control.config, {**common, **opts["control_set"]})
    assert r_trigger.config.mamba_cache_mode is None and r_trigger.config.speculative_method is None


def test_capture_starts_the_engine_reproduce_judges_under_the_same_overrides():
    """``capture --set X`` records the configuration ``reproduce --trigger-set X`` judges (one
    override rule: aliases, coupled fields, the model), and a bad pair names ``--set``."""
    from statescope.cli.capture import capture_config
    from statescope.cli.reproduce import reproduce_arms

    for pairs in ([], ["enable-prefix-caching=false"], ["num_speculative_tokens=0"],
                  ["no-async-scheduling=true", "max_num_seqs=8"]):
        want, _ = reproduce_arms("reference", pairs, None, "tiny-qwen35")
        assert capture_config(pairs, "tiny-qwen35") == want.config, pairs
    off = capture_config(["enable-prefix-caching=false"], None)
    assert off.enable_prefix_caching is False and off.mamba_cache_mode is None  # coupled, as reproduce
    assert capture_config(["num_speculative_tokens=0"], None).speculative_method is None
    with pytest.raises(InputError, match="--set"):
        capture_config(["enable_prefix_caching=yes"], None)


def test_concurrency_on_the_offline_runner_is_the_batch(tmp_path):
    from statescope.cli.reproduce import experiment_of

    trigger, control = experiment_of("reference", batch=4).arms()
    assert trigger.config.max_num_seqs == control.config.max_num_seqs == 4
    with pytest.raises(InputError, match="--concurrency is max_num_seqs"):
        experiment_of("reference", ["max_num_seqs=8"], batch=4).arms()
    proc = _cli("reproduce", "--concurrency", "0", "--runs", str(tmp_path))
    assert proc.returncode == 2 and "concurrency=0" in proc.stderr
    assert not list(tmp_path.iterdir())
    assert math.isfinite(best_p(1, 1))


# the same overrides, as every command's options spell them
SAME_OVERRIDES = {"--both-set": ["max_num_seqs=8"],
                  "--trigger-set": ["enable-prefix-caching=false", "no-async-scheduling=true"],
                  "--control-set": ["num_speculative_tokens=1"]}


def test_every_command_resolves_the_same_overrides_to_the_same_arms(tmp_path):
    """One ``Experiment``, built one way: reproduce, a build's cell (matrix / bisect / Ray: the
    options -> REQUEST.json -> ``Experiment.from_request`` in the build's process), capture (the
    trigger arm), shrink (a trace file) and the GPU arms give identical configurations for the same
    overrides, coupled fields included (prefix caching off clears the cache mode)."""
    from statescope.cli.builds import cell_options
    from statescope.cli.capture import capture_config
    from statescope.cli.reproduce import experiment_of
    from statescope.cli.shrink import _arms as shrink_arms
    from statescope.cluster.plan import CellPlan
    from statescope.engine.config import model_path
    from statescope.gpu.e2e_arms import e2e_arms, gpu_extra
    from statescope.verdict.experiment import Experiment

    both, trig, ctl = (SAME_OVERRIDES[k] for k in ("--both-set", "--trigger-set", "--control-set"))
    model = "tiny-qwen35"
    want_t, want_c = experiment_of("no_mtp", trig, ctl, model, both_pairs=both).arms()
    assert want_t.config.mamba_cache_mode is None and want_t.config.max_num_seqs == 8
    assert want_c.config.num_speculative_tokens == 1 and want_c.config.max_num_seqs == 8
    assert want_t.config.model == str(model_path(model))

    args = argparse.Namespace(control="no_mtp", both_set=both, trigger_set=trig, control_set=ctl,
                              trigger_patch=[], model=model, cell_seeds=None,
                              fresh_controls=True, control_cache=None, runs=str(tmp_path))
    request = json.loads(json.dumps({"control": "no_mtp", **cell_options(args)}))
    cell_t, cell_c = Experiment.from_request(request).arms()
    assert (cell_t.config, cell_c.config) == (want_t.config.replace(
        model=str(model_path(model).resolve())), want_c.config.replace(
        model=str(model_path(model).resolve())))

    plan = CellPlan(spec=f"python:{sys.executable}", trigger_set=request["trigger_set"],
                    control="no_mtp", model=request["model"])
    ray_req = json.loads(json.dumps({**plan.cell_kwargs(), "control_set": request["control_set"]}))
    assert Experiment.from_request(ray_req).arms()[0].config == cell_t.config

    assert capture_config(both + trig, model) == experiment_of(
        "reference", both + trig, None, model).arms()[0].config
    assert capture_config(both + trig, model).mamba_cache_mode is None

    shrink = argparse.Namespace(control="no_mtp", both_set=both, trigger_set=trig, control_set=ctl,
                                trigger_patch=[], fault_spec=None, model=model)
    s_t, s_c = shrink_arms(shrink, None)
    assert (s_t.config, s_c.config) == (want_t.config, want_c.config)  # was a plain replace

    gpu = e2e_arms(str(model_path(model)))
    flags = ["enforce_eager=false", "max_num_seqs=32", "async_scheduling=true",
             "extra=" + json.dumps(gpu_extra())]
    for name in ("no_prefix_cache", "no_mtp"):
        t, c = experiment_of(name, flags, flags, model).arms()
        assert gpu["trigger"].config == t.config and gpu[name].config == c.config
    t, c = experiment_of("no_async", flags, [flags[0], flags[1], flags[3]], model).arms()
    assert gpu["no_async"].config == c.config and c.config.async_scheduling is False


def test_an_experiment_refuses_before_any_engine_naming_the_flag():
    from statescope.cli.reproduce import experiment_of
    from statescope.verdict.experiment import Experiment

    with pytest.raises(InputError, match="--control-set/--both-set"):
        experiment_of("no_mtp", None, ["mamba_cache_mode=none"], None,
                      both_pairs=["enable_prefix_caching=true"]).arms()
    with pytest.raises(InputError, match="--control-set: max_num_seqs='x'"):
        experiment_of("no_mtp", None, ["max_num_seqs=x"], None)
    with pytest.raises(InputError, match="--set"):
        experiment_of("reference", ["enable_prefix_caching=yes"], trigger_where="--set")
    with pytest.raises(InputError, match="control='nope'"):
        Experiment(control="nope")
    from statescope.verdict.reproduce import STANDARD_CONTROLS
    for name in STANDARD_CONTROLS:  # every control an Experiment accepts, standard_arms builds
        assert Experiment(control=name).arms()[1].name == name
    with pytest.raises(InputError, match="no such model directory"):
        Experiment(model="no-such-model").check()
    with pytest.raises(InputError, match="expected one of"):
        Experiment(trigger_patches=("nope",)).check()
    with pytest.raises(InputError, match="planted fault"):
        Experiment(control="same").to_request()
    same_t, same_c = Experiment(control="same", trigger_set={"max_num_seqs": 2}).arms()
    assert same_c.name == "same" and same_c.config == same_t.config


def test_a_report_gives_each_seed_set_and_the_pooled_verdict_and_says_the_disagreement():
    """Labels as reproduce's label_rows makes them (episodes s<seed>-...), judged per seed set
    and pooled; the SPRT's accept_h1 beside a Fisher 'no evidence' is said, not hidden."""
    from pathlib import Path

    from statescope.verdict.reproduce import Arm, ArmRun, ReproduceResult, summarize_arm
    from statescope.verdict.rule import seed_set_verdicts
    from statescope.verdict.stats import decide

    def labels(failed, seeds):
        return [{"episode": f"s{s}-ep{e:04d}", "step": 0, "text": "x", "degenerate": False,
                 "reasons": [], "flip": None, "failed": (s, e) in failed, "lifetime": 0,
                 "num_cached_tokens": 0} for s in seeds for e in range(4)]

    t_lab = labels({(48, 1), (52, 2), (53, 0), (56, 3)}, range(48, 60))
    c_lab = labels(set(), range(48, 60))
    m = {"prefix_cache_queries": 10, "prefix_cache_hits": 5, "spec_draft_tokens": 10,
         "spec_accepted_tokens": 5}
    t = ArmRun(Arm("trigger", EngineConfig(), expect_prefix_cache=True, expect_spec=True), [], m,
               {"x": 1})
    c = ArmRun(Arm("no_async", EngineConfig()), [], m, {"x": 2})
    v = decide(summarize_arm(t, t_lab, "episode"), summarize_arm(c, c_lab, "episode"))
    res = ReproduceResult(v, t, c, t_lab, c_lab, Path("run"), power_of(48, 48, 0.01, "episode"))
    res.seed_sets = seed_set_verdicts(res, split_seed_sets(list(range(48, 60)), 3))
    d = res.to_dict()
    assert d["pooled"] and d["outcome"] == NO_EVIDENCE
    assert d["fisher_p"] == pytest.approx(fisher_exact_one_sided(4, 48, 0, 48))
    assert [s["seeds"] for s in d["seed_sets"]] == ["48:52", "52:56", "56:60"]
    assert [s["trigger"] for s in d["seed_sets"]] == [[1, 16], [2, 16], [1, 16]]
    assert d["sequential"]["decision"] == "accept_h1" and d["sequential"]["agrees"] is False
    assert "DISAGREEMENT" in d["sequential"]["note"] and d["decision_rule"].startswith("decision rule")
    assert "Each seed set" in res._repr_html_() and "DISAGREEMENT" in res._repr_html_()
