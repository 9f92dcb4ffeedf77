"""A step's host facts in compact form: numpy arrays taken in the step, per-request rows made later.

What it does: ``step_tables`` reads the Mamba groups' block tables for a set of batch rows — from
vLLM's input batch (``MultiGroupBlockTable``'s host arrays: one fancy index per group), or from the
requests' own block-id lists where the batch's table is not a plain copy of them (kernel-split
blocks) or disagreed once (``TableSource`` checks the first steps of every run and falls back for
good, saying so). ``digest_columns`` picks, vectorized, each selected request's running column and,
optionally, the columns after it holding its drafts' candidate states (``column_candidates``).
``expand`` turns the compact
record back into the per-request ``metas`` and the ``block_ids`` map that the emitter and the
census decode read — in the flusher or at idle, not in the step.

Why: on a GPU the step's host time is the throughput (host-bound decode). Per-request Python in
the step — a dict of facts and a list copy per group per request — was most of the capture's
~1 ms per step at 32 requests (H200, data/results/gpu/overhead_graph_digest/), and every container made in the step is walked by
Python's cyclic collector for as long as the step waits to be emitted. numpy arrays are neither.

What it deliberately does not do: touch the device, or decide which requests are selected.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

CHECK_STEPS = 3  # steps per run on which the input batch's table is compared with the requests'


def _group_table(runner: Any, group: int) -> Any:
    bt = getattr(getattr(runner, "input_batch", None), "block_table", None)
    tables = getattr(bt, "block_tables", None)
    if tables is None or group >= len(tables):
        return None
    t = tables[group]
    if getattr(t, "blocks_per_kv_block", 1) != 1 or not hasattr(t, "num_blocks_per_row"):
        return None  # kernel-split blocks: the batch's ids are not the allocator's
    return t


def tables_from_batch(runner: Any, groups: Sequence[int], rows: np.ndarray) -> list | None:
    """Per group ``(table [R, W] int64, blocks per row [R] int64)`` for batch ``rows``, or None."""
    out = []
    for g in groups:
        t = _group_table(runner, g)
        if t is None:
            return None
        nb = t.num_blocks_per_row[rows].astype(np.int64)
        width = int(nb.max()) if len(nb) else 0
        out.append((t.get_numpy_array()[rows, :width], nb))  # a copy (fancy index), int32
    return out


def tables_from_requests(runner: Any, groups: Sequence[int], req_ids: Sequence[str]) -> list:
    """The same arrays from ``runner.requests[rid].block_ids`` (one list copy per request and group)."""
    out = []
    for g in groups:
        lists = [runner.requests[rid].block_ids[g] for rid in req_ids]
        nb = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        tab = np.zeros((len(lists), int(nb.max()) if len(lists) else 0), dtype=np.int64)
        for i, ids in enumerate(lists):
            tab[i, :len(ids)] = ids
        out.append((tab, nb))
    return out


def same_tables(a: list, b: list) -> bool:
    """Whether two ``step_tables`` results hold the same block ids (stale entries past a row's
    count ignored)."""
    for (ta, na), (tb, nb) in zip(a, b):
        if not np.array_equal(na, nb):
            return False
        w = int(na.max()) if len(na) else 0
        live = np.arange(w)[None, :] < na[:, None]
        if not np.array_equal(np.where(live, ta[:, :w], 0), np.where(live, tb[:, :w], 0)):
            return False
    return True


class TableSource:
    """Where a run's block tables come from: the input batch, checked against the requests on the
    first ``CHECK_STEPS`` steps (``source`` says which one, and why if it fell back)."""

    def __init__(self) -> None:
        self.checked = 0
        self.source = "input_batch"

    def tables(self, runner: Any, groups: Sequence[int], req_ids: Sequence[str],
               rows: np.ndarray) -> list:
        if self.source == "input_batch":
            got = tables_from_batch(runner, groups, rows)
            if got is None:
                self.source = "requests (the input batch has no plain block table)"
            elif self.checked < CHECK_STEPS:
                self.checked += 1
                if not same_tables(got, tables_from_requests(runner, groups, req_ids)):
                    self.source = f"requests (the input batch disagreed on check {self.checked})"
                    got = None
            if got is not None:
                return got
        return tables_from_requests(runner, groups, req_ids)


def digest_columns(tables: list, pos: np.ndarray, cols: np.ndarray, num_drafts: np.ndarray,
                   with_drafts: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For selected requests at table rows ``pos`` with running columns ``cols``: (digested
    columns ``[C, G]`` block ids, ``digest_rows`` ``[C, 2]`` (request, column offset), running
    blocks ``[R, G]`` (0 past a row's end), position of each request's running column in C).
    Per request: the running column, then (``with_drafts``) the ``num_drafts`` columns after it
    whose blocks exist in every group — the order the per-request loop this replaces produced."""
    reqs, ngroups = len(pos), len(tables)
    depth = int(num_drafts.max()) if with_drafts and reqs else 0
    if depth == 0:  # the default (no draft columns): one gather per group
        running = np.zeros((reqs, ngroups), dtype=np.int64)
        for gi, (tab, nb) in enumerate(tables):
            if tab.shape[1]:
                running[:, gi] = np.where(cols < nb[pos], tab[pos, np.minimum(cols, tab.shape[1] - 1)], 0)
        digest_rows = np.zeros((reqs, 2), dtype=np.int64)
        digest_rows[:, 0] = np.arange(reqs)
        return running, digest_rows, running, np.arange(reqs)
    offs = np.arange(depth + 1)
    cand = column_candidates(tables, pos, cols, depth)
    keep = np.ones((reqs, depth + 1), dtype=bool)
    if depth:
        keep[:, 1:] = (offs[None, 1:] <= num_drafts[:, None]) & (cand[:, 1:, :] != 0).all(axis=2)
    running_pos = (np.cumsum(keep.ravel()) - 1).reshape(reqs, depth + 1)[:, 0]
    return cand[keep], np.argwhere(keep), cand[:, 0, :], running_pos


def column_candidates(tables: list, pos: np.ndarray, cols: np.ndarray, depth: int) -> np.ndarray:
    """Block ids ``[R, depth + 1, G]`` of columns ``cols .. cols + depth`` of each selected
    request's row (table rows ``pos``), per Mamba group; 0 past a row's end (the null block)."""
    reqs, ngroups = len(pos), len(tables)
    at = cols[:, None] + np.arange(depth + 1)[None, :]  # [R, D+1]
    cand = np.zeros((reqs, depth + 1, ngroups), dtype=np.int64)
    for gi, (tab, nb) in enumerate(tables):
        if tab.shape[1] == 0:
            continue
        inside = at < nb[pos][:, None]
        cand[:, :, gi] = np.where(inside, tab[pos[:, None], np.minimum(at, tab.shape[1] - 1)], 0)
    return cand


def expand(item: dict, groups: Sequence[int]) -> None:
    """Add ``metas`` (one dict per selected request) and ``block_ids`` (req id -> {group: list})
    to a compact step ``item`` (a no-op for an item that has them)."""
    if "metas" in item:
        return
    req_ids, tables = item.pop("table_reqs"), item.pop("tables")
    lists = [[tab[i, :nb[i]].tolist() for i in range(len(req_ids))] for tab, nb in tables]
    item["block_ids"] = {rid: {g: lists[k][i] for k, g in enumerate(groups)}
                         for i, rid in enumerate(req_ids)}
    f = item.pop("facts", None)
    metas = []
    if f is not None:
        arrays = {k: f[k].tolist() for k in ("req_step", "batch_row", "running_col",
                                             "num_computed_runner", "running")}
        for r, rid in enumerate(f["sel"]):
            blocks = item["block_ids"][rid]
            metas.append(dict(f["sched"][r], engine_step=item["engine_step"], req_id=rid,
                              prompt_sha=f["prompt_sha"][r], prompt_len=f["prompt_len"][r],
                              req_step=arrays["req_step"][r], batch_row=arrays["batch_row"][r],
                              running_col=arrays["running_col"][r],
                              running_blocks=arrays["running"][r],
                              mamba_block_ids=[blocks[g] for g in groups],
                              block_size=f["block_size"],
                              num_computed_runner=arrays["num_computed_runner"][r]))
    item["metas"] = metas
