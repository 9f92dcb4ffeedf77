"""The ``statescope`` command line: the scriptable face of the workbook.

What it does: one subcommand per report, each with ``--json`` for machines and a short human form
otherwise; one exit status rule for all (``statescope.cli.exit_codes``, stated in every
``--help``): 0 clean / no evidence, 1 corruption detected or a problem found, 2 bad input or a
design that cannot answer. Each subcommand is a thin wrapper over a library call that notebooks
use too.

What it deliberately does not do: hold logic of its own.
"""
from __future__ import annotations

import argparse
import json
import sys

from statescope.cli.reproduce import cmd_reproduce
from statescope.cli.workload import add_workload_subcommand
from statescope.errors import InputError, StatescopeError
from statescope.cli.exit_codes import EXIT_STATUS, add_json_flag, add_missing_epilogs, exit_epilog


def _print(obj, as_json: bool) -> None:
    print(json.dumps(obj.to_dict(), indent=2, default=str) if as_json else repr(obj))


def cmd_doctor(args: argparse.Namespace) -> int:
    from statescope.engine.config import model_path
    from statescope.engine.doctor import run_doctor
    from statescope.engine.modeldir import check_model_dir

    if args.model is not None:  # a model that is not there is bad input (2), not a broken setup (1)
        check_model_dir(model_path(args.model))
    report = run_doctor(args.model, start_engine=not args.no_engine)
    report.census = _installed_census()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        for c in report.checks:
            print(f"{'ok ' if c.ok else 'FAIL'} {c.name:<24} {c.detail}")
        if report.census:  # the source census of the installed build (statescope build census)
            print("census: " + report.census["summary"].replace("; #", "\n        #", 1))
    if not report.ok:
        bad = report.first_failure
        print(f"statescope doctor: {bad.name}: {bad.detail}", file=sys.stderr)
        return 1
    return 0


def _installed_census() -> dict:
    """The source census of the installed vLLM (``statescope.builds.census``); information, never
    fatal: a census that cannot be read says why."""
    try:
        from statescope.builds.census import census_installed

        return census_installed().to_dict()
    except (StatescopeError, OSError, ImportError) as exc:
        return {"summary": f"census unavailable: {exc}", "brief": None}


def cmd_workbook(args: argparse.Namespace) -> int:
    import os

    from statescope.cli.render import NotebookLines
    from statescope.share.render import REPO, notebook_paths, run_notebook

    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"  # inherited by the kernels: keep reports readable
    out = args.out if os.path.isabs(args.out) else str(REPO / args.out)
    lines, results = NotebookLines(sys.stderr), []  # progress: stderr only
    for path in notebook_paths(args.notebooks or None):
        results.append(run_notebook(path, __import__("pathlib").Path(out),
                                    progress=lines.start(path), keep_warnings=args.verbose))
        lines.done(results[-1])
    if args.json:
        print(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


def _version() -> str:
    import statescope

    return statescope.__version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="statescope", description=__doc__.splitlines()[0],
                                epilog=EXIT_STATUS)
    p.add_argument("--version", action="version", version=f"statescope {_version()}")
    from statescope.patches.device_profiles import PROFILES

    p.add_argument("--profile", default=None, choices=(*PROFILES, "auto"),
                   help="device profile for every engine this command starts: cpu | cuda | "
                        "cuda-triton | auto (default: $STATESCOPE_PROFILE, else auto-detected; "
                        "statescope.patches.device_profiles)")
    p.add_argument("--verbose", action="store_true",
                   help="keep known-benign library warnings (NUMA binding, kernel transport, ...) "
                        "in the terminal and in rendered notebooks (also after the subcommand)")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", epilog=exit_epilog("a check failed (versions, model, engine start)"),
                       help="versions, model and a short start of the trigger config")
    d.add_argument("--model", default=None, help="model directory or name under data/models")
    d.add_argument("--no-engine", action="store_true", help="skip the engine start")
    add_json_flag(d)
    d.set_defaults(func=cmd_doctor)
    w = sub.add_parser("workbook",
                       epilog=exit_epilog('a notebook failed'),
                       help="execute notebooks headless and render HTML to reports/")
    w.add_argument("notebooks", nargs="*", help="notebook names (default: all in notebooks/)")
    w.add_argument("--out", default="reports")
    add_json_flag(w)
    w.set_defaults(func=cmd_workbook)
    add_workload_subcommand(sub)
    r = sub.add_parser("reproduce",
                       epilog=exit_epilog(),
                       help="trigger arm vs control arm on real vLLM, with a verdict")
    from statescope.cli.exit_codes import shown_choices
    from statescope.verdict.reproduce import STANDARD_CONTROLS
    from statescope.verdict.units import UNITS
    from statescope.workload.episodes import PRESETS
    from statescope.workload.trace import REPLAYS

    r.add_argument("--preset", default=None, choices=shown_choices(PRESETS),
                   help="smoke | laptop | repro288 | long (default smoke; without --seeds sized to "
                        "the fewest seeds whose episodes can reach --alpha: smoke -> --seeds 0:2)")
    r.add_argument("--seeds", default=None, help="run the preset once per seed: A:B | A,B,C "
                                                  "(episode ids prefixed s<seed>-); a design "
                                                  "that cannot reach --alpha is refused (exit 2)")
    r.add_argument("--seed-sets", type=int, default=None, metavar="N",
                   help="cut --seeds into N equal consecutive sets: each set's verdict and the "
                        "pooled one (the exit status is the pooled verdict's)")
    r.add_argument("--trace", help="a trace file (overrides --preset)")
    r.add_argument("--geometry", default=None, help="with --preset: before | at | after | mixed "
                                                    "| image_across (with --vision)")
    r.add_argument("--runner", default="offline", help="offline | server | http://HOST:PORT")
    r.add_argument("--control", default="no_prefix_cache", choices=shown_choices(STANDARD_CONTROLS),
                   help="no_prefix_cache | no_mtp | no_async | reference")
    r.add_argument("--model", help="model directory or name under data/models")
    r.add_argument("--control-run", metavar="RUN_DIR", default=None,
                   help="re-use the --control arm already run into RUN_DIR (same trace: refused "
                        "otherwise) instead of running it again")
    r.add_argument("--trigger-set", action="append", metavar="FIELD=VALUE",
                   help="override an engine setting of the trigger arm (repeatable): an "
                        "EngineConfig field or vLLM's spelling (enable-prefix-caching=false, "
                        "speculative_config={...}, no-async-scheduling=true); one rule for every "
                        "command (EngineConfig.with_overrides)")
    r.add_argument("--control-set", action="append", metavar="FIELD=VALUE",
                   help="the same for the control arm")
    r.add_argument("--trigger-patch", action="append", default=[], metavar="NAME",
                   help="statescope runtime patch on the trigger arm (offline runner), e.g. "
                        "accept_sync; the arm is labelled PATCHED (repeatable)")
    r.add_argument("--unit", default="episode", choices=shown_choices(UNITS), help="request | episode | engine_lifetime "
                                                      "(the unit of independence counted)")
    r.add_argument("--episodes-per-lifetime", type=int, default=None,
                   help="reset the prefix cache after this many episodes (engine_lifetime unit)")
    r.add_argument("--fault", help="PLANTED test fault on the trigger arm: KIND[:RATE], "
                                   "KIND one of zero_conv, zero_ssm, nan_conv, nan_ssm")
    r.add_argument("--copy-semantics", default=None,
                   help="CPU copy-kernel semantics of the trigger arm (barrierless_tiles = "
                        "EMULATED GPU race)")
    r.add_argument("--vision", action="store_true", help="with --preset: 1-3 screenshots per "
                                                        "request (read by a vision model: tiny-vl)")
    r.add_argument("--replay", default=None, choices=REPLAYS, help="as_logged | agent_loop (default: the trace's)")
    r.add_argument("--alpha", type=float, default=0.01,
                   help="significance level of the one-sided Fisher test (the decision rule)")
    r.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight: on a server the client's limit (default: an "
                        "imported log's own, else 32); on the offline runner both arms' "
                        "max_num_seqs (default: their own, 32)")
    r.add_argument("--runs", default="runs")
    r.add_argument("--run-id")
    add_json_flag(r)
    r.set_defaults(func=cmd_reproduce)
    # one module per command family; each registers its own subcommands
    from statescope.cli.bisect import add_bisect_subcommands
    from statescope.cli.builds import add_build_subcommands, add_releases_subcommand
    from statescope.cli.capture import add_capture_overhead_subcommand, add_capture_subcommands
    from statescope.cli.diverge import (add_continuity_subcommand, add_diverge_subcommand,
                                        add_localize_subcommand)
    from statescope.cli.gpu import (add_gpu_arm_subcommand, add_gpu_results_subcommand,
                                    add_racecheck_subcommand)
    from statescope.cli.models import add_model_check_subcommand, add_vision_probe_subcommand
    from statescope.cli.render import add_render_subcommand
    from statescope.cli.shrink import add_shrink_subcommands

    add_capture_subcommands(sub)
    add_capture_overhead_subcommand(sub)
    add_diverge_subcommand(sub)
    add_continuity_subcommand(sub)
    add_localize_subcommand(sub)
    add_racecheck_subcommand(sub)
    add_build_subcommands(sub)
    add_releases_subcommand(sub)
    add_model_check_subcommand(sub)
    add_vision_probe_subcommand(sub)
    add_bisect_subcommands(sub)
    add_render_subcommand(sub)
    add_gpu_results_subcommand(sub)
    add_gpu_arm_subcommand(sub)
    add_shrink_subcommands(sub)
    add_missing_epilogs(p)  # a command registered without the rule still states it in --help
    return p


def main(argv: list[str] | None = None) -> int:
    import contextlib
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before any vLLM import
    # vLLM logs to stdout by default; stdout is for reports (and --json must stay parseable).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    argv = list(sys.argv[1:] if argv is None else argv)
    # --verbose anywhere on the line (before or after the subcommand): keep the known-benign
    # library warnings that are otherwise filtered (statescope.quiet).
    verbose = "--verbose" in argv or os.environ.get("STATESCOPE_VERBOSE") == "1"
    argv = [a for a in argv if a != "--verbose"]
    args = build_parser().parse_args(argv)
    args.verbose = verbose
    if not verbose:
        from statescope import quiet

        quiet.install_log_filter()
    if args.profile:  # one profile for every engine the command starts (in this process or not)
        os.environ["STATESCOPE_PROFILE"] = args.profile
        os.environ["STATESCOPE_PROFILE_CHOSEN_BY"] = "--profile"
    with contextlib.nullcontext() if verbose or not _owns_stderr() else _filtered():
        try:
            return args.func(args)
        except InputError as exc:
            print(f"statescope {args.command}: {exc}", file=sys.stderr)
            return 2
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
            if exc.filename is None:  # not about a path the user named: a real failure
                raise
            # last resort for a path no check above caught: one line, exit 2, no traceback
            print(f"statescope {args.command}: {exc.filename}: {exc.strerror}", file=sys.stderr)
            return 2
        except StatescopeError as exc:
            print(f"statescope {args.command}: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM where a run turned it into this
            from statescope.records import Terminated

            what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
            print(f"statescope {args.command}: {what}; what was stored is kept (resume with the "
                  "same --run-id)", file=sys.stderr)
            return 143 if isinstance(exc, Terminated) else 130


def _owns_stderr() -> bool:
    """Filter the process's stderr only when run as a command, not when ``main`` is called from
    a test or a notebook whose stderr is not a plain file descriptor."""
    try:
        return sys.stderr is sys.__stderr__ and sys.stderr.fileno() == 2
    except (AttributeError, ValueError, OSError):
        return False


def _filtered():
    from statescope.quiet import filtered_stderr

    return filtered_stderr()


if __name__ == "__main__":
    sys.exit(main())
