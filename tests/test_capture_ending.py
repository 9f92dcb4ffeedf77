"""Pure parts of issue 20's fixes: how a run ended, the resume-column lookup, older captures.

No engine: the manifest's ``ended`` record from plan and outcome (``statescope.capture.ending``),
older manifests read back, the resume-offset lookup the step uploads (``capture.resume``), the
capture command's help, and the committed H200 capture (vLLM 0.26.0, before the word hash and
the resume column) still compared and checked — on its running column, which the report says.
"""
from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest

import statescope  # noqa: F401
from statescope.capture.ending import ending, run_ending
from statescope.capture.resume import lookup_offsets
from statescope.capture.store import CaptureRun

ROOT = Path(__file__).resolve().parents[1]
GPU_CAPTURE = ROOT / "data/results/gpu/e2e/capture_tiny-gui.tar.gz"
PLAN = {"requests_planned": 12, "max_tokens": 16}


@pytest.mark.parametrize("workload,outcome,complete,why", [
    (PLAN, {"requests_finished": 12}, True, "ran to its end"),
    (PLAN, {"requests_finished": 4}, False, "4 of 12 planned requests finished"),
    (PLAN, {"engine_error": "RuntimeError: boom"}, False, "the engine raised: RuntimeError: boom"),
    (PLAN, None, False, "before the workload reported how it ended"),
    (None, None, True, "completeness not known"),
])
def test_run_ending_from_plan_and_outcome(workload, outcome, complete, why):
    end = run_ending(workload, outcome, "close", 7, 0)
    assert end["complete"] is complete and why in end["why"]
    assert end["engine_steps_captured"] == 7 and end["requests_planned"] == (workload or {}).get(
        "requests_planned")


def test_ending_reads_older_manifests_by_status():
    assert ending({"status": "complete"})["complete"] and not ending({"status": "complete"})["recorded"]
    assert not ending({"status": "running"})["complete"]
    bad = ending({"status": "complete_with_errors", "error_count": 3})
    assert not bad["complete"] and "3 capture hook error(s)" in bad["why"]
    hooked = ending({"status": "complete_with_errors", "error_count": 1,
                     "ended": run_ending(PLAN, {"requests_finished": 12}, "close", 3, 1)})
    assert not hooked["complete"] and hooked["recorded"]


def test_resume_offsets_for_every_count():
    """Offset of the column the next step reads, per accepted count 0..3: ``count - 1`` clamped
    to the drafts; 0 when every draft was accepted and the step ended a block (the post-process
    moved the state to the running column)."""
    lut = lookup_offsets(np.array([2, 2, 0, 1]), np.array([False, True, False, True]), 4)
    # (a count above drafts + 1 cannot happen; it only clamps, so the gather stays in bounds)
    assert lut.tolist() == [[0, 0, 1, 2], [0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1]]


def test_capture_help_says_what_the_workload_runs(capsys):
    from statescope.cli.main import main

    with pytest.raises(SystemExit):
        main(["capture", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "EPISODES x STEPS" in text and "waves" in text and "tiny-gui" in text
    assert "tokens generated per request" in text and "accepts ~0.76" in text


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory) -> CaptureRun:
    out = tmp_path_factory.mktemp("gpu_capture")
    with tarfile.open(GPU_CAPTURE) as tf:
        tf.extractall(out, filter="data")
    return CaptureRun(out)


def test_an_older_capture_is_compared_on_its_running_column(gpu_run, capsys):
    from statescope.cli.main import main
    from statescope.diverge.report import divergence_report

    assert "hash" not in gpu_run.digests().columns and "resume" not in gpu_run.digests().columns
    report = divergence_report(gpu_run, gpu_run)
    assert report.columns == "running" and report.diverged == [] and len(report.requests) == 288
    assert report.endings["run"]["complete"] and not report.endings["run"]["recorded"]
    assert main(["diverge", str(gpu_run.path), "--reference", str(gpu_run.path)]) == 0
    out = capsys.readouterr().out
    assert "0 of 288 requests diverge" in out and "running column only" in out
    assert "one step late" in out


def _as_killed(run: CaptureRun, dst: Path, finished: int | None, tables: bool = True) -> Path:
    """A copy of ``run`` as a capture killed mid-run: status running, no ``ended`` record, the
    plan and (``finished``) the progress its workload last recorded."""
    import json
    import shutil

    shutil.copytree(run.path, dst)
    if not tables:
        for part in (dst / "tables").glob("*.parquet"):
            part.unlink()
    man = json.loads((dst / "manifest.json").read_text())
    man.pop("ended", None)
    man.update(status="running", workload=dict(PLAN, requests_planned=288))
    if finished is not None:
        man["progress"] = {"requests_finished": finished, "waves_completed": 1}
    (dst / "manifest.json").write_text(json.dumps(man))
    return dst


def test_every_reader_refuses_an_incomplete_capture_until_told(gpu_run, tmp_path, capsys):
    """Item 7: continuity, census and diverge refuse a killed run (exit 2, the reason); recover
    closes it incomplete with how far it got; --allow-incomplete reads it, with a warning."""
    from statescope.capture.spool import recover
    from statescope.cli.main import main

    killed = _as_killed(gpu_run, tmp_path / "killed", finished=96)
    for argv in (["continuity", str(killed)], ["census", str(killed)],
                 ["diverge", str(killed), "--reference", str(gpu_run.path)]):
        assert main(argv) == 2, argv
        assert "incomplete" in capsys.readouterr().err
    rep = recover(killed)
    assert rep["steps_emitted"] == 0 and rep["status"] == "incomplete"  # closed, not left running
    end = CaptureRun(killed).ending()
    assert not end["complete"] and "96 of 288 planned requests finished" in end["why"]
    assert end["closed_by"] == "capture-recover" and "recovered" in end["why"]
    assert main(["census", str(killed)]) == 2 and main(["continuity", str(killed)]) == 2
    capsys.readouterr()
    assert main(["census", str(killed), "--allow-incomplete"]) == 0
    assert main(["continuity", str(killed), "--allow-incomplete"]) == 1  # its real breaks
    assert "INCOMPLETE" in capsys.readouterr().err
    assert recover(killed)["status"] == "incomplete"  # a second recovery changes nothing


def test_zero_of_zero_is_never_success(gpu_run, tmp_path, capsys):
    """An incomplete run that kept no rows: read anyway, it has nothing to say (exit 2)."""
    from statescope.cli.main import main

    empty = _as_killed(gpu_run, tmp_path / "empty", finished=None, tables=False)
    assert main(["diverge", str(empty), "--reference", str(gpu_run.path), "--allow-incomplete"]) == 2
    assert main(["census", str(empty), "--allow-incomplete"]) == 2
    assert main(["continuity", str(empty), "--allow-incomplete"]) == 2
    err = capsys.readouterr().err
    assert "0 of 0" not in err and "nothing" in err
