"""Command line of cluster runs: ``--ray [ADDRESS]`` on ``statescope matrix`` and ``statescope bisect``.

What it does: ``add_cluster_arguments`` adds the cluster options to those two subcommands;
``matrix_on_ray`` / ``bisect_on_ray`` run them through ``statescope.cluster`` when ``--ray`` is
given (``--ray`` alone: a local cluster started and torn down for the command; ``--ray ADDRESS``:
the cluster at that head address, ``ray://`` for Ray Client, ``auto`` for one running here) and
return None otherwise, after refusing cluster-only options given without ``--ray``. The run id is
printed to stderr first, so a killed driver can be resumed with ``--run-id``.

What it deliberately does not do: any work beyond parsing (``statescope.cluster.matrix``,
``statescope.cluster.bisect``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from statescope.errors import InputError

CLUSTER_ONLY = ("run_id", "retries", "cell_timeout", "cell_gpus", "cell_cpus", "store_access",
                "local_cpus", "retry_failed", "axis", "seeds", "workers", "min_gain", "first_seed")


def add_cluster_arguments(p: argparse.ArgumentParser, *, matrix: bool) -> None:
    """Options of cells as Ray tasks (defaults None: a given one without --ray is refused)."""
    g = p.add_argument_group("cells on a Ray cluster")
    g.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run cells as Ray tasks: on the cluster at ADDRESS (HOST:PORT of the head, "
                        "ray://HOST:10001, or auto), or without ADDRESS on a local cluster started "
                        "and torn down for this command")
    g.add_argument("--run-id", help="the cluster run to start, or to resume after a killed driver")
    g.add_argument("--retries", type=int, help="re-runs of a cell whose worker died or that timed "
                                               "out (default 2)")
    g.add_argument("--cell-timeout", type=float, help="seconds one cell may run (default 3600)")
    g.add_argument("--cell-gpus", type=float, help="GPUs per cell (default 1 when the cluster has "
                                                   "GPUs, else 0)")
    g.add_argument("--cell-cpus", type=float, help="CPUs per cell (default 1)")
    from statescope.cluster.cells import STORE_ACCESS

    g.add_argument("--store-access", choices=STORE_ACCESS, help="cells write the store directly "
                                          "(shared filesystem) or send their files back (default auto)")
    g.add_argument("--local-cpus", type=int, help="with --ray and no ADDRESS: CPUs of the local cluster")
    if matrix:
        g.add_argument("--axis", action="append", metavar="FIELD=V1,V2,...",
                       help="cross the builds with values of a trigger-arm EngineConfig field "
                            "(repeatable; values as JSON, else strings)")
        g.add_argument("--seeds", type=int, help="seeds 0..N-1 per cell (default 1)")
        g.add_argument("--retry-failed", action="store_true", default=None,
                       help="on resume, run failed cells again")
    else:
        g.add_argument("--workers", type=int, help="probes in flight at most (default: as many "
                                                   "cells as fit in the cluster)")
        g.add_argument("--min-gain", type=float, help="bits a probe must be expected to add to "
                                                      "take a free worker (default 1e-9)")
        g.add_argument("--first-seed", type=int, help="seed of each item's first probe (default 0)")


def _refuse_without_ray(args: argparse.Namespace) -> None:
    given = [name for name in CLUSTER_ONLY if getattr(args, name, None) is not None]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise InputError(f"{flags}: expected --ray as well (these options set up cells on a Ray "
                         "cluster; the sequential path has none of them)")


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_axes(pairs: list[str] | None) -> dict[str, list]:
    """``FIELD=V1,V2,...`` pairs as {field: [values]} (the fields are checked by the planner)."""
    axes: dict[str, list] = {}
    for pair in pairs or []:
        name, sep, values = pair.partition("=")
        if not sep or not name.isidentifier() or not values or name in axes:
            raise InputError(f"--axis {pair!r}: expected FIELD=V1,V2,... with FIELD an identifier "
                             "given once")
        axes[name] = [_value(v) for v in values.split(",")]
    return axes


def _common(args: argparse.Namespace, run_id: str) -> dict[str, Any]:
    return dict(address=args.ray or None, local_cpus=args.local_cpus, run_id=run_id,
                store_root=args.runs,
                retries=2 if args.retries is None else args.retries,
                timeout_s=3600.0 if args.cell_timeout is None else args.cell_timeout,
                cell_cpus=1.0 if args.cell_cpus is None else args.cell_cpus,
                cell_gpus=args.cell_gpus, store_access=args.store_access or "auto",
                installer=args.installer, preset=args.preset, unit=args.unit, control=args.control)


def _stdout_for_reports_only():
    """Ray's driver prints cluster error messages (a worker died, ...) to stdout from a thread of
    its own; stdout is for the report (``--json`` must parse), so they go to stderr meanwhile."""
    return contextlib.redirect_stdout(sys.stderr)


def _announce(command: str, args: argparse.Namespace, run_id: str) -> None:
    where = f"the cluster at {args.ray}" if args.ray else "a local Ray cluster"
    print(f"statescope {command}: cluster run {run_id} under {args.runs} on {where} "
          f"(resume with --run-id {run_id})", file=sys.stderr, flush=True)


def matrix_on_ray(args: argparse.Namespace):
    """``statescope matrix --ray``: the matrix table, or None without --ray."""
    if args.ray is None:
        _refuse_without_ray(args)
        return None
    from statescope.cluster.matrix import ray_matrix
    from statescope.cluster.plan import matrix_plan
    from statescope.records import new_run_id

    run_id = args.run_id or new_run_id("matrix")
    seeds = 1 if args.seeds is None else args.seeds
    if seeds < 1:
        raise InputError(f"--seeds {seeds}: expected an integer >= 1")
    seeds, args.design = ray_cell_design(args, seeds)
    axes, common = parse_axes(args.axis), _common(args, run_id)
    matrix_plan(args.specs, axes=axes, seeds=range(seeds),
                **{k: common[k] for k in ("preset", "unit", "control")})  # bad input: before the run
    _announce("matrix", args, run_id)
    with _stdout_for_reports_only():
        return ray_matrix(args.specs, axes=axes, seeds=range(seeds),
                          retry_failed=bool(args.retry_failed), **common)


def ray_cell_design(args: argparse.Namespace, seeds: int) -> tuple[int, dict]:
    """The pooled design of one build and settings over ``seeds`` cells (a seed each), before the
    cluster starts: refused when ``--seeds`` was given and cannot reach alpha, sized otherwise."""
    from statescope.verdict.design import CELL_ALPHA
    from statescope.cli.reproduce import seeds_that_can_answer
    from statescope.verdict.design import design_units, power_of
    from statescope.workload.episodes import PRESETS, preset_trace

    if args.preset not in PRESETS or args.unit not in ("request", "episode"):
        if args.unit == "engine_lifetime":
            raise InputError("--unit engine_lifetime: a cluster cell is one engine lifetime; its "
                             "seeds cannot be pooled into a design that answers (--unit episode)")
        return seeds, {"sized": None}  # matrix_plan names the bad preset or unit
    n = seeds * design_units(preset_trace(args.preset), args.unit)
    design = power_of(n, n, CELL_ALPHA, args.unit)
    sized = None
    if not design.can_answer:
        k = seeds_that_can_answer(args.preset, args.unit, CELL_ALPHA, None)
        if args.seeds is not None or k is None:
            raise InputError("a build's pooled cells " + design.refusal(f"--seeds {k}"))
        seeds, sized = k, (f"one seed of the {args.preset} preset cannot reach alpha="
                           f"{CELL_ALPHA}: sized to --seeds {k} (each build and setting pooled)")
        n = seeds * design_units(preset_trace(args.preset), args.unit)
        design = power_of(n, n, CELL_ALPHA, args.unit)
    line = design.summary() + (f" ({sized})" if sized else "")
    return seeds, {"sized": sized, **design.to_dict(), "line": line}


def bisect_on_ray(args: argparse.Namespace, requests_per_probe: int):
    """``statescope bisect --ray``: the BisectResult, or None without --ray."""
    if args.ray is None:
        _refuse_without_ray(args)
        return None
    if args.simulate or args.plain:
        raise InputError("--ray runs real cells with the batched Bayesian search; expected neither "
                         "--simulate nor --plain with it")
    from statescope.builds.run import plant_regression
    from statescope.builds.spec import BuildSpec
    from statescope.cluster.batches import MIN_GAIN_BITS
    from statescope.cluster.bisect import ray_bisect
    from statescope.records import new_run_id

    run_id = args.run_id or new_run_id("bisect")
    common = _common(args, run_id)
    search = dict(mode=args.mode, requests_per_probe=requests_per_probe, budget=args.budget,
                  confidence=args.confidence, workers=args.workers,
                  min_gain_bits=MIN_GAIN_BITS if args.min_gain is None else args.min_gain,
                  first_seed=0 if args.first_seed is None else args.first_seed)
    if args.settings:
        axis, _, values = args.settings.partition("=")
        items: list = [_value(v) for v in values.split(",")]
        _announce("bisect", args, run_id)
        with _stdout_for_reports_only():
            return ray_bisect(items, setting=axis, build=args.build, **search, **common)
    specs = [BuildSpec.parse(s) for s in args.builds]
    if args.plant_from is not None:
        specs = plant_regression(specs, args.plant_from)
    _announce("bisect", args, run_id)
    with _stdout_for_reports_only():
        return ray_bisect(specs, **search, **common)
