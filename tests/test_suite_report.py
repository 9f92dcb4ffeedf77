"""The suite's own end-of-run checks (``tests/suite_report.py``): a non-GPU skip fails the run, a
GPU skip does not, and every run prints its wall time per file."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from suite_report import is_gpu_reason

HERE = Path(__file__).parent


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["suite_report"]\n')
    (tmp_path / "test_inner.py").write_text("import pytest\n" + body)
    env = {"PYTHONPATH": str(HERE), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


def test_reasons_that_name_an_accelerator():
    assert is_gpu_reason("needs a CUDA device (runs on the GPU host)")
    assert is_gpu_reason("CUDA graphs need a GPU")
    assert not is_gpu_reason("vLLM 0.32.0 sources not extracted at /x")
    assert not is_gpu_reason("no C compiler")
    assert not is_gpu_reason("no device profile file")  # "device" alone is no GPU wording


def test_a_non_gpu_skip_fails_the_run_under_xdist(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["suite_report"]\n')
    (tmp_path / "test_inner.py").write_text(
        "import pytest\ndef test_ok():\n    pass\n"
        "def test_s():\n    pytest.skip('no device profile file')\n")
    env = {"PYTHONPATH": str(HERE), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                        str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 1, r.stdout
    assert "skips that do not need a GPU" in r.stdout and "no device profile file" in r.stdout


def test_a_skip_that_needs_no_gpu_fails_the_run(tmp_path):
    r = _run(tmp_path, "def test_ok():\n    pass\n"
                       "def test_s():\n    pytest.skip('release sources not extracted')\n")
    assert r.returncode == 1, r.stdout
    assert "skips that do not need a GPU" in r.stdout and "release sources not extracted" in r.stdout
    assert "wall time per test file" in r.stdout and "test_inner.py" in r.stdout


def test_a_gpu_skip_passes(tmp_path):
    r = _run(tmp_path, "def test_ok():\n    pass\n"
                       "@pytest.mark.skipif(True, reason='needs a CUDA device')\n"
                       "def test_g():\n    pass\n")
    assert r.returncode == 0, r.stdout
    assert "1 passed, 1 skipped" in r.stdout and "skips that do not need" not in r.stdout
