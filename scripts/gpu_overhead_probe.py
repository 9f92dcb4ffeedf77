"""Where the capture's throughput cost goes on a GPU (issue 7): one device call, one JSON file.

    python3 scripts/gpu_overhead_probe.py --out DIR [--sizes 1p3b,7b] [--rounds 6] [--max-tokens 160]
        [--modes off,hooks,digest,digest_eager,digest_bg] [--workloads decode,gui] [--budget-s 540]

Device glue: for each random-weight hybrid of ``statescope.gpu.e2e_run.LARGE_SIZES`` (compiled, CUDA
graphs, async scheduling, prefix caching + align + MTP(2): the trigger configuration) it starts one
engine (``large_hybrid_runner``) and runs ``statescope.capture.overhead_probe.probe_engine`` on it —
the same code as ``statescope capture-overhead`` — then rewrites ``OUT/overhead_probe.json``
(``{"env", "modes", <size>: <probe_engine's document + the hybrid's facts>}``) after each size, so a
call cut off at its limit still returns what it finished. ``--cpu`` shakes it out on the CPU build
(a 4-layer hybrid, smaller GUI prompts).

What it deliberately does not do: compute anything itself (every number comes from
``statescope.capture.overhead``), or decide (``statescope.results.overhead`` reads the files).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import statescope  # noqa: E402,F401  (CPU import shims before vLLM)
from statescope.capture.overhead import MODES, check_modes  # noqa: E402
from statescope.errors import InputError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROBE_MODES = ("off", "hooks", "digest", "digest_eager", "digest_bg")  # the probe's default set


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", default="1p3b,7b")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--cpu", action="store_true", help="shake-out on the CPU build (a 4-layer hybrid)")
    p.add_argument("--modes", default=",".join(PROBE_MODES), help=f"'off' first, then any of {MODES[1:]}")
    p.add_argument("--workloads", default="decode", help="decode and/or gui")
    a = p.parse_args()
    from statescope.gpu.e2e_run import LARGE_SIZES, large_hybrid_runner
    from statescope.capture.overhead_probe import probe_engine

    try:
        modes = check_modes(a.modes.split(","), "--modes")
    except InputError as exc:
        p.error(str(exc))
    workloads = tuple(a.workloads.split(","))
    if not set(workloads) <= {"decode", "gui"}:
        p.error(f"--workloads: expected decode and/or gui, got {a.workloads!r}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + a.budget_s
    results: dict = {"env": {k: os.environ.get(k) for k in ("STATESCOPE_DIGEST_TRITON",)}, "modes": list(modes)}

    def said(name: str):
        def on_workload(wl: str, part: dict) -> None:
            print(name, wl, json.dumps({m: {k: v for k, v in s.items() if k not in ("by_name_ms_per_step", "paired_ratios")}
                                        for m, s in part["summary"].items()}), flush=True)
        return on_workload

    for name in a.sizes.split(","):
        if time.time() > deadline - 150:
            results[name] = {"skipped": "device time"}
            continue
        t0 = time.time()
        try:
            runner, res = large_hybrid_runner(ROOT / "data/models/tiny-gui", cpu=a.cpu,
                                              **({} if a.cpu else LARGE_SIZES[name]))
            try:
                res.update(probe_engine(runner, workloads=workloads, modes=modes, rounds=a.rounds,
                                        max_tokens=a.max_tokens, gui_max_tokens=a.max_tokens if a.cpu else 64,
                                        gui_shape={"prefix": 96, "suffix": 32} if a.cpu else None,
                                        deadline=deadline, on_workload=said(name)))
            finally:
                runner.close()
            results[name] = res
        except Exception:
            results[name] = {"error": traceback.format_exc()[-3000:]}
        results[name]["wall_s"] = time.time() - t0
        (out / "overhead_probe.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
