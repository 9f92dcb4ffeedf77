"""The ``statescope`` command line: the scriptable face of the workbook.

What it does: one subcommand per report, each with ``--json`` for machines and a short human form
otherwise; exit status 0 when the report is good, 1 when it found a problem, 2 for bad input. Each
subcommand is a thin wrapper over a library call that notebooks use too.

What it deliberately does not do: hold logic of its own.
"""
from __future__ import annotations

import argparse
import json
import sys

from statescope.errors import InputError, StatescopeError


def _print(obj, as_json: bool) -> None:
    print(json.dumps(obj.to_dict(), indent=2, default=str) if as_json else repr(obj))


def cmd_doctor(args: argparse.Namespace) -> int:
    from statescope.doctor import run_doctor

    report = run_doctor(args.model, start_engine=not args.no_engine)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        for c in report.checks:
            print(f"{'ok ' if c.ok else 'FAIL'} {c.name:<24} {c.detail}")
    if not report.ok:
        bad = report.first_failure
        print(f"statescope doctor: {bad.name}: {bad.detail}", file=sys.stderr)
        return 1
    return 0


def cmd_workbook(args: argparse.Namespace) -> int:
    from statescope.render import run_notebooks

    results = run_notebooks(args.notebooks or None, out_dir=args.out)
    for r in results:
        print(f"{'ok ' if r['ok'] else 'FAIL'} {r['notebook']} -> {r['html']} ({r['seconds']:.0f} s)")
        if not r["ok"]:
            print(f"statescope workbook: {r['notebook']}: {r['error']}", file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="statescope", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="versions, model and a short start of the trigger config")
    d.add_argument("--model", default=None, help="model directory or name under data/models")
    d.add_argument("--no-engine", action="store_true", help="skip the engine start")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_doctor)
    w = sub.add_parser("workbook", help="execute notebooks headless and render HTML to reports/")
    w.add_argument("notebooks", nargs="*", help="notebook names (default: all in notebooks/)")
    w.add_argument("--out", default="reports")
    w.add_argument("--json", action="store_true")
    w.set_defaults(func=cmd_workbook)
    return p


def main(argv: list[str] | None = None) -> int:
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before any vLLM import
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InputError as exc:
        print(f"statescope {args.command}: {exc}", file=sys.stderr)
        return 2
    except StatescopeError as exc:
        print(f"statescope {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
