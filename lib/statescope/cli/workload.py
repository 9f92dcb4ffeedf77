"""``statescope workload``: write a trace from a preset, or import a request log as one.

What it does: ``statescope workload [--preset NAME] [--vision] [--geometry G] --out TRACE`` writes a
preset trace; ``statescope workload import FILE [--format openai-chat|openai-batch|auto]
[--group-by auto|prefix|root|field:NAME] [--replay as_logged|agent_loop] [--allow-root DIR]
[--drop-images] [--max-image-bytes N] [--max-line-bytes N] [--max-trace-bytes N] --out TRACE`` streams a
JSONL log of chat-completions request bodies into a trace and ``TRACE``'s manifest
(``statescope.workload.importer``). Both print one summary line (``--json``: the manifest).
Exit 0 done, 2 bad input (file, line and field named).

What it deliberately does not do: run anything (``statescope reproduce --trace TRACE`` does).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from statescope.errors import InputError
from statescope.cli.exit_codes import add_json_flag, exit_epilog


def cmd_workload(args: argparse.Namespace) -> int:
    if args.action == "import":
        return _cmd_import(args)
    if args.file:
        raise InputError(f"workload: unexpected argument {args.file!r} (did you mean "
                         f"'statescope workload import {args.file}'?)")
    from statescope.workload.episodes import preset_trace
    from statescope.workload.trace import write_trace

    steps = preset_trace(args.preset, vision=args.vision, seed=args.seed, geometry=args.geometry)
    path = write_trace(steps, args.out)
    info = {"trace": str(path), "requests": len(steps),
            "episodes": len({s.episode for s in steps}), "images": sum(s.n_images for s in steps)}
    print(json.dumps(info, indent=2) if args.json else
          f"wrote {info['requests']} requests ({info['episodes']} episodes) to {path}")
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    from statescope.workload.importer import import_request_log, manifest_path

    if not args.file:
        raise InputError("workload import: expected the request log to import "
                         "(statescope workload import FILE --out TRACE)")
    caps = {k: getattr(args, k) for k in ("max_image_bytes", "max_line_bytes", "max_trace_bytes")
            if getattr(args, k) is not None}
    for name, value in caps.items():
        if value < 1:
            raise InputError(f"workload import --{name.replace('_', '-')} {value}: expected a "
                             "positive number of bytes")
    m = import_request_log(args.file, args.out, fmt=args.format, group_by=args.group_by,
                           replay=args.replay, default_max_tokens=args.max_tokens,
                           allow_roots=args.allow_root or (), drop_images=args.drop_images, **caps)
    if args.json:
        print(json.dumps(m, indent=2))
    else:
        extra = f", max concurrency {m['max_concurrency']}" if m["max_concurrency"] else ""
        print(f"imported {m['requests']} requests ({m['episodes']} episodes by {m['group_by']}, "
              f"{m['images']} images{extra}) to {m['trace']} [replay {m['replay']}]; "
              f"manifest {manifest_path(m['trace'])}")
        kept = m["fields"]["kept"]
        if kept:
            print("kept and sent on replay: " + ", ".join(f"{k} ({v})" for k, v in kept.items()))
        for note in m["notes"]:
            print(f"note: {note}")
    return 0


def add_workload_subcommand(sub: Any) -> None:
    wl = sub.add_parser("workload",
                        epilog=exit_epilog(),
                        help="write a GUI-agent trace (JSONL) from a preset, or "
                                         "import a request log: workload import FILE")
    wl.add_argument("action", nargs="?", choices=("preset", "import"), default="preset",
                    help="'import FILE' turns a request log into a trace (default: a preset)")
    wl.add_argument("file", nargs="?", help="with import: the JSONL request log")
    from statescope.workload.episodes import PRESETS
    from statescope.workload.importer import FORMATS
    from statescope.workload.trace import REPLAYS

    wl.add_argument("--preset", default="laptop", choices=tuple(PRESETS), help="smoke | laptop | repro288 | long")
    wl.add_argument("--vision", action="store_true", help="attach 1-3 PNG screenshots per step")
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument("--geometry", default=None, help="before | at | after | mixed: prompt ends "
                                                     "relative to the resolved Mamba block size; "
                                                     "image_across (with --vision): a block "
                                                     "boundary inside each step's first image")
    wl.add_argument("--format", default="auto", choices=FORMATS, help="with import: auto | openai-chat | openai-batch")
    wl.add_argument("--group-by", default="auto",
                    help="with import: auto | prefix | root | field:NAME (episodes)")
    wl.add_argument("--replay", default="as_logged", choices=REPLAYS, help="with import: as_logged | agent_loop")
    wl.add_argument("--max-tokens", type=int, default=64,
                    help="with import: for requests that do not say (default 64)")
    wl.add_argument("--allow-root", action="append", metavar="DIR",
                    help="with import: a further folder image files may be read from (repeatable; "
                         "default: only the log's own folder)")
    wl.add_argument("--drop-images", action="store_true",
                    help="with import: leave image parts out (a text-only model; the manifest "
                         "counts them)")
    wl.add_argument("--max-image-bytes", type=int, default=None, help="with import: cap of one image")
    wl.add_argument("--max-line-bytes", type=int, default=None, help="with import: cap of one log line")
    wl.add_argument("--max-trace-bytes", type=int, default=None, help="with import: cap of the trace")
    wl.add_argument("--out", default="runs/trace.jsonl")
    add_json_flag(wl)
    wl.set_defaults(func=cmd_workload)
