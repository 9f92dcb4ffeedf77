"""Rounds 5-6 of the capture-overhead probes (data/results/gpu/overhead_round{5,6}/): recomputed,
not read."""
from __future__ import annotations

import json
import shutil

import pytest

from statescope.results import overhead as gor
from statescope.errors import InputError

R5, R6 = gor.R5_DIR, gor.R6_DIR


@pytest.mark.parametrize("d", [R5, R6])
def test_rows_recompute_the_probe_summaries(d):
    rows = gor.overhead_rows(d)
    assert {r["file"] for r in rows} == set(gor.probe_files(d))
    for r in rows:
        part = json.loads((d / r["file"]).read_text())["7b"]
        part = (part.get("workloads") or {"decode": part})[r["workload"]]
        s = part["summary"][r["mode"]]
        assert r["paired_median"] == pytest.approx(s["paired_ratio_median"], abs=5e-4)
        assert (r["ci_lo"], r["ci_hi"]) == pytest.approx((s["paired_ratio_ci"]["lo"], s["paired_ratio_ci"]["hi"]), abs=5e-4)
        assert r["ci_lo"] <= r["paired_median"] <= r["ci_hi"]


def test_graph_digest_spends_less_host_time_than_eager_in_the_same_engine():
    by = {(r["file"], r["mode"]): r for r in gor.overhead_rows(R5)}
    for f in ("probe_7b_call3.json", "probe_7b_call6.json"):  # the two calls that ran both
        graph, eager = by[(f, "digest")], by[(f, "digest_eager")]
        assert graph["digest_graph"] == "on" and eager["digest_graph"] == "off"
        assert graph["host_ms_in_step"] < 0.8 * eager["host_ms_in_step"]
        done, total = map(int, graph["graph_vs_eager_identical"].split("/"))
        assert total > 200_000 and done >= total - 10


def test_round5_goal_is_judged_on_the_interval_not_the_median():
    goal = gor.goal_check(R5)
    assert all(g["goal"] != "met" for g in goal)  # round 5: not shown on any workload
    gui = [g for g in goal if g["workload"] == "gui" and g["rounds"] == 19][0]
    assert gui["paired_median"] > gor.GOAL and gui["goal"].startswith("not shown")


def test_round6_the_compact_record_cut_host_time_and_the_capture_really_ran():
    r5 = {(r["workload"]): r for r in gor.overhead_rows(R5) if r["file"] == "probe_7b_call9.json"}
    rows = gor.overhead_rows(R6)
    for r in rows:
        assert r["capture_ran"] == f"all {r['rounds']}"  # complete, no hook error, digest rows
        assert r["host_ms_in_step"] < r5[r["workload"]]["host_ms_in_step"]  # round 5, same workloads
    same = [r for r in rows if r["file"] in gor.R6_SAME_CODE]
    assert sum(r["host_ms_in_step"] + r["host_ms_flusher"] for r in same) / len(same) < 1.0
    goal = {(g["file"], g["workload"]): g for g in gor.goal_check(R6)}
    assert goal[("probe_7b_call3.json", "gui")]["goal"] == "met"  # the one interval above 0.97
    assert sum(g["goal"] == "met" for g in goal.values()) == 1
    pooled = {p["workload"]: p for p in gor.pooled_check()}
    assert pooled["decode"]["rounds"] == 44 and pooled["gui"]["rounds"] == 48
    assert all(0.96 <= p["paired_median"] <= 0.99 for p in pooled.values())


def test_missing_probe_is_one_clear_error(tmp_path):
    for name in gor.R5_PROBES[:2]:
        shutil.copy(R5 / name, tmp_path / name)
    with pytest.raises(InputError, match="probe_7b_call9.json: missing"):
        gor.overhead_rows(tmp_path)
    (tmp_path / "manifest.json").write_text("{round: 6")
    with pytest.raises(InputError, match="manifest.json: not JSON"):
        gor.overhead_rows(tmp_path)


@pytest.mark.parametrize("d,goals,pooled", [(R5, 5, 0), (R6, 6, 2)])
def test_cli_reports_overhead_rounds(capsys, d, goals, pooled):
    from statescope.cli.main import main

    assert main(["gpu-results", str(d), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["goal"]) == goals and rep["rows"][0]["mode"] == "digest"
    assert len(rep["pooled"]) == pooled
