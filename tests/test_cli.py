"""The statescope CLI as a user runs it: a real subprocess, real engine."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "statescope.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_doctor_without_engine_json():
    proc = _cli("doctor", "--no-engine", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    names = [c["name"] for c in report["checks"]]
    assert names == ["statescope", "torch", "vllm", "device profile", "model"] and report["ok"]


def test_doctor_bad_model_is_one_line(tmp_path):
    proc = _cli("doctor", "--no-engine", "--model", str(tmp_path))
    assert proc.returncode == 2  # a model that is not there is bad input (issue 24)
    assert proc.stderr.strip().splitlines()[-1].startswith("statescope doctor: ")
    assert "config.json: missing" in proc.stderr


@pytest.mark.slow
@pytest.mark.engine
def test_doctor_starts_the_trigger_configuration():
    proc = _cli("doctor", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"]
    r, m = report["resolved"], report["metrics"]
    assert r["enable_prefix_caching"] and r["mamba_cache_mode"] == "align"
    assert r["num_speculative_tokens"] == 2 and r["draft_architecture"] == "Qwen3_5MTP"
    assert m["prefix_cache_hits"] > 0 and m["spec_accepted_tokens"] > 0
    assert r["async_scheduling"] is False and r["warnings"]
