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
from statescope.errors import InputError


def _config_overrides(pairs: list[str], where: str) -> dict:
    """``key=value`` pairs for EngineConfig fields (``--trigger-set`` / ``--control-set``), each
    value of its field's type (``enable_prefix_caching=yes`` is an error, not a cast)."""
    from statescope.cli.assignments import dataclass_fields
    from statescope.engine.config import EngineConfig

    return parse_assignments(pairs, where, dataclass_fields(EngineConfig))


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
    from statescope.engine.config import model_path
    from statescope.patches.faults import FaultSpec
    from statescope.verdict.inputs import parse_copy_semantics, parse_fault
    from statescope.verdict.reproduce import reproduce, standard_arms
    from statescope.workload.episodes import preset_trace
    from statescope.verdict.reproduce import load_arm_run
    from statescope.workload.episodes import parse_seeds, seeds_trace
    from statescope.workload.trace import read_trace

    if args.trace and args.geometry:
        raise InputError("--geometry applies to --preset traces; a --trace file places its own "
                         "prompt ends (its steps' 'geometry' field)")
    if args.trace and args.seeds:
        raise InputError("--seeds applies to --preset traces; a --trace file is one trace")
    if args.trace:
        trace = read_trace(args.trace)
    elif args.seeds:
        trace = seeds_trace(args.preset, parse_seeds(args.seeds), geometry=args.geometry)
    else:
        trace = preset_trace(args.preset, geometry=args.geometry)
    trigger, control = standard_arms(args.control)
    control_run = load_arm_run(args.control_run, control.name) if args.control_run else None
    common = {"model": str(model_path(args.model))} if args.model else {}
    trigger.config = trigger.config.replace(**common, **_config_overrides(args.trigger_set, "--trigger-set"))
    control.config = control.config.replace(**common, **_config_overrides(args.control_set, "--control-set"))
    if args.fault:
        kind, rate = parse_fault(args.fault)
        trigger.fault = FaultSpec(kind=kind, rate=rate, at_output_token=2, layers=[0])
    parse_copy_semantics(args.copy_semantics)
    trigger.copy_semantics = args.copy_semantics
    if args.trigger_patch:
        from statescope.patches.registry import parse_patch

        for name in args.trigger_patch:
            parse_patch(name)  # bad names fail here, before any engine starts
        trigger.patches = tuple(args.trigger_patch)
    # reproduce() checks everything else (unit, alpha, runner, trace, store) before any engine
    # starts; without --run-id it claims a fresh, unique one
    result = reproduce(trigger, control, trace, store_root=args.runs, run_id=args.run_id,
                       runner=args.runner, unit=args.unit, concurrency=args.concurrency,
                       episodes_per_lifetime=args.episodes_per_lifetime, alpha=args.alpha,
                       control_run=control_run)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(result.verdict.outcome.upper() + ": " + result.verdict.explanation)
        print(f"records: {result.run_dir}")
    return 0 if result.verdict.outcome in ("no evidence", "corruption detected") else 1
