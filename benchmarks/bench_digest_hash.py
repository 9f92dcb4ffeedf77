"""What the word hash costs on CPU: the digest with it (issue 20) against the digest without it.

The word hash (``statescope.capture.word_hash``) is the digest's second exact number: it sees a
doubled float32 state and values permuted inside a row, which the word-sum checksum misses. This
measures its price on the two CPU digest paths, for two geometries of vLLM-like state (per layer
one page buffer per block: a bf16 SD conv window, then a float32 recurrent state, as
``as_strided`` views):

- ``tiny-gui``: 3 GDN layers, conv ``[5, 384]``, recurrent ``[1, 128, 128]``, 32 requests;
- ``qwen35-27b``: the reported model's per-layer geometry at TP=1 (conv ``[5, 10240]``,
  recurrent ``[48, 128, 128]`` = 3 MiB), 4 layers x 8 requests (the 48-layer model scales the
  time by 12; memory stays small on a shared machine).

Paths: ``c`` — the C kernel in place (the CPU default), built with and without the hash
(``digest_native.build_kernel(("STATESCOPE_NO_HASH",))``: the same source before the hash);
``torch`` — the gather + reductions fallback, with ``word_hash.block_hash`` and the token-row
hash in and out. Each case: both state kinds digested as the capture's step does
(``capture.run.digest_kinds``, conv token rows included), median of ``--iters`` timed calls
after warm-up, one thread. Prints one JSON line per (geometry, path) with ``ms_old``, ``ms_new``
and ``ratio`` (new / old), and checks that the hash-less build gives the same checksums.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_digest_hash.py [--iters 30]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

import torch  # noqa: E402

from statescope.capture import census_decode as cd  # noqa: E402
from statescope.capture import digest_native, word_hash  # noqa: E402
from statescope.capture.digest import Digester  # noqa: E402
from statescope.capture.run import digest_kinds  # noqa: E402

GEOMETRIES = {"tiny-gui": (3, 32, (5, 384), (1, 128, 128)),
              "qwen35-27b": (4, 8, (5, 10240), (48, 128, 128))}


def build(layers: int, requests: int, conv_shape: tuple, ssm_shape: tuple) -> tuple:
    blocks = requests + 2
    conv_elems, ssm_elems = conv_shape[0] * conv_shape[1], int(torch.tensor(ssm_shape).prod())
    page = conv_elems * 2 + ssm_elems * 4
    states = []
    for layer in range(layers):
        g = torch.Generator().manual_seed(layer)
        raw = torch.empty(blocks * page, dtype=torch.uint8)
        conv = torch.as_strided(raw.view(torch.bfloat16), (blocks, *conv_shape),
                                (page // 2, conv_shape[1], 1))
        strides = (ssm_shape[1] * ssm_shape[2], ssm_shape[2], 1)
        ssm = torch.as_strided(raw.view(torch.float32), (blocks, *ssm_shape), (page // 4, *strides),
                               conv_elems * 2 // 4)
        conv.copy_(torch.randn(conv.shape, generator=g).to(torch.bfloat16))
        ssm.copy_(torch.randn(ssm.shape, generator=g))
        states.append([conv, ssm])
    ids = torch.stack([torch.randperm(blocks - 1)[:requests] + 1 for _ in range(layers)])
    geoms = cd.geometry_from_states([(f"l{i}", 0, s) for i, s in enumerate(states)], False)
    return states, ids, geoms[0]


def timed(fns: dict, iters: int, rounds: int = 5) -> dict:
    """Median ms per call of each function, timed in alternating rounds (a shared machine's
    load changes over seconds: interleaving keeps it out of the ratio)."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    times: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            for _ in range(max(1, iters // rounds)):
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def measure(name: str, iters: int) -> list[dict]:
    layers, requests, conv_shape, ssm_shape = GEOMETRIES[name]
    states, ids, geom = build(layers, requests, conv_shape, ssm_shape)
    d = Digester(3, 0)
    run = lambda: digest_kinds(d, geom, states, ids, reuse=True)  # noqa: E731
    rows = []
    # the C kernel: today's build against the build without the hash
    new_fn, old_fn = digest_native.native_kernel(), digest_native.build_kernel(("STATESCOPE_NO_HASH",))

    def with_kernel(fn):
        def call():
            digest_native._native[:] = [fn]
            return run()
        return call

    if new_fn is not None and old_fn is not None:
        new, old = with_kernel(new_fn)(), with_kernel(old_fn)()
        assert torch.equal(new[1][..., 0], old[1][..., 0]), "checksums differ between the builds"
        assert (old[1][..., 1] == 0).all() and (new[1][..., 1] != 0).any()
        ms = timed({"new": with_kernel(new_fn), "old": with_kernel(old_fn)}, iters)
        digest_native._native[:] = [new_fn]
        rows.append({"geometry": name, "path": "c", "ms_old": round(ms["old"], 4),
                     "ms_new": round(ms["new"], 4), "ratio": round(ms["new"] / ms["old"], 3)})
    # the torch fallback, with and without the hash's integer passes
    saved = digest_native._native[:]
    keep_block, keep_rows = word_hash.block_hash, word_hash.token_row_hash

    def torch_path(hashed: bool):
        def call():
            digest_native._native[:] = [None]
            word_hash.block_hash = keep_block if hashed else \
                (lambda x: torch.zeros(x.shape[:-2], dtype=torch.int64))
            word_hash.token_row_hash = keep_rows if hashed else \
                (lambda x: torch.zeros(x.shape[:-1], dtype=torch.int64))
            return run()
        return call

    try:
        ms = timed({"new": torch_path(True), "old": torch_path(False)}, max(5, iters // 3))
    finally:
        word_hash.block_hash, word_hash.token_row_hash = keep_block, keep_rows
        digest_native._native[:] = saved
    rows.append({"geometry": name, "path": "torch", "ms_old": round(ms["old"], 4),
                 "ms_new": round(ms["new"], 4), "ratio": round(ms["new"] / ms["old"], 3)})
    state_bytes = sum(s[k][0].numel() * s[k].element_size() for s in states for k in (0, 1))
    for r in rows:
        r.update(layers=layers, requests=requests, bytes_per_step=state_bytes * requests,
                 threads=torch.get_num_threads())
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), action="append")
    a = p.parse_args()
    torch.set_num_threads(1)
    for name in a.geometry or list(GEOMETRIES):
        for row in measure(name, a.iters):
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
