"""Engine-start errors reach the user verbatim; guards read engagement from the best source;
arms are compared only like with like; the device profile is chosen, applied and recorded.

Real vLLM-CPU engines where an engine is the point (an engine start that fails inside vLLM's own
config validation; per-request scheduler counts against vLLM's own counters); committed GPU
records where the point is a comparison of files.
"""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from statescope.engine.offline import _stdout_with_fileno
from statescope.errors import InputError
from statescope.resolved import engagement_metrics, lifetime_metrics

REPO = Path(__file__).resolve().parents[1]
PATCH_CHECK = REPO / "data" / "results" / "gpu" / "e2e_patch_check"


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "statescope.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


# --- engine-start errors ------------------------------------------------------------------

@pytest.mark.parametrize("has_fileno", [True, False])
def test_stdout_guard_lets_a_value_error_through_unchanged(monkeypatch, has_fileno):
    """The guard once caught ValueError around its yield: a pydantic ValidationError (a
    ValueError) became "generator didn't stop after throw()"."""
    if not has_fileno:
        monkeypatch.setattr(sys, "stdout", io.StringIO())  # a Jupyter-like stdout, no fd
    with pytest.raises(ValueError, match="the real error"):
        with _stdout_with_fileno():
            raise ValueError("the real error")


@pytest.mark.engine
def test_a_value_error_at_engine_start_reaches_the_user_verbatim(tmp_path):
    # a cross-field rule only vLLM's own SchedulerConfig checks (max_num_batched_tokens >=
    # max_num_seqs = 32): past statescope's per-field check, refused while the control starts
    proc = _cli("reproduce", "--preset", "smoke", "--control", "reference", "--runs", str(tmp_path),
                "--control-set", 'extra={"max_num_batched_tokens": 8}')
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "generator didn't stop" not in proc.stderr
    err = [l for l in proc.stderr.splitlines() if l.startswith("statescope reproduce:")]
    assert err and "vLLM engine start failed:" in err[0], proc.stderr[-2000:]
    assert "max_num_batched_tokens (8)" in proc.stderr and "max_num_seqs" in proc.stderr
    assert "engine arguments:" in proc.stderr  # what was asked, beside what vLLM said


def test_vllm_choices_are_vllms_own_literals():
    import typing
    from vllm.config.cache import MambaCacheMode, MambaDType
    from vllm.config.model import ModelDType
    from statescope.engine.overrides import VLLM_CHOICES

    assert set(VLLM_CHOICES["dtype"]) == set(typing.get_args(ModelDType))
    assert set(VLLM_CHOICES["mamba_ssm_cache_dtype"]) == set(typing.get_args(MambaDType))
    assert set(VLLM_CHOICES["mamba_cache_mode"]) == {*typing.get_args(MambaCacheMode), None}


@pytest.mark.parametrize("extra, words", [
    ({"max_num_batched_tokens": -5}, ">= 1 (vLLM"),
    ({"max_num_batched_tokenz": 5}, "did you mean max_num_batched_tokens"),
    ({"max_num_seqs": "many"}, "expected int | None"),
    ({"enforce_eager": "maybe"}, "expected bool")])
def test_bad_extra_is_refused_before_any_engine_starts(extra, words):
    import time
    import psutil
    from vllm import LLM  # noqa: F401  (what the engine imports anyway; not timed)
    from statescope.engine.config import EngineConfig
    from statescope.engine.offline import OfflineEngine
    from statescope.engine.server import VllmServer
    from statescope.engine.vllm_types import check_with_vllm

    check_with_vllm(EngineConfig())  # the defaults pass (and the field tables are built)
    check_with_vllm(EngineConfig(), server=True)
    name = next(iter(extra))
    # Another test on this xdist worker may hold an engine (a module fixture); only new
    # children would be ours.
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    for start in (OfflineEngine, VllmServer):
        t0 = time.perf_counter()
        with pytest.raises(InputError) as info:
            start(EngineConfig(extra=extra))
        assert time.perf_counter() - t0 < 5
        assert f"extra[{name!r}]" in str(info.value) and words in str(info.value)
        started = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
        assert started == []  # no server, no engine core


# --- engagement guards: the best source, named ----------------------------------------------

def test_engagement_prefers_counters_then_requests_and_names_the_source():
    rows = [{"prompt_token_ids": [1] * 100, "num_cached_tokens": 64, "spec_draft_tokens": 10,
             "spec_accepted_tokens": 7}, {"prompt_token_ids": [1] * 50, "num_cached_tokens": 0,
                                          "spec_draft_tokens": 4, "spec_accepted_tokens": 1}]
    zero = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0}
    m = engagement_metrics(zero, rows)  # what vLLM 0.26.0's in-process engine reported on the H200
    assert (m["prefix_cache_hits"], m["prefix_cache_queries"]) == (64, 150)
    assert (m["spec_accepted_tokens"], m["spec_draft_tokens"]) == (8, 14)
    assert m["prefix_cache_source"].startswith("per-request num_cached_tokens")
    assert m["spec_source"].startswith("per-request scheduler counts of 2 requests")
    counted = dict(zero, prefix_cache_queries=500, prefix_cache_hits=200, spec_draft_tokens=40,
                   spec_accepted_tokens=30)
    m = engagement_metrics(counted, rows)
    assert m["prefix_cache_hits"] == 200 and m["prefix_cache_source"] == "vLLM counters"
    assert m["spec_accepted_tokens"] == 30 and m["spec_source"] == "vLLM counters"
    m = engagement_metrics(zero, [dict(r, num_cached_tokens=0, spec_accepted_tokens=0) for r in rows])
    assert m["prefix_cache_hits"] == 0 and "both 0" in m["prefix_cache_source"]
    assert lifetime_metrics([{"metrics": counted}, {"metrics": counted}, {}])["prefix_cache_hits"] == 400


@pytest.mark.engine
def test_scheduler_tap_counts_what_vllm_counts_and_keeps_an_engaged_arm_engaged(engine_pool):
    """On vLLM-CPU the counters work: the tap's per-request counts must add up to them. With the
    counters zeroed (the H200's in-process 0.26.0), the verdict still sees the engagement."""
    from statescope.verdict.stats import ArmSummary, GEOMETRY_NOT_EXERCISED, decide
    from statescope.workload.episodes import run_episodes, shared_prefix_episodes
    from conftest import TRIGGER

    engine = engine_pool.get(TRIGGER)
    engine.reset_prefix_cache()
    before = engine.metrics()
    rows = run_episodes(engine, shared_prefix_episodes(n_episodes=2, n_steps=3), max_tokens=12,
                        system_repeat=16)
    after = engine.metrics()
    drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafts > 0 and accepted > 0
    assert sum(r["spec_draft_tokens"] for r in rows) == drafts
    assert sum(r["spec_accepted_tokens"] for r in rows) == accepted
    assert any(r["num_cached_tokens"] for r in rows)
    zero = {k: 0 for k in ("prefix_cache_queries", "prefix_cache_hits", "spec_draft_tokens",
                           "spec_accepted_tokens")}
    m = engagement_metrics(zero, rows)

    def arm(name: str, metrics: dict, **kw) -> ArmSummary:
        return ArmSummary(name=name, n_units=6, n_failed_units=0, unit="episode",
                          prefix_cache_queries=metrics["prefix_cache_queries"],
                          prefix_cache_hits=metrics["prefix_cache_hits"],
                          spec_draft_tokens=metrics["spec_draft_tokens"],
                          spec_accepted_tokens=metrics["spec_accepted_tokens"], resolved={"a": 1},
                          engagement_sources={k: metrics[k] for k in ("prefix_cache_source",
                                                                      "spec_source") if k in metrics},
                          **kw)

    ctl = arm("control", zero)
    ctl.resolved = {"a": 2}
    v = decide(arm("trigger", m, expect_prefix_cache=True, expect_spec=True), ctl)
    assert v.outcome != GEOMETRY_NOT_EXERCISED, v.explanation
    guard = {g.name: g.detail for g in v.guards}
    assert "per-request num_cached_tokens" in guard["prefix_cache_engaged"]
    assert "statescope.capture.spec_tap" in guard["spec_engaged"]
    v0 = decide(arm("trigger", dict(zero, prefix_cache_source="vLLM counters"),
                    expect_prefix_cache=True, expect_spec=True), ctl)
    assert v0.outcome == GEOMETRY_NOT_EXERCISED  # the guard still bites when nothing engaged


# --- like with like -------------------------------------------------------------------------

def _patch_check_with_other_seeds(dest: Path) -> Path:
    """The patch check's folder with every episode renamed to seeds its controls (the factor
    check's) never ran."""
    shutil.copytree(PATCH_CHECK, dest)
    for f in dest.glob("records_*.jsonl"):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        for r in rows:
            r["episode"] = "s9" + r["episode"]
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dest


def test_gpu_results_refuses_controls_that_share_no_request(tmp_path):
    d = _patch_check_with_other_seeds(tmp_path / "e2e_patch_check")
    proc = _cli("gpu-results", str(d), timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-1500:])
    line = proc.stderr.strip().splitlines()[-1]
    assert "cannot compare" in line and "share no request" in line
    assert str(d) in line and "e2e_factors" in line  # both runs named, in one line
    assert "p = 1" not in proc.stdout


def test_committed_patch_check_still_compares_with_its_controls():
    from statescope.results import patch_check

    rows = patch_check.patch_verdicts()
    assert rows and {r["control"] for r in rows} == {"no_async", "no_prefix_cache", "no_mtp"}


@pytest.mark.engine
def test_control_run_of_another_trace_is_refused_before_the_trigger_runs(tmp_path):
    # --unit request: the smoke preset's 16 requests can answer at alpha 0.01 as they are (an
    # episode design of 4 would be sized or refused first, issue 28)
    first = _cli("reproduce", "--preset", "smoke", "--control", "reference", "--runs",
                 str(tmp_path), "--run-id", "a", "--json", "--unit", "request")
    assert first.returncode in (0, 1), first.stderr[-2000:]
    proc = _cli("reproduce", "--preset", "smoke", "--seeds", "3:4", "--unit", "request",
                "--control", "reference",
                "--runs", str(tmp_path), "--run-id", "b", "--control-run", str(tmp_path / "a"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "cannot compare trigger" in line and str(tmp_path / "a") in line
    assert "different traces" in line
    assert not list((tmp_path / "b").glob("trigger*")), "the trigger must not have run"
    same = _cli("reproduce", "--preset", "smoke", "--control", "reference", "--runs",
                str(tmp_path), "--run-id", "c", "--control-run", str(tmp_path / "a"), "--json",
                "--unit", "request")
    assert same.returncode in (0, 1), same.stderr[-2000:]
    out = json.loads(same.stdout)
    assert out["control"]["n_units"] == json.loads(first.stdout)["control"]["n_units"]


# --- device profiles ----------------------------------------------------------------------

def test_profile_is_chosen_by_flag_env_or_detection(monkeypatch):
    from statescope.patches.device_profiles import choose_profile, merged_extra

    monkeypatch.delenv("STATESCOPE_PROFILE", raising=False)
    monkeypatch.delenv("STATESCOPE_PROFILE_CHOSEN_BY", raising=False)
    auto = choose_profile()
    assert auto.name == "cpu" and auto.chosen_by == "auto: no CUDA device"
    assert choose_profile("cuda-triton").chosen_by == "--profile"
    monkeypatch.setenv("STATESCOPE_PROFILE", "cuda-triton")
    p = choose_profile()
    assert p.name == "cuda-triton" and p.chosen_by == "STATESCOPE_PROFILE"
    assert p.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    # the experiment's own additional_config wins over the profile's
    extra = merged_extra({"additional_config": {"gdn_prefill_backend": "flashinfer", "x": 1}}, p)
    assert extra["additional_config"] == {"gdn_prefill_backend": "flashinfer", "x": 1}
    assert merged_extra({}, p)["additional_config"] == {"gdn_prefill_backend": "triton"}
    with pytest.raises(InputError, match="device profile 'gpu'"):
        choose_profile("gpu")


@pytest.mark.engine
def test_resolved_config_records_the_profile(engine_pool):
    from conftest import TRIGGER

    r = engine_pool.get(TRIGGER).resolved()
    assert r["profile"]["name"] == "cpu" and r["profile"]["chosen_by"]  # how it was chosen, said
    assert isinstance(r["profile"]["applied"], list)


def test_engine_gate_admits_every_release_the_capture_covers():
    # the H200 run of 0.33.0 stopped at this gate while the capture already covered it
    from statescope.capture.adapters import COVERED, COVERED_V2
    from statescope.engine.offline import SUPPORTED_VLLM

    refused = [v for v in (*COVERED, *COVERED_V2) if not v.startswith(SUPPORTED_VLLM)]
    assert refused == [], f"engine gate refuses releases the capture covers: {refused}"
    assert not "0.34.0".startswith(SUPPORTED_VLLM)  # an unknown release is still refused
