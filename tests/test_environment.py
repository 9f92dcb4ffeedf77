"""environment.yml, pyproject.toml and bin/setup describe one environment."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_environment_yml_agrees_with_pyproject():
    env = (REPO / "environment.yml").read_text()
    py = re.search(r"-\s*python=(\d+\.\d+)", env).group(1)
    requires = _pyproject()["project"]["requires-python"]
    lo, hi = re.search(r">=(\d+\.\d+),<(\d+\.\d+)", requires).groups()
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(lo) <= as_tuple(py) < as_tuple(hi)
    extras = re.search(r'-e\s+"?\.\[([a-z,]+)\]', env).group(1).split(",")
    declared = _pyproject()["project"]["optional-dependencies"]
    assert set(extras) <= set(declared), f"environment.yml extras {extras} not in pyproject"
    setup = (REPO / "bin" / "setup").read_text()
    default = re.search(r'STATESCOPE_EXTRAS:-([a-z,]+)', setup).group(1).split(",")
    assert sorted(default) == sorted(extras), "bin/setup and environment.yml install different extras"


def test_pinned_vllm_is_the_installed_one():
    from importlib.metadata import version

    pin = next(d for d in _pyproject()["project"]["optional-dependencies"]["cpu"] if "vllm" in d)
    name, want = pin.split("==")
    assert version(name) == want


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    cmd = next(line.split("exec ")[-1].strip() for line in ci.splitlines() if "bin/test" in line)
    assert cmd in (REPO / "README.md").read_text()


def test_shims_act_in_a_fresh_interpreter():
    """vLLM imports models in subprocesses: the .pth hook must make torchvision import there."""
    code = ("import importlib.util, torchvision\n"
            "from torchvision.transforms import v2\n"
            "assert importlib.util.find_spec('torchaudio') is None\n"
            "try:\n    import torchaudio\nexcept ImportError:\n    print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"
