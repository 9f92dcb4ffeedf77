"""Capture must not hide the failure it observes: the reproduce verdict with capture on and off.

A planted NaN conv-window fault (``statescope.patches.faults``, the reported ``!!!!`` symptom) in the
trigger arm; the control arm (the reference configuration) is run once and shared. The trigger
arm runs twice — capture off, then capture on (digest mode) — and must give the same verdict
("corruption detected") for the same requests; the capture itself must show the planted NaN in
the layer it was planted in, and its perturbation report must say what capturing did.
"""
from __future__ import annotations

import pytest

from statescope.capture.session import perturbation_report
from statescope.verdict.reproduce import reproduce_with_capture
from statescope.patches.faults import FaultSpec
from statescope.verdict.reproduce import standard_arms
from statescope.verdict.stats import CORRUPTION_DETECTED
from statescope.workload.episodes import preset_trace

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_planted_failure_still_fires_with_capture_on(tmp_path, engine_pool):
    engine_pool.close()  # one engine alive at a time: each arm starts its own
    trigger, control = standard_arms("reference")
    trigger.fault = FaultSpec(kind="nan_conv", rate=1.0, at_output_token=1, layers=[0])
    trace = preset_trace("smoke")
    res = reproduce_with_capture(trigger, control, trace, store_root=tmp_path,
                                 spec={"mode": "digest", "run_id": "trigger"})
    off, on = res["off"], res["on"]
    assert off.verdict.outcome == on.verdict.outcome == CORRUPTION_DETECTED
    assert res["same_verdict"] and res["same_failures"]
    failed = [lab for lab in on.trigger_labels if lab["failed"]]
    assert len(failed) == len(trace)
    assert [lab["text"] for lab in on.trigger_labels] == [lab["text"] for lab in off.trigger_labels]
    run = res["run"]
    assert run is not None and run.manifest["status"] == "complete"
    d = run.digests()
    nan_rows = d[d["nan"] > 0]
    assert len(nan_rows) > 0 and 0 in set(nan_rows["layer_index"])  # where it was planted
    assert "conv" in set(nan_rows["kind"])  # (a NaN state poisons every later layer too)
    report = perturbation_report(run)
    assert report["mode"] == "digest" and report["forced_sync"] is False
    assert report["forced_eager"] is False and report["measured_overhead"] is not None
    assert report["emit"] == "background" and report["digest_graph"] == "off"  # the CPU defaults
