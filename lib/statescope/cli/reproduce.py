"""``statescope reproduce``: trigger arm vs control arm on a trace (``statescope workload`` writes one).

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


def cmd_reproduce(args: argparse.Namespace) -> int:
    from statescope.engine.config import model_path
    from statescope.patches.faults import FaultSpec
    from statescope.progress import Progress
    from statescope.verdict.inputs import parse_copy_semantics, parse_fault
    from statescope.verdict.reproduce import load_arm_run, replay_mode, reproduce, standard_arms
    from statescope.workload.episodes import parse_seeds, preset_trace, seeds_trace
    from statescope.workload.importer import read_manifest
    from statescope.workload.trace import read_trace

    if args.trace and args.preset:
        raise InputError(f"--preset {args.preset} and --trace {args.trace}: expected one workload, "
                         "a --trace file or a --preset")
    args.preset = args.preset or "smoke"
    if args.trace and args.geometry:
        raise InputError("--geometry applies to --preset traces; a --trace file places its own "
                         "prompt ends (its steps' 'geometry' field)")
    if args.trace and args.seeds:
        raise InputError("--seeds applies to --preset traces; a --trace file is one trace")
    if args.trace and args.vision:
        raise InputError("--vision applies to --preset traces; a --trace file carries its own "
                         "images (its steps' image_url parts)")
    if args.trace:
        trace, info = read_trace(args.trace), read_manifest(args.trace) or {"trace": args.trace}
    elif args.seeds:
        trace = seeds_trace(args.preset, parse_seeds(args.seeds), vision=args.vision,
                            geometry=args.geometry)
        info = {"preset": args.preset, "seeds": args.seeds, "vision": args.vision,
                "geometry": args.geometry}
    else:
        trace = preset_trace(args.preset, vision=args.vision, geometry=args.geometry)
        info = {"preset": args.preset, "vision": args.vision, "geometry": args.geometry}
    concurrency = (args.concurrency if args.concurrency is not None  # 0 is checked, not replaced
                   else info.get("max_concurrency") or 32)
    trigger, control = standard_arms(args.control)
    control_run = load_arm_run(args.control_run, control.name) if args.control_run else None
    common = {"model": str(model_path(args.model))} if args.model else {}
    trigger.config = trigger.config.replace(**common, **_config_overrides(args.trigger_set, "--trigger-set"))
    control.config = control.config.replace(**common, **_config_overrides(args.control_set, "--control-set"))
    if args.fault:
        kind, rate = parse_fault(args.fault)
        # after the first output token: tiny-gui answers in 3-11 tokens, and with MTP(2) a later
        # trigger point can miss an answer that ends in the next step
        trigger.fault = FaultSpec(kind=kind, rate=rate, at_output_token=1, layers=[0])
    parse_copy_semantics(args.copy_semantics)
    trigger.copy_semantics = args.copy_semantics
    if args.trigger_patch:
        from statescope.patches.registry import parse_patch

        for name in args.trigger_patch:
            parse_patch(name)  # bad names fail here, before any engine starts
        trigger.patches = tuple(args.trigger_patch)
    mode = replay_mode(trace, args.replay)
    # reproduce() checks everything else (unit, alpha, runner, trace, store) before any engine
    # starts; without --run-id it claims a fresh, unique one
    arms = 1 if control_run is not None else 2
    with Progress(arms * len(trace), "reproduce", "requests") as bar:
        bar.note(f"{len(trace)} requests x {arms} arm(s), replay {mode}, concurrency "
                 f"{concurrency}, model {trigger.config.model}")
        result = reproduce(trigger, control, trace, store_root=args.runs, run_id=args.run_id,
                           runner=args.runner, unit=args.unit, concurrency=concurrency,
                           episodes_per_lifetime=args.episodes_per_lifetime, alpha=args.alpha,
                           control_run=control_run, replay=mode, trace_info=info, progress=bar)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(result.verdict.outcome.upper() + ": " + result.verdict.explanation)
        print(engagement_line(result, trace))
        print(f"records: {result.run_dir}")
    return 0 if result.verdict.outcome in ("no evidence", "corruption detected") else 1


def engagement_line(result, trace) -> str:
    """What the trigger arm really exercised: cache hits, accepted drafts, images."""
    m = result.trigger.metrics
    q, h = m.get("prefix_cache_queries", 0), m.get("prefix_cache_hits", 0)
    d, a = m.get("spec_draft_tokens", 0), m.get("spec_accepted_tokens", 0)
    rows = result.trigger.rows
    cached = sum(1 for r in rows if (r.get("num_cached_tokens") or 0) > 0)
    images = sum(s.n_images for s in trace)
    line = (f"trigger arm: prefix-cache hits {h}/{q} tokens ({cached}/{len(rows)} requests "
            f"with cached tokens), drafts accepted {a}/{d}")
    if images:
        line += f", {images} images in the trace"
    return line
