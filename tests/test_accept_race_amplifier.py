"""The AMPLIFIED accepted-count race (``statescope.patches.accept_race_amplifier``): its ordering on
small fakes of the runner's fields (the race itself needs a GPU), its composition with
``accept_sync`` (which must cancel it), its labels, and that it installs on and uninstalls from the
real vLLM runner class and mamba_utils of this build."""
from __future__ import annotations

import pytest

from statescope.patches import accept_race_amplifier as amp
from statescope.patches import accept_sync
from statescope.patches.registry import parse_patch
from test_accept_sync import _reorder, _runner


def test_the_copy_is_forced_to_land_before_the_row_moves():
    r = _runner()
    before = amp.engaged()["waits"]
    assert amp.amplified_update_states(_reorder)(r, None) == "result"
    assert r.log == ["event waited", "original ran"]
    assert amp.engaged()["waits"] == before + 1
    # the moves were applied to the landed previous-order values: vLLM's remap then moves them
    # a second time (the corrupting order); here: rows 0 and 2 swapped
    assert r.input_batch.num_accepted_tokens_cpu.tolist() == [1, 2, 3, 1]


@pytest.mark.parametrize("async_on,mode", [(False, "align"), (True, "all")])
def test_not_engaged_where_nothing_races(async_on, mode):
    r = _runner(async_on, mode)
    before = amp.engaged()["waits"]
    amp.amplified_update_states(_reorder)(r, None)
    assert r.log == ["original ran"] and amp.engaged()["waits"] == before


def test_accept_sync_over_the_amplifier_cancels_it():
    r = _runner()
    both = accept_sync.ordered_update_states(amp.amplified_update_states(_reorder))
    both(r, None)
    assert r.input_batch.num_accepted_tokens_cpu.tolist() == [3, 2, 1, 1]  # previous order kept


def test_patch_names_and_labels():
    from statescope.engine.config import EngineConfig
    from statescope.verdict.reproduce import Arm

    assert parse_patch("amplify_accept_race").option is None
    assert parse_patch("amplify_accept_race=delay").option == "delay"
    arm = Arm("trigger", EngineConfig(), patches=("amplify_accept_race",))
    assert arm.labels and arm.labels[0].startswith("AMPLIFIED")
    assert Arm("trigger", EngineConfig()).key() != arm.key()  # never stored as the same arm


def test_installs_on_this_builds_runner_and_uninstalls():
    from vllm.v1.worker import gpu_model_runner, mamba_utils

    original = gpu_model_runner.GPUModelRunner._update_states
    original_pp = mamba_utils.postprocess_mamba_align_gpu
    try:
        amp.install()
        amp.install()  # idempotent
        assert gpu_model_runner.GPUModelRunner._update_states.statescope_patch == "amplify_accept_race"
        amp.install("delay")
        assert mamba_utils.postprocess_mamba_align_gpu is not original_pp
    finally:
        amp.uninstall()
    assert gpu_model_runner.GPUModelRunner._update_states is original
    assert mamba_utils.postprocess_mamba_align_gpu is original_pp
