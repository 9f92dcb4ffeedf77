"""Hypothesis scorers on small fake first-divergence records, and one real-engine divergence report.

The pure tests build records by hand (the shape ``diverge.divergence_report`` produces) and check
each scorer's three outcomes. The engine test re-uses the planted barrier-less copy of
tests/test_capture.py: a memmove reference, a second memmove run (no fault, no divergence) and a
``barrierless_tiles`` run, then the report, the CLI and the ranked table.
"""
from __future__ import annotations

import argparse
import json

import pytest

import statescope  # noqa: F401
from statescope.diverge.report import divergence_report
from statescope.cli.diverge import add_diverge_subcommand
from statescope.errors import InputError
from statescope.diverge.hypotheses import (CONTRADICTS, NOT_EXERCISED, SCORERS, SUPPORTS, RunContext,
                                   hypothesis_table, score_accept, score_copy, score_drop,
                                   score_empty, score_lostcopy, score_midblock, score_reorder,
                                   score_split)

LAYERS = ["model.layers.0.linear_attn", "model.layers.1.linear_attn", "model.layers.2.linear_attn"]


def rec(first_step=3, kinds=("conv",), layers=LAYERS[:1], conv_rows=(0,), ssm_lag=1, **events):
    ev = {"same_block_left_shift": False, "prefix_hit_tokens": 0, "block_crossing": False,
          "num_drafts": [2, 2], "accepted": [3, 3], "batch_has_prefill": False}
    ev.update(events)
    return {"req_id": "r", "first_step": first_step, "kinds": list(kinds), "layers": list(layers),
            "conv_rows": list(conv_rows), "ssm_lag": ssm_lag, "events": ev}


SYNC_SPEC = RunContext(spec=True, gdn_layers=3, same_block_shifts=4, block_size=384,
                       mamba_block_size=384)
ASYNC_SPEC = RunContext(async_scheduling=True, spec=True, gdn_layers=3)


def test_copy_supports_only_leading_conv_rows_right_after_a_same_block_shift():
    v = score_copy(rec(same_block_left_shift=True), SYNC_SPEC)
    assert v.verdict == SUPPORTS and "one step later" in v.why
    assert score_copy(rec(same_block_left_shift=True, ssm_lag=None), SYNC_SPEC).verdict == SUPPORTS
    assert score_copy(rec(), SYNC_SPEC).verdict == CONTRADICTS  # no shift near the divergence
    both = score_copy(rec(kinds=("conv", "ssm"), same_block_left_shift=True), SYNC_SPEC)
    assert both.verdict == CONTRADICTS and "conv+ssm" in both.why
    newest = score_copy(rec(conv_rows=(2,), same_block_left_shift=True), SYNC_SPEC)
    assert newest.verdict == CONTRADICTS and "leading" in newest.why
    assert score_copy(rec(), RunContext(spec=True)).verdict == NOT_EXERCISED  # no shift at all


def test_accept_needs_async_and_spec_and_every_layer_at_once():
    everything = rec(kinds=("conv", "ssm"), layers=LAYERS)
    assert score_accept(everything, SYNC_SPEC).verdict == NOT_EXERCISED
    assert score_accept(everything, RunContext(async_scheduling=True, gdn_layers=3)).verdict \
        == NOT_EXERCISED
    assert score_accept(everything, ASYNC_SPEC).verdict == SUPPORTS
    assert score_accept(rec(kinds=("conv", "ssm"), layers=LAYERS[:2]), ASYNC_SPEC).verdict == CONTRADICTS
    assert score_accept(rec(layers=LAYERS), ASYNC_SPEC).verdict == CONTRADICTS  # conv only
    # the post-process launch's count equal to the sampled one is a note, not a contradiction:
    # the next forward's state update reads its own copy of the count
    fine = score_accept(rec(kinds=("conv", "ssm"), layers=LAYERS, accepted_mismatch=False), ASYNC_SPEC)
    assert fine.verdict == SUPPORTS and "not decisive" in fine.why


def test_accept_uses_the_count_used_vs_sampled_and_a_planted_permutation_exercises_it():
    ssm_all = rec(kinds=("ssm",), layers=LAYERS)  # conv live rows may be all fresh inputs
    assert score_accept(ssm_all, ASYNC_SPEC).verdict == SUPPORTS
    assert "not recorded" in score_accept(ssm_all, ASYNC_SPEC).why
    used = rec(kinds=("ssm",), layers=LAYERS, accepted_mismatch=True)
    assert "differs" in score_accept(used, ASYNC_SPEC).why
    assert score_accept(used, SYNC_SPEC).verdict == NOT_EXERCISED
    planted = RunContext(spec=True, gdn_layers=3, planted="permute_accepted")
    assert score_accept(used, planted).verdict == SUPPORTS
    table = hypothesis_table([used], planted)
    assert table.ranking()[0] == "H-accept" and "PLANTED permute_accepted" in table.rows[0]["label"]


def test_lostcopy_wants_conv_and_ssm_in_the_step_of_a_postprocess_copy():
    ctx = RunContext(spec=True, gdn_layers=3, postprocess_copies=6)
    hit = rec(kinds=("conv", "ssm"), postprocess_copy_steps=[3])
    assert score_lostcopy(hit, ctx).verdict == SUPPORTS
    assert score_lostcopy(rec(kinds=("conv", "ssm"), postprocess_copy_steps=[2]), ctx).verdict \
        == CONTRADICTS
    assert score_lostcopy(rec(postprocess_copy_steps=[3]), ctx).verdict == CONTRADICTS  # conv only
    wrong_count = rec(kinds=("conv", "ssm"), postprocess_copy_steps=[3], accepted_mismatch=True)
    assert "H-accept" in score_lostcopy(wrong_count, ctx).why
    assert score_lostcopy(hit, RunContext(spec=True)).verdict == SUPPORTS  # the event itself counts
    assert score_lostcopy(rec(), RunContext(spec=True)).verdict == NOT_EXERCISED


def test_reorder_wants_the_prefill_in_the_divergent_step_itself():
    r = rec(kinds=("conv", "ssm"), layers=LAYERS, batch_has_prefill=True, prefill_steps=[2])
    assert score_reorder(r, SYNC_SPEC).verdict == CONTRADICTS  # prefill one step earlier
    assert score_reorder({**r, "events": {**r["events"], "prefill_steps": [3]}},
                         SYNC_SPEC).verdict == SUPPORTS


@pytest.mark.parametrize("scorer", [score_drop, score_midblock])
def test_drop_and_midblock_want_divergence_from_the_first_step_after_a_prefix_hit(scorer):
    hits = RunContext(spec=True, prefix_cache_hits=2)
    assert scorer(rec(first_step=1, prefix_hit_tokens=384), hits).verdict == SUPPORTS
    late = scorer(rec(first_step=5, prefix_hit_tokens=384), hits)
    assert late.verdict == CONTRADICTS and "step 5" in late.why
    assert scorer(rec(first_step=1), hits).verdict == CONTRADICTS  # this request had no hit
    assert scorer(rec(first_step=1, prefix_hit_tokens=384), SYNC_SPEC).verdict == NOT_EXERCISED


def test_drop_needs_a_drafter_midblock_does_not():
    no_spec = RunContext(prefix_cache_hits=1)
    r = rec(first_step=1, prefix_hit_tokens=384)
    assert score_drop(r, no_spec).verdict == NOT_EXERCISED
    assert score_midblock(r, no_spec).verdict == SUPPORTS


def test_split_only_when_block_sizes_differ():
    assert score_split(rec(block_crossing=True), SYNC_SPEC).verdict == NOT_EXERCISED
    differ = RunContext(spec=True, block_size=16, mamba_block_size=384)
    assert score_split(rec(block_crossing=True), differ).verdict == SUPPORTS
    assert score_split(rec(), differ).verdict == CONTRADICTS


def test_empty_wants_a_decode_step_without_drafts():
    assert score_empty(rec(num_drafts=[2, 0]), SYNC_SPEC).verdict == SUPPORTS
    assert score_empty(rec(num_drafts=[0, 2]), SYNC_SPEC).verdict == CONTRADICTS
    assert score_empty(rec(first_step=0, num_drafts=[0]), SYNC_SPEC).verdict == CONTRADICTS
    assert score_empty(rec(num_drafts=[]), SYNC_SPEC).verdict == NOT_EXERCISED
    assert score_empty(rec(num_drafts=[2, 0]), RunContext()).verdict == NOT_EXERCISED


def test_reorder_wants_a_prefill_in_the_batch_and_the_recurrent_state_at_once():
    hit = rec(kinds=("conv", "ssm"), layers=LAYERS, batch_has_prefill=True)
    assert score_reorder(hit, SYNC_SPEC).verdict == SUPPORTS
    one = score_reorder({**hit, "layers": LAYERS[1:2]}, SYNC_SPEC)  # a wrong kernel hits every layer
    assert one.verdict == CONTRADICTS and "1 of 3 GDN layers" in one.why
    assert score_reorder(rec(batch_has_prefill=True), SYNC_SPEC).verdict == CONTRADICTS
    assert score_reorder(rec(kinds=("conv", "ssm")), SYNC_SPEC).verdict == CONTRADICTS
    assert score_reorder(hit, RunContext()).verdict == NOT_EXERCISED


def test_table_ranks_by_supporting_requests_and_labels_a_planted_fault():
    records = [rec(first_step=s, same_block_left_shift=True) for s in (1, 2, 3)]
    records.append({**rec(), "first_step": None})  # an undiverged request is not evidence
    ctx = RunContext(spec=True, gdn_layers=3, same_block_shifts=3, planted="barrierless_tiles")
    table = hypothesis_table(records, ctx)
    top = table.rows[0]
    assert table.ranking()[0] == "H-copy" and top["supports"] == 3 and top["rank"] == 1
    assert top["label"].startswith("EMULATED")
    # the others say what they are: contradicted by some request, or not exercised at all
    assert all(r["label"] == ("contradicted" if r["contradicts"] else "not exercised")
               for r in table.rows[1:] if not r["supports"])
    assert sum(r["supports"] + r["contradicts"] + r["not_exercised"] for r in table.rows) \
        == 3 * len(SCORERS)
    assert "EMULATED" in table._repr_html_() and json.dumps(table.to_dict())
    assert table.finding() == ["H-copy"] and "EMULATED" in table.finding_line()
    honest = hypothesis_table(records, RunContext(spec=True, gdn_layers=3, same_block_shifts=3))
    assert honest.rows[0]["label"] == "observed"  # nothing planted, nothing emulated
    assert hypothesis_table([], ctx).rows[0]["why"] == "no request diverged from the reference"
    assert hypothesis_table([], ctx).finding_line() == "no request diverged: nothing to explain"


def test_when_nothing_fits_the_table_says_so_and_ranks_not_exercised_last():
    """Issue 20, defect 6: a run whose divergence no mechanism explains ranked a "not exercised"
    mechanism first, labelled "observed". Now: supported, then contradicted, then not exercised;
    no finding, and a line that says no mechanism fits."""
    # a recurrent-state change in one layer of a synchronous run without shifts, hits or copies
    records = [rec(kinds=("ssm",), layers=LAYERS[:1], first_step=4)]
    ctx = RunContext(spec=True, gdn_layers=3)
    table = hypothesis_table(records, ctx)
    assert all(r["supports"] == 0 for r in table.rows)
    assert table.finding() == []
    assert table.finding_line().startswith("no mechanism fits the evidence")
    groups = [0 if r["contradicts"] else 1 for r in table.rows]  # contradicted, then the rest
    assert groups == sorted(groups) and groups[-1] == 1
    top = table.rows[0]
    assert top["label"] == "contradicted" and top["contradicts"] == 1
    assert all(r["label"] == "not exercised" for r in table.rows if not r["contradicts"])
    assert "no mechanism fits" in table._repr_html_()
    assert table.to_dict()["finding"] == []


def test_async_all_layer_evidence_ranks_accept_over_copy():
    records = [rec(kinds=("conv", "ssm"), layers=LAYERS, first_step=s) for s in (2, 4)]
    table = hypothesis_table(records, ASYNC_SPEC)
    assert table.ranking()[0] == "H-accept" and table.rows[0]["supports"] == 2
    copy = next(r for r in table.rows if r["hypothesis"] == "H-copy")
    assert copy["not_exercised"] == 2 and copy["supports"] == 0


def test_report_rejects_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(InputError, match="not a directory"):
        divergence_report(tmp_path / "missing", tmp_path)
    with pytest.raises(InputError, match="not a capture run"):
        divergence_report(tmp_path, tmp_path)


# ---- real engine ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.engine
def test_barrierless_run_diverges_after_same_block_shifts_and_ranks_copy_first(
        engine_pool, tmp_path, monkeypatch, capsys):
    from conftest import TRIGGER
    from statescope.capture import recorder as capture
    from statescope.capture import run as capture_run
    from statescope.patches import cpu_kernels
    from statescope.diverge.digest_diff import shifts_by_request
    from statescope.capture.session import boundary_prompts, record
    from statescope.diverge.hypotheses import run_context

    monkeypatch.setenv("STATESCOPE_CAPTURE_STRICT", "1")
    engine = engine_pool.get(TRIGGER)
    prompts = boundary_prompts(engine.resolved()["mamba_block_size"], 12)
    spec = lambda name: {"output_dir": str(tmp_path), "run_id": name}  # noqa: E731
    try:
        cpu_kernels.set_copy_semantics("memmove")
        ref, _ = record(engine, spec("memmove"), prompts)
        again, _ = record(engine, spec("memmove-again"), prompts)
        cpu_kernels.set_copy_semantics("barrierless_tiles", 8192)
        monkeypatch.setattr(capture_run, "DEVICE_PATH_ON_CPU", True)
        bad, _ = record(engine, spec("barrierless"), prompts)
    finally:
        capture.uninstall()
        cpu_kernels.set_copy_semantics("memmove")

    clean = divergence_report(again.path, ref.path)  # no planted fault -> no divergence
    assert len(clean.requests) == 12 and clean.diverged == []

    report = divergence_report(bad.path, ref.path)
    shas = bad.steps().drop_duplicates("req_id").set_index("req_id")["prompt_sha"]
    first_shift = {shas[r.req_id]: min(r.req_steps) for r in shifts_by_request(bad).itertuples()}
    diverged = {r["prompt_sha"]: r for r in report.diverged}
    assert 0 < len(diverged) < 12 and set(diverged) == set(first_shift)
    for sha, r in diverged.items():
        assert r["first_step"] == first_shift[sha] and r["kinds"] == ["conv"]
        assert 0 in r["conv_rows"] and r["ssm_lag"] == 1  # leading row first, recurrent next
        assert r["events"]["same_block_left_shift"] and r["first_step"] in r["events"]["shift_steps"]
        assert r["magnitude"] != 0 and not r["nan_or_inf"]
    assert report.heatmap().data[0].z.shape[0] == 2 * report.gdn_layers
    assert "diverge" in report._repr_html_()

    parser = argparse.ArgumentParser()
    add_diverge_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["diverge", str(bad.path), "--reference", str(ref.path), "--json"])
    assert args.func(args) == 1  # requests diverge: a problem found (README: 0 / 1 / 2)
    printed = capsys.readouterr().out  # vLLM may log to stdout too: the report is the last JSON
    out = json.loads(printed[printed.rindex('{\n  "run"'):])
    assert out["requests_diverged"] == len(diverged) and out["requests_compared"] == 12

    ctx = run_context(bad, planted=cpu_kernels.COPY_SEMANTICS[1])
    assert ctx.spec and not ctx.async_scheduling and ctx.same_block_shifts > 0
    table = hypothesis_table(report, ctx)
    assert table.ranking()[0] == "H-copy" and table.rows[0]["label"].startswith("EMULATED")
    assert table.rows[0]["supports"] == len(diverged) and table.rows[0]["contradicts"] == 0
    accept = next(r for r in table.rows if r["hypothesis"] == "H-accept")
    assert accept["not_exercised"] == len(diverged)  # the CPU build never schedules async


def test_a_value_change_in_one_layer_is_not_a_wrong_accepted_count():
    """Issue 20, defect 3: +4.0 on one carried conv row of one layer broke continuity with no
    shift fitting, and H-accept was ranked first on it. A wrong count is one number per request:
    it moves every GDN layer's window by the same other shift. Anything else contradicts it."""
    import pandas as pd

    from statescope.diverge.hypotheses import with_continuity

    def cont(broken_layers: int, observed: list) -> pd.DataFrame:
        return pd.DataFrame([{"req_id": "r", "req_step": 4, "layer": l, "expected_shift": 3,
                              "observed_shifts": observed if i < broken_layers else [3],
                              "ok": i >= broken_layers} for i, l in enumerate(LAYERS)])

    record = rec(kinds=("conv", "ssm"), layers=LAYERS, first_step=4)
    for broken, observed, verdict in ((1, [], CONTRADICTS), (3, [], CONTRADICTS),
                                      (1, [1], CONTRADICTS), (3, [1], SUPPORTS)):
        v = score_accept(with_continuity(record, cont(broken, observed)), ASYNC_SPEC)
        assert v.verdict == verdict, (broken, observed, v)
        if verdict == CONTRADICTS:
            assert "value change" in v.why and f"{broken} of 3" in v.why
    table = hypothesis_table([record], ASYNC_SPEC, continuity=cont(1, []))
    accept = next(r for r in table.rows if r["hypothesis"] == "H-accept")
    assert accept["supports"] == 0 and "H-accept" not in table.finding()
