"""Connecting to a Ray cluster, or starting a local one and tearing it down completely.

What it does: ``RayCluster(address)`` is a context manager. With an address (``HOST:PORT`` of a
head node, ``ray://HOST:10001`` for Ray Client, or ``auto`` for a cluster already running on this
machine) it connects and, on exit, disconnects. Without one it starts a private local cluster
(``address="local"``: never an unrelated cluster that happens to run here) with ``num_cpus``
CPUs, no dashboard and a small object store, and on exit shuts it down and checks that every
process it started (GCS, raylet, workers, and whatever they launched) is gone; any survivor is
listed in ``survivors`` and then killed by pid. A local start that times out (Ray waits a fixed 15 s for
its dashboard agent; an overloaded machine can take longer) is cleaned up the same way and tried
again, up to ``LOCAL_START_TRIES`` times. A process that already has Ray initialised (a
notebook that called ``ray.init``) is reused and left as it was. ``cell_resources`` and
``slots`` say what one cell asks for and how many such cells fit at once.

What it deliberately does not do: provision machines, change a remote cluster, or kill a process
it did not start (the survivors checked are descendants of this process, found in /proc).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from statescope.errors import EnvironmentBroken, InputError

RAY_VERSION = "2.60.0"  # the version tested here (pyproject's dev extra); nodes must match the driver
OBJECT_STORE_BYTES = 256 * 2**20  # cells return small results: do not reserve 30% of RAM
TEARDOWN_WAIT_S = 20.0
# Ray 2.60 gives its dashboard agent a fixed 15 s to report its ports (and the raylet 30 s to
# register); on an overloaded machine the agent imports slower than that and the raylet aborts,
# so a local start is cleaned up and tried again, this many times.
LOCAL_START_TRIES = 4


def require_ray():
    """The ``ray`` module, or EnvironmentBroken saying how to install it."""
    try:
        import ray
    except ImportError:
        raise EnvironmentBroken(f"--ray needs Ray: pip install 'ray=={RAY_VERSION}' (statescope's "
                                "dev extra, installed by bin/setup)") from None
    return ray


def descendants(pid: int) -> set[int]:
    """Live (non-zombie) processes below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2:].split()[0] not in ("Z", "X")


class RayCluster:
    """A connection to a Ray cluster; a local one is started here and removed on exit."""

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None,
                 num_gpus: int | None = None) -> None:
        if address is not None and not str(address).strip():
            address = None
        if address == "local":
            raise InputError("RayCluster address 'local': leave the address out to start a local cluster")
        self.address_asked, self.num_cpus, self.num_gpus = address, num_cpus, num_gpus
        self.started_here = False
        self.reused = False
        self.survivors: list[int] = []
        self.failed_start_leftovers: list[int] = []  # killed after a start that timed out
        self._before: set[int] = set()

    def __enter__(self) -> "RayCluster":
        ray = require_ray()
        if ray.is_initialized():
            self.reused = True
            return self
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": "WARNING",
                                  "namespace": "statescope"}
        if self.address_asked is None:
            self._before = descendants(os.getpid())
            kwargs.update(address="local", num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                          object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False)
            self.started_here = True
        else:
            kwargs["address"] = self.address_asked
        tries = LOCAL_START_TRIES if self.started_here else 1
        for attempt in range(1, tries + 1):
            try:
                ray.init(**kwargs)
                return self
            except Exception as exc:  # Ray raises bare Exception for a node that did not start
                if self.started_here:
                    self._teardown(ray)  # what the failed start left, before trying again
                    self.failed_start_leftovers += self.survivors
                    self.survivors = []
                if attempt == tries:
                    self.started_here = False
                    raise EnvironmentBroken(
                        f"Ray cluster {self.address_asked or '(local)'}: could not "
                        f"{'connect' if self.address_asked else f'start in {tries} tries'} "
                        f"({type(exc).__name__}: {exc})") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        ray = require_ray()
        if self.reused or not ray.is_initialized():
            return
        if not self.started_here:
            ray.shutdown()
            return
        self._teardown(ray)

    def _teardown(self, ray) -> None:
        """Shut the local cluster down, wait for its processes, kill (by pid) what is left."""
        ours = self._cluster_processes()
        if ray.is_initialized():
            ray.shutdown()
        deadline = time.monotonic() + TEARDOWN_WAIT_S
        while time.monotonic() < deadline and any(_alive(p) for p in ours):
            time.sleep(0.2)
        self.survivors = sorted(p for p in ours if _alive(p))
        for pid in self.survivors:  # started by this cluster: ours to remove
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _cluster_processes(self) -> set[int]:
        """The cluster's processes: children of this process started with it that run Ray's own
        programs, and everything below them (workers, and the cells the workers launched)."""
        import ray

        ray_dir = str(Path(ray.__file__).resolve().parent)
        roots = set()
        for pid in descendants(os.getpid()) - self._before:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if ray_dir in cmdline:
                roots.add(pid)
        return roots.union(*(descendants(p) for p in roots))

    @property
    def address(self) -> str:
        """The GCS address other drivers connect to (``statescope ... --ray ADDRESS``)."""
        return require_ray().get_runtime_context().gcs_address

    def resources(self) -> dict[str, float]:
        return dict(require_ray().cluster_resources())


def cell_resources(cluster_resources: dict[str, float], *, cpus: float = 1.0,
                   gpus: float | None = None) -> dict[str, float]:
    """What one cell asks Ray for: ``gpus`` (default 1 when the cluster has GPUs, else none)."""
    if gpus is None:
        gpus = 1.0 if cluster_resources.get("GPU", 0) > 0 else 0.0
    if cpus < 0 or gpus < 0:
        raise InputError(f"cell resources cpus={cpus}, gpus={gpus}: expected numbers >= 0")
    return {"num_cpus": float(cpus), "num_gpus": float(gpus)}


def slots(cluster_resources: dict[str, float], per_cell: dict[str, float]) -> int:
    """How many cells of ``per_cell`` fit in the cluster at once (InputError when none does)."""
    fits = []
    for key, name in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
        if per_cell.get(key, 0) > 0:
            fits.append(int(cluster_resources.get(name, 0) // per_cell[key]))
    n = min(fits) if fits else int(cluster_resources.get("CPU", 1))
    if n < 1:
        raise InputError(f"cells ask for {per_cell}; the cluster has {cluster_resources.get('CPU', 0)}"
                         f" CPUs and {cluster_resources.get('GPU', 0)} GPUs: expected room for one cell")
    return n
