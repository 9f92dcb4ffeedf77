"""diverge pairs states by token position: runs that schedule one request differently still line up.

No engine. Small captures are written with the project's own writer (``CaptureWriter``): one
request whose state after token ``p`` is a pure function of ``p`` (so two runs that reach a
position hold the same state there), scheduled differently in the two runs — run A accepts both
drafts in one step, run B reaches the same token in two steps (1 then 2 tokens). Paired by
request step (the old pairing) that is a divergence; by position it is none, and a state that
really differs is reported at exactly its position. Plus: async scheduling's optimistic
scheduler count, a capture lacking the columns positions need (step pairing and a warning), and
the committed H200 captures (async on vs off) under ``data/results/gpu/cli/captures``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

import statescope  # noqa: F401
from statescope.capture.store import CaptureRun, CaptureWriter
from statescope.diverge.digest_diff import digest_diff, first_divergence
from statescope.diverge.positions import token_positions
from statescope.diverge.report import divergence_report

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "data/results/gpu/cli/captures"
TRIGGER = GPU / "trigger/run-20261201-105115-2600"  # async on (vLLM 0.26.0, H200)
REFERENCE = GPU / "reference/run-20261201-105230-7745"  # async off
LAYERS = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
W = 3  # live conv rows
PROMPT = 8
SHA = "p0"


def _ssm(p: int) -> dict:
    return {"checksum": 1000 + 7 * p, "sum": 1.5 * p}


def _tok(p: int) -> int:
    return 50 + p


def _schedule(accepted: list[int], optimistic: bool = False) -> list[dict]:
    """Step rows of one request: a prefill of PROMPT tokens, then decode steps with 2 drafts
    accepting ``accepted[i] - 1`` of them. ``optimistic``: the scheduler's count runs ahead by
    the previous step's rejected drafts (async scheduling); the runner's count is right.
    ``_computed`` (not written): the tokens the state really holds before the step."""
    rows, computed, rejected = [], 0, 0
    for i, acc in enumerate([1] + accepted):
        sched, drafts = (PROMPT, 0) if i == 0 else (3, 2)
        rows.append({"engine_step": 10 + i, "req_id": "r-0", "req_step": i, "prompt_sha": SHA,
                     "prompt_len": PROMPT, "num_computed_tokens": computed + rejected,
                     "num_computed_runner": computed, "_computed": computed,
                     "num_scheduled_tokens": sched,
                     "num_drafts": drafts, "accepted": acc, "num_accepted_sampled": acc,
                     "num_accepted_used": acc if drafts else None, "conv_live_offset": acc - 1,
                     "resume_col_offset": acc - 1, "is_new": i == 0,
                     "prefix_hit_tokens": 0 if i == 0 else None, "batch_row": 0, "block_size": 64})
        rejected = drafts - (acc - 1) if optimistic else 0
        computed += sched - drafts + acc - 1
    return rows


def _digest_rows(steps: list[dict], mode: str, bad: dict | None = None) -> list[dict]:
    """Digests after each step: the conv window ending at the step's last accepted token, the
    recurrent state of the running column (state after the step's first token), and per
    ``mode`` the resume column (``resume``) or every draft column (``all``: columns past the
    accepted ones hold the rejected drafts' states, which differ per run). ``bad``:
    ``{(position, layer, kind): delta}`` added to the checksum of that state."""
    bad = bad or {}
    out = []
    for st in steps:
        off = st["conv_live_offset"]
        end = st["_computed"] + st["num_scheduled_tokens"] - st["num_drafts"] + off - 1
        first = end - off
        base = {k: st[k] for k in ("engine_step", "req_id", "req_step", "prompt_sha")}
        for li, layer in enumerate(LAYERS):
            rows = list(range(end - W - off + 1, end + 1))  # the window; live rows from ``off``
            conv = {"checksum": sum(map(_tok, rows)) + bad.get((end, layer, "conv"), 0),
                    "sum": float(sum(rows)), "row_checksums": [_tok(r) for r in rows],
                    "row_sums": [float(r) for r in rows]}
            if (end, layer, "conv") in bad:
                conv["row_checksums"][-1] += bad[(end, layer, "conv")]
            out.append(dict(base, layer=layer, layer_index=li, kind="conv", column_offset=0,
                            resume=off == 0, nan=0, inf=0, **conv))
            cols = [0] + {"running": [], "resume": [off] if off else [],
                          "all": list(range(1, st["num_drafts"] + 1))}[mode]
            for c in cols:
                p = first + c
                ssm = _ssm(p) if c <= off else {"checksum": 9 * p + st["req_step"], "sum": -1.0}
                ssm["checksum"] += bad.get((p, layer, "ssm"), 0)
                out.append(dict(base, layer=layer, layer_index=li, kind="ssm", column_offset=c,
                                resume=c == off, nan=0, inf=0, row_checksums=None, row_sums=None,
                                **ssm))
    return out


def _capture(path: Path, steps: list[dict], mode: str = "resume", bad: dict | None = None,
             drop: tuple = ()) -> CaptureRun:
    manifest = {"mode": "digest", "conv_window": W, "block_size": 64, "digest_stats": ["sum"],
                "digest_version": 2, "resolved": {"num_speculative_tokens": 2},
                "spec": {"draft_columns": mode == "all"}}
    if mode == "resume":
        manifest["digest_columns"] = "running+resume"
    w = CaptureWriter(path, manifest, max_bytes=2**30)
    w.add_rows("steps", [{k: v for k, v in s.items() if k not in drop and not k.startswith("_")}
                         for s in steps])
    w.add_rows("digests", _digest_rows(steps, mode, bad))
    w.close()
    return CaptureRun(path)


A_ACCEPTED = [3, 1]  # step 1 accepts both drafts: tokens 8, 9, 10; step 2: token 11
B_ACCEPTED = [1, 2, 1]  # token 8, then 9 and 10, then 11: one step more to the same token


def test_positions_follow_the_accepted_tokens():
    st = token_positions(pd.DataFrame(_schedule(B_ACCEPTED)))
    assert st["end_position"].tolist() == [7, 8, 10, 11]
    assert st["computed_from"].tolist() == ["runner", "carried", "carried", "carried"]


@pytest.mark.parametrize("mode", ["running", "resume", "all"])
def test_another_schedule_to_the_same_states_is_no_divergence(tmp_path, mode):
    a = _capture(tmp_path / "a", _schedule(A_ACCEPTED), mode)
    b = _capture(tmp_path / "b", _schedule(B_ACCEPTED), mode)
    old = divergence_report(b, a, pairing="step")  # what diverge reported before issue 29
    assert old.pairing == "engine step" and [r["first_step"] for r in old.diverged] == [1]
    default = divergence_report(b, a)  # position pairing is the default (issue 29)
    assert default.pairing == "token position" and default.diverged == []
    assert digest_diff(a, b).attrs["pairing"] == "position"
    report = divergence_report(b, a, pairing="auto")
    assert report.pairing == "token position" and report.diverged == [], report.text()
    rec = report.requests[0]
    assert rec["steps_run"] == 4 and rec["steps_reference"] == 3
    assert rec["positions_compared"] >= 3 and rec["unpaired_positions"]["reference"] == 0
    assert report.unpaired_positions["run"] == rec["unpaired_positions"]["run"]
    if mode != "all":  # B's state after token 8 (resume) or 9 (running): a column A has not
        assert rec["unpaired_positions"]["run"] == 1
    assert not any("different number of steps" in w for w in report.warnings)
    text = report.text(all_requests=True)
    assert "paired by: token position" in text
    assert ("unpaired positions: 1 in the run only" in text) is (mode != "all")
    doc = json.loads(json.dumps(report.to_dict(), default=str))
    assert doc["pairing"] == "token position" and doc["requests_diverged"] == 0


def test_a_state_that_differs_is_reported_at_its_position(tmp_path):
    a = _capture(tmp_path / "a", _schedule(A_ACCEPTED))
    # run B's recurrent state after token 10, in its last layer only: B's step 2 (A's step 1)
    b = _capture(tmp_path / "b", _schedule(B_ACCEPTED), bad={(10, LAYERS[1], "ssm"): 1})
    report = divergence_report(b, a, pairing="auto")
    (rec,) = report.diverged
    assert rec["position"] == 10 and rec["first_step"] == 2 and rec["reference_step"] == 1
    assert rec["origin_layer"] == LAYERS[1] and rec["kinds"] == ["ssm"]
    assert rec["layers"] == [LAYERS[1]] and rec["per_layer"][0]["position"] == 10
    assert rec["events"]["steps"] == [1, 2] and rec["events"]["accepted"] == [1, 2]
    assert ("first divergence at step 2, origin layer 2 (ssm); layers 2; conv rows -; "
            "magnitude 0; token position 10 (reference step 1)") in report.text()
    fd = first_divergence(a, b, pairing="position")
    assert fd["first_position"].tolist() == [10] and fd["first_step"].tolist() == [2]
    # a difference at the token before: reported there, not at the later one
    b2 = _capture(tmp_path / "b2", _schedule(B_ACCEPTED),
                  bad={(9, LAYERS[0], "ssm"): 5, (10, LAYERS[1], "ssm"): 1})
    a_all = _capture(tmp_path / "a_all", _schedule(A_ACCEPTED), "all")
    b_all = _capture(tmp_path / "b_all", _schedule(B_ACCEPTED), "all",
                     bad={(9, LAYERS[0], "ssm"): 5, (10, LAYERS[1], "ssm"): 1})
    (rec,) = divergence_report(b_all, a_all, pairing="auto").diverged
    assert rec["position"] == 9 and rec["first_step"] == 2 and rec["origin_layer"] == LAYERS[0]
    # resume mode: token 9's state sits in B's running column only (A went from 8 to 10 in one
    # step and digested no state of 9), so it pairs with nothing and the difference shows at 10
    assert divergence_report(b2, a, pairing="auto").diverged[0]["position"] == 10


def test_a_wrong_resume_count_is_seen_although_no_resume_position_is_shared_again(tmp_path):
    """A planted accepted-count swap (``permute_accepted``) corrupts the states of the step after
    it; the corrupted run then accepts otherwise than its reference, so after the swap their
    resume columns (and conv windows) never stand at one position again. The run's running
    column — its state after the step's first, already sampled token — does: compared there."""
    a = _capture(tmp_path / "a", _schedule([3, 1, 1]))  # resume after tokens 7, 10, 11, 12
    # B's step 2 started from a wrong state: every state of steps 2 and 3 is off; resume after
    # tokens 7, 10, 13, 15, running columns after 8, 11, 14
    bad = {(p, layer, kind): 1 for p in (11, 13, 14, 15) for layer in LAYERS
           for kind in ("conv", "ssm")}
    b = _capture(tmp_path / "b", _schedule([3, 3, 2]), bad=bad)
    report = divergence_report(b, a)
    assert report.pairing == "token position"
    (rec,) = report.diverged
    assert rec["position"] == 11 and rec["first_step"] == 2 and rec["reference_step"] == 2
    assert rec["kinds"] == ["ssm"] and rec["layers"] == LAYERS
    # and no false divergence: the same two schedules with the right states pair cleanly
    clean = _capture(tmp_path / "clean", _schedule([3, 3, 2]))
    assert divergence_report(clean, a).diverged == []
    assert bool(digest_diff(a, clean)["same"].all())
    # resume, running column and conv window of the step before the corruption (token 10)
    m = digest_diff(a, b)
    assert sorted(m[m["same"].astype(bool)]["position"].unique()) == [7, 8, 10]


def test_a_conv_window_that_differs_is_reported_at_its_position(tmp_path):
    a = _capture(tmp_path / "a", _schedule(A_ACCEPTED), "running")
    b = _capture(tmp_path / "b", _schedule(B_ACCEPTED), "running",
                 bad={(11, LAYERS[0], "conv"): 3})
    (rec,) = divergence_report(b, a, pairing="auto").diverged
    assert rec["position"] == 11 and rec["first_step"] == 3 and rec["reference_step"] == 2
    assert rec["kinds"] == ["conv"] and rec["conv_rows"] == [W - 1]  # the newest live row


def test_async_scheduler_count_running_ahead_still_pairs(tmp_path):
    """The scheduler's num_computed_tokens counts the previous step's drafts before their
    rejection is known (async scheduling). Positions follow the runner's count — or, in a
    capture without it, the accepted tokens carried from step to step."""
    a = _capture(tmp_path / "a", _schedule(A_ACCEPTED))
    b = _capture(tmp_path / "b", _schedule(B_ACCEPTED, optimistic=True))
    assert (b.steps()["num_computed_tokens"] > b.steps()["num_computed_runner"]).any()
    report = divergence_report(b, a, pairing="auto")
    assert report.diverged == [] and any("num_computed_tokens differs" in n for n in report.notes)
    # Model Runner V2 under async scheduling: its host count mirrors the scheduler's
    v2 = _capture(tmp_path / "v2", [dict(s, num_computed_runner=s["num_computed_tokens"])
                                    for s in _schedule(B_ACCEPTED, optimistic=True)])
    report = divergence_report(v2, a, pairing="auto")
    assert report.diverged == [] and any("num_computed_runner differs" in n for n in report.notes)
    carried = _capture(tmp_path / "c", _schedule(B_ACCEPTED, optimistic=True),
                       drop=("num_computed_runner",))
    st = token_positions(carried.steps())
    assert st.sort_values("req_step")["computed_from"].tolist() == \
        ["scheduler", "carried", "carried", "carried"]
    assert divergence_report(carried, a, pairing="auto").diverged == []


def test_a_capture_without_the_position_columns_falls_back_to_step_pairing(tmp_path, capsys):
    from statescope.cli.main import main

    a = _capture(tmp_path / "a", _schedule(A_ACCEPTED))
    old = _capture(tmp_path / "old", _schedule(B_ACCEPTED),
                   drop=("accepted", "num_accepted_sampled"))
    report = divergence_report(old, a, pairing="auto")
    assert report.pairing.startswith("engine step (fallback: ") and "accepted" in report.pairing
    assert any("paired by engine step, not token position" in w and str(old.path) in w
               for w in report.warnings)
    assert any("different number of steps" in w for w in report.warnings)
    assert report.diverged  # the false divergence step pairing makes of another schedule
    assert report.unpaired_positions is None and "position" not in report.requests[0]
    with pytest.raises(Exception, match="cannot pair its states by token position"):
        divergence_report(old, a, pairing="position")
    with pytest.raises(Exception, match="cannot pair"):
        digest_diff(a, old, pairing="position")
    assert main(["diverge", str(old.path), "--reference", str(a.path), "--pairing", "auto"]) == 1
    out, err = capsys.readouterr()
    assert "paired by: engine step (fallback: " in out and "WARNING: paired by engine step" in err


def test_cli_pairs_by_position_and_says_so(tmp_path, capsys):
    from statescope.cli.main import main

    a = _capture(tmp_path / "a", _schedule(A_ACCEPTED))
    b = _capture(tmp_path / "b", _schedule(B_ACCEPTED))
    assert main(["diverge", str(b.path), "--reference", str(a.path), "--json", "--pairing", "auto"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pairing"] == "token position" and doc["requests_diverged"] == 0
    assert doc["unpaired_positions"]["reference"] == 0
    assert main(["diverge", str(b.path), "--reference", str(a.path), "--pairing", "step"]) == 1
    assert "paired by: engine step" in capsys.readouterr().out


def test_committed_async_trigger_against_async_off_reference(tmp_path):
    """vLLM 0.26.0 on the H200: the trigger (async on) runs one step more per request and its
    scheduler count runs ahead in 252 of 604 rows; by position every paired state is identical,
    the extra steps' positions are unpaired, and the same holds without the runner's count."""
    trig, ref = CaptureRun(TRIGGER), CaptureRun(REFERENCE)
    m = digest_diff(ref, trig, pairing="position")
    # async on vs off: configurations differ, so each request's last step (a state no step
    # reads) is left out: 3060 rows; every state of every step: 3348
    assert m.attrs["pairing"] == "position" and m.attrs["across_configs"] and len(m) == 3060
    assert bool(m["same"].all())
    exact = digest_diff(ref, trig, pairing="position", across_configs=False)
    assert len(exact) == 3348 and bool(exact["same"].all())
    report = divergence_report(trig, ref, pairing="auto")
    assert report.pairing == "token position" and report.diverged == []
    assert len(report.requests) == 48 and report.unpaired_positions["reference"] == 0
    assert report.unpaired_positions["run"] > 0
    assert report.warnings == [] and any("252 step row(s)" in n for n in report.notes)
    assert not any("num_computed_runner" in n for n in report.notes)  # V1: runner = carried

    class WithoutRunnerCount:  # an older capture: positions carried from the accepted tokens
        path, manifest = trig.path, trig.manifest

        def steps(self):
            return trig.steps().drop(columns=["num_computed_runner"])

        def __getattr__(self, name):
            return getattr(trig, name)

    carried = digest_diff(ref, WithoutRunnerCount(), pairing="position")
    assert len(carried) == 3060 and bool(carried["same"].all())
