"""``statescope workload`` and ``statescope reproduce``: write a trace; trigger arm vs control arm.

What it does: parses the arguments (engine overrides through ``statescope.cli.assignments``),
builds the arms and calls ``statescope.verdict.reproduce.reproduce``; prints the verdict (``--json``
for machines). Exit 0 no evidence, 1 corruption detected or the geometry was not exercised, 2 bad
input.

What it deliberately does not do: decide anything (``statescope.verdict`` does).
"""
from __future__ import annotations

import argparse
import json

from statescope.cli.assignments import parse_assignments


def _config_overrides(pairs: list[str], where: str) -> dict:
    """``key=value`` pairs for EngineConfig fields (``--trigger-set`` / ``--control-set``)."""
    import dataclasses

    from statescope.engine.config import EngineConfig

    return parse_assignments(pairs, where, [f.name for f in dataclasses.fields(EngineConfig)])


def cmd_workload(args: argparse.Namespace) -> int:
    from statescope.workload.episodes import preset_trace
    from statescope.workload.trace import write_trace

    steps = preset_trace(args.preset, vision=args.vision, seed=args.seed, geometry=args.geometry)
    path = write_trace(steps, args.out)
    info = {"trace": str(path), "requests": len(steps),
            "episodes": len({s.episode for s in steps}), "images": sum(s.n_images for s in steps)}
    print(json.dumps(info, indent=2) if args.json else
          f"wrote {info['requests']} requests ({info['episodes']} episodes) to {path}")
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    import time

    from statescope.engine.offline import model_path
    from statescope.patches.faults import FaultSpec
    from statescope.verdict.reproduce import reproduce, standard_arms
    from statescope.workload.episodes import preset_trace
    from statescope.workload.trace import read_trace

    trace = read_trace(args.trace) if args.trace else preset_trace(args.preset,
                                                                   geometry=args.geometry)
    trigger, control = standard_arms(args.control)
    common = {"model": str(model_path(args.model))} if args.model else {}
    trigger.config = trigger.config.replace(**common, **_config_overrides(args.trigger_set, "--trigger-set"))
    control.config = control.config.replace(**common, **_config_overrides(args.control_set, "--control-set"))
    if args.fault:
        kind, _, rest = args.fault.partition(":")
        rate = float(rest) if rest else 1.0
        trigger.fault = FaultSpec(kind=kind, rate=rate, at_output_token=2, layers=[0])
    trigger.copy_semantics = args.copy_semantics
    result = reproduce(trigger, control, trace, store_root=args.runs,
                       run_id=args.run_id or time.strftime("repro-%Y%m%d-%H%M%S"),
                       runner=args.runner, unit=args.unit, concurrency=args.concurrency,
                       episodes_per_lifetime=args.episodes_per_lifetime, alpha=args.alpha)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(result.verdict.outcome.upper() + ": " + result.verdict.explanation)
        print(f"records: {result.run_dir}")
    return 0 if result.verdict.outcome in ("no evidence", "corruption detected") else 1
