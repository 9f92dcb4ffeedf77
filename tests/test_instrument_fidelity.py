"""Capture, diverge and continuity against corruptions statescope did not plant itself (issue 20).

Each test changes one request's GDN state at a chosen request step, layer and state kind inside a
real vLLM-CPU engine — ``tests/gdn_perturb.py``, a wrap of the GDN layer's forward written from
vLLM's source, independent of ``statescope.patches.faults`` — and asserts what the instruments
report: the request (and only it), the exact step, the origin layer and the kind. The model is
``tiny-gui`` (MTP acceptance ~0.76, 128-token blocks) on GUI-agent prompts, so steps accept 1, 2
or 3 tokens and conv windows shift in place; the first test asserts that the workload really
does both. One reference capture serves the module; every perturbed run is one more capture on
the same engine (a fraction of a second each, after the engine's start). The last test kills
the engine with an error mid-run and closes it.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

import statescope  # noqa: F401
import gdn_perturb as gp
from statescope.capture.session import record
from statescope.capture.store import CaptureRun
from statescope.diverge.conv_continuity import continuity_summary, conv_shift_check
from statescope.diverge.hypotheses import hypothesis_table, run_context
from statescope.diverge.report import divergence_report
from statescope.engine.config import EngineConfig, model_path
from statescope.workload.trace import prompt_sha

pytestmark = pytest.mark.engine
CONFIG = EngineConfig(model=str(model_path("tiny-gui")))  # prefix caching + align + MTP(2)
LAYER = "model.layers.{}.linear_attn"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def engine(engine_pool, monkeypatch_module):
    monkeypatch_module.setenv("STATESCOPE_CAPTURE_STRICT", "1")  # a hook error fails the test
    return engine_pool.get(CONFIG)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    """Token ids of the twelve step prompts of three held-out GUI-agent episodes (3, 4 and 5
    steps: later steps share earlier ones as a prefix)."""
    from statescope.models.tiny_vllm import step_prompts

    texts = [p for p, _ in step_prompts(3)]
    return [list(r.prompt_token_ids) for r in engine.generate(texts, max_tokens=1)]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fidelity")


@pytest.fixture(scope="module")
def reference(engine, prompts, out) -> CaptureRun:
    return record(engine, {"output_dir": str(out), "run_id": "reference"}, prompts,
                  max_tokens=MAX_TOKENS)[0]


def _perturbed(engine, prompts, out, name: str, *perturbations: gp.Perturbation) -> CaptureRun:
    gp.install(engine, list(perturbations))
    try:
        run, _ = record(engine, {"output_dir": str(out), "run_id": name}, prompts,
                        max_tokens=MAX_TOKENS)
    finally:
        gp.uninstall(engine)
    for p in perturbations:
        assert len(p.applied) == 1, p  # it fired, once
    return run


def _steady_steps(run: CaptureRun) -> pd.DataFrame:
    """Decode steps with a full draft set, step >= 2, no post-process copy (the state stays
    where the step wrote it), followed by two more full decode steps of the request."""
    st, cp = run.steps(), run.copies()
    pp = cp[(cp["launch_kind"] == "postprocess") & (cp["nbytes"] > 0)]
    moved = set(zip(pp["req_id"], pp["engine_step"]))
    full = st[st["num_drafts"] == 2]
    have = set(zip(full["req_id"], full["req_step"]))
    keep = [(r.req_id, r.engine_step) not in moved and (r.req_id, r.req_step + 1) in have
            and (r.req_id, r.req_step + 2) in have and r.req_step >= 2
            for r in full.itertuples()]
    return full[keep].sort_values(["req_step", "req_id"])


def _ids(prompts, sha: str) -> list[int]:
    return next(p for p in prompts if prompt_sha(p) == sha)


def _hit_what_it_named(p: gp.Perturbation, target) -> None:
    """The perturbation's own log agrees with the reference capture on the step it hit."""
    assert p.applied[0]["req_step"] == target.req_step
    assert p.applied[0]["num_computed_tokens"] == target.num_computed_tokens


def _victim(report, sha: str) -> dict:
    assert [r["prompt_sha"] for r in report.diverged] == [sha]  # that request, and only it
    return report.diverged[0]


def _drop_columns(run: CaptureRun, dst: Path, columns: list[str]) -> CaptureRun:
    """A copy of ``run`` as an older capture without ``columns`` in its digests table."""
    shutil.copytree(run.path, dst)
    for part in (dst / "tables").glob("digests-*.parquet"):
        frame = pd.read_parquet(part)
        frame.drop(columns=[c for c in columns if c in frame]).to_parquet(part)
    return CaptureRun(dst)


def test_workload_sees_partial_acceptance_and_in_place_shifts(reference):
    """Item 9: with tiny-gui the capture workload accepts 1, 2 or 3 tokens per decode step and
    shifts conv windows in place; the resume column is 0, 1 or 2 columns after the running one."""
    from statescope.cli.capture import exercised

    st = reference.steps()
    full = st[st["num_drafts"] == 2]
    assert set(full["accepted"]) == {1, 2, 3}
    assert 0.1 < (full["accepted"] < 3).mean() < 0.9
    assert set(full["resume_col_offset"]) == {0, 1, 2}
    ex = exercised(reference)
    assert ex["in_place_shifts"] > 0 and ex["partial_accept_steps"] > 0
    assert 0.5 < ex["acceptance"] < 0.95
    d = reference.digests()
    resume = d[d["resume"] & (d["kind"] == "ssm")]
    assert len(resume) == len(st) * 3  # one recurrent-state row per step and GDN layer
    assert set(resume["column_offset"]) == {0, 1, 2}
    assert reference.ending()["complete"] and reference.manifest["status"] == "complete"
    assert reference.manifest["ended"]["requests_finished"] == 12


def test_an_unperturbed_rerun_does_not_diverge(engine, prompts, out, reference, capsys):
    from statescope.cli.main import main

    again, _ = record(engine, {"output_dir": str(out), "run_id": "again"}, prompts,
                      max_tokens=MAX_TOKENS)
    report = divergence_report(again, reference)
    assert len(report.requests) == 12 and report.diverged == [] and report.warnings == []
    assert main(["diverge", str(again.path), "--reference", str(reference.path)]) == 0
    text = capsys.readouterr().out
    assert "0 of 12 requests diverge" in text and "no request diverged: nothing to explain" in text


def test_resume_slot_corruption_is_found_at_its_own_step(engine, prompts, out, reference, capsys):
    """Defect 1: a change to the column the next step resumes from (all drafts accepted: two
    columns after the running one) showed one step late. Now: that step, that layer, ssm, and
    the column it sits in; only the running-column comparison of older captures is late."""
    from statescope.cli.main import main

    target = _steady_steps(reference).query("resume_col_offset == 2").iloc[0]
    p = gp.Perturbation(_ids(prompts, target.prompt_sha), int(target.req_step), 1, "ssm",
                        lambda b: b[0, 3, 5].add_(1.0), column=2)
    bad = _perturbed(engine, prompts, out, "resume-slot", p)
    _hit_what_it_named(p, target)
    report = divergence_report(bad, reference)
    assert report.columns == "resume"
    rec = _victim(report, target.prompt_sha)
    assert rec["first_step"] == target.req_step
    assert rec["origin_layer"] == LAYER.format(1) and rec["kinds"] == ["ssm"]
    assert rec["layers"] == [LAYER.format(1)] and rec["per_layer"][0]["ssm_columns"] == [2]
    late = divergence_report(bad, reference, columns="running")  # what the old default saw
    assert _victim(late, target.prompt_sha)["first_step"] == target.req_step + 1
    # defect 7 and 8: exit 1 when a request diverges; integer steps, layer numbers, one request
    assert main(["diverge", str(bad.path), "--reference", str(reference.path)]) == 1
    text = capsys.readouterr().out
    assert f"first divergence at step {int(target.req_step)}, origin layer 1 (ssm); layers 1" in text
    assert "recurrent columns [2]" in text and "11 other request(s): no divergence" in text
    assert "NaN" not in text and ".0," not in text
    assert text.count("first divergence at step") == 1
    # defect 6: a one-layer recurrent-state change on a synchronous CPU run fits no mechanism
    assert "finding: no mechanism fits the evidence" in text
    assert main(["diverge", str(bad.path), "--reference", str(reference.path), "--json"]) == 1
    js = json.loads(capsys.readouterr().out)
    assert js["requests_diverged"] == 1 and js["columns"] == "resume"
    assert js["hypotheses"]["finding"] == []


def test_whole_state_scale_by_two_is_seen_by_the_hash(engine, prompts, out, reference, tmp_path):
    """Defect 2a: every float32 word of a recurrent state doubled (exponent + 1) keeps the
    word-sum checksum when the block has a multiple of 512 nonzero elements (tiny-gui: 16384).
    The word hash sees it at its step — also where only exact numbers are compared."""
    target = _steady_steps(reference).iloc[1]
    p = gp.Perturbation(_ids(prompts, target.prompt_sha), int(target.req_step), 2, "ssm",
                        lambda b: b.mul_(2), column=int(target.resume_col_offset))
    bad = _perturbed(engine, prompts, out, "scale2", p)
    _hit_what_it_named(p, target)
    assert p.applied[0]["zeros_before"] == 0  # every word changed: the checksum cannot see it
    rec = _victim(divergence_report(bad, reference), target.prompt_sha)
    assert rec["first_step"] == target.req_step and rec["kinds"] == ["ssm"]
    assert rec["origin_layer"] == LAYER.format(2)
    seen = rec["per_layer"][0]["differs_by"]
    assert "hash" in seen and "floats" in seen and "checksum" not in seen
    exact_only = divergence_report(bad, reference, rtol=float("inf"))  # floats never differ
    assert _victim(exact_only, target.prompt_sha)["first_step"] == target.req_step
    # the same runs as captures before the hash: exact-only comparison misses the step
    old_bad = _drop_columns(bad, tmp_path / "bad", ["hash", "row_hashes"])
    old_ref = _drop_columns(reference, tmp_path / "ref", ["hash", "row_hashes"])
    missed = divergence_report(old_bad, old_ref, rtol=float("inf"))
    assert all(r["first_step"] != target.req_step for r in missed.diverged)


def _swap_two_channels(row: torch.Tensor) -> None:
    a = 0
    b = next(i for i in range(1, row.numel()) if row[i] != row[a])
    row[[a, b]] = row[[b, a]]


def test_a_swap_inside_a_live_conv_row_is_found_at_its_step(engine, prompts, out, reference,
                                                            tmp_path):
    """Defect 2b: two channels of one live conv row swapped keep the row's checksum and sum;
    the row hash sees the swap at its own step, as conv row 0 of that layer's window."""
    target = _steady_steps(reference).iloc[2]
    row = int(target.conv_live_offset)  # the live window's leading row
    p = gp.Perturbation(_ids(prompts, target.prompt_sha), int(target.req_step), 0, "conv",
                        lambda b: _swap_two_channels(b[row]))
    bad = _perturbed(engine, prompts, out, "swap", p)
    _hit_what_it_named(p, target)
    assert p.applied[0]["changed"] == 2
    rec = _victim(divergence_report(bad, reference), target.prompt_sha)
    assert rec["first_step"] == target.req_step and rec["origin_layer"] == LAYER.format(0)
    assert rec["kinds"] == ["conv"] and rec["conv_rows"] == [0]
    assert rec["layers"] == [LAYER.format(0)]
    old = divergence_report(_drop_columns(bad, tmp_path / "bad", ["row_hashes"]),
                            _drop_columns(reference, tmp_path / "ref", ["row_hashes"]))
    assert all(r["first_step"] != target.req_step for r in old.diverged)  # missed before


def test_a_value_error_on_one_carried_conv_row_is_not_read_as_a_wrong_shift(
        engine, prompts, out, reference, capsys):
    """Defect 3: +4.0 on one carried conv row of one layer, just before the next step reads it.
    Continuity breaks there with no shift fitting, in that layer only: a value change. Every
    GDN layer diverges at that step (layer 0 feeds the others), which alone looks like H-accept's
    signature; with async scheduling assumed on, the continuity evidence contradicts it."""
    from statescope.cli.main import main

    target = _steady_steps(reference).iloc[0]
    step = int(target.req_step) + 1
    carried = int(target.conv_live_offset) + 1  # the next read's second row, carried on
    p = gp.Perturbation(_ids(prompts, target.prompt_sha), step, 0, "conv",
                        lambda b: b[carried].add_(4.0), when="before")
    bad = _perturbed(engine, prompts, out, "carried-row", p)
    df = conv_shift_check(bad)
    broken = df[~df["ok"]]
    victim = bad.steps().query("prompt_sha == @target.prompt_sha")["req_id"].iloc[0]
    assert list(zip(broken["req_id"], broken["req_step"], broken["layer"])) == [
        (victim, step, LAYER.format(0))]
    assert broken["break_kind"].tolist() == ["no shift fits"]
    assert continuity_summary(df)["break_kinds"] == {"value change (no shift fits)": 1}
    assert main(["continuity", str(bad.path)]) == 1
    assert "1 value change (no shift fits)" in capsys.readouterr().out
    report = divergence_report(bad, reference)
    rec = _victim(report, target.prompt_sha)
    assert rec["first_step"] == step and rec["origin_layer"] == LAYER.format(0)
    # layer 0's conv inputs are the embeddings: only the carried row differs, and it is live
    # again only if the step accepts one token; its recurrent state differs for sure
    assert "ssm" in rec["kinds"]
    assert len(rec["layers"]) == 3  # the trap: every layer at once
    ctx = replace(run_context(bad, gdn_layers=3), async_scheduling=True)
    naive = {r["hypothesis"]: r for r in hypothesis_table(report, ctx).rows}
    assert naive["H-accept"]["supports"] == 1  # the signature alone would have said H-accept
    table = hypothesis_table(report, ctx, continuity=df)
    accept = {r["hypothesis"]: r for r in table.rows}["H-accept"]
    assert accept["supports"] == 0 and accept["contradicts"] == 1
    assert "value change" in accept["why"] and "H-accept" not in table.finding()


def test_a_capture_whose_engine_raised_is_incomplete_and_diverge_refuses_it(
        engine_pool, engine, prompts, out, reference, capfd):
    """Defect 5: the engine raised mid-run; the capture said complete and diverge compared its
    two steps silently. Now: status incomplete, the error and the plan in the manifest, exit 2
    from diverge (a loud warning with --allow-incomplete). Kills the engine: runs last."""
    from statescope.cli.main import main

    target = _steady_steps(reference).iloc[0]
    p = gp.Perturbation(_ids(prompts, target.prompt_sha), 3, 1, "ssm", "raise")
    gp.install(engine, [p])
    try:
        with pytest.raises(Exception):
            record(engine, {"output_dir": str(out), "run_id": "crashed"}, prompts,
                   max_tokens=MAX_TOKENS)
    finally:
        engine_pool.close()  # the engine is dead after an error in its step
    run = CaptureRun(out / "crashed")
    end = run.ending()
    assert run.manifest["status"] == "incomplete" and not end["complete"]
    assert "test perturbation" in end["engine_error"] and end["requests_planned"] == 12
    assert len(run.steps()) > 0  # what it captured before the error is kept
    capfd.readouterr()
    assert main(["diverge", str(run.path), "--reference", str(reference.path)]) == 2
    err = capfd.readouterr().err
    assert "incomplete" in err and "crashed" in err and "--allow-incomplete" in err
    rc = main(["diverge", str(run.path), "--reference", str(reference.path), "--allow-incomplete"])
    assert rc in (0, 1)
    captured = capfd.readouterr()
    assert "WARNING: INCOMPLETE" in captured.err and "WARNING: INCOMPLETE" in captured.out
    # by token position (the default) the positions the crashed run never reached are counted
    # as unpaired, not warned about; by request step the shorter request is named
    assert "paired by: token position" in captured.out
    un = re.search(r"unpaired positions: \d+ in the run only, (\d+) in the", captured.out)
    assert un and int(un.group(1)) > 0
    main(["diverge", str(run.path), "--reference", str(reference.path), "--allow-incomplete",
          "--pairing", "step"])
    assert "captured a different number of steps" in capfd.readouterr().out
