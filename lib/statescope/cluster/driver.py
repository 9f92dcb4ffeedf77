"""The driver side of a cluster run: submit cells as Ray tasks, retry what the cluster lost, record
every outcome as it arrives.

What it does: ``CellDriver`` submits ``statescope.cluster.cells.execute_cell`` tasks with the
resources one cell asks for (``statescope.cluster.session.cell_resources``), never more at once
than fit in the cluster (``slots``, re-read as the cluster grows or shrinks), and ``wait`` returns
cells as they finish. A retryable outcome -- the worker died (a Ray system error: the process was
killed, its node was lost), the cell timed out, or its process was killed by a signal -- is
submitted again with a new attempt token, up to ``retries`` times; a cell still failing, or one
that failed for a reason a retry cannot change (the build does not install, the experiment
exits with an error), is recorded as failed with the error of every attempt. A cell's record is
appended to the ledger the moment it finishes (``statescope.cluster.ledger``), so whatever
finished before the driver dies is kept. A task running far past its timeout (its worker hung)
is cancelled with force, which kills the worker and, through the guard, the cell.

What it deliberately does not do: choose cells (``statescope.cluster.matrix``,
``statescope.cluster.bisect``), or use Ray's own task retries (they would hide the attempts).
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from statescope.cluster.cells import cell_task, publish_shipped
from statescope.cluster.ledger import CellLedger
from statescope.cluster.plan import CellPlan
from statescope.cluster.session import cell_resources, require_ray, slots
from statescope.errors import InputError

HUNG_MARGIN_S = 600.0  # past timeout + install allowance + this, a task is presumed hung


@dataclass
class Flight:
    """A cell in flight: its plan, the attempts so far, and the current one."""
    plan: CellPlan
    token: str
    submitted: float
    attempts: list[dict] = field(default_factory=list)
    hung: bool = False  # cancelled by the driver for running far past its timeout


@dataclass
class Finished:
    """A cell that will not run again in this run: its ledger record."""
    plan: CellPlan
    record: dict


class CellDriver:
    """Runs cells of one ledger on the connected Ray cluster."""

    def __init__(self, ledger: CellLedger, *, retries: int = 2, timeout_s: float = 3600.0,
                 install_timeout_s: float = 3600.0, cpus: float = 1.0, gpus: float | None = None,
                 store_access: str = "auto", installer: str = "auto") -> None:
        if not isinstance(retries, int) or retries < 0:
            raise InputError(f"retries={retries!r}: expected an integer >= 0")
        if not timeout_s > 0:
            raise InputError(f"cell timeout={timeout_s!r}: expected seconds > 0")
        self.ray = require_ray()
        self.ledger, self.retries, self.timeout_s = ledger, retries, float(timeout_s)
        self.install_timeout_s, self.store_access, self.installer = install_timeout_s, store_access, installer
        self.per_cell = cell_resources(self.ray.cluster_resources(), cpus=cpus, gpus=gpus)
        self.in_flight: dict[Any, Flight] = {}  # Ray object ref -> flight

    def slots(self) -> int:
        return slots(self.ray.cluster_resources(), self.per_cell)

    def free(self) -> int:
        return max(0, self.slots() - len(self.in_flight))

    def submit(self, plan: CellPlan, attempts: list[dict] | None = None) -> str:
        token = f"a{len(attempts or []) + 1}-{secrets.token_hex(3)}"
        ref = cell_task().options(**self.per_cell, name=f"cell {plan.label}").remote(
            plan.to_dict(), str(self.ledger.cells_dir), self.ledger.token, token,
            store_access=self.store_access, installer=self.installer, timeout_s=self.timeout_s)
        self.in_flight[ref] = Flight(plan, token, time.time(), list(attempts or []))
        return token

    def wait(self, timeout_s: float = 1.0) -> list[Finished]:
        """Cells that finished for good since the last call (retries are resubmitted here)."""
        if not self.in_flight:
            return []
        ready, _ = self.ray.wait(list(self.in_flight), num_returns=1, timeout=timeout_s)
        done: list[Finished] = []
        for ref in ready:
            flight = self.in_flight.pop(ref)
            outcome = self._outcome(ref, flight)
            finished = self._settle(flight, outcome)
            if finished is not None:
                done.append(finished)
        self._cancel_hung()
        return done

    def cancel_all(self) -> list[CellPlan]:
        """Stop every cell in flight (force: the worker and, through its guard, the cell die)."""
        plans = [f.plan for f in self.in_flight.values()]
        for ref in list(self.in_flight):
            self.ray.cancel(ref, force=True)
        self.in_flight.clear()
        return plans

    # -- internals --------------------------------------------------------------------------
    def _outcome(self, ref: Any, flight: Flight) -> dict:
        exceptions = self.ray.exceptions
        try:
            outcome = self.ray.get(ref)
        except exceptions.RayTaskError as exc:  # an exception inside the task: a bug, not the cluster
            return {"status": "run failed", "retryable": False, "attempt": {"token": flight.token},
                    "error": f"cell task raised {type(exc.cause).__name__}: {exc.cause}"}
        except exceptions.RayError as exc:  # the worker or its node died, or it was cancelled
            return {"status": "timed out" if flight.hung else "worker died", "retryable": True,
                    "attempt": {"token": flight.token},
                    "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        if outcome["status"] == "ok":
            if outcome.get("shipped") is not None:
                final = publish_shipped(self.ledger.cells_dir, flight.plan.cell_id, flight.token,
                                        outcome.pop("shipped"))
                outcome["cell"].update(run_dir=str(final), log=str(final / "cell.log"))
        # submission to result, as the driver saw it: minus the task's own seconds, Ray's share
        outcome["attempt"]["driver_seconds"] = round(time.time() - flight.submitted, 3)
        outcome.pop("shipped", None)
        return outcome

    def _settle(self, flight: Flight, outcome: dict) -> Finished | None:
        attempt = {**outcome.get("attempt", {}), "status": outcome["status"],
                   "error": outcome.get("error")}
        attempts = flight.attempts + [attempt]
        if outcome["status"] == "ok":
            return Finished(flight.plan, self.ledger.append(flight.plan, "ok", cell=outcome["cell"],
                                                            attempts=attempts))
        if outcome.get("retryable") and len(attempts) <= self.retries:
            self.submit(flight.plan, attempts)
            return None
        errors = "; ".join(f"attempt {i + 1}: {a['status']}: {a['error']}" for i, a in enumerate(attempts))
        status = "install failed" if outcome["status"] == "install failed" else "run failed"
        return Finished(flight.plan, self.ledger.append(
            flight.plan, status, attempts=attempts, error=errors,
            extra={"log": outcome.get("log"), "last_status": outcome["status"]}))

    def _cancel_hung(self) -> None:
        limit = self.timeout_s + self.install_timeout_s + HUNG_MARGIN_S
        now = time.time()
        for ref, flight in list(self.in_flight.items()):
            if now - flight.submitted > limit and not flight.hung:
                flight.hung = True
                self.ray.cancel(ref, force=True)  # its result then raises: a retryable loss

