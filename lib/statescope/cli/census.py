"""Command line of the source census: ``statescope build census [NAME ... | --installed | --release X ...]``.

What it does: registers ``build census`` (``add_census_subcommand``, called from
``statescope.cli.builds``) and prints, per build, its version, the headline (runner and H-accept),
one row per signature (verdict, file:line, function, why) and the settings that force the V1
runner; ``--json`` prints ``{"kind": "census", "command", "seconds", "censuses": [...]}`` and
``--out FILE`` writes the same payload, the census cache folder written as ``<census sources>``
(how ``data/results/census/releases.json`` is made). With
no NAME, ``--installed`` is assumed. Exit 0 when every census ran; 2 for bad input (a path that is
not a vLLM tree, a build not installed, a release pip cannot fetch).

What it deliberately does not do: any census logic (``statescope.builds.census``).
"""
from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import Any

from statescope.builds.census import BuildCensus, census_many
from statescope.builds.census_sources import sources_dir
from statescope.cli.exit_codes import add_json_flag, exit_epilog


def _text(c: BuildCensus) -> str:
    where = f" from {c.root}" if c.origin != "release" else ""
    lines = [f"{c.build}: vLLM {c.version or '?'} ({c.distribution or 'distribution unknown'}){where}"
             f" [{c.seconds:.2f} s]", f"  {c.headline}"]
    w = max(len(x.check) for x in c.checks)
    for x in c.checks:
        verdict = x.verdict + (f" ({x.value})" if x.value else "")
        lines.append(f"  {x.mechanism:<11} {x.check:<{w}}  {verdict:<22} {' '.join(x.prs):<22} "
                     f"{x.where}")
        lines.append(f"  {'':<11} {'':<{w}}  {x.detail}")
    forced = c.check("default_runner").extra.get("forces_v1", [])
    features = [f.removeprefix("unsupported by V2: ") for f in forced if f.startswith("unsupported")]
    others = [f for f in forced if not f.startswith("unsupported")]
    if c.runner == "V2" and forced:
        lines.append("  V1 is forced by: " + "; ".join(others))
        lines.append("  ... and by any feature V2 does not support: " + "; ".join(features))
    elif c.runner == "V1":
        lines.append("  V2 can be asked for with VLLM_USE_V2_MODEL_RUNNER=1 (unless: "
                     + "; ".join(o for o in others if "VLLM_USE_V2" not in o)
                     + (f"; {len(features)} features V2 does not support" if features else "") + ")")
    lines.append(f"  {c.pr_tokens()}")
    return "\n".join(lines)


def _command(args: argparse.Namespace) -> str:
    parts = ["statescope", "build", "census", *args.names]
    parts += ["--installed"] if args.installed else []
    parts += ["--release", *args.release] if args.release else []
    parts += ["--json"] if args.json else []
    parts += ["--out", args.out] if args.out else []
    return shlex.join(parts)


def _cmd_census(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    installed = args.installed or not (args.names or args.release)
    found = census_many(args.names, installed=installed, releases=args.release or (),
                        fetch=not args.no_fetch)
    payload = {"kind": "census", "command": _command(args),
               "seconds": round(time.perf_counter() - t0, 2),
               "censuses": [c.to_dict() for c in found]}
    if args.out:  # a file meant to be shared: the cache folder by name, not this machine's path
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(payload, indent=1).replace(str(sources_dir()), "<census sources>")
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(json.dumps(payload, indent=1))
    else:
        print("\n\n".join(_text(c) for c in found))
    return 0


def add_census_subcommand(build_subparsers: Any) -> None:
    """Register ``statescope build census`` under ``statescope build``."""
    p = build_subparsers.add_parser(
        "census", epilog=exit_epilog(),
        help="which fixes of the bug family a build's sources contain (no engine)")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="a build made by `statescope build add` (spec or install key), a .whl "
                        "file, or a directory: a vLLM tree, site-packages or virtualenv")
    p.add_argument("--installed", action="store_true",
                   help="the vLLM this Python imports (the default with no NAME)")
    p.add_argument("--release", nargs="+", metavar="X.Y.Z",
                   help="PyPI releases, read from their wheels (fetched once with pip download)")
    p.add_argument("--no-fetch", action="store_true", help="--release: only the census cache")
    add_json_flag(p)
    p.add_argument("--out", help="also write the JSON payload to this file")
    p.set_defaults(func=_cmd_census)
