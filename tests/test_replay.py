"""Position-aligned divergence on real vLLM-CPU engines: replay, oracle, noise, planted faults.

One module-scoped study (``statescope.diverge.study``) on the shared engine pool: the trigger
configuration (prefix caching + align + MTP 2) records a clean run, three re-batched clean runs
and two planted-fault runs in mode "full"; the reference configuration (no prefix caching, no
MTP) replays every run's tokens. Then:

- positions: a clean run agrees with its replay and the float64 oracle within the calibrated
  tolerance, and the same comparison shifted by one token position does not (alignment matters);
- no planted fault: no request of a held-out re-batched clean run leaves tolerance;
- accepted-count permutation (H-accept): both swapped requests first diverge one step after the
  swap (the next step reads the swapped count), in every GDN layer's recurrent state; nobody else
  diverges; H-accept ranks first, labelled EMULATED;
- dropped post-process copy: the request diverges in the very step of the (in-place) copy, conv
  and recurrent state, every live conv row; H-lostcopy ranks first and H-copy is contradicted;
- one perturbed conv row (layer 1): seen in the step that reads it, in layer 1, never layer 0;
- the views draw and PNG export says what happened either way.
"""
from __future__ import annotations

import json

import pytest

import statescope  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def study(engine_pool, tmp_path_factory):
    from conftest import REFERENCE, TRIGGER
    from statescope.diverge import study as dd
    from statescope.patches.faults import FaultSpec

    from statescope.engine.config import model_path

    # tiny-qwen35, as notebook 06: the faults' victims are chosen by position for its 384-token
    # blocks and successor-chain drafts (on tiny-gui request 1's first copy is not in place)
    placeholder = str(model_path("tiny-qwen35"))
    engine = engine_pool.get(TRIGGER.replace(model=placeholder))
    prompts = dd.staggered_prompts(engine.resolved()["mamba_block_size"])
    from statescope.workload.trace import prompt_sha

    shas = [prompt_sha(p) for p in prompts]
    faults = {  # the swap partner is the last prompt, still in prefill (accepted 1) at step 1
        "permute_accepted": FaultSpec("permute_accepted", prompt_shas=[shas[0]], at_output_token=1),
        # prompt 1 ends where its first post-process copy is an in-place shift of the running block
        "drop_postprocess_copy": FaultSpec("drop_postprocess_copy", prompt_shas=[shas[1]],
                                           at_output_token=1),
        # the leading live conv row of GDN layer 1 (model layer 1), before a mid-decode step
        "perturb_conv_row": FaultSpec("perturb_conv_row", prompt_shas=[shas[2]], at_output_token=4,
                                      layers=[1], row=0, delta=4.0)}
    s = dd.record_study(engine, tmp_path_factory.mktemp("study"), prompts, faults)
    dd.replay_study(engine_pool.get(REFERENCE.replace(model=placeholder)), s)
    return dd.calibrate_study(s)


def test_tolerances_are_measured_and_small(study):
    for tol in (study.tolerance, study.oracle_tolerance):
        t = tol.table
        assert set(t.kind) == {"conv", "ssm"} and t.layer.nunique() == 3
        assert (t.tol > 0).all() and (t.tol >= 2 * t.measured).all()
        conv, ssm = t[t.kind == "conv"], t[t.kind == "ssm"]
        assert (conv.tol < 0.02 * conv.scale).all()  # ~1 bf16 step of the window's values
        assert (ssm.tol < 0.1 * ssm.scale).all()
    oracle = study.oracle_tolerance.table
    assert (oracle.measured > 0).all()  # bf16 engine vs float64 oracle is never bit-exact
    assert json.dumps(study.tolerance.to_dict())


def test_clean_run_matches_replay_and_oracle_by_position_and_not_off_by_one(study):
    from statescope.diverge import noise

    clean, oracle = study.runs["clean"][0], study.oracle("clean")
    for ref, tol in ((study.replays["clean"], study.tolerance), (oracle, study.oracle_tolerance)):
        f = noise.in_units(noise.compare_states(clean, ref), tol)
        assert len(f) >= 200 and not f["out"].any()

    class Shifted:  # the same reference one token later: must be far out of tolerance
        label = "shifted"

        def prepare(self, points):
            oracle.prepare(points.assign(position=points.position + 1))

        def at(self, sha, position, kind):
            return oracle.at(sha, position + 1, kind)

    f = noise.in_units(noise.compare_states(clean, Shifted()), study.oracle_tolerance)
    assert f["out"].mean() > 0.9


def test_no_planted_fault_means_no_divergence_in_held_out_rebatched_runs(study):
    from statescope.diverge.by_position import clean_check, position_report

    for states, _ in study.runs["rebatched"]:
        report = position_report(states, study.replays["clean"], study.tolerance)
        check = clean_check(report)
        assert check["clean"] and check["requests"] >= 4, check


def _first(report, req_id):
    return next(r for r in report.requests if r["req_id"] == req_id)


def test_permuted_accepted_counts_diverge_one_step_later_and_rank_h_accept(study):
    from statescope.diverge import study as dd
    from statescope.diverge.hypotheses import hypothesis_table, run_context

    planted = [dd.planted_step(study, "permute_accepted", i) for i in range(2)]
    assert {p["num_accepted_sampled"] for p in planted} == {1, 3}
    assert all(p["num_accepted_used"] != p["num_accepted_sampled"] for p in planted)
    reports = dd.reports(study, "permute_accepted")
    for report in reports.values():
        assert {r["req_id"] for r in report.diverged} == {p["req_id"] for p in planted}
        for p in planted:
            r = _first(report, p["req_id"])
            assert r["first_step"] == p["req_step"] + 1  # the next step reads the swapped count
            assert "ssm" in r["kinds"] and len(r["layers"]) == 3 and r["magnitude"] > 10
            assert r["events"]["accepted_mismatch"] is True  # capture: used != sampled
    ctx = run_context(study.runs["permute_accepted"][0].run, planted="permute_accepted")
    table = hypothesis_table(reports["replay"], ctx)
    assert table.ranking()[0] == "H-accept" and table.rows[0]["supports"] == 2
    assert table.rows[0]["label"].startswith("EMULATED") and table.rows[0]["contradicts"] == 0
    assert "differs from the one sampled" in table.rows[0]["why"]


def test_dropped_postprocess_copy_diverges_in_its_step_and_ranks_lost_copy(study):
    from statescope.diverge import study as dd
    from statescope.diverge.hypotheses import hypothesis_table, run_context

    p = dd.planted_step(study, "drop_postprocess_copy")
    assert p["in_place"] and p["bias"] > 0
    reports = dd.reports(study, "drop_postprocess_copy")
    for report in reports.values():
        assert [r["req_id"] for r in report.diverged] == [p["req_id"]]
        r = report.diverged[0]
        assert r["first_step"] == p["req_step"] and set(r["kinds"]) == {"conv", "ssm"}
        assert r["conv_rows"] == [0, 1, 2] and r["ssm_lag"] == 0
        assert r["first_step"] in r["events"]["postprocess_copy_steps"]
    ctx = run_context(study.runs["drop_postprocess_copy"][0].run, planted="drop_postprocess_copy")
    table = hypothesis_table(reports["replay"], ctx)
    assert table.ranking()[0] == "H-lostcopy" and table.rows[0]["label"].startswith("EMULATED")
    copy = next(r for r in table.rows if r["hypothesis"] == "H-copy")
    assert copy["contradicts"] == 1 and copy["supports"] == 0


def test_perturbed_conv_row_is_seen_in_its_step_in_that_layer_and_the_ones_after(study):
    from statescope.diverge import study as dd

    p = dd.planted_step(study, "perturb_conv_row")
    assert p["layer"] == "model.layers.1.linear_attn" and p["row"] == 0
    for report in dd.reports(study, "perturb_conv_row").values():
        assert [r["req_id"] for r in report.diverged] == [p["req_id"]]
        r = report.diverged[0]
        # the step reads the perturbed row; its live window afterwards holds only fresh inputs,
        # so the earliest visible effect is that layer's recurrent state; the layer before it
        # cannot be touched (later layers only see it through layer 1's output)
        assert r["first_step"] == p["req_step"] and "ssm" in r["kinds"]
        assert "model.layers.1.linear_attn" in r["layers"]
        assert "model.layers.0.linear_attn" not in r["layers"]


def test_views_draw_and_png_export_reports_either_outcome(study, tmp_path, monkeypatch):
    from statescope.diverge import study as dd
    from statescope.diverge import views
    from statescope.share import figures

    p = dd.planted_step(study, "drop_postprocess_copy")
    states = study.runs["drop_postprocess_copy"][0]
    report = dd.reports(study, "drop_postprocess_copy")["replay"]
    fig = views.conv_window_figure(states, study.replays["drop_postprocess_copy"], p["req_id"],
                                   p["req_step"], "model.layers.0.linear_attn", study.tolerance)
    assert len(fig.data) == 3 and fig.data[2].z.shape == (3, 512)
    assert abs(fig.data[2].z).max() > 1  # the dropped copy is many tolerances off
    timeline = views.request_timeline(states, p["req_id"], report)
    assert any("first divergence" in (a.text or "") for a in timeline.layout.annotations)
    heat = report.heatmap()
    labels = [a.text for a in heat.layout.annotations]
    assert "first divergence" in labels and "post-process copy" in labels
    assert heat.data[0].z.shape[0] == 6  # 3 GDN layers x (conv, ssm)
    viewer = views.conv_diff_viewer(states, study.replays["drop_postprocess_copy"])
    assert len(viewer.children) == 2
    monkeypatch.setattr(figures, "save_png", lambda fig, path, **kw: None)
    monkeypatch.setattr(figures, "last_export_error", "no Chrome/Chromium found")
    assert figures.export_png(fig, tmp_path / "x.png").startswith("PNG not exported")


def test_cli_by_position_prints_first_divergence_and_hypothesis_table(study, capsys):
    import argparse

    from statescope.diverge import study as dd
    from statescope.cli.diverge import add_diverge_subcommand

    p = dd.planted_step(study, "drop_postprocess_copy")
    parser = argparse.ArgumentParser()
    add_diverge_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([
        "diverge", str(study.runs["drop_postprocess_copy"][0].run.path),
        "--reference", str(study.runs["clean"][0].run.path), "--by-position",
        "--noise", str(study.runs["rebatched"][0][0].run.path),
        "--planted", "drop_postprocess_copy", "--json"])
    assert args.func(args) == 1  # a request diverges: a problem found
    printed = capsys.readouterr().out
    out = json.loads(printed[printed.rindex('{\n  "run"'):])
    assert out["unit"] == "tolerance units" and out["requests_diverged"] == 1
    first = out["requests"][0]
    assert first["req_id"] == p["req_id"] and first["first_step"] == p["req_step"]
    assert out["hypotheses"]["rows"][0]["hypothesis"] == "H-lostcopy"
