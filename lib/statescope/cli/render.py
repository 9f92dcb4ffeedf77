"""``statescope render``: execute notebooks with parameters and write scrubbed, shareable renders.

What it does: registers the ``render`` subcommand (``add_render_subcommand``). ``statescope render
07_teach_failure_mode -p max_tokens=8 --out reports/share`` writes ``reports/share/<stem>/`` (HTML,
GitHub Markdown, ``summary.md``, PNGs, figure data, manifest); ``--all`` renders every notebook
and an ``INDEX.md``. Exit status: 0 all notebooks ran, 1 a notebook failed or a secret survived
scrubbing (the render is refused), 2 bad input.

What it deliberately does not do: hold logic (``statescope.share.render.render_for_sharing``).
"""
from __future__ import annotations

import argparse
import json
import sys

from statescope.errors import InputError
from statescope.cli.exit_codes import add_json_flag, exit_epilog


class NotebookLines:
    """One line per notebook as it finishes (name, elapsed, result) on ``stream`` (stderr: it is
    progress, stdout is for ``--json``), and — on a terminal — a bar over the notebook's code
    cells on stderr while it runs."""

    def __init__(self, stream=None, what=None) -> None:
        self.stream = stream or sys.stderr
        self.what = what or (lambda r: r.get("html") or r.get("dir", ""))
        self._bar = None

    def start(self, path):
        from statescope.progress import Progress
        from statescope.share.render import code_cells, sync_pair

        self._bar = Progress(code_cells(sync_pair(path)) if path.suffix == ".py" else 0,
                             path.stem, "cells", lines_when_piped=False)
        return self._bar

    def done(self, r: dict) -> None:
        if self._bar is not None:
            self._bar.close()
        print(f"{'ok ' if r['ok'] else 'FAIL'} {r['notebook']:<28} {r['seconds']:6.0f} s  "
              f"-> {self.what(r)}", file=self.stream, flush=True)
        if not r["ok"]:
            print(f"  {r['notebook']}: {r['error']}", file=sys.stderr, flush=True)


def _parameters(pairs: list[str] | None, sources: list) -> dict:
    """``-p`` pairs checked against the parameters every named notebook declares: an unknown
    name, or a value of another type than the default's, is an error before any kernel starts."""
    from statescope.cli.assignments import FieldType, literal_kind, parse_assignments
    from statescope.share.parameters import declared_parameters
    from statescope.share.render import source_notebook

    if not pairs:
        return {}
    fields: dict | None = None
    for source in sources:
        stem, nb = source_notebook(source)
        declared = {k: literal_kind(v) for k, v in declared_parameters(nb, stem).items()}
        if not declared:
            raise InputError(f"-p: notebook {stem} has no cell tagged 'parameters'; it takes no -p")
        fields = declared if fields is None else {
            k: FieldType(tuple(dict.fromkeys(fields[k].types + declared[k].types)))
            for k in fields if k in declared}  # with several notebooks: names all of them take
    return parse_assignments(pairs, "-p", fields)


def cmd_render(args: argparse.Namespace) -> int:
    import os

    from statescope.share.render import notebook_paths, render_all, render_for_sharing

    if not args.all and not args.notebooks:
        raise InputError("render: name notebooks (or paths), or pass --all")
    if args.timeout <= 0:
        raise InputError(f"--timeout {args.timeout}: expected a positive number of seconds per cell")
    if args.repro is not None:
        from statescope.share.repro_link import check_repro_dir

        check_repro_dir(args.repro)  # before anything executes
    sources = notebook_paths(args.notebooks or None) if args.all else list(args.notebooks)
    for s in sources:  # fail on a bad name before executing anything
        if not os.path.isfile(s):
            notebook_paths([str(s)])
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"  # inherited by the kernels: keep reports readable
    kw = dict(parameters=_parameters(args.param, sources), png=not args.no_png,
              timeout_s=args.timeout, keep_warnings=getattr(args, "verbose", False))

    def what(r: dict) -> str:
        pngs = sum(1 for f in r["figures"] if f["png"])
        return f"{r['dir']} ({pngs}/{len(r['figures'])} PNG, summary {r['summary_chars']} chars)"

    lines = NotebookLines(sys.stderr, what)

    def done(r: dict) -> None:  # what the command prints is pasted too: scrubbed first
        if args.repro is not None:  # the exported reproducer, linked in summary.md
            from statescope.share.repro_link import attach_repro

            r.update(attach_repro(r, args.repro))
        lines.done(_shareable([r])[0])

    if args.all:
        results = render_all(args.out, names=args.notebooks or None, on_start=lines.start,
                             on_done=done, **kw)
    else:
        from pathlib import Path

        paths = [Path(s) if os.path.isfile(s) else notebook_paths([str(s)])[0] for s in sources]
        results = []  # a bad name fails above, before anything is executed
        for path in paths:
            results.append(render_for_sharing(path, args.out, progress=lines.start(path), **kw))
            done(results[-1])
    results = _shareable(results)
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    return 0 if all(r["ok"] for r in results) else 1


def _shareable(results: list[dict]) -> list[dict]:
    """What the command prints is pasted too: scrubbed, and checked like the files."""
    from statescope.share.leakcheck import check_text
    from statescope.share.scrub import Scrubber

    scrubber = Scrubber.for_environment()
    results = scrubber.scrub_obj(results)
    check_text(json.dumps(results, default=str), "render's printed result", scrubber)
    return results


def add_render_subcommand(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("render",
                       epilog=exit_epilog('a notebook failed'),
                       help="execute notebooks (papermill) and write scrubbed HTML, "
                                      "Markdown, PNGs and an issue-ready summary.md")
    r.add_argument("notebooks", nargs="*", help="notebook names in notebooks/ or paths")
    r.add_argument("--all", action="store_true", help="every notebook in notebooks/, plus INDEX.md")
    r.add_argument("-p", "--param", action="append", metavar="NAME=VALUE",
                   help="papermill parameter (repeatable; NAME one the notebook's parameters cell "
                        "declares, VALUE JSON of its default's type, else a string)")
    r.add_argument("--out", default="reports/share")
    r.add_argument("--no-png", action="store_true", help="skip the PNG export (no Chromium needed)")
    r.add_argument("--timeout", type=int, default=1800, help="seconds per cell (> 0)")
    r.add_argument("--repro", metavar="DIR", default=None,
                   help="a folder written by `statescope export-repro`: copied beside each render "
                        "(repro/) and linked in its summary.md")
    add_json_flag(r)
    r.set_defaults(func=cmd_render)
