"""``statescope shrink RUN|TRACE`` and ``statescope export-repro SHRUNK --out DIR``.

What it does: ``shrink`` reads a failing workload — a ``reproduce`` run folder (its trace from the
manifest, its two arms' configurations and labels) or a trace file (arms from ``--control`` and
the ``--*-set`` overrides, as ``reproduce`` builds them) — and calls
``statescope.verdict.shrink.shrink``; it prints every trial and the conditions found (``--json``
for machines), progress on stderr. Exit 1 when a minimal failing workload was found, 0 when the
failure did not reproduce in every re-run, 2 on bad input. ``export-repro`` writes the standalone
plain-vLLM script of a finished shrink (``statescope.share.repro_script``).

What it deliberately does not do: search or decide (``statescope.verdict.shrink``).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from statescope.cli.exit_codes import add_json_flag, shown_choices
from statescope.errors import InputError


def _trace_of_run(run_dir: Path) -> tuple[list, dict]:
    """The trace a reproduce run answered, rebuilt from its manifest, and the manifest."""
    from statescope.records import load_manifest
    from statescope.workload.episodes import parse_seeds, preset_trace, seeds_trace
    from statescope.workload.trace import read_trace

    manifest = load_manifest(run_dir)
    info = (manifest.get("extra") or {}).get("trace") or {}
    if info.get("trace"):
        trace = read_trace(info["trace"])
    elif info.get("preset") and info.get("seeds"):
        trace = seeds_trace(info["preset"], parse_seeds(str(info["seeds"])),
                            vision=bool(info.get("vision")), geometry=info.get("geometry"))
    elif info.get("preset"):
        trace = preset_trace(info["preset"], vision=bool(info.get("vision")),
                             geometry=info.get("geometry"))
    else:
        raise InputError(f"{run_dir}/manifest.json: field 'extra.trace' names no trace file or "
                         "preset: cannot rebuild the workload (shrink the trace file instead)")
    replay = (manifest.get("extra") or {}).get("replay")
    if replay and trace and replay != trace[0].replay:
        raise InputError(f"{run_dir}: the run replayed its trace {replay}, the trace's own mode is "
                         f"{trace[0].replay}: shrink replays a trace in its own mode")
    return trace, manifest


def _arms(args: argparse.Namespace, manifest: dict | None):
    """The arms a shrink re-runs: the run's own (its manifest's configurations and PATCHED labels)
    or ``--control``'s, with ``--model`` and the ``--*-set`` pairs by the one override rule, as
    ``reproduce`` builds them (``statescope.verdict.experiment.Experiment``)."""
    from statescope.cli.reproduce import experiment_of
    from statescope.patches.faults import FaultSpec
    from statescope.patches.registry import parse_patch

    fields: dict[str, Any] = {}
    if manifest is not None:  # the run's own arms, as they were configured
        configs = manifest.get("resolved_config") or {}
        if not isinstance(configs.get("trigger"), dict) or not isinstance(configs.get("control"), dict):
            raise InputError("manifest.json: field 'resolved_config': expected the 'trigger' and "
                             "'control' EngineConfig of a reproduce run")
        fields.update(base_trigger=configs["trigger"], base_control=configs["control"],
                      control_name=args.control if args.control != "no_prefix_cache" else "control")
        labels = (manifest.get("extra") or {}).get("labels") or []
        fields["trigger_patches"] = tuple(
            m.group(1) for l in labels if (m := re.match(r"PATCHED (\S+)", l)))
        odd = [l for l in labels if l.startswith(("AMPLIFIED", "PLANTED", "EMULATED"))]
        if odd and not (args.fault_spec or args.trigger_patch):
            raise InputError(f"manifest.json: the run's trigger arm was {odd}: give the same with "
                             "--fault-spec / --trigger-patch (the manifest keeps only the label)")
    if args.trigger_patch:
        for name in args.trigger_patch:
            parse_patch(name)
        fields["trigger_patches"] = tuple(args.trigger_patch)
    if args.fault_spec:
        try:
            fields["fault"] = FaultSpec(**json.loads(args.fault_spec))
        except (json.JSONDecodeError, TypeError) as exc:
            raise InputError(f"--fault-spec: expected a JSON FaultSpec object ({exc})") from None
    return experiment_of(args.control, args.trigger_set, args.control_set, args.model,
                         both_pairs=args.both_set, **fields).arms()


def cmd_shrink(args: argparse.Namespace) -> int:
    from statescope.workload.trace import read_trace

    manifest = None
    if args.preset or args.seeds:
        if args.source:
            raise InputError("shrink: give a run folder / trace file, or --preset/--seeds, not both")
        from statescope.workload.episodes import parse_seeds, preset_trace, seeds_trace

        preset = args.preset or "long"
        trace = (seeds_trace(preset, parse_seeds(args.seeds)) if args.seeds
                 else preset_trace(preset))
        return _run_shrink(args, trace, None)
    if not args.source:
        raise InputError("shrink: expected a reproduce run folder, a trace file or --preset/--seeds")
    source = Path(args.source)
    if source.is_dir():
        trace, manifest = _trace_of_run(source)
    elif source.is_file():
        trace = read_trace(source)
    else:
        raise InputError(f"{source}: expected a reproduce run folder or a trace file")
    return _run_shrink(args, trace, manifest)


def _run_shrink(args: argparse.Namespace, trace: list, manifest: dict | None) -> int:
    from statescope.verdict.shrink import PHASES, shrink
    from statescope.workload.trace import trace_sha

    phases = tuple(p.strip() for p in args.phases.split(",") if p.strip()) if args.phases else PHASES
    trigger, control = _arms(args, manifest)
    out = Path(args.out) if args.out else Path(args.runs) / f"shrink-{trace_sha(trace)}"
    result = shrink(trace, trigger, control, out, keep_failing=args.keep_failing, phases=phases,
                    strict=args.strict)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print("\n".join(result.report_lines()))
        print(f"run folder: {result.run_dir}")
    return 1 if result.reproduced else 0


def cmd_export_repro(args: argparse.Namespace) -> int:
    from statescope.share.repro_script import export_repro

    written = export_repro(args.shrunk, args.out)
    if args.json:
        print(json.dumps(written, indent=2))
    else:
        print(f"wrote {written['script']} and {written['readme']}: {written['n_requests']} "
              f"request(s) in {written['waves']} batch(es), expected CORRUPTED for "
              f"{', '.join(written['failing'])}" + (" (PLANTED fault)" if written["planted"] else ""))
    return 0


def add_shrink_subcommands(sub: Any) -> None:
    s = sub.add_parser("shrink", help="the smallest workload that still corrupts (delta "
                                      "debugging over episodes, steps, batch, prompt length)")
    s.add_argument("source", nargs="?", help="a reproduce run folder (runs/ID) or a trace file")
    s.add_argument("--preset", help="instead of SOURCE: a preset trace (with --seeds: once per seed)")
    s.add_argument("--seeds", help="with --preset (default long): A:B | A,B,C")
    s.add_argument("--keep-failing", type=int, default=3, metavar="K",
                   help="a candidate fails only when every one of K trigger re-runs corrupts "
                        "(default 3) and the control stays clean")
    s.add_argument("--strict", action="store_true",
                   help="K re-runs and the control for every candidate (default: one trigger run "
                        "per candidate, the result verified with K re-runs and the control, and "
                        "searched again strictly if it does not hold)")
    from statescope.verdict.experiment import CONTROLS

    s.add_argument("--control", default="no_prefix_cache", choices=shown_choices(CONTROLS),
                   help="with a trace: the control arm (same: the trigger's configuration "
                        "without its planted fault or patches)")
    s.add_argument("--model", help="model directory or name under data/models")
    for flag in ("--both-set", "--trigger-set", "--control-set"):
        s.add_argument(flag, action="append", default=[], metavar="FIELD=VALUE",
                       help="override an EngineConfig field (repeatable)")
    s.add_argument("--trigger-patch", action="append", default=[], metavar="NAME")
    s.add_argument("--fault-spec", metavar="JSON", help="PLANTED test fault on the trigger arm: a "
                                                        "FaultSpec as JSON (e.g. with prompt_shas)")
    s.add_argument("--phases", default=None, help="comma-separated subset of narrow,episodes,"
                                                  "steps,batch,prompt (default: all, in that "
                                                  "order; narrow = the smallest failing batch "
                                                  "of >= 2 first)")
    s.add_argument("--out", help="the run folder (resumable; default runs/shrink-<trace sha>)")
    s.add_argument("--runs", default="runs")
    add_json_flag(s)
    s.set_defaults(func=cmd_shrink)
    e = sub.add_parser("export-repro", help="a standalone plain-vLLM script of a shrunk workload")
    e.add_argument("shrunk", help="a shrink run folder")
    e.add_argument("--out", required=True, help="the folder for repro.py and README.md")
    add_json_flag(e)
    e.set_defaults(func=cmd_export_repro)
