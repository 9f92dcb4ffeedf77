"""``bin/setup --here`` refuses, without a terminal and without ``--force``, to re-point a Python
whose statescope comes from another checkout (issue 32 item 5).

The Python is this project's real .venv (real vLLM) behind a small wrapper that puts a stub
checkout first on its path, so ``import statescope`` resolves to that other checkout. It does not
run the ``--force`` path: that would pip-install into the shared .venv.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_setup_here_refuses_to_repoint_another_checkout_without_force(tmp_path):
    other = tmp_path / "other-checkout"
    (other / "lib" / "statescope").mkdir(parents=True)
    (other / "lib" / "statescope" / "__init__.py").write_text('__version__ = "0.0.0"\n')
    wrapper = tmp_path / "python"
    # bin/setup clears PYTHONPATH for its look-up; the wrapper sets it inside, as an install would
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={other / "lib"} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, STATESCOPE_PYTHON=str(wrapper), PIP_NO_INDEX="1")
    out = subprocess.run([str(REPO / "bin" / "setup"), "--here"], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert f"has statescope from {other}" in out.stderr
    assert "bin/setup --here --force" in out.stderr
    assert "installing" not in out.stdout  # nothing was installed
