"""Per-step digest cost on a CUDA GPU: the torch gather path vs the one-launch Triton kernel.

Builds L GDN layers (default 18) of vLLM-like state: per layer one page buffer holding, per block,
a bf16 conv window (SD ``[3, 8192]``; ``--layout DS``: ``[8192, 3]``) followed by a float32
recurrent state ``[32, 128, 128]`` (2 MB), as ``as_strided`` views. Each "step" digests R
requests' blocks (default 32; duplicate-free, shuffled) of both kinds through
``capture_run.digest_kinds`` (what the capture's step digest runs, conv token rows included), once
with the Triton path off (``statescope.capture.digest`` falls back to its torch gather + reductions) and
once with it on. Reported per step: host time (``perf_counter`` around the call; nothing is
synchronized inside it) and device time (CUDA events around the call, with a sleep kernel queued
first so the step's kernels run back to back however slowly the host enqueues them). Checks that
the two paths' exact numbers (checksum and word hash, per block and per conv token row) are
identical and prints one JSON line. A third pass runs the Triton kernel without the word hash
(``digest_triton.HASH = False``: the digest as it was before issue 20) and reports
``hash_device_ratio`` / ``hash_host_ratio``: the cost of the hash, new over old.

    python benchmarks/bench_digest_gpu.py [--layers 18] [--requests 32] [--layout SD] [--iters 10]
        [--stages 3] [--tile 2048]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("STATESCOPE_DIGEST_TRITON", "1")  # the default; "0" in the env would skip it

import statescope  # noqa: E402,F401  (import shims first)
import torch  # noqa: E402

from statescope.capture import census_decode as cd
from statescope.capture import digest as digest_mod
from statescope.capture.run import digest_kinds  # noqa: E402
from statescope.capture.digest import Digester, host_to_device  # noqa: E402


def build_states(layers: int, blocks: int, layout: str, conv_dim: int = 8192, state_len: int = 3,
                 ssm_shape: tuple = (32, 128, 128), device: str = "cuda") -> list:
    conv_shape = (state_len, conv_dim) if layout == "SD" else (conv_dim, state_len)
    conv_elems, ssm_elems = conv_dim * state_len, ssm_shape[0] * ssm_shape[1] * ssm_shape[2]
    page = conv_elems * 2 + ssm_elems * 4  # bytes; conv first, as one vLLM page per block
    states = []
    for layer in range(layers):
        raw = torch.empty(blocks * page, dtype=torch.uint8, device=device)
        conv = torch.as_strided(raw.view(torch.bfloat16), (blocks, *conv_shape),
                                (page // 2, conv_shape[1], 1))
        ssm = torch.as_strided(raw.view(torch.float32), (blocks, *ssm_shape),
                               (page // 4, ssm_shape[1] * ssm_shape[2], ssm_shape[2], 1),
                               conv_elems * 2 // 4)
        gen = torch.Generator(device=device).manual_seed(layer)
        conv.copy_(torch.randn(conv.shape, generator=gen, device=device).to(torch.bfloat16))
        ssm.copy_(torch.randn(ssm.shape, generator=gen, device=device))
        states.append([conv, ssm])
    return states


def one_step(cap: SimpleNamespace, states: list, ids_host: torch.Tensor
             ) -> tuple[dict, float, float]:
    """(results, host ms, device ms) of one capture digest step."""
    device = states[0][0].device
    cuda = device.type == "cuda"  # (a CPU run is only a smoke test of this script)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time: the host enqueues the step meanwhile
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    ids = host_to_device(ids_host, device)  # as end_step does: part of the host cost
    stats, checks, row_checks, row_sums = digest_kinds(cap.digester, cap.geoms[0], states, ids, reuse=False)
    item = {"stats": stats, "checksum": checks, "conv_row_checks": row_checks, "conv_row_sums": row_sums}
    host = time.perf_counter() - t0
    if not cuda:
        return item, host * 1e3, host * 1e3
    end.record()
    end.synchronize()
    return item, host * 1e3, start.elapsed_time(end)


def run(cap: SimpleNamespace, states: list, ids: torch.Tensor, iters: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        item = one_step(cap, states, ids)[0]
    hosts, devices = [], []
    for _ in range(iters):
        item, h, d = one_step(cap, states, ids)
        hosts.append(h)
        devices.append(d)
    hosts.sort()
    devices.sort()
    return {"item": item, "host_ms": hosts[len(hosts) // 2],
            "device_ms": devices[len(devices) // 2], "host_ms_min": hosts[0],
            "device_ms_min": devices[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--layout", choices=("SD", "DS"), default="SD")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--heads", type=int, default=32, help="recurrent state heads (x 128 x 128)")
    ap.add_argument("--conv-dim", type=int, default=8192)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test under TRITON_INTERPRET=1")
    ap.add_argument("--stages", type=int, help="override digest_triton.STAGES (pipelined loads)")
    ap.add_argument("--tile", type=int, help="override digest_triton.TILE (elements per tile)")
    args = ap.parse_args()
    from statescope.capture import digest_triton

    digest_triton.STAGES = args.stages or digest_triton.STAGES
    digest_triton.TILE = args.tile or digest_triton.TILE
    blocks = args.requests + 8
    states = build_states(args.layers, blocks, args.layout, args.conv_dim,
                          ssm_shape=(args.heads, 128, 128), device=args.device)
    geoms = cd.geometry_from_states([(f"l{i}", 0, s) for i, s in enumerate(states)],
                                    args.layout == "DS")
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(blocks - 1, generator=gen)[:args.requests] + 1
                       for _ in range(args.layers)])  # [L, R], no null block
    results = {}
    for path in ("torch", "triton", "triton_nohash"):
        digest_triton.HASH = path != "triton_nohash"
        digest_mod._triton[:] = [] if path.startswith("triton") else [None]
        d = Digester(3, 0)
        cap = SimpleNamespace(geoms=geoms, digester=d, device_path=True)
        if path.startswith("triton"):
            assert d.digest_device([s[1] for s in states], ids.to(args.device)) is not None, \
                "the Triton path declined (see the log)"
        results[path] = run(cap, states, ids, args.iters)
    a, b = results["torch"]["item"], results["triton"]["item"]
    stats_a, stats_b = a["stats"].float().cpu(), b["stats"].float().cpu()
    # per statistic column: the largest difference over the column's largest magnitude
    rel = ((stats_a - stats_b).abs().amax((1, 2))
           / stats_a.abs().amax((1, 2)).clamp_min(1e-6)).max().item()
    state_bytes = sum(s[k][0].numel() * s[k].element_size() for s in states for k in (0, 1))
    out = {"layers": args.layers, "requests": args.requests, "layout": args.layout,
           "stages": digest_triton.STAGES, "tile": digest_triton.TILE,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
           "torch_version": torch.__version__,
           "triton_version": __import__("triton").__version__,
           "bytes_per_step": state_bytes * args.requests,
           "checksums_equal": bool(torch.equal(a["checksum"].cpu(), b["checksum"].cpu())),
           "conv_row_checks_equal": bool(torch.equal(a["conv_row_checks"].cpu(),
                                                     b["conv_row_checks"].cpu())),
           "stats_max_rel_diff": rel}
    digest_triton.HASH = True
    for path, r in results.items():
        out.update({f"{path}_{k}": round(v, 4) for k, v in r.items() if k != "item"})
    old, new = results["triton_nohash"], results["triton"]
    out["hash_device_ratio"] = round(new["device_ms_min"] / max(old["device_ms_min"], 1e-9), 3)
    out["hash_host_ratio"] = round(new["host_ms"] / max(old["host_ms"], 1e-9), 3)
    out["hashes_nonzero"] = bool((b["checksum"][..., 1] != 0).any())
    dev_s = results["triton"]["device_ms_min"] / 1e3
    out["triton_GBps"] = round(out["bytes_per_step"] / dev_s / 1e9, 1) if dev_s else None
    print(json.dumps(out))
    if not (out["checksums_equal"] and out["conv_row_checks_equal"]):
        raise SystemExit("checksums differ between the torch and Triton paths")


if __name__ == "__main__":
    main()
