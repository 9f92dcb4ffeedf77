"""Capture inside ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` path).

The plugin loads in every server process; only the worker (which holds the model) records steps,
the engine core logs the scheduler's prefix-cache lookups, and the server's teardown — SIGTERM to
the whole process group, the engine core force-killed right after — must still leave the run
closed (status complete).
"""
from __future__ import annotations

import os

import pytest

import statescope  # noqa: F401
from conftest import TRIGGER
from statescope.capture.session import boundary_prompts
from statescope.capture.spec import ENV_CAPTURE, CaptureSpec
from statescope.capture.store import CaptureRun, find_runs


@pytest.mark.slow
@pytest.mark.engine
def test_capture_inside_the_openai_api_server(engine_pool, tmp_path):
    import httpx

    from statescope.engine.server import VllmServer

    engine_pool.close()  # one engine alive at a time
    spec = CaptureSpec.from_dict({"output_dir": str(tmp_path / "caps"), "flush_interval_s": 0.5,
                                  "run_id": "server"}).write(tmp_path / "spec.json")
    with VllmServer(TRIGGER, env={ENV_CAPTURE: str(spec), "OMP_NUM_THREADS": "1"}) as server:
        for prompt in boundary_prompts(384, 3):
            r = httpx.post(server.url + "/v1/completions", timeout=120, json={
                "model": server.served_model, "prompt": prompt, "max_tokens": 12,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
        import time

        time.sleep(2.0)  # the worker's flusher writes finished steps on its own
    runs = find_runs(tmp_path / "caps")
    assert len(runs) == 1, runs  # only the process holding the model records
    run = CaptureRun(runs[0])
    assert run.manifest["pid"] != os.getpid() and run.manifest["runner_class"] == "CPUModelRunner"
    steps = run.steps()
    assert steps["prompt_sha"].nunique() == 3 and len(run.digests()) > 0
    # server teardown SIGTERMs the worker, possibly before its shutdown hook: the chained
    # SIGTERM handler (or the hook, whichever runs first) closes the run
    assert run.manifest["status"] == "complete", run.manifest.get("closed_by")
    # the API server shut its engine core and worker down in vLLM's order: nothing to recover
    assert server.recovered == [] and "--shutdown-timeout" in server.command
    assert len(run.copies()) > 0
    # prefix-cache lookups were logged by the engine core, another process than the worker
    hits = run.prefix_hits()
    assert len(hits) == 3 and (hits["pid"] != run.manifest["pid"]).all()
    assert set(hits["req_id"]) == set(steps["req_id"])
