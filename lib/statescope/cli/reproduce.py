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


def _config_overrides(pairs: list[str], where: str) -> dict:
    """``key=value`` pairs for EngineConfig fields (``--trigger-set`` / ``--control-set``)."""
    import dataclasses

    from statescope.engine.config import EngineConfig

    return parse_assignments(pairs, where, [f.name for f in dataclasses.fields(EngineConfig)])


def cmd_reproduce(args: argparse.Namespace) -> int:
    import time

    from statescope.engine.config import model_path
    from statescope.patches.faults import FaultSpec
    from statescope.progress import Progress
    from statescope.verdict.reproduce import replay_mode, reproduce, standard_arms
    from statescope.workload.episodes import preset_trace
    from statescope.workload.importer import read_manifest
    from statescope.workload.trace import read_trace

    if args.trace:
        trace, info = read_trace(args.trace), read_manifest(args.trace) or {"trace": args.trace}
    else:
        trace = preset_trace(args.preset, vision=args.vision, geometry=args.geometry)
        info = {"preset": args.preset, "vision": args.vision, "geometry": args.geometry}
    concurrency = args.concurrency or info.get("max_concurrency") or 32
    trigger, control = standard_arms(args.control)
    common = {"model": str(model_path(args.model))} if args.model else {}
    trigger.config = trigger.config.replace(**common, **_config_overrides(args.trigger_set, "--trigger-set"))
    control.config = control.config.replace(**common, **_config_overrides(args.control_set, "--control-set"))
    if args.fault:
        kind, _, rest = args.fault.partition(":")
        rate = float(rest) if rest else 1.0
        # after the first output token: tiny-gui answers in 3-11 tokens, and with MTP(2) a later
        # trigger point can miss an answer that ends in the next step
        trigger.fault = FaultSpec(kind=kind, rate=rate, at_output_token=1, layers=[0])
    trigger.copy_semantics = args.copy_semantics
    mode = replay_mode(trace, args.replay)
    with Progress(2 * len(trace), "reproduce", "requests") as bar:
        bar.note(f"{len(trace)} requests x 2 arms, replay {mode}, concurrency {concurrency}, "
                 f"model {trigger.config.model}")
        result = reproduce(trigger, control, trace, store_root=args.runs,
                           run_id=args.run_id or time.strftime("repro-%Y%m%d-%H%M%S"),
                           runner=args.runner, unit=args.unit, concurrency=concurrency,
                           episodes_per_lifetime=args.episodes_per_lifetime, alpha=args.alpha,
                           replay=mode, trace_info=info, progress=bar)
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
