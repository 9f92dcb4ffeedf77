"""Round 5's capture-overhead probes (data/results/gpu/overhead_round5/): recomputed, not read."""
from __future__ import annotations

import json
import shutil

import pytest

from statescope import gpu_round5
from statescope.errors import InputError

R5 = gpu_round5.R5_DIR


def test_rows_recompute_the_probe_summaries():
    rows = gpu_round5.overhead_rows()
    assert {(r["file"], r["workload"]) for r in rows} >= {("probe_7b_call9.json", "decode"),
                                                          ("probe_7b_call10.json", "gui")}
    for r in rows:
        part = json.loads((R5 / r["file"]).read_text())["7b"]
        part = (part.get("workloads") or {"decode": part})[r["workload"]]
        s = part["summary"][r["mode"]]
        assert r["paired_median"] == pytest.approx(s["paired_ratio_median"], abs=5e-4)
        assert (r["ci_lo"], r["ci_hi"]) == pytest.approx((s["paired_ratio_ci"]["lo"], s["paired_ratio_ci"]["hi"]), abs=5e-4)
        assert r["ci_lo"] <= r["paired_median"] <= r["ci_hi"]


def test_graph_digest_spends_less_host_time_than_eager_in_the_same_engine():
    by = {(r["file"], r["mode"]): r for r in gpu_round5.overhead_rows()}
    for f in ("probe_7b_call3.json", "probe_7b_call6.json"):  # the two calls that ran both
        graph, eager = by[(f, "digest")], by[(f, "digest_eager")]
        assert graph["digest_graph"] == "on" and eager["digest_graph"] == "off"
        assert graph["host_ms_in_step"] < 0.8 * eager["host_ms_in_step"]
        done, total = map(int, graph["graph_vs_eager_identical"].split("/"))
        assert total > 200_000 and done >= total - 10


def test_goal_is_judged_on_the_interval_not_the_median():
    goal = gpu_round5.goal_check()
    assert all(g["goal"] != "met" for g in goal)  # round 5: not shown on any workload
    gui = [g for g in goal if g["workload"] == "gui" and g["rounds"] == 19][0]
    assert gui["paired_median"] > gpu_round5.GOAL and gui["goal"].startswith("not shown")


def test_missing_probe_is_one_clear_error(tmp_path):
    for name in gpu_round5.PROBES[:2]:
        shutil.copy(R5 / name, tmp_path / name)
    with pytest.raises(InputError, match="probe_7b_call9.json: missing"):
        gpu_round5.overhead_rows(tmp_path)


def test_cli_reports_round5(capsys):
    from statescope.cli import main

    assert main(["gpu-results", str(R5), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["goal"]) == 5 and rep["rows"][0]["mode"] == "digest"
