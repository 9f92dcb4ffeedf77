"""``statescope reproduce``: trigger arm vs control arm on a trace (``statescope workload`` writes one).

What it does: parses the arguments into one ``statescope.verdict.experiment.Experiment`` (engine
overrides typed by the one override rule), builds the arms from it and calls ``statescope.verdict.reproduce.reproduce``; prints the design's power,
the verdict, the decision rule and the secondary (sequential) test, and with ``--seed-sets`` each
seed set's verdict beside the pooled one (``--json`` for machines). Before any engine starts, a
design that can never reach alpha is refused (exit 2, one line naming the fixing flags); without
``--seeds`` or ``--trace`` the preset is sized (the fewest seeds whose episodes can reach alpha:
the smoke preset's 4 episodes at alpha 0.01 cannot). ``--concurrency`` on the in-process runner
sets both arms' ``max_num_seqs`` (the batch it really runs). Exit status
(``statescope.cli.exit_codes``): 0 no evidence, 1 corruption detected or a guard failed (geometry
not exercised, control or engine broken), 2 bad input or a design that cannot answer.

What it deliberately does not do: decide anything (``statescope.verdict`` does).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from statescope.cli.exit_codes import verdict_exit
from statescope.errors import InputError


def config_overrides(pairs: list[str] | None, where: str) -> dict:
    """``key=value`` pairs of engine settings (``--trigger-set`` / ``--control-set``), typed by the
    one override rule (``statescope.engine.overrides.typed_overrides``: EngineConfig field names
    or vLLM's spellings; ``enable_prefix_caching=yes`` is an error, not a cast)."""
    from statescope.engine.config import EngineConfig
    from statescope.engine.overrides import typed_overrides

    raw = parse_assignments_raw(pairs, where)
    return typed_overrides(EngineConfig(), raw, where)


def reproduce_arms(control: str, trigger_pairs: list[str] | None = None,
                   control_pairs: list[str] | None = None, model: str | None = None, *,
                   trigger_where: str = "--trigger-set"):
    """The trigger and control ``Arm`` of ``reproduce`` for these ``--trigger-set`` /
    ``--control-set`` pairs and ``--model``: ``experiment_of(...).arms()``. ``capture`` builds its
    engine as this trigger arm (its ``--set`` pairs: ``trigger_where``)."""
    return experiment_of(control, trigger_pairs, control_pairs, model,
                         trigger_where=trigger_where).arms()


def experiment_of(control: str, trigger_pairs: list[str] | None = None,
                  control_pairs: list[str] | None = None, model: str | None = None, *,
                  both_pairs: list[str] | None = None, trigger_where: str = "--trigger-set",
                  **fields: Any):
    """The ``statescope.verdict.experiment.Experiment`` of a command's options: ``NAME=VALUE``
    pairs typed by the one override rule (each error naming its flag), the rest as given."""
    from statescope.verdict.experiment import Experiment

    return Experiment(control=control, model=model or None,
                      both_set=config_overrides(both_pairs, "--both-set"),
                      trigger_set=config_overrides(trigger_pairs, trigger_where),
                      control_set=config_overrides(control_pairs, "--control-set"),
                      flags=("--both-set", trigger_where, "--control-set"), **fields)


def parse_assignments_raw(pairs: list[str] | None, where: str) -> dict[str, str]:
    """``{NAME: VALUE text}`` of ``NAME=VALUE`` pairs, a name given twice refused."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise InputError(f"{where} {pair!r}: expected NAME=VALUE")
        if key in out:
            raise InputError(f"{where} {pair!r}: {key!r} is set twice")
        out[key] = raw
    return out


def seeds_that_can_answer(preset: str, unit: str, alpha: float, epl: int | None) -> int | None:
    """Seeds 0:k (the fewest) whose preset episodes can reach alpha; None when no count can."""
    from statescope.verdict.design import best_p
    from statescope.workload.episodes import PRESETS

    if preset not in PRESETS or unit not in ("request", "episode", "engine_lifetime") \
            or not isinstance(alpha, float) or not 0 < alpha < 1:
        return None  # reproduce() names the bad preset, unit or alpha
    episodes, steps = PRESETS[preset][0], PRESETS[preset][1]
    for k in range(1, 65):
        n = {"request": k * episodes * steps, "episode": k * episodes,
             "engine_lifetime": -(-k * episodes // epl) if epl else 1}[unit]
        if best_p(n, n) < alpha:
            return k
    return None


def _fixes(args: argparse.Namespace, preset: str | None) -> str:
    """The flags that turn a design that cannot answer into one that can."""
    from statescope.verdict.design import best_p

    k = seeds_that_can_answer(preset, args.unit, args.alpha, args.episodes_per_lifetime) if preset else None
    out = []
    if k is not None:
        out.append(f"--seeds 0:{k}")
    if args.unit == "engine_lifetime":
        out.append("--episodes-per-lifetime N (one lifetime per N episodes) or --unit episode")
    elif args.unit == "episode":
        out.append("--unit request (requests of one episode are not independent)")
    return "use " + ", or ".join(out + ["a larger --alpha"]) if out else "use a larger --alpha"


def cmd_reproduce(args: argparse.Namespace) -> int:
    from statescope.patches.faults import FaultSpec
    from statescope.progress import Progress
    from statescope.verdict.inputs import check_reproduce, parse_copy_semantics, parse_fault
    from statescope.verdict.reproduce import load_arm_run, replay_mode, reproduce
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
    if args.seed_sets is not None and not args.seeds:
        raise InputError("--seed-sets N splits --seeds into N sets: give --seeds too")
    if args.trace and args.vision:
        raise InputError("--vision applies to --preset traces; a --trace file carries its own "
                         "images (its steps' image_url parts)")
    from statescope.verdict.design import design_units
    from statescope.verdict.rule import split_seed_sets
    from statescope.workload.episodes import PRESETS

    preset = args.preset or "smoke"
    if not args.trace and preset not in PRESETS:
        raise InputError(f"--preset {preset!r}: expected one of {sorted(PRESETS)}")
    sized, seed_sets = None, None
    if args.trace:
        trace, info = read_trace(args.trace), read_manifest(args.trace) or {"trace": args.trace}
    elif args.seeds:
        seeds = parse_seeds(args.seeds)
        if args.seed_sets is not None:
            seed_sets = split_seed_sets(seeds, args.seed_sets)
        trace = seeds_trace(preset, seeds, vision=args.vision, geometry=args.geometry)
        info = {"preset": preset, "seeds": args.seeds, "vision": args.vision,
                "geometry": args.geometry, "seed_sets": seed_sets}
    else:
        trace = preset_trace(preset, vision=args.vision, geometry=args.geometry)
        info = {"preset": preset, "vision": args.vision, "geometry": args.geometry}
        n = design_units(trace, args.unit, args.episodes_per_lifetime) if args.unit in (
            "request", "episode", "engine_lifetime") else None
        from statescope.verdict.design import best_p

        k = (seeds_that_can_answer(preset, args.unit, args.alpha, args.episodes_per_lifetime)
             if n is not None and isinstance(args.alpha, float) and 0 < args.alpha < 1
             and not best_p(n, n) < args.alpha else None)
        if k is not None:  # the default design sizes itself: the fewest seeds that can answer
            sized = (f"the {preset} preset's {n} {args.unit}s an arm cannot reach alpha="
                     f"{args.alpha}: sized to --seeds 0:{k}")
            trace = seeds_trace(preset, list(range(k)), vision=args.vision, geometry=args.geometry)
            info = {**info, "seeds": f"0:{k}", "sized": sized}
    fault = None
    if args.fault:
        kind, rate = parse_fault(args.fault)
        # after the first output token: tiny-gui answers in 3-11 tokens, and with MTP(2) a later
        # trigger point can miss an answer that ends in the next step
        fault = FaultSpec(kind=kind, rate=rate, at_output_token=1, layers=[0])
    parse_copy_semantics(args.copy_semantics)
    if args.trigger_patch:
        from statescope.patches.registry import parse_patch

        for name in args.trigger_patch:
            parse_patch(name)  # bad names fail here, before any engine starts
    # --concurrency on the in-process runner is the batch it really runs (both arms' max_num_seqs)
    batch = args.concurrency if args.concurrency is not None and args.runner == "offline" else None
    experiment = experiment_of(args.control, args.trigger_set, args.control_set, args.model,
                               trigger_patches=tuple(args.trigger_patch or ()), fault=fault,
                               copy_semantics=args.copy_semantics, batch=batch)
    trigger, control = experiment.arms()
    control_run = load_arm_run(args.control_run, control.name) if args.control_run else None
    concurrency = (args.concurrency if args.concurrency is not None  # 0 is checked, not replaced
                   else info.get("max_concurrency") or 32)
    mode = replay_mode(trace, args.replay)
    # bad input first, in reproduce()'s order (a corrupt store, a prompt too long for the model),
    # then the design's power: fixing the flags of a design is no use on a trace that cannot run
    check_reproduce(trigger, control, trace, store_root=args.runs, run_id=args.run_id,
                    runner=args.runner, unit=args.unit, concurrency=concurrency,
                    episodes_per_lifetime=args.episodes_per_lifetime, alpha=args.alpha)
    _refuse_powerless(args, trace, None if args.trace else preset)
    # reproduce() checks everything else (unit, alpha, runner, trace, store) before any engine
    # starts; without --run-id it claims a fresh, unique one
    arms = 1 if control_run is not None else 2
    with Progress(arms * len(trace), "reproduce", "requests") as bar:
        bar.note(f"{len(trace)} requests x {arms} arm(s), replay {mode}, concurrency "
                 f"{concurrency}, model {trigger.config.model}")
        result = reproduce(trigger, control, trace, store_root=args.runs, run_id=args.run_id,
                           runner=args.runner, unit=args.unit, concurrency=concurrency,
                           episodes_per_lifetime=args.episodes_per_lifetime, alpha=args.alpha,
                           control_run=control_run, replay=mode, trace_info=info, progress=bar,
                           require_power=True, power_fixes=_fixes(args, None if args.trace
                                                                   else preset),
                           seed_sets=seed_sets)
    if args.json:
        out = result.to_dict()
        out["sized"] = sized
        print(json.dumps(out, indent=2, default=str))
    else:
        print_report(result, trace, sized)
    return verdict_exit(result.verdict.outcome)


def print_report(result, trace, sized: str | None) -> None:
    """The human report: design, verdict, rule, secondary test, seed sets, engagement, records."""
    if sized:
        print(f"design: {sized}")
    if result.design is not None:
        print(result.design.summary())
    label = "POOLED " if result.seed_sets else ""
    print(label + result.verdict.outcome.upper() + ": " + result.verdict.explanation)
    for row in result.seed_sets:
        p = "n/a" if row["fisher_p"] is None else f"{row['fisher_p']:.3g}"
        alone = "" if row["can_answer_alone"] else f" (this set alone can reach at best p={row['best_p']:.3g})"
        print(f"  seed set {row['seeds']}: {row['outcome']}: trigger {row['trigger'][0]}/"
              f"{row['trigger'][1]}, control {row['control'][0]}/{row['control'][1]}, p={p}"
              f"{alone}; secondary: {row['secondary']['note']}")
    seq = result.secondary()
    print(f"secondary (sequential test): {seq['decision']} after {seq['units_used']} of "
          f"{seq['units_available']} {result.verdict.unit}s: {seq['note']}")
    print(result.decision_rule())
    print(engagement_line(result, trace))
    print(f"records: {result.run_dir}")


def _refuse_powerless(args: argparse.Namespace, trace, preset: str | None) -> None:
    """The design's refusal before the progress bar (``reproduce`` checks it again, with the rest)."""
    from statescope.verdict.design import design_units, power_of
    from statescope.verdict.units import UNITS

    alpha = args.alpha
    if args.unit not in UNITS or not isinstance(alpha, float) or not 0 < alpha < 1:
        return  # reproduce() names the bad unit or alpha
    n = design_units(trace, args.unit, args.episodes_per_lifetime)
    design = power_of(n, n, alpha, args.unit)
    if not design.can_answer:
        raise InputError(design.refusal(_fixes(args, preset)))


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
