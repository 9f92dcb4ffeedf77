"""Bayesian bisection on a Ray cluster: probes chosen in batches that fill the free workers.

What it does: ``ray_bisect(items, ...)`` bisects ordered build specs (or, with ``setting``, ordered
values of one trigger-arm setting run in ``build``); one probe is one cell (one experiment with a
seed of its own: item i's probes use seeds first_seed, first_seed + 1, ...). Whenever workers are
free it asks ``statescope.cluster.batches.BatchedSearch`` for that many probes, chosen by
expected information given the probes still running, and submits them as cells
(``statescope.cluster.driver``); each result updates the posterior the moment it arrives. The
posterior depends only on the summed counts per item, so it is the same whatever order results
arrive in. It stops when one location holds ``confidence`` of the posterior (probes still running
are cancelled: their engines are torn down), when the budget would be exceeded, or when no probe is
informative; an item whose cell fails for good is skipped, as in the sequential search. The
run's store is a cluster ledger (``statescope.cluster.ledger``) plus ``bisect.json`` (the
``BisectResult``, rewritten after every probe); a killed driver resumes with the same
``run_id``: completed probes are replayed as observations, none re-run.

What it deliberately does not do: plain (textbook) bisection -- it is sequential by nature --, or
combine requests of several cells into one probe (pick a larger preset for larger probes).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from statescope.bisect.model import RatePrior
from statescope.bisect.result import BisectResult, ProbeRecord
from statescope.builds.spec import BuildSpec
from statescope.cluster.batches import MIN_GAIN_BITS, BatchedSearch
from statescope.cluster.driver import CellDriver, Finished
from statescope.cluster.ledger import CellLedger
from statescope.cluster.plan import CELL_PARAMS, CellPlan, check_settings
from statescope.cluster.session import RayCluster
from statescope.errors import InputError
from statescope.records import new_run_id


def _labels(items: Sequence, setting: str | None) -> list[str]:
    names = [f"{setting}={v}" if setting else BuildSpec.parse(v).label for v in items]
    if len(set(names)) < len(names):  # the same build listed twice: tell them apart by position
        names = [f"#{i} {n}" for i, n in enumerate(names)]
    return names


class _Bisection:
    """The bookkeeping of one batched bisection (probes, posteriors, cells) around a search."""

    def __init__(self, items: list, setting: str | None, build: str | None, search: BatchedSearch,
                 labels: list[str], first_seed: int, params: dict, run_dir: Path) -> None:
        self.items, self.setting, self.build, self.search = items, setting, build, search
        self.labels, self.params, self.run_dir = labels, params, run_dir
        self.next_seed = {i: first_seed for i in range(len(items))}
        self.gains: dict[str, float] = {}
        self.probes: list[ProbeRecord] = []
        self.posteriors: list[list[float]] = []
        self.cells: list[dict] = []
        self.skipped: dict[str, str] = {}
        self.cancelled: list[str] = []
        self.prior_marginal = search.marginal().tolist()

    def plan(self, index: int) -> CellPlan:
        seed = self.next_seed[index]
        self.next_seed[index] += 1
        if self.setting:
            return CellPlan(self.build, {self.setting: self.items[index]}, seed,
                            tag={"item": index}, **self.params)
        return CellPlan(self.items[index], {}, seed, tag={"item": index}, **self.params)

    def settle(self, plan: CellPlan, record: dict, *, in_flight: bool) -> None:
        index = int(plan.tag["item"])
        self.next_seed[index] = max(self.next_seed[index], plan.seed + 1)
        cell = record.get("cell") or {}
        token = plan.cell_id if in_flight else None
        if record["status"] != "ok" or not cell.get("n_units"):
            why = record.get("error") or "the experiment completed no units"
            if in_flight:
                self.search.abandon(token, skip_item=True)
            else:
                self.search.skipped.add(index)
            self.skipped[self.labels[index]] = why
            return
        n, k = int(cell["n_units"]), int(cell["n_failed"])
        self.search.observe(token, index, n, k)
        m = self.search.marginal()
        best = int(np.argmax(m))
        self.probes.append(ProbeRecord(len(self.probes) + 1, index, self.labels[index], n, k,
                                       self.search.used, best, float(m[best]),
                                       self.gains.get(plan.cell_id)))
        self.posteriors.append(m.tolist())
        self.cells.append({"cell_id": plan.cell_id, "item": index, "seed": plan.seed,
                           "cell_dir": record.get("cell_dir"), "attempts": len(record.get("attempts", [])),
                           "replayed": not in_flight})

    def result(self, stopped: str, settings: dict) -> BisectResult:
        m = self.search.marginal()
        best = int(np.argmax(m))
        return BisectResult("bayesian-batched", self.search.mode, self.labels, self.probes,
                            self.prior_marginal, self.posteriors, best, float(m[best]),
                            self.search.used, stopped,
                            {**settings, "cells": self.cells, "cancelled": self.cancelled,
                             "run_dir": str(self.run_dir)}, self.skipped)

    def save(self, stopped: str, settings: dict) -> None:
        tmp = self.run_dir / ".bisect.json.tmp"
        tmp.write_text(json.dumps(self.result(stopped, settings).to_dict(), indent=2))
        os.replace(tmp, self.run_dir / "bisect.json")


def ray_bisect(items: Sequence, *, setting: str | None = None, build: BuildSpec | str | None = None,
               mode: str = "regression", requests_per_probe: int = 4, budget: int | None = None,
               confidence: float = 0.95, prior: RatePrior | None = None, workers: int | None = None,
               min_gain_bits: float = MIN_GAIN_BITS, max_probes: int = 200, first_seed: int = 0,
               address: str | None = None, local_cpus: int | None = None, run_id: str | None = None,
               store_root: str | Path = "runs", retries: int = 2, timeout_s: float = 3600.0,
               cell_cpus: float = 1.0, cell_gpus: float | None = None, store_access: str = "auto",
               installer: str = "auto", **params: Any) -> BisectResult:
    """Batched Bayesian bisection over ``items`` with cells as Ray tasks (see the module docstring).
    ``requests_per_probe`` is the units one cell is expected to yield (for choosing probes);
    ``workers`` caps the probes in flight (default: as many cells as fit in the cluster)."""
    items = list(items)
    unknown = sorted(set(params) - set(CELL_PARAMS))
    if unknown:
        raise InputError(f"ray_bisect parameters {unknown}: expected some of {list(CELL_PARAMS)}")
    if setting and build is None:
        raise InputError("ray_bisect(setting=...): expected the build to run the values in")
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise InputError(f"ray_bisect workers={workers!r}: expected an integer >= 1")
    if setting:
        check_settings({setting: items})
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            diffs = np.diff(np.asarray(items, dtype=float))
            if not (np.all(diffs > 0) or np.all(diffs < 0)):
                raise InputError(f"ray_bisect {setting}: expected numeric values in increasing or "
                                 f"decreasing order, got {items}")
    build_text = BuildSpec.parse(build).text if setting else None
    if not setting:
        items = [BuildSpec.parse(s).text for s in items]
    search = BatchedSearch(len(items), mode=mode, requests_per_probe=requests_per_probe,
                           confidence=confidence, budget=budget, prior=prior,
                           min_gain_bits=min_gain_bits)
    labels = _labels(items, setting)
    run_id = run_id or new_run_id("bisect")
    ledger = CellLedger(store_root, run_id)
    settings = {"requests_per_probe": requests_per_probe, "budget": budget,
                "confidence": confidence, "prior": asdict(search.posterior.prior), "mode": mode,
                "first_seed": first_seed, "min_gain_bits": min_gain_bits}
    ledger.begin("bisect", {"items": items, "setting": setting, "build": build_text,
                            "params": params, **settings})
    state = _Bisection(items, setting, build_text, search, labels, first_seed, params, ledger.run_dir)
    status, stopped = "failed", "max_probes"
    try:
        ledger.recover()
        for record in ledger.latest().values():  # replay: the order does not change the posterior
            state.settle(CellPlan.from_dict(record["plan"]), record, in_flight=False)
        stopped = _drive(state, ledger, address=address, local_cpus=local_cpus, workers=workers,
                         max_probes=max_probes, retries=retries, timeout_s=timeout_s,
                         cell_cpus=cell_cpus, cell_gpus=cell_gpus, store_access=store_access,
                         installer=installer, settings=settings)
        status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        state.save(stopped, {**settings, "workers": workers})
        ledger.finish(status)
    return state.result(stopped, {**settings, "workers": workers})


def _drive(state: _Bisection, ledger: CellLedger, *, address: str | None, local_cpus: int | None,
           workers: int | None, max_probes: int, settings: dict, **driver_kw: Any) -> str:
    search = state.search
    if search.marginal().max() >= search.confidence:
        return "confident"
    with RayCluster(address, num_cpus=local_cpus):
        cpus, gpus = driver_kw.pop("cell_cpus"), driver_kw.pop("cell_gpus")
        driver = CellDriver(ledger, cpus=cpus, gpus=gpus, **driver_kw)
        cap = workers or driver.slots()
        settings["workers"] = cap
        try:
            while True:
                room = min(driver.free(), cap - len(driver.in_flight),
                           max_probes - len(state.probes) - len(driver.in_flight))
                for pick in search.choose(room):
                    plan = state.plan(pick.index)
                    state.gains[plan.cell_id] = pick.gain_bits
                    search.start(plan.cell_id, pick.index)
                    driver.submit(plan)
                if not driver.in_flight:
                    if len(state.probes) >= max_probes:
                        return "max_probes"
                    return search.stop_reason() or "no informative probe"
                finished: list[Finished] = driver.wait(1.0)
                for f in finished:
                    state.settle(f.plan, f.record, in_flight=True)
                if finished:
                    state.save("running", settings)
                if search.marginal().max() >= search.confidence:
                    for plan in driver.cancel_all():
                        search.abandon(plan.cell_id, skip_item=False)
                        state.cancelled.append(plan.label)
                    return "confident"
        finally:
            driver.cancel_all()
