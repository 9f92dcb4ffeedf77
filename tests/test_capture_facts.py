"""statescope.capture.facts: the step's compact record against the per-request loop it replaced."""
from __future__ import annotations

import types

import numpy as np
import pytest

from statescope.capture import facts as cf


def _loop_reference(lists_per_group, cols, drafts, with_drafts):
    """The per-request loop capture_run.end_step ran before the compact record (session 6)."""
    columns, digest_rows, running = [], [], []
    for r, col in enumerate(cols):
        group_blocks = [lists[r] for lists in lists_per_group]
        run = [b[col] if col < len(b) else 0 for b in group_blocks]
        running.append(run)
        columns.append(run)
        digest_rows.append((r, 0))
        if with_drafts:
            for j in range(1, drafts[r] + 1):
                blocks = [b[col + j] if col + j < len(b) else 0 for b in group_blocks]
                if all(blocks):
                    columns.append(blocks)
                    digest_rows.append((r, j))
    return columns, digest_rows, running


@pytest.mark.parametrize("with_drafts", [False, True])
def test_digest_columns_match_the_per_request_loop(with_drafts):
    rng = np.random.default_rng(0)
    for _ in range(200):
        reqs, groups = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        lists = [[[int(x) for x in rng.integers(0, 4, rng.integers(0, 7))] for _ in range(reqs)]
                 for _ in range(groups)]
        tables = []
        for g in range(groups):
            nb = np.array([len(x) for x in lists[g]], dtype=np.int64)
            tab = np.full((reqs, int(nb.max()) + 2), 99, dtype=np.int64)  # stale past each row's end
            for i, x in enumerate(lists[g]):
                tab[i, :len(x)] = x
            tables.append((tab, nb))
        cols = rng.integers(0, 6, reqs)
        drafts = rng.integers(0, 3, reqs)
        columns, rows, running, running_pos = cf.digest_columns(
            tables, np.arange(reqs), cols, drafts, with_drafts)
        want_cols, want_rows, want_running = _loop_reference(lists, cols, drafts, with_drafts)
        assert columns.reshape(-1, groups).tolist() == want_cols
        assert [tuple(x) for x in rows.tolist()] == want_rows
        assert running.tolist() == want_running
        assert [want_rows[p] for p in running_pos] == [(r, 0) for r in range(reqs)]


class _Table:
    blocks_per_kv_block = 1

    def __init__(self, lists):
        self.arr = np.zeros((8, 6), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(8, dtype=np.int32)
        for i, ids in enumerate(lists):
            self.arr[i, :len(ids)] = ids
            self.num_blocks_per_row[i] = len(ids)

    def get_numpy_array(self):
        return self.arr


def _runner(lists, batch_lists=None):
    reqs = {f"r{i}": types.SimpleNamespace(block_ids=([], ids)) for i, ids in enumerate(lists)}
    bt = types.SimpleNamespace(block_tables=[_Table([]), _Table(batch_lists or lists)])
    return types.SimpleNamespace(requests=reqs, input_batch=types.SimpleNamespace(block_table=bt))


def test_table_source_reads_the_batch_and_falls_back_when_it_disagrees():
    lists = [[3, 4], [5], [6, 7, 8]]
    rows = np.array([2, 0], dtype=np.int64)
    src = cf.TableSource()
    got = src.tables(_runner(lists), [1], ["r2", "r0"], rows)
    assert src.source == "input_batch"
    assert got[0][1].tolist() == [3, 2] and got[0][0][0].tolist() == [6, 7, 8]
    bad = cf.TableSource()
    got = bad.tables(_runner(lists, [[3, 4], [5], [6, 7, 9]]), [1], ["r2", "r0"], rows)
    assert bad.source.startswith("requests (the input batch disagreed")
    assert got[0][0][0].tolist() == [6, 7, 8]  # the requests' ids, not the batch's
    split = _runner(lists)
    split.input_batch.block_table.block_tables[1].blocks_per_kv_block = 2
    kernel = cf.TableSource()
    kernel.tables(split, [1], ["r0"], np.array([0]))
    assert kernel.source.startswith("requests (the input batch has no plain block table")


def test_expand_rebuilds_metas_and_block_lists():
    tables = [(np.array([[1, 2, 0], [4, 0, 0]]), np.array([2, 1]))]
    item = {"engine_step": 7, "table_reqs": ["a", "b"], "tables": tables, "facts": {
        "sel": ["b"], "sched": [{"num_drafts": 2, "is_new": False}], "block_size": 16,
        "prompt_sha": ["s"], "prompt_len": [5], "req_step": np.array([3]),
        "batch_row": np.array([1]), "running_col": np.array([0]), "running": np.array([[4]]),
        "num_computed_runner": np.array([9])}}
    cf.expand(item, [2])
    assert item["block_ids"] == {"a": {2: [1, 2]}, "b": {2: [4]}}
    (meta,) = item["metas"]
    assert meta == {"num_drafts": 2, "is_new": False, "engine_step": 7, "req_id": "b",
                    "prompt_sha": "s", "prompt_len": 5, "req_step": 3, "batch_row": 1,
                    "running_col": 0, "running_blocks": [4], "mamba_block_ids": [[4]],
                    "block_size": 16, "num_computed_runner": 9}
    assert all(type(v) is int for k, v in meta.items() if k in ("req_step", "batch_row", "running_col"))
    cf.expand(item, [2])  # idempotent
    assert len(item["metas"]) == 1


def test_step_stand_in_benchmark_runs_the_real_capture_code():
    """benchmarks/bench_capture_step.py drives RunCapture with a fake runner: it must keep working
    (and read the block tables from the fake input batch) as the capture changes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_capture_step as bench

    for drafts in (False, True):
        row = bench.measure(20, "frozen", draft_columns=drafts)
        assert row["step_ms"] > 0 and row["spool_ms"] > 0 and row["spool_bytes_per_step"] > 1000
        assert row["block_table_source"] == "input_batch"
