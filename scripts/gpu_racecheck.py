"""Run the H-copy kernel race probe on a CUDA machine with real vLLM and write small result files.

What it does: records the environment (``statescope.share.envmanifest.device_environment``: torch,
vLLM, Triton, GPU, driver, the sha256 of vLLM's mamba_utils.py), then probes vLLM's ``batch_memcpy``
with left-overlapping copies for a byte-shift sweep and for the tiny model's and Qwen3.5-27B's
(TP 1/2/4) in-place conv shifts, once unpatched and once with ``statescope.patches.overlap_safe``
installed, and drives the fused post-process kernel with in-place shifts for several row sizes.
Writes OUT/<tag>.json (environment + every row), OUT/<tag>.csv (the table) and OUT/<tag>.log
(``--tag``, default ``racecheck``; the committed ones are data/results/gpu/racecheck/*, named by
what was probed). The JSON is rewritten after every probe, so a run cut short still returns what
it measured.

What it deliberately does not do: start an engine or a model; it measures the kernels alone.
Usage (on the device, after the vLLM install):  python3 scripts/gpu_racecheck.py --out "$OUT"
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import traceback
from pathlib import Path

import statescope  # noqa: F401  (before torch/vLLM)
from statescope.gpu import racecheck as rc
from statescope.share.envmanifest import device_environment
from statescope.patches.overlap_safe import install_overlap_safe_copy, uninstall_overlap_safe_copy

# Fused-kernel geometries: (name, row_bytes, state_len). Rows below the kernel's tile can race
# (1 KiB in 0.26.0; 8 KiB in 0.28.0, whose fused conv copy moves 1024 u64 per iteration).
FUSED_GEOMETRIES = [
    ("fused tiny row1024", 1024, 5),
    ("fused qwen35-27b tp4 row5120", 5120, 5),
    ("fused row64", 64, 5),
    ("fused row576", 576, 5),
    ("fused row768", 768, 5),
    ("fused row1000", 1000, 5),
]
# --more-fused (the 10^6-copy batch_memcpy probe) adds the other Qwen3.5-27B TP degrees and rows
# around 0.28.0's 8 KiB tile.
FUSED_GEOMETRIES_MORE = [
    ("fused qwen35-27b tp2 row10240", 10240, 5),
    ("fused qwen35-27b tp1 row20480", 20480, 5),
    ("fused row2048", 2048, 5),
    ("fused row4096", 4096, 5),
    ("fused row6144", 6144, 5),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--copies", type=int, default=100_000, help="copies per batch_memcpy class and arm")
    ap.add_argument("--fused-reqs", type=int, default=100_000, help="in-place shifts per fused class")
    ap.add_argument("--more-fused", action="store_true", help="also FUSED_GEOMETRIES_MORE")
    ap.add_argument("--fused-source", help="another build's mamba_utils.py: probe its fused kernel too")
    ap.add_argument("--fused-source-label", default="0.28.0", help="that build's vLLM version")
    ap.add_argument("--tag", default="racecheck", help="output file stem")
    ap.add_argument("--skip-batch", action="store_true", help="probe only the fused kernels")
    ap.add_argument("--fused-rows", help="comma-separated row sizes in bytes (replaces the geometry lists)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"{args.tag}.log", "w")

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    mamba_utils = rc.require_cuda()
    env = device_environment()
    say(json.dumps(env))
    classes = rc.sweep_shift_classes() + rc.preset_shift_classes("tiny", 1)
    classes += [c for tp in (1, 2, 4) for c in rc.preset_shift_classes("qwen35-27b", tp)]
    results: list[rc.ProbeResult] = []
    errors: list[str] = []
    t_start = time.perf_counter()
    source_sha = args.fused_source and hashlib.sha256(Path(args.fused_source).read_bytes()).hexdigest()

    def flush() -> None:
        frame = rc.results_frame(results) if results else None
        doc = {"environment": env, "copies": args.copies, "fused_reqs": args.fused_reqs,
               "fused_source": args.fused_source and {"path": args.fused_source, "vllm": args.fused_source_label,
                                                      "sha256": source_sha},
               "classes": [] if args.skip_batch else [c.__dict__ for c in classes], "errors": errors,
               "seconds": time.perf_counter() - t_start,
               "rows": [] if frame is None else frame.to_dict(orient="records"),
               "probes": [r.to_dict() for r in results]}
        (out / f"{args.tag}.json").write_text(json.dumps(doc, indent=1))
        if frame is not None:
            frame.to_csv(out / f"{args.tag}.csv", index=False)

    for patched in () if args.skip_batch else (False, True):
        (install_overlap_safe_copy if patched else uninstall_overlap_safe_copy)(mamba_utils)
        for c in classes:
            try:
                r = rc.probe_batch_memcpy(c.shift_bytes, c.copy_bytes, args.copies, name=c.name)
                results.append(r)
                say(f"batch_memcpy patched={patched} {c.name}: {r.corrupted}/{r.n} ({r.seconds:.1f} s)")
            except Exception:
                errors.append(traceback.format_exc())
                say(errors[-1])
            flush()
    uninstall_overlap_safe_copy(mamba_utils)

    geometries = FUSED_GEOMETRIES + (FUSED_GEOMETRIES_MORE if args.more_fused else [])
    if args.fused_rows:
        known = {row: name for name, row, _ in FUSED_GEOMETRIES + FUSED_GEOMETRIES_MORE}
        geometries = [(known.get(int(r), f"fused row{int(r)}"), int(r), 5) for r in args.fused_rows.split(",")]
    builds = [(None, "postprocess_mamba_fused_kernel", rc.FUSED_CONV_TILE_BYTES["0.26.0"])]
    if args.fused_source:
        label = args.fused_source_label
        builds.append((args.fused_source, f"postprocess_mamba_fused_kernel@{label}",
                       rc.FUSED_CONV_TILE_BYTES.get(label, rc.FUSED_CONV_TILE_BYTES["0.28.0"])))
    for source, kernel_name, tile in builds:
        try:
            module = rc.load_kernel_source(source) if source else None
        except Exception:
            errors.append(traceback.format_exc())
            say(errors[-1])
            continue
        for name, row, state_len in geometries:
            for bias in (1, 2):
                try:
                    r = rc.probe_fused_postprocess(row, 2, state_len, bias, args.fused_reqs,
                                                   name=f"{name} bias{bias}", module=module,
                                                   kernel_name=kernel_name, tile_bytes=tile)
                    results.append(r)
                    say(f"{kernel_name} {r.shift_class}: {r.corrupted}/{r.n} ({r.seconds:.1f} s)")
                except Exception:
                    errors.append(traceback.format_exc())
                    say(errors[-1])
                flush()
    say(f"done in {time.perf_counter() - t_start:.0f} s, {len(errors)} errors")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
