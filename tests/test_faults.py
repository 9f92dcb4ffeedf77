"""Planted faults without an engine: spec validation, selection, and the two post-process faults'
decisions on hand-built runner stand-ins (the real-engine proof is tests/test_replay.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest
import torch

import statescope  # noqa: F401
from statescope.patches import faults
from statescope.workload.trace import prompt_sha
from statescope.errors import InputError
from statescope.patches.faults import FaultSpec


def test_spec_validates_kinds_and_selection_fields():
    assert set(faults.KINDS) >= {"zero_conv", "nan_ssm", "permute_accepted", "drop_postprocess_copy"}
    with pytest.raises(InputError, match="'kind'"):
        FaultSpec("swap_everything")
    with pytest.raises(InputError, match="'prompt_shas'"):
        FaultSpec("permute_accepted", prompt_shas=[1])
    spec = FaultSpec("drop_postprocess_copy", prompt_shas=["abc"], at_output_token=2)
    assert json.loads(spec.to_env())["prompt_shas"] == ["abc"]


def test_env_round_trip_and_bad_env(monkeypatch):
    spec = FaultSpec("permute_accepted", req_ids=["3"])
    monkeypatch.setenv(faults.FAULT_ENV, spec.to_env())
    again = faults.spec_from_env()
    assert again.kind == "permute_accepted" and again.selects("3-ab12") and not again.selects("33-x")
    monkeypatch.setenv(faults.FAULT_ENV, '{"kind": "zero_conv", "colour": 1}')
    with pytest.raises(InputError, match="prompt_shas"):
        faults.spec_from_env()


def _runner(requests: dict) -> NS:
    return NS(requests={rid: NS(output_token_ids=[7] * n, num_computed_tokens=c,
                                prompt_token_ids=prompt)
                        for rid, (n, c, prompt) in requests.items()})


def test_permute_swaps_with_the_first_row_of_another_count_and_logs_both(tmp_path):
    runner = _runner({"a-1": (2, 10, [5, 6]), "b-1": (2, 11, [5, 7]), "c-1": (0, 0, [5, 8])})
    spec = FaultSpec("permute_accepted", prompt_shas=[prompt_sha([5, 6])], out=str(tmp_path))
    accepted = torch.tensor([3, 3, 1])
    faults._permute(runner, spec, ["a-1", "b-1", "c-1"], accepted)
    assert accepted.tolist() == [1, 3, 3]  # a <-> c; b has a's count, so it is skipped
    a, c = spec.planted
    assert (a["req_id"], a["partner"], a["num_accepted_sampled"], a["num_accepted_used"]) == \
        ("a-1", "c-1", 3, 1)
    assert (c["req_id"], c["num_accepted_sampled"], c["num_accepted_used"]) == ("c-1", 1, 3)
    assert len((tmp_path / "faults.jsonl").read_text().splitlines()) == 2
    faults._permute(runner, spec, ["a-1", "b-1", "c-1"], accepted)  # fires once per request
    assert accepted.tolist() == [1, 3, 3] and len(spec.planted) == 2


def test_permute_waits_while_every_row_has_the_same_count():
    runner = _runner({"a-1": (2, 10, [5, 6]), "b-1": (2, 11, [5, 7])})
    spec = FaultSpec("permute_accepted", req_ids=["a"])
    accepted = torch.tensor([3, 3])
    faults._permute(runner, spec, ["a-1", "b-1"], accepted)
    assert accepted.tolist() == [3, 3] and spec.planted == []


def _bufs(computed, scheduled, drafts, state_idx, bs=16) -> NS:
    t = lambda v: NS(gpu=torch.tensor(v))  # noqa: E731
    return NS(postprocess_align=NS(num_computed_tokens_buf=t(computed),
                                   num_scheduled_tokens_buf=t(scheduled),
                                   num_draft_tokens_buf=t(drafts),
                                   mamba_state_idx_buf=t(state_idx), block_size=bs))


def test_postprocess_copy_decision_matches_the_align_arithmetic():
    # row 0: 13 computed + 1 token, accepted 3 -> reaches 16: in-place shift by 2 in column 0
    # row 1: 9 computed, accepted 2 -> position 11, no boundary: no copy
    # row 2: running column already advanced (1); boundary state goes back to column 0
    bufs = _bufs([13, 9, 14], [3, 3, 3], [2, 2, 2], [0, 0, 1])
    assert faults._postprocess_copy(bufs, 0, 3) == (0, 0, 2)
    assert faults._postprocess_copy(bufs, 1, 2) is None
    assert faults._postprocess_copy(bufs, 2, 3) == (1, 0, 1)
    exact = _bufs([15], [1], [0], [0])  # prefill ending exactly at the boundary: nothing moves
    assert faults._postprocess_copy(exact, 0, 1) is None


def test_dropped_copy_saves_the_destination_blocks_of_the_chosen_layers():
    conv, ssm = torch.zeros(4, 3, 2), torch.zeros(4, 2, 2)
    runner = _runner({"a-1": (2, 13, [1])})
    runner.requests["a-1"].block_ids = [[2, 3]]
    runner.compilation_config = NS(static_forward_context={"model.layers.0.linear_attn":
                                                           NS(kv_cache=[conv, ssm])})
    runner.kv_cache_config = None
    spec = FaultSpec("drop_postprocess_copy", req_ids=["a"])
    orig = faults.gdn_layers
    faults.gdn_layers = lambda r: [(0, "model.layers.0.linear_attn")]
    try:
        saved = faults._save_dropped(runner, spec, _bufs([13], [3], [2], [0]), ["a-1"],
                                     torch.tensor([3]))
    finally:
        faults.gdn_layers = orig
    assert [(t is conv or t is ssm, block) for t, block, _ in saved] == [(True, 2), (True, 2)]
    assert spec.planted[0]["in_place"] and spec.planted[0]["bias"] == 2


def test_perturb_conv_row_hits_the_live_row_the_next_step_reads():
    conv = torch.zeros(3, 5, 16)  # blocks, rows (conv_kernel - 1 + 2 drafts), channels
    runner = _runner({"a-1": (3, 380, [1])})
    runner.requests["a-1"].block_ids = [[2]]
    runner.compilation_config = NS(static_forward_context={"model.layers.0.linear_attn":
                                                           NS(kv_cache=[conv, torch.zeros(3, 1)])})
    runner.input_batch = NS(req_ids=["a-1"], req_id_to_index={"a-1": 0},
                            num_accepted_tokens_cpu=[3])
    spec = FaultSpec("perturb_conv_row", req_ids=["a"], row=1, delta=2.0)
    so = NS(scheduled_new_reqs=[], scheduled_cached_reqs=NS(req_ids=["a-1"],
                                                             num_computed_tokens=[383]))
    orig = faults.gdn_layers
    faults.gdn_layers = lambda r: [(0, "model.layers.0.linear_attn")]
    try:
        faults._plant_state(runner, spec, so)
    finally:
        faults.gdn_layers = orig
    assert conv[2, 3].tolist() == [2.0] * 16 and conv.abs().sum() == 32  # live offset 2 + row 1
    assert spec.planted[0]["window_row"] == 3 and spec.planted[0]["num_computed_tokens"] == 383


def test_a_fault_is_planted_only_into_requests_the_coming_step_runs():
    """The batch still lists requests that finished in the previous step until ``execute_model``
    removes them; on the H200 (async scheduling) notebook 06's prompt-selected fault was planted
    into the previous run's finished request of the same prompt. Such a request is skipped."""
    from types import SimpleNamespace

    from statescope.patches.faults import _in_this_step

    step = SimpleNamespace(num_scheduled_tokens={"52-b": 3}, finished_req_ids={"42-a"})
    assert _in_this_step(step, "52-b")
    assert not _in_this_step(step, "42-a")  # finished in the previous step
    assert not _in_this_step(SimpleNamespace(num_scheduled_tokens={"52-b": 3},
                                             finished_req_ids=set()), "43-c")  # not scheduled
    assert _in_this_step(None, "42-a")  # no scheduler output: the runner's view only
