"""What issue 24's safety costs: the data-only spool format vs the pickle it replaced, and the
scrubber and leak check per megabyte of report.

    PYTHONPATH=lib OMP_NUM_THREADS=1 python benchmarks/bench_security.py [--steps 200]

The spool items are built like a captured step on an accelerator (``emit: idle``): 32 requests,
the compact facts, two fused launches whose inputs stayed on the device, and the step's packed
host buffer (14 KiB, 7 tensors); ``--events N`` adds N copy events per launch (the CPU build's
cross-check; none on a GPU). The baseline is the removed ``_HostPickler`` (pickle with numpy
arrays as raw bytes), rebuilt here only to time it: pickle is written, never read from a run.
Prints microseconds per step (best of 5) and the ratios.
"""
from __future__ import annotations

import argparse
import io
import pickle
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from statescope.capture import spool_format  # noqa: E402
from statescope.patches.cpu_kernels_copy import CopyEvent  # noqa: E402


@dataclass
class Launch:  # the fields of statescope.capture.run._Launch
    seq: int
    kind: str
    data: object = None
    owners: dict = field(default_factory=dict)
    observed: list = field(default_factory=list)
    block_size: int | None = None


def _array(data: bytes, dtype: str, shape: tuple) -> np.ndarray:
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


class _HostPickler(pickle.Pickler):
    """The removed spool writer (numpy arrays as raw bytes), for the baseline only."""

    def reducer_override(self, obj):
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            return _array, (obj.tobytes(), obj.dtype.str, obj.shape)
        if isinstance(obj, torch.Tensor):
            return torch.from_numpy, (obj.detach().numpy().copy(),)
        return NotImplemented


def step_item(step: int, events: int, requests: int = 32) -> dict:
    event = CopyEvent("postprocess", 0, "model.layers.0", "conv", 0, 0, 1, 2, 3, 4, 1, 1 << 40, 0,
                      4096, 8192, 3, 2048, "memmove", 1024)
    launches = [Launch(0, "precopy", None, observed=[event] * events),
                Launch(1, "postprocess", None, observed=[event] * events)]
    ids = [f"{i}-{step:08x}" for i in range(requests)]
    layout = [(torch.float32, (2, 4, 3, 4), 0)] + [(torch.int64, (2, 4, 3), 4096 + 128 * k) for k in range(6)]
    return {
        "engine_step": step, "launches": launches, "batch": ids, "table_reqs": ids,
        "tables": [(np.arange(requests * 4, dtype=np.int32).reshape(requests, 4),
                    np.full(requests, 4, dtype=np.int64)) for _ in range(2)],
        "facts": {"sel": ids, "sched": [{"num_computed_tokens": 374 + i, "is_new": False,
                                         "prefix_hit_tokens": None, "num_scheduled_tokens": 3,
                                         "num_drafts": 2} for i in range(requests)],
                  "block_size": 384, "prompt_sha": [f"{i:016x}" for i in range(requests)],
                  "prompt_len": [300 + i for i in range(requests)],
                  **{k: np.arange(requests, dtype=np.int64) for k in
                     ("req_step", "batch_row", "running_col", "num_computed_runner")},
                  "running": np.zeros((requests, 2), dtype=np.int64)},
        "digest_rows": np.zeros((requests, 2), dtype=np.int64),
        "digest_blocks": np.zeros((3, requests), dtype=np.int64), "used_in_launch": True,
        "packed": (torch.zeros(14336, dtype=torch.uint8), layout, ["stats", "checksum", "accepted"],
                   launches),
    }


def best_us(fn, items, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for it in items:
            fn(it)
        times.append((time.perf_counter() - t0) / len(items) * 1e6)
    return min(times)


def old_encode(item: dict) -> bytes:
    buf = io.BytesIO()
    _HostPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(item)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--events", type=int, default=0, help="copy events per launch (0 on a GPU)")
    ap.add_argument("--report-mb", type=float, default=1.0)
    args = ap.parse_args()
    items = [step_item(i, args.events) for i in range(args.steps)]
    new = [spool_format.encode(it) for it in items]
    old = [old_encode(it) for it in items]
    enc_new, enc_old = best_us(spool_format.encode, items), best_us(old_encode, items)
    dec_new, dec_old = best_us(spool_format.decode, new), best_us(pickle.loads, old)
    print(f"spool step, {args.events} copy events per launch: {np.mean([len(b) for b in new]):.0f} B "
          f"(pickle {np.mean([len(b) for b in old]):.0f} B)")
    print(f"  encode: data-only {enc_new:.0f} us, pickle {enc_old:.0f} us, ratio {enc_new / enc_old:.2f}")
    print(f"  decode: data-only {dec_new:.0f} us, pickle {dec_old:.0f} us, ratio {dec_new / dec_old:.2f}")

    from statescope.share.leakcheck import leaks_in_text
    from statescope.share.scrub import Scrubber

    source = (Path(__file__).resolve().parents[1] / "lib" / "statescope" / "capture" / "run.py").read_text()
    text = (source * (int(args.report_mb * 2**20) // len(source) + 1))[:int(args.report_mb * 2**20)]
    scrubber = Scrubber.for_environment({"HOME": "/home/someone", "DB_PASS": "opaque-value-1234"})
    t0 = time.perf_counter()
    scrubber.scrub(text)
    t1 = time.perf_counter()
    leaks_in_text(text, scrubber)
    t2 = time.perf_counter()
    print(f"report text ({args.report_mb:.1f} MiB of Python source): scrub {t1 - t0:.2f} s, "
          f"leak check {t2 - t1:.2f} s")


if __name__ == "__main__":
    main()
