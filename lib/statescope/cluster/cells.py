"""One cell as a Ray task: install the build on the node if needed, run the experiment in the build's
own interpreter under a process-group guard, and publish the cell's store only once complete.

What it does: ``execute_cell`` is the task body (``cell_task()`` is it wrapped by ``ray.remote``;
without Ray it is a plain function). It ensures the build's environment on the node it runs on
(``statescope.builds.install``, cached per node), writes the request with
``statescope.builds.run.write_cell_request`` into a fresh *attempt* directory, and starts
``python -m statescope.engine.server_guard WORKER_PID -- BUILD_PYTHON -m statescope.builds
run-cell ...`` as the leader of a new process group: if the Ray worker dies (killed, node lost,
cancelled with force) the guard sees its parent gone and removes the whole group, so no engine
outlives its task; on the cell's own timeout the task removes the group itself. A complete cell
(``cell.json`` written, exit 0) is published by one atomic rename from
``cells/.attempts/<cell_id>.<token>/<cell_id>`` to ``cells/<cell_id>``, so a cell directory
exists only when complete and an interrupted attempt never mixes into it. When the store is not
visible from the node (no shared filesystem: the token file the driver wrote is absent) the cell
runs in a node-local directory and its files come back to the driver in the task's result
(``shipped``, a gzip'd tar) for ``publish_shipped``. Every outcome is a plain dict (``status``
ok / install failed / run failed / timed out / killed, ``retryable``, ``error``, ``attempt``:
worker pid, host, guard pid, seconds) rather than an exception, so it crosses Ray intact.

What it deliberately does not do: decide retries or record outcomes (``statescope.cluster.driver``
and ``statescope.cluster.ledger``), or import the build's vLLM in the worker.
"""
from __future__ import annotations

import functools
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from statescope.builds.install import ensure_build
from statescope.builds.run import cell_command, read_cell_result, write_cell_request
from statescope.builds.spec import REPO
from statescope.cluster.plan import CellPlan
from statescope.engine.server_guard import group_members, teardown_group
from statescope.errors import EnvironmentBroken, InputError

ATTEMPTS = ".attempts"
STORE_TOKEN = ".store_token"
GUARD_GRACE_S = 5.0
STORE_ACCESS = ("auto", "shared", "ship")
# Exit codes of a cell whose process was killed by a signal (the guard passes the child's
# negative code to sys.exit, which the shell sees as 256 - signal): SIGKILL (OOM killer), SIGTERM.
KILLED_CODES = {256 - 9, 256 - 15, 128 + 9, 128 + 15}


def attempt_dir(cells_dir: Path, cell_id: str, token: str) -> Path:
    return Path(cells_dir) / ATTEMPTS / f"{cell_id}.{token}"


def store_visible(cells_dir: str | Path, token: str) -> bool:
    """True when ``cells_dir`` here is the driver's (its token file holds the driver's token)."""
    try:
        return (Path(cells_dir) / STORE_TOKEN).read_text().strip() == token
    except OSError:
        return False


def _write_attempt(path: Path, info: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, path)


def _outcome(status: str, info: dict, *, error: str | None = None, retryable: bool = False,
             cell: dict | None = None, shipped: bytes | None = None, log: str | None = None) -> dict:
    return {"status": status, "retryable": retryable, "error": error, "cell": cell,
            "shipped": shipped, "log": log, "attempt": info}


def _pack(run_dir: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(run_dir, arcname=run_dir.name)
    return buf.getvalue()


def _publish(run_dir: Path, final: Path) -> Path:
    """Move a complete cell into place; when another attempt got there first, keep that one."""
    try:
        os.rename(run_dir, final)
    except OSError:
        if not (final / "cell.json").is_file():
            raise
    return final


def execute_cell(plan: dict, cells_dir: str, store_token: str, attempt_token: str, *,
                 store_access: str = "auto", installer: str = "auto",
                 timeout_s: float = 3600.0) -> dict:
    """Run one cell (the Ray task body); returns an outcome dict, see the module docstring."""
    t0 = time.perf_counter()
    cell = CellPlan.from_dict(plan)
    if store_access not in STORE_ACCESS:
        raise InputError(f"store_access={store_access!r}: expected one of {STORE_ACCESS}")
    shared = store_access != "ship" and store_visible(cells_dir, store_token)
    info: dict[str, Any] = {"token": attempt_token, "worker_pid": os.getpid(),
                            "host": socket.gethostname(), "shared_store": shared,
                            "started": time.time()}
    if store_access == "shared" and not shared:
        return _outcome("run failed", info, error=f"store {cells_dir} is not visible on host "
                        f"{info['host']}: expected a shared filesystem path there (or "
                        "store_access='ship' to send files back to the driver)")
    base = Path(cells_dir) if shared else Path(tempfile.mkdtemp(prefix="statescope-cell-"))
    adir = attempt_dir(base, cell.cell_id, attempt_token)
    run_dir = adir / cell.cell_id
    run_dir.mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps(plan, indent=2, default=str))
    _write_attempt(adir / "attempt.json", info)
    try:
        return _run(cell, run_dir, adir, info, shared=shared, cells_dir=Path(cells_dir),
                    installer=installer, timeout_s=timeout_s, t0=t0)
    finally:
        if not shared:
            shutil.rmtree(base, ignore_errors=True)


def _run(cell: CellPlan, run_dir: Path, adir: Path, info: dict, *, shared: bool, cells_dir: Path,
         installer: str, timeout_s: float, t0: float) -> dict:
    try:
        build = ensure_build(cell.build, installer=installer)
    except EnvironmentBroken as exc:  # BuildFailed included: a cached failure stays failed
        return _outcome("install failed", info, error=str(exc),
                        log=str(getattr(exc, "log_path", "")) or None)
    request = write_cell_request(cell.build, run_dir, **cell.cell_kwargs())
    argv, env = cell_command(build, request)
    guard = [sys.executable, "-m", "statescope.engine.server_guard", str(os.getpid()),
             "--grace", str(GUARD_GRACE_S), "--", *argv]
    t_cell = time.perf_counter()
    timed_out = False
    with open(run_dir / "cell.log", "wb") as log:
        proc = subprocess.Popen(guard, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        info["guard_pid"] = proc.pid  # also the process group of everything the cell runs
        _write_attempt(adir / "attempt.json", info)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out, rc = True, 124
        finally:  # timeout, cancellation (KeyboardInterrupt) or a normal end: nothing stays
            if proc.poll() is None or group_members(proc.pid):
                teardown_group(proc.pid, GUARD_GRACE_S)
                proc.wait()
    info.update(cell_seconds=round(time.perf_counter() - t_cell, 2), exit=rc)
    _write_attempt(adir / "attempt.json", info)
    if timed_out:
        return _outcome("timed out", info, retryable=True,
                        error=f"cell {cell.label}: ran past its {timeout_s:g} s timeout; its "
                              f"process group was torn down (log: {run_dir / 'cell.log'})")
    try:
        result = read_cell_result(cell.build, run_dir, rc, info["cell_seconds"])
    except EnvironmentBroken as exc:
        killed = rc in KILLED_CODES or rc < 0
        return _outcome("killed" if killed else "run failed", info, retryable=killed, error=str(exc))
    info["seconds"] = round(time.perf_counter() - t0, 2)
    cell_dict = {k: v for k, v in vars(result).items()}
    if not shared:
        return _outcome("ok", info, cell=cell_dict, shipped=_pack(run_dir))
    final = _publish(run_dir, cells_dir / cell.cell_id)
    shutil.rmtree(adir, ignore_errors=True)  # only attempt.json is left: the ledger keeps it
    cell_dict.update(run_dir=str(final), log=str(final / "cell.log"))
    return _outcome("ok", info, cell=cell_dict)


def publish_shipped(cells_dir: Path, cell_id: str, token: str, shipped: bytes) -> Path:
    """Unpack a cell that ran where the store is not visible, then publish it like a shared one."""
    adir = attempt_dir(cells_dir, cell_id, token)
    adir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(shipped), mode="r:gz") as tar:
        tar.extractall(adir, filter="data")
    final = _publish(adir / cell_id, Path(cells_dir) / cell_id)
    shutil.rmtree(adir, ignore_errors=True)
    return final


@functools.cache
def cell_task():
    """``execute_cell`` as a Ray remote function (Ray's own retries off: the driver retries, so
    every attempt is recorded)."""
    import ray

    return ray.remote(max_retries=0)(execute_cell)
