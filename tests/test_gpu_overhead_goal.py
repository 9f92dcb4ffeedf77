"""Is the capture-overhead goal shown? The graph-digest and compact-record probes
(data/results/gpu/overhead_graph_digest/, overhead_compact_record/): recomputed, not read."""
from __future__ import annotations

import json
import shutil

import pytest

from statescope.results import overhead
from statescope.errors import InputError

GRAPH_DIGEST, COMPACT_RECORD = overhead.OVERHEAD_GRAPH_DIGEST_DIR, overhead.OVERHEAD_COMPACT_RECORD_DIR


@pytest.mark.parametrize("d", [GRAPH_DIGEST, COMPACT_RECORD])
def test_rows_recompute_the_probe_summaries(d):
    rows = overhead.overhead_rows(d)
    assert {r["file"] for r in rows} == set(overhead.probe_files(d))
    for r in rows:
        part = json.loads((d / r["file"]).read_text())["7b"]
        part = (part.get("workloads") or {"decode": part})[r["workload"]]
        s = part["summary"][r["mode"]]
        assert r["paired_median"] == pytest.approx(s["paired_ratio_median"], abs=5e-4)
        assert (r["ci_lo"], r["ci_hi"]) == pytest.approx((s["paired_ratio_ci"]["lo"], s["paired_ratio_ci"]["hi"]), abs=5e-4)
        assert r["ci_lo"] <= r["paired_median"] <= r["ci_hi"]


def test_graph_digest_spends_less_host_time_than_eager_in_the_same_engine():
    by = {(r["file"], r["mode"]): r for r in overhead.overhead_rows(GRAPH_DIGEST)}
    for f in ("probe_7b_call3.json", "probe_7b_call6.json"):  # the two calls that ran both
        graph, eager = by[(f, "digest")], by[(f, "digest_eager")]
        assert graph["digest_graph"] == "on" and eager["digest_graph"] == "off"
        assert graph["host_ms_in_step"] < 0.8 * eager["host_ms_in_step"]
        done, total = map(int, graph["graph_vs_eager_identical"].split("/"))
        assert total > 200_000 and done >= total - 10


def test_graph_digest_goal_is_judged_on_the_interval_not_the_median():
    goal = overhead.goal_check(GRAPH_DIGEST)
    assert all(g["goal"] != "met" for g in goal)  # not shown on any workload
    gui = [g for g in goal if g["workload"] == "gui" and g["rounds"] == 19][0]
    assert gui["paired_median"] > overhead.GOAL and gui["goal"].startswith("not shown")


def test_the_compact_record_cut_host_time_and_the_capture_really_ran():
    graph = {(r["workload"]): r for r in overhead.overhead_rows(GRAPH_DIGEST) if r["file"] == "probe_7b_call9.json"}
    rows = overhead.overhead_rows(COMPACT_RECORD)
    for r in rows:
        assert r["capture_ran"] == f"all {r['rounds']}"  # complete, no hook error, digest rows
        assert r["host_ms_in_step"] < graph[r["workload"]]["host_ms_in_step"]  # graph digest, same workloads
    same = [r for r in rows if r["file"] in overhead.COMPACT_RECORD_SAME_CODE]
    assert sum(r["host_ms_in_step"] + r["host_ms_flusher"] for r in same) / len(same) < 1.0
    goal = {(g["file"], g["workload"]): g for g in overhead.goal_check(COMPACT_RECORD)}
    assert goal[("probe_7b_call3.json", "gui")]["goal"] == "met"  # the one interval above 0.97
    assert sum(g["goal"] == "met" for g in goal.values()) == 1
    pooled = {p["workload"]: p for p in overhead.pooled_check()}
    assert pooled["decode"]["rounds"] == 44 and pooled["gui"]["rounds"] == 48
    assert all(0.96 <= p["paired_median"] <= 0.99 for p in pooled.values())


def test_probe_files_are_the_ones_the_manifest_describes(tmp_path):
    assert overhead.probe_files(GRAPH_DIGEST) == overhead.GRAPH_DIGEST_PROBES
    assert overhead.probe_files(COMPACT_RECORD) == overhead.COMPACT_RECORD_PROBES
    shutil.copy(COMPACT_RECORD / "manifest.json", tmp_path / "manifest.json")
    assert overhead.probe_files(tmp_path) == overhead.COMPACT_RECORD_PROBES  # by content, not by folder name
    assert overhead.probe_files(tmp_path / "elsewhere") == overhead.GRAPH_DIGEST_PROBES  # no manifest


def test_missing_probe_is_one_clear_error(tmp_path):
    for name in overhead.GRAPH_DIGEST_PROBES[:2]:
        shutil.copy(GRAPH_DIGEST / name, tmp_path / name)
    with pytest.raises(InputError, match="probe_7b_call9.json: missing"):
        overhead.overhead_rows(tmp_path)
    (tmp_path / "manifest.json").write_text("{what: {")
    with pytest.raises(InputError, match="manifest.json: not JSON"):
        overhead.overhead_rows(tmp_path)


@pytest.mark.parametrize("d,goals,pooled", [(GRAPH_DIGEST, 5, 0), (COMPACT_RECORD, 6, 2)])
def test_cli_reports_overhead_probes(capsys, d, goals, pooled):
    from statescope.cli.main import main

    assert main(["gpu-results", str(d), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["goal"]) == goals and rep["rows"][0]["mode"] == "digest"
    assert len(rep["pooled"]) == pooled
