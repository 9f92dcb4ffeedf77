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


def test_sharing_and_browser_tools_are_in_the_installed_extras():
    """render/browser tests need these; environment.yml installs the same extras as bin/setup."""
    env = (REPO / "environment.yml").read_text()
    extras = re.search(r'-e\s+"?\.\[([a-z,]+)\]', env).group(1).split(",")
    declared = _pyproject()["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0].lower() for e in extras for d in declared[e]}
    for need in ("papermill", "nbformat", "kaleido", "jupyterlab", "playwright"):
        assert need in names, f"{need} is not in the extras {extras} that environment.yml installs"


def test_setup_installs_debian_chromium_only_when_missing():
    setup = (REPO / "bin" / "setup").read_text()
    guard = setup.index("! command -v chromium")
    assert guard < setup.index("apt-get install -y -qq chromium"), "chromium install is not guarded"
    assert "playwright install" not in setup, "the browser must come from Debian, not a download"


def _lock() -> dict[str, str]:
    from statescope.lockfile import read_lock

    return read_lock(REPO / "requirements.lock")


def test_the_lock_pins_every_dependency_and_bin_setup_and_conda_use_it():
    import re as _re

    pins = _lock()
    assert len(pins) > 50, "requirements.lock is missing or nearly empty (run bin/lock)"
    norm = lambda n: _re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    deps = list(_pyproject()["project"]["dependencies"])
    for extra in ("cpu", "notebooks", "dev"):
        deps += _pyproject()["project"]["optional-dependencies"][extra]
    for dep in deps:
        name = norm(_re.match(r"[A-Za-z0-9._-]+", dep).group(0))
        assert name in pins, f"{dep} (pyproject.toml) is not pinned in requirements.lock"
        if "==" in dep:
            assert pins[name] == dep.split("==")[1], f"{dep}: the lock pins {pins[name]}"
    assert "-c requirements.lock" in (REPO / "bin" / "setup").read_text().replace(
        "lockargs=(-c requirements.lock)", "-c requirements.lock")
    assert "- -c requirements.lock" in (REPO / "environment.yml").read_text()


def test_the_installed_environment_matches_the_lock():
    """bin/setup installed with the lock: nothing drifted (a drift is what a manifest records)."""
    from statescope.lockfile import environment_record

    rec = environment_record()
    assert rec["lock_sha256"] and rec["locked"] == len(_lock())
    assert rec["drift"] == {}, f"installed versions differ from requirements.lock: {rec['drift']}"
    assert rec["packages"]["torch"].startswith("2.13.0")


def test_drift_from_a_lock_is_named(tmp_path, monkeypatch):
    import statescope.lockfile as lf

    lock = tmp_path / "requirements.lock"
    lock.write_text("# a comment\nnumpy==0.0.1\nnot-installed-anywhere==1.0\n")
    monkeypatch.setattr(lf, "LOCK_FILE", lock)
    lf.environment_record.cache_clear()
    try:
        rec = lf.environment_record()
    finally:
        lf.environment_record.cache_clear()
    assert rec["locked"] == 2 and rec["drift"]["numpy"][0] == "0.0.1"
    assert rec["drift"]["not-installed-anywhere"] == ["1.0", None]
