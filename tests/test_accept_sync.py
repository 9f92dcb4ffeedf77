"""The H-accept runtime patch (``statescope.patches.accept_sync``): its ordering rule on small fakes of the
runner's fields (the race itself needs a GPU; data/results/gpu/ holds the H200 run), and that it
installs on and uninstalls from the real vLLM runner class of this build."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from statescope.patches import accept_sync
from statescope.patches.registry import PATCHES, parse_patch


class _Event:
    def __init__(self, log: list) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("event waited")


def _runner(async_on: bool = True, mode: str = "align") -> SimpleNamespace:
    log: list = []
    return SimpleNamespace(use_async_scheduling=async_on, cache_config=SimpleNamespace(mamba_cache_mode=mode),
                           num_accepted_tokens_event=_Event(log), log=log,
                           input_batch=SimpleNamespace(num_accepted_tokens_cpu=np.array([3, 2, 1, 1]),
                                                       prev_req_id_to_index={"a": 0, "b": 1, "c": 2}))


def _reorder(runner: SimpleNamespace, _scheduler_output: object) -> str:
    """What vLLM's _update_states does to the host counts: swap rows 0 and 2 (a decode moves
    behind a new prefill), a new request's row set to 1."""
    runner.log.append("original ran")
    c = runner.input_batch.num_accepted_tokens_cpu
    c[0], c[2] = c[2], c[0]
    c[3] = 1
    return "result"


def test_counts_keep_the_previous_order_through_the_reorder():
    r = _runner()
    wrapped = accept_sync.ordered_update_states(_reorder)
    assert wrapped(r, None) == "result"
    assert r.log == ["event waited", "original ran"]  # the in-flight copy landed first
    # vLLM's remap (prev_positions) then reads previous-order values, as it assumes
    assert r.input_batch.num_accepted_tokens_cpu.tolist() == [3, 2, 1, 1]


@pytest.mark.parametrize("async_on,mode", [(False, "align"), (True, "all"), (True, "none")])
def test_no_change_where_nothing_races(async_on, mode):
    r = _runner(async_on, mode)
    accept_sync.ordered_update_states(_reorder)(r, None)
    assert r.log == ["original ran"]  # no wait, and vLLM's own moves stand
    assert r.input_batch.num_accepted_tokens_cpu.tolist() == [1, 2, 3, 1]


def test_no_restore_when_no_previous_request_is_left():
    """vLLM then reads the array as it stands (new order; new requests at 1): a restore would hand
    a new request a finished request's count."""
    r = _runner()

    def new_wave(runner, so):
        runner.input_batch.prev_req_id_to_index = {}  # every previous request finished
        runner.input_batch.num_accepted_tokens_cpu[:] = 1  # add_request: new rows start at 1
    accept_sync.ordered_update_states(new_wave)(r, None)
    assert r.log == ["event waited"]
    assert r.input_batch.num_accepted_tokens_cpu.tolist() == [1, 1, 1, 1]


def test_counts_restored_even_when_the_original_raises():
    r = _runner()

    def broken(runner, so):
        runner.input_batch.num_accepted_tokens_cpu[:] = 9
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        accept_sync.ordered_update_states(broken)(r, None)
    assert r.input_batch.num_accepted_tokens_cpu.tolist() == [3, 2, 1, 1]


def test_installs_on_the_real_runner_class_idempotently():
    import statescope  # noqa: F401  (CPU import shims)
    pytest.importorskip("vllm")
    from vllm.v1.worker import gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    before = cls._update_states
    try:
        accept_sync.install_accept_sync()
        accept_sync.install_accept_sync()
        assert cls._update_states.statescope_patch == "accept_sync"
        assert cls._update_states.__wrapped__ is before  # wrapped once
    finally:
        accept_sync.uninstall_accept_sync()
    assert cls._update_states is before
    assert parse_patch("accept_sync").label == PATCHES["accept_sync"]
