"""A matrix of cells on a Ray cluster: builds x setting axes x seeds, resumable from its store.

What it does: ``ray_matrix(specs, axes=..., address=...)`` plans the cells
(``statescope.cluster.plan.matrix_plan``), opens or resumes the run's ledger, connects to the
cluster at ``address`` (none: a local cluster, started and torn down here), keeps every free slot
busy with the cells not yet complete, and returns a ``BuildMatrix`` with one row per cell (the
columns of ``statescope.builds.run.build_matrix``, plus settings, seed, attempts and cell id).
A cell that cannot install or run fails its row only. ``matrix_from_ledger`` rebuilds the table
from a run's store alone (what a notebook reads after the driver is gone).

What it deliberately does not do: anything without Ray (``statescope.builds.run.build_matrix`` is
the sequential path and stays as it was), or judge one cell against another.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from statescope.builds.run import MATRIX_COLUMNS, BuildMatrix
from statescope.builds.spec import BuildSpec
from statescope.cluster.driver import CellDriver, Finished
from statescope.cluster.ledger import CellLedger
from statescope.cluster.plan import CellPlan, matrix_plan
from statescope.cluster.session import RayCluster
from statescope.records import new_run_id

CLUSTER_COLUMNS = MATRIX_COLUMNS[:1] + ["settings", "seed"] + MATRIX_COLUMNS[1:] + ["attempts", "cell_id"]


def cell_row(plan: CellPlan, record: dict | None) -> dict[str, Any]:
    """One matrix row from a cell's ledger record (None: the cell has not finished)."""
    from statescope.verdict.stats import clopper_pearson

    row: dict[str, Any] = {"build": plan.build.label, "settings": dict(plan.trigger_set),
                           "seed": plan.seed, "status": "not run", "vllm": None, "failed": None,
                           "units": None, "rate": None, "outcome": None,
                           "labels": [p.label for p in plan.build.patches], "detail": None,
                           "attempts": 0, "cell_id": plan.cell_id}
    if record is None:
        return row
    row.update(status=record["status"], attempts=len(record.get("attempts", [])))
    cell = record.get("cell")
    if record["status"] == "ok" and cell:
        units, failed = cell["n_units"], cell["n_failed"]
        row.update(vllm=cell["vllm"], failed=failed, units=units,
                   rate=round(failed / units, 4) if units else 0.0,
                   ci95=clopper_pearson(failed, units) if units else None, outcome=cell["outcome"],
                   labels=cell["labels"], detail=record["cell_dir"], seconds=cell.get("seconds"),
                   copies=cell.get("copies"), recovered=bool(record.get("recovered")),
                   control_failed=cell.get("control_failed"), control_units=cell.get("control_units"))
    else:
        row.update(detail=record.get("error"), log=record.get("log"))
    return row


def matrix_from_ledger(store_root: str | Path, run_id: str) -> BuildMatrix:
    """The matrix of a cluster run as its store holds it now."""
    ledger = CellLedger(store_root, run_id)
    from statescope.records import load_manifest

    definition = load_manifest(ledger.run_dir).get("extra", {}).get("definition", {})
    plans = [CellPlan.from_dict(d) for d in definition.get("cells", [])]
    latest = ledger.latest()
    table = BuildMatrix(f"cluster matrix {run_id} (trigger arm per cell)",
                        [cell_row(p, latest.get(p.cell_id)) for p in plans], CLUSTER_COLUMNS)
    table.run_dir = str(ledger.run_dir)  # type: ignore[attr-defined]
    return table


def ray_matrix(specs: Sequence[BuildSpec | str], *, axes: dict[str, Sequence] | None = None,
               seeds: Sequence[int] = (0,), address: str | None = None,
               local_cpus: int | None = None, run_id: str | None = None,
               store_root: str | Path = "runs", retries: int = 2, timeout_s: float = 3600.0,
               cell_cpus: float = 1.0, cell_gpus: float | None = None, store_access: str = "auto",
               installer: str = "auto", retry_failed: bool = False,
               on_cell: Callable[[Finished], None] | None = None, **params: Any) -> BuildMatrix:
    """Run (or resume, with the same ``run_id``) every cell of the matrix as a Ray task."""
    plans = matrix_plan(specs, axes=axes, seeds=seeds, **params)
    run_id = run_id or new_run_id("matrix")
    ledger = CellLedger(store_root, run_id)
    ledger.begin("matrix", {"cells": [p.to_dict() for p in plans]})
    status = "failed"
    try:
        ledger.recover()
        done = ledger.done(retry_failed=retry_failed)
        todo = [p for p in plans if p.cell_id not in done]
        if todo:
            with RayCluster(address, num_cpus=local_cpus):
                driver = CellDriver(ledger, retries=retries, timeout_s=timeout_s, cpus=cell_cpus,
                                    gpus=cell_gpus, store_access=store_access, installer=installer)
                try:
                    while todo or driver.in_flight:
                        for _ in range(driver.free()):
                            if todo:
                                driver.submit(todo.pop(0))
                        for finished in driver.wait(1.0):
                            if on_cell is not None:
                                on_cell(finished)
                finally:
                    driver.cancel_all()  # only non-empty when interrupted
        status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        ledger.finish(status)
    return matrix_from_ledger(store_root, run_id)


def pooled_verdicts(rows: Sequence[dict], alpha: float) -> list[dict]:
    """One verdict per (build, settings) over its seeds' cells: the summed trigger and control
    counts, one-sided Fisher at ``alpha``. A group with a cell not run or failed is
    ``incomplete``; a cell whose own guards failed (geometry not exercised, control or engine
    broken) gives the group that outcome, since pooling cannot repair it."""
    import json

    from statescope.verdict.stats import (CORRUPTION_DETECTED, NO_EVIDENCE,
                                          fisher_exact_one_sided)

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["build"], json.dumps(r["settings"], sort_keys=True)), []).append(r)
    out = []
    for (build, settings), cells in groups.items():
        ok = [c for c in cells if c["status"] == "ok" and c.get("control_units") is not None]
        k, n = sum(c["failed"] for c in ok), sum(c["units"] for c in ok)
        kc, nc = sum(c["control_failed"] for c in ok), sum(c["control_units"] for c in ok)
        guard = next((c["outcome"] for c in ok
                      if c["outcome"] not in (NO_EVIDENCE, CORRUPTION_DETECTED)), None)
        p = fisher_exact_one_sided(k, n, kc, nc) if n and nc else None
        if len(ok) < len(cells):
            outcome = "incomplete"
        elif guard is not None:
            outcome = guard
        else:
            outcome = CORRUPTION_DETECTED if p is not None and p < alpha else NO_EVIDENCE
        out.append({"build": build, "settings": json.loads(settings),
                    "seeds": sorted(c["seed"] for c in cells), "trigger": [k, n],
                    "control": [kc, nc], "fisher_p": p, "alpha": alpha, "outcome": outcome})
    return out
