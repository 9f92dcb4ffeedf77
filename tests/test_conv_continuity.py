"""Exact conv-window continuity (``statescope.diverge.conv_continuity``) and how the hypothesis scorer uses it.

Fast (no engine): the committed GPU capture (vLLM 0.26.0, H200, async + MTP 2) gives the numbers
docs/gpu.md reports — 41 broken transitions on 36 requests, all "1 where 3", 41 of 47 moved rows
in batches with prefill rows, none elsewhere; bad captures raise ``InputError``; the continuity
evidence makes H-accept outrank H-reorder. Engine (vLLM-CPU, embedded tiny model, trigger
configuration): a clean digest capture has no break, and the planted ``permute_accepted`` fault
breaks continuity exactly at the step after the swap of each swapped request whose swap step and
next step are both full decode steps; H-accept is then ranked first on that evidence.
"""
from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pandas as pd
import pytest

import statescope  # noqa: F401
from statescope.capture.store import CaptureRun
from statescope.diverge.conv_continuity import conv_shift_check, continuity_summary, window_geometry
from statescope.errors import InputError
from statescope.diverge.hypotheses import (CONTRADICTS, SUPPORTS, RunContext, hypothesis_table,
                                   score_accept, score_reorder, with_continuity)

ROOT = Path(__file__).resolve().parents[1]
GPU_CAPTURE = ROOT / "data/results/gpu/e2e/capture_tiny-gui.tar.gz"
LAYERS = ["model.layers.0.linear_attn", "model.layers.1.linear_attn", "model.layers.2.linear_attn"]


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory) -> CaptureRun:
    out = tmp_path_factory.mktemp("gpu_capture")
    with tarfile.open(GPU_CAPTURE) as tf:
        tf.extractall(out, filter="data")
    return CaptureRun(out)


@pytest.fixture(scope="module")
def gpu_check(gpu_run) -> pd.DataFrame:
    return conv_shift_check(gpu_run)


def test_geometry_comes_from_the_manifest(gpu_run):
    assert window_geometry(gpu_run) == {"rows": 5, "kernel": 4, "num_spec": 2, "carry": 2}


def test_gpu_capture_breaks_only_on_moved_rows_in_batches_with_prefill(gpu_check):
    df = gpu_check
    assert set(df.layer) == set(LAYERS)
    s = continuity_summary(df)
    assert s["transitions_checked"] == 1039 and s["requests_checked"] == 288
    assert s["requests_with_break"] == 36 and s["break_transitions"] == 41
    assert s["break_transitions_moved"] == 41 and s["breaks_per_layer_agree"]
    assert s["observed_vs_expected"] == [{"expected_shift": 3, "observed_shifts": "[1]",
                                          "transitions": 41}]
    cells = {(c["expected_shift"], c["moved"], c["prefill_in_batch"]): (c["transitions"], c["broken"])
             for c in s["contingency"]}
    assert cells[(3, True, True)] == (47, 41)
    others = [v for k, v in cells.items() if k != (3, True, True)]
    assert sum(b for _, b in others) == 0 and sum(t for t, _ in others) == 1039 - 47
    assert s["break_engine_steps"] == [7, 9, 25, 26, 39, 40, 41, 42, 58, 59, 83]
    # the recorded post-process count agrees with the sampled one at every break: that column
    # cannot see what the next forward's conv update read
    broken = df[~df.ok]
    assert (broken.used_recorded == broken.accepted_prev).all()
    # in-place shifts read after the shift: the rows they duplicate agree bit for bit
    shifted = df[df.inplace_shift_bias > 0]
    assert len(shifted) == 36 and shifted.inplace_shift_intact.all()


def test_continuity_evidence_ranks_accept_over_reorder_on_the_gpu_break(gpu_check):
    # the first departed request of docs/history/gpu-campaigns.md (round 2): oracle departure at
    # step 6, all layers, both kinds, prefill rows in the batch of steps 5 and 6; the post-process count equals the sampled one
    rec = {"req_id": "99-97b8b3da", "first_step": 6, "kinds": ["conv", "ssm"], "layers": LAYERS,
           "conv_rows": [0, 1, 2], "ssm_lag": 0,
           "events": {"num_drafts": [2, 2, 2], "prefill_steps": [5, 6], "batch_has_prefill": True,
                      "accepted_mismatch": False, "same_block_left_shift": False}}
    ctx = RunContext(async_scheduling=True, spec=True, gdn_layers=3, prefix_cache_hits=1,
                     block_size=48, mamba_block_size=48)
    assert score_reorder(rec, ctx).verdict == SUPPORTS  # without the continuity check
    with_cc = with_continuity(rec, gpu_check)
    assert with_cc["conv_continuity"]["breaks"] == [
        {"req_step": 6, "expected_shift": 3, "observed_shifts": [1], "layers": 3, "moved": True,
         "inplace_shift_bias": 0, "prefill_rows_in_batch": 10}]
    accept = score_accept(with_cc, ctx)
    assert accept.verdict == SUPPORTS and "by [1]" in accept.why and "gives 3" in accept.why
    assert score_reorder(with_cc, ctx).verdict == CONTRADICTS
    table = hypothesis_table([rec], ctx, continuity=gpu_check)
    rank = {r["hypothesis"]: r["rank"] for r in table.rows}
    assert rank["H-accept"] == 1 and rank["H-accept"] < rank["H-reorder"]
    plain = hypothesis_table([rec], ctx)  # no continuity: the old ranking, accept not contradicted
    assert {r["hypothesis"]: r for r in plain.rows}["H-accept"]["contradicts"] == 0


def test_intact_continuity_keeps_the_signature_verdict():
    rec = {"req_id": "r", "first_step": 4, "kinds": ["ssm"], "layers": LAYERS, "conv_rows": [],
           "ssm_lag": 0, "events": {"accepted_mismatch": False}}
    cont = pd.DataFrame([{"req_id": "r", "req_step": 4, "layer": l, "expected_shift": 3,
                          "observed_shifts": [3], "ok": True} for l in LAYERS])
    v = score_accept(with_continuity(rec, cont), RunContext(async_scheduling=True, spec=True,
                                                            gdn_layers=3))
    assert v.verdict == SUPPORTS and "signature only" in v.why and "intact at steps [4]" in v.why


def _copy_run(src: CaptureRun, dst: Path) -> Path:
    shutil.copytree(src.path, dst)
    return dst


def test_bad_captures_raise_input_error_naming_run_and_field(gpu_run, tmp_path):
    no_rows = _copy_run(gpu_run, tmp_path / "no_rows")
    for part in (no_rows / "tables").glob("digests-*.parquet"):
        pd.read_parquet(part).drop(columns=["row_checksums"]).to_parquet(part)
    with pytest.raises(InputError, match=r"no_rows.*row_checksums"):
        conv_shift_check(no_rows)
    from statescope.diverge.conv_continuity import run_continuity

    assert run_continuity(no_rows) is None  # what `statescope diverge` uses: skipped, not an error
    assert len(run_continuity(gpu_run)) == 3117

    no_acc = _copy_run(gpu_run, tmp_path / "no_acc")
    for part in (no_acc / "tables").glob("steps-*.parquet"):
        pd.read_parquet(part).drop(columns=["accepted", "num_accepted_sampled"]).to_parquet(part)
    with pytest.raises(InputError, match=r"no_acc.*num_accepted_sampled"):
        conv_shift_check(no_acc)

    no_geo = _copy_run(gpu_run, tmp_path / "no_geo")
    manifest = json.loads((no_geo / "manifest.json").read_text())
    del manifest["conv_window"]
    (no_geo / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=r"no_geo.*conv_window"):
        conv_shift_check(no_geo)


# ---- real engine ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.engine
def test_clean_run_is_continuous_and_a_planted_count_swap_breaks_it_where_planted(
        engine_pool, tmp_path):
    from conftest import TRIGGER
    from statescope.capture.session import record
    from statescope.workload.trace import prompt_sha
    from statescope.diverge.report import divergence_report
    from statescope.diverge.study import staggered_prompts
    from statescope.patches.faults import FaultSpec, install_fault, uninstall_fault
    from statescope.diverge.hypotheses import run_context

    engine = engine_pool.get(TRIGGER)
    prompts = staggered_prompts(engine.resolved()["mamba_block_size"])
    spec = lambda name: {"output_dir": str(tmp_path), "run_id": name}  # noqa: E731 (digest mode)
    clean, _ = record(engine, spec("clean"), prompts, max_tokens=10)
    fault = FaultSpec("permute_accepted", prompt_shas=[prompt_sha(prompts[0])], at_output_token=1)
    install_fault(fault)
    try:
        bad, _ = record(engine, spec("permuted"), prompts, max_tokens=10)
    finally:
        uninstall_fault()

    clean_df = conv_shift_check(clean)
    s = continuity_summary(clean_df)
    assert s["transitions_checked"] >= 2 * len(prompts) and s["break_transitions"] == 0, s

    df = conv_shift_check(bad)
    steps = bad.steps()
    assert len(fault.planted) == 2  # the selected request and its swap partner
    want = set()
    for p in fault.planted:
        mine = steps[steps.req_id == p["req_id"]].set_index("req_step")
        at = int(mine.index[mine.num_computed_tokens == p["num_computed_tokens"]][0])
        checkable = (at + 1 in mine.index and (mine.loc[[at, at + 1], "num_drafts"] == 2).all())
        if checkable:  # decode -> decode: the next step's conv update reads the swapped count
            want.add((p["req_id"], at + 1))
            got = df[(df.req_id == p["req_id"]) & (df.req_step == at + 1)]
            assert len(got) == 3 and not got.ok.any()
            assert (got.accepted_prev == p["num_accepted_sampled"]).all()
            assert all(p["num_accepted_used"] - b in o for o, b in
                       zip(got.observed_shifts, got.inplace_shift_bias_prev))
    broken = {(r, int(q)) for r, q in df[~df.ok][["req_id", "req_step"]].itertuples(index=False)}
    assert want and broken == want  # nowhere else

    report = divergence_report(bad, clean)  # by token position (the default)
    assert report.pairing == "token position"
    # both swapped requests, the partner too: its resume positions after the swap meet none of
    # the clean run's (it accepts otherwise), its running column's state does
    assert {r["req_id"] for r in report.diverged} >= {p["req_id"] for p in fault.planted}
    assert {r["req_id"] for r in report.diverged} >= {r for r, _ in want}
    ctx = run_context(bad, planted="permute_accepted")
    table = hypothesis_table(report, ctx, continuity=df)
    assert table.ranking()[0] == "H-accept" and table.rows[0]["label"].startswith("EMULATED")
    assert table.rows[0]["contradicts"] == 0
    victim = next(r for r in report.diverged if (r["req_id"], r["first_step"]) in want)
    why = score_accept(with_continuity(victim, df), ctx).why
    assert "exact row checksums" in why


def test_continuity_cli_reports_the_gpu_breaks_and_exits_1(gpu_run, capsys):
    """`statescope continuity RUN --json` needs no reference run: the GPU capture's 41 broken
    transitions (3 layers each) come out, and the exit status says a shift broke."""
    from statescope.cli.main import main

    rc = main(["continuity", str(gpu_run.path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert out["summary"]["break_transitions"] == 41 and len(out["breaks"]) == 41 * 3
    assert {b["expected_shift"] for b in out["breaks"]} == {3}
    assert all(b["moved"] for b in out["breaks"])
    # every break moved all three layers' windows by one other shift: the wrong-count signature
    assert out["summary"]["break_kinds"] == {"wrong shift": 41}
    assert {b["break_kind"] for b in out["breaks"]} == {"other shift"}
    main(["continuity", str(gpu_run.path)])
    assert "41 wrong shift: every GDN layer's window moved" in capsys.readouterr().out
