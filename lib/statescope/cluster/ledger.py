"""The store of a cluster run: one record per finished cell, the cells' own stores beside it.

What it does: ``CellLedger(store_root, run_id)`` lays a run out as
``<store_root>/<run_id>/records.jsonl`` (one ``statescope.records.ResultsStore`` record per cell
outcome: key (run_id, build label, cell id, "cell", generation), with the plan, status, error,
every attempt, and the cell's counts) + ``manifest.json`` (what the run is: kind and definition)
+ ``cells/<cell_id>/`` (each cell's own results store, published only when complete). Only the
driver writes the ledger, under an exclusive lock (a second driver of the same run is refused).
``begin`` checks that a resumed run is the same run (its manifest and every ledger record of this
run id, ``ResultsStore.check_belongs``: a ledger copied from another run is refused, and a corrupt
one is refused before the manifest is touched), ``recover`` appends records for cells that
completed but whose record was never written (a driver killed in between): so a resumed driver
re-runs no complete cell and loses none. ``latest`` gives the current record per cell; a failed
cell stays failed on resume unless ``retry_failed`` (its new record then has the next generation).

What it deliberately does not do: run cells, or delete attempts (failed attempts stay under
``cells/.attempts/`` as evidence).
"""
from __future__ import annotations

import fcntl
import json
import secrets
from pathlib import Path
from typing import Any

from statescope.cluster.cells import STORE_TOKEN
from statescope.cluster.plan import CellPlan
from statescope.errors import InputError
from statescope.records import ResultsStore, scan_records, load_manifest

CELL_EPISODE = "cell"


class CellLedger:
    """Writer of one cluster run's ledger (the driver's side)."""

    def __init__(self, store_root: str | Path, run_id: str) -> None:
        self.store = ResultsStore(Path(store_root).resolve(), run_id)
        self.run_id = run_id
        self.run_dir = self.store.run_dir
        self.cells_dir = self.run_dir / "cells"
        self.cells_dir.mkdir(parents=True, exist_ok=True)
        self._lock = None

    # -- lifetime ---------------------------------------------------------------------------
    def begin(self, kind: str, definition: dict) -> bool:
        """Lock the run and write its manifest; True when resuming. A run started with another
        definition is refused."""
        self._lock = open(self.run_dir / ".driver.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(f"run {self.run_dir}: another driver is running it; expected one "
                             "driver per run (wait for it, or use a new --run-id)") from None
        self.store.check_belongs()
        resuming = self.store.manifest_path.exists()
        if resuming:
            old = load_manifest(self.run_dir).get("extra", {})
            if old.get("kind") != kind or old.get("definition") != _plain(definition):
                raise InputError(f"run {self.run_dir}: was started as a {old.get('kind')} with "
                                 f"another definition; expected the same cells to resume it "
                                 "(or a new --run-id)")
        token_file = self.cells_dir / STORE_TOKEN
        if not token_file.is_file():
            token_file.write_text(secrets.token_hex(16))
        self.store.start(extra={"kind": kind, "definition": _plain(definition)})
        return resuming

    def finish(self, status: str = "completed") -> None:
        self.store.finish(status)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    @property
    def token(self) -> str:
        return (self.cells_dir / STORE_TOKEN).read_text().strip()

    # -- records ----------------------------------------------------------------------------
    def records(self) -> list[dict]:
        return scan_records(self.store.records_path)[0]

    def latest(self) -> dict[str, dict]:
        """The newest record of each cell, by cell id."""
        out: dict[str, dict] = {}
        for rec in self.records():
            if rec.get("episode") == CELL_EPISODE:
                if rec["config_hash"] not in out or rec["step"] > out[rec["config_hash"]]["step"]:
                    out[rec["config_hash"]] = rec
        return out

    def done(self, *, retry_failed: bool = False) -> dict[str, dict]:
        """Cells that need no (new) run: ok ones, and failed ones unless ``retry_failed``."""
        return {cid: r for cid, r in self.latest().items()
                if r["status"] == "ok" or not retry_failed}

    def append(self, plan: CellPlan, status: str, *, cell: dict | None = None,
               attempts: list[dict] | None = None, error: str | None = None,
               extra: dict | None = None) -> dict:
        prev = self.latest().get(plan.cell_id)
        record = {"run_id": self.run_id, "build": plan.build.label, "config_hash": plan.cell_id,
                  "episode": CELL_EPISODE, "step": prev["step"] + 1 if prev else 0,
                  "status": status, "plan": plan.to_dict(), "label": plan.label, "error": error,
                  "attempts": attempts or [], "cell": cell,
                  "cell_dir": str(self.cells_dir / plan.cell_id) if status == "ok" else None,
                  **(extra or {})}
        self.store.append(_plain(record))
        return record

    def recover(self) -> list[dict]:
        """Records for complete cells under ``cells/`` that have no ok record (none re-run)."""
        have = {cid for cid, r in self.latest().items() if r["status"] == "ok"}
        added = []
        for cell_json in sorted(self.cells_dir.glob("*/cell.json")):
            cid = cell_json.parent.name
            if cid in have or not (cell_json.parent / "plan.json").is_file():
                continue
            plan = CellPlan.from_dict(json.loads((cell_json.parent / "plan.json").read_text()))
            if plan.cell_id != cid:
                continue  # not a cell of this layout: leave it alone
            cell = json.loads(cell_json.read_text())
            cell.update(run_dir=str(cell_json.parent), log=str(cell_json.parent / "cell.log"))
            added.append(self.append(plan, "ok", cell=cell, extra={"recovered": True}))
        return added


def _plain(obj: Any) -> Any:
    """JSON-clean copy (tuples to lists, paths and numbers to JSON types)."""
    return json.loads(json.dumps(obj, default=str))
