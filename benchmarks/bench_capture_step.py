"""Host cost of the capture's per-step bookkeeping, on a CPU stand-in of one engine step.

A fake model runner (32 requests, 18 GDN layers in 3 Mamba groups of 5 KV groups, MTP(2), align
mode, a post-process launch per step; no vLLM, no device) drives ``RunCapture`` exactly as the
hooks do — ``begin_step``, ``note_sampled``, the fused post-process launch, ``end_step`` — with
the digest replaced by a ready buffer (as a CUDA-graph replay is, on the host) and the accelerator
path on (packed copy, spool). Every tenth step the finished steps are spooled, as the flusher does.
It prints host milliseconds per step (step and spool), with Python's cyclic collector on, frozen
after warm-up (what vLLM does after start-up) and off, and the ratio of each to "off".

Why: on a GPU the step's host time is the capture's throughput cost (host-bound decode), and a GPU
is scarce; this measures the Python part of that cost in seconds, anywhere. It does not measure
torch's CUDA dispatch or the GIL hand-offs with the flusher thread (on the H200 the step costs
2-3x what it costs here: data/results/gpu/overhead_compact_record/, docs/history/gpu-campaigns.md).

    .venv/bin/python benchmarks/bench_capture_step.py [--steps 300] [--draft-columns]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import threading
import time
import types
from collections import deque
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from statescope.capture import facts as cf
from statescope.capture import run as cr
from statescope.capture.spec import CaptureSpec  # noqa: E402
from statescope.capture.spool import Spool  # noqa: E402
from statescope.capture.store import CaptureWriter  # noqa: E402

REQS, LAYERS, KV_GROUPS, MAMBA_GROUPS = 32, 18, 5, [1, 2, 3]


class _Digest:  # a graph replay's result: a ready device buffer, nothing computed on the host
    def __init__(self) -> None:
        self.flat = torch.zeros(2_000, dtype=torch.uint8)

    def run(self, blocks: np.ndarray, graphs: bool, extra: torch.Tensor | None = None) -> tuple:
        cols = blocks.shape[1] + (0 if extra is None else extra.shape[1])  # + resume columns
        return self.flat, [(torch.float32, (2, LAYERS, 8, 5), 0)], cols

    def status(self, want: bool) -> str:
        return "on"


class _Table:
    blocks_per_kv_block = 1

    def __init__(self, lists: list) -> None:
        self.arr = np.zeros((256, 64), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(256, dtype=np.int32)
        for i, ids in enumerate(lists):
            self.arr[i, :len(ids)] = ids
            self.num_blocks_per_row[i] = len(ids)

    def get_numpy_array(self) -> np.ndarray:
        return self.arr


def stand_in(run_dir: str, draft_columns: bool) -> tuple:
    """(RunCapture wired to a fake runner, the runner, its scheduler output, launch inputs)."""
    spec = CaptureSpec.from_dict({"output_dir": run_dir, "draft_columns": draft_columns})
    rc = cr.RunCapture.__new__(cr.RunCapture)  # __init__ needs a real runner's KV-cache config
    rc.spec, rc.groups, rc.block_size = spec, MAMBA_GROUPS, 544
    rc.layers = [(f"l{i}", MAMBA_GROUPS[i % 3]) for i in range(LAYERS)]
    rc.layer_group_pos = [i % 3 for i in range(LAYERS)]
    rc.device, rc.device_path, rc.step_digest, rc.want_graph = torch.device("cpu"), True, _Digest(), True
    rc.writer = CaptureWriter(Path(run_dir) / "run", {"digest_graph": "on"}, spec.max_bytes)
    rc.spool, rc.deferred, rc.pending = Spool(Path(run_dir) / "run"), [], deque()
    rc.lock, rc.drain_lock = threading.RLock(), threading.RLock()
    rc.step, rc.engine_step, rc.reqs, rc.snap_reserved, rc.skipped = None, 0, {}, 0, 0
    rc.last_step_t, rc.emit_s, rc.steps_since_write, rc.last_write = time.monotonic(), 0.0, 0, 0.0
    rc.crosscheck, rc.defer, rc.table_source = {}, True, cf.TableSource()
    ids = [f"r{i}" for i in range(REQS)]
    reqs = {rid: types.SimpleNamespace(
        prompt_token_ids=list(range(500 + i)), num_computed_tokens=600,
        block_ids=tuple(list(range(i * 10, i * 10 + 6)) for _ in range(KV_GROUPS)))
        for i, rid in enumerate(ids)}
    tables = [_Table([reqs[r].block_ids[g] for r in ids]) for g in range(KV_GROUPS)]
    runner = types.SimpleNamespace(
        requests=reqs, mamba_state_idx={rid: 1 for rid in ids},
        cache_config=types.SimpleNamespace(mamba_cache_mode="align"),
        input_batch=types.SimpleNamespace(req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                          block_table=types.SimpleNamespace(block_tables=tables)))
    so = types.SimpleNamespace(
        finished_req_ids=set(), scheduled_new_reqs=[],
        scheduled_spec_decode_tokens={rid: [1, 2] for rid in ids},
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=ids, num_computed_tokens=[600] * REQS,
                                                    resumed_req_ids=set()),
        num_scheduled_tokens={rid: 3 for rid in ids})
    return rc, runner, so, torch.zeros(REQS, 5, dtype=torch.int32)


def measure(steps: int, collector: str, draft_columns: bool = False) -> dict:
    """Host ms per step of the step's hooks and of spooling, ``collector`` on / frozen / off."""
    with tempfile.TemporaryDirectory() as tmp:
        rc, runner, so, launch = stand_in(tmp, draft_columns)
        sampled = torch.zeros(REQS, 3, dtype=torch.int64)

        def one() -> None:
            rc.begin_step(so)
            rc.note_sampled(sampled)
            rc.note_used(None)
            rc.open_launch("postprocess", launch.clone(), block_size=544)
            rc.launch_done()
            rc.end_step(runner)

        for _ in range(20):  # warm-up (first-step checks of the table source included)
            one()
        rc.pending.clear()
        was_enabled = gc.isenabled()
        if collector == "frozen":
            gc.collect()
            gc.freeze()
        elif collector == "off":
            gc.disable()
        try:
            spool_s, t0 = 0.0, time.perf_counter()
            for i in range(steps):
                one()
                if i % 10 == 9:  # the flusher's cadence: spool what finished, keep it until idle
                    items = list(rc.pending)
                    rc.pending.clear()
                    t1 = time.perf_counter()
                    rc.spool.append_many(items)
                    spool_s += time.perf_counter() - t1
                    rc.deferred += items
            total = time.perf_counter() - t0
        finally:
            if collector == "frozen":
                gc.unfreeze()
            if was_enabled:
                gc.enable()
            rc.spool.close()
        return {"collector": collector, "draft_columns": draft_columns,
                "step_ms": round((total - spool_s) * 1e3 / steps, 4),
                "spool_ms": round(spool_s * 1e3 / steps, 4),
                "spool_bytes_per_step": round(rc.spool.offset / steps),
                "block_table_source": rc.table_source.source}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--draft-columns", action="store_true")
    a = p.parse_args()
    rows = [measure(a.steps, c, a.draft_columns) for c in ("on", "frozen", "off")]
    off = rows[-1]["step_ms"] + rows[-1]["spool_ms"]
    for r in rows:
        r["ratio_to_collector_off"] = round((r["step_ms"] + r["spool_ms"]) / off, 3)
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
