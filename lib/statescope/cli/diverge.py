"""``statescope diverge RUN --reference REF`` and ``statescope continuity RUN``: where a capture
run's state first departs, in a terminal.

What it does: parses the arguments, calls the library (``statescope.diverge.report``,
``.by_position``, ``.hypotheses``, ``.conv_continuity``) and prints the report (``--json`` for
machines; ``statescope.diverge.text`` for people). ``diverge`` pairs the two runs' states by
token position (``--pairing auto``, the default, or ``position``: runs that schedule differently
— async scheduling on or off, other batch limits — line up; ``auto`` falls back to step pairing,
with a warning, for a capture whose steps table cannot place states), or by request step
(``--pairing step``: only runs that schedule alike line up; others show false divergences).
Exit status, as every statescope report: 0 when no request diverges (``continuity``: no conv
shift breaks), 1 when some do, 2 for bad input — a path that is not a capture run, or an incomplete capture (the engine raised, fewer requests
finished than planned) unless ``--allow-incomplete``, which compares what it has and warns. ``statescope localize`` runs
``statescope.diverge.localize`` on a trigger's digest capture, its records and a control's, and
prints (or writes) where its states first depart.

What it deliberately does not do: compare anything itself; every rule lives in ``statescope.diverge``.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from statescope.cli.exit_codes import add_json_flag
from statescope.diverge.conv_continuity import continuity_summary, conv_shift_check
from statescope.diverge.report import DivergenceReport, divergence_report
from statescope.diverge.report import open_capture as _open_run


def _open(path: Any, what: str) -> Any:
    return _open_run(path, what)


def _position_report(args: argparse.Namespace) -> DivergenceReport:
    from statescope.diverge.by_position import position_report
    from statescope.diverge.noise import calibrate, compare_states
    from statescope.diverge.replay import CapturedStates

    from statescope.diverge.report import check_completeness

    run, ref = CapturedStates(_open(args.run, "run")), CapturedStates(_open(args.reference, "reference"))
    # no clean runs given: compare the reference with itself, so only the floor sets tolerance
    clean = [CapturedStates(_open(n, "noise run")) for n in args.noise] or [ref]
    tol = calibrate([compare_states(c, ref) for c in clean],
                    [f"{c.run.path.name} vs {ref.run.path.name}" for c in clean])
    report = position_report(run, ref, tol)
    check_completeness(report, {"run": run.run, "reference": ref.run}, args.allow_incomplete)
    return report


def diverge_command(args: argparse.Namespace) -> int:
    import sys

    from statescope.diverge.conv_continuity import run_continuity
    from statescope.diverge.hypotheses import hypothesis_table, run_context
    from statescope.diverge.text import hypotheses_text

    report = (_position_report(args) if args.by_position
              else divergence_report(args.run, args.reference, rtol=args.rtol,
                                     columns=args.columns,
                                     allow_incomplete=args.allow_incomplete,
                                     pairing=getattr(args, "pairing", "auto")))
    run = _open(args.run, "run")  # the exact conv-shift check sharpens H-accept / H-reorder
    table = hypothesis_table(report, run_context(run, planted=args.planted, gdn_layers=report.gdn_layers),
                             continuity=run_continuity(run))
    for w in report.warnings:  # loud on stderr as well, whatever the output format
        print(f"statescope diverge: WARNING: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps(dict(report.to_dict(), hypotheses=table.to_dict()), indent=2, default=str))
    else:
        print(report.text(all_requests=args.all))
        print()
        print(hypotheses_text(table))
    if not report.requests:  # "0 of 0 requests diverge" is no answer (an incomplete run's steps)
        print(f"statescope diverge: no request of {args.run} could be compared with "
              f"{args.reference}: nothing was checked (exit 2)", file=sys.stderr)
        return 2
    return 1 if report.diverged else 0


def add_diverge_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("diverge", help="where a capture run first departs from a reference run")
    p.add_argument("run", help="capture run directory")
    p.add_argument("--reference", required=True, help="capture run of the same prompts to compare to")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance of statistics")
    p.add_argument("--columns", default="auto", choices=("auto", "all", "resume", "running"),
                   help="block columns to compare: the column each step's successor resumes from "
                        "(resume), every captured column (all: needs draft-column captures), the "
                        "running column (running: older captures); auto = all, else resume, else "
                        "running, whichever both runs support (the report says which)")
    p.add_argument("--pairing", default="auto", choices=("auto", "position", "step"),
                   help="how the two runs' states are paired per request: by the token position "
                        "each state stands for (position: runs that schedule differently, e.g. "
                        "async scheduling on vs off, line up), by request step (step: only runs "
                        "that schedule alike line up, others show false divergences); auto (the "
                        "default) = position, else step with a warning (a capture lacking the "
                        "step columns positions need); the report's 'paired by' line says which")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="compare an incomplete capture (engine error, fewer requests finished "
                        "than planned) anyway, with a warning; without it such a run is refused "
                        "(exit 2)")
    p.add_argument("--all", action="store_true",
                   help="text form: list every request, not only those that diverge")
    p.add_argument("--by-position", action="store_true",
                   help="compare full-mode captures' snapshots by (request, token position) in "
                        "tolerance units (the digests are paired by position too: --pairing)")
    p.add_argument("--noise", nargs="*", default=[], metavar="CLEAN_RUN",
                   help="with --by-position: clean full-mode runs of the same prompts; tolerance "
                        "= 2x their largest difference from the reference (floor: 1/256 of scale)")
    p.add_argument("--planted", default=None,
                   help="planted fault / copy semantics of RUN (e.g. barrierless_tiles, "
                        "permute_accepted): its mechanism is labelled EMULATED")
    p.add_argument("--json", action="store_true", help="print the report and hypothesis table as JSON")
    p.set_defaults(func=diverge_command)
    p.epilog = ("states are paired by token position by default (--pairing auto); --pairing "
                "step pairs them by request step. exit status: 0 no request diverges, 1 some do, "
                "2 bad input, an incomplete run (without --allow-incomplete), or no request "
                "compared (with it)")


def continuity_command(args: Any) -> int:
    """``statescope continuity RUN``: the check needs no reference run; exit 1 if a shift broke,
    2 for an incomplete run (unless ``--allow-incomplete``) or a run with nothing to check."""
    import json
    import sys

    from statescope.capture.ending import require_complete

    run = _open(args.run, "run")
    warning = require_complete(run, args.allow_incomplete, "statescope continuity")
    if warning:
        print(f"statescope continuity: WARNING: {warning}", file=sys.stderr)
    df = conv_shift_check(run)
    summary = continuity_summary(df)
    breaks = df[~df["ok"]] if not df.empty else df
    if args.json:
        print(json.dumps({"run": str(args.run), "summary": summary, "warnings": [warning] if warning else [],
                          "breaks": breaks.to_dict(orient="records")}, indent=2, default=str))
    else:
        if warning:
            print(f"WARNING: {warning}")
        print(f"{summary['break_transitions']} of {summary['transitions_checked']} decode transitions "
              f"({summary['requests_with_break']} of {summary['requests_checked']} requests) break "
              "the conv window's continuity")
        meaning = {"wrong shift": "every GDN layer's window moved by another shift than the "
                                  "accepted count: a wrong count reached the update",
                   "value change (no shift fits)": "the carried rows match no shift of the "
                                                   "previous window: their values changed, not "
                                                   "the shift",
                   "some layers only": "only some GDN layers break: a layer-local change, not a "
                                       "wrong count (one per request, all layers)",
                   "in-place shift broken": "the rows an in-place shift duplicates or carries "
                                            "disagree"}
        for kind, n in summary["break_kinds"].items():
            print(f"  {n} {kind}: {meaning.get(kind, kind)}")
        if len(breaks):
            cols = ["req_id", "req_step", "engine_step", "layer", "expected_shift", "observed_shifts",
                    "break_kind", "moved", "prefill_rows_in_batch"]
            print(breaks[[c for c in cols if c in breaks]].head(args.limit).to_string(index=False))
    if summary["break_transitions"]:
        return 1
    if not summary["transitions_checked"]:  # "0 of 0" is no answer: nothing was checked
        print(f"statescope continuity: {args.run} has no decode -> decode transition to check "
              "(no captured decode steps with every draft scheduled): no answer (exit 2)",
              file=sys.stderr)
        return 2
    return 0


def add_continuity_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("continuity", help="exact check, from a digest capture alone, that each "
                                                 "decode step's conv update shifted by the accepted count")
    p.add_argument("run", help="capture run directory (digest or full mode, speculative decoding on)")
    p.add_argument("--limit", type=int, default=40, help="break rows to print")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="check an incomplete capture (killed, engine error, fewer requests "
                        "finished than planned) anyway, with a warning; without it such a run "
                        "is refused (exit 2)")
    add_json_flag(p)
    p.set_defaults(func=continuity_command)
    p.epilog = ("exit status: 0 every checked transition continues, 1 some break, 2 bad input, "
                "an incomplete run (without --allow-incomplete), or no transition to check")


def _repo_relative(path: str) -> str:
    """A path as the committed results name it: repo-relative where it can be, else its name
    (no machine paths in a document that may be committed)."""
    from pathlib import Path

    from statescope.engine.config import MODELS_DIR

    root = MODELS_DIR.parents[1]
    p = Path(path).resolve()
    return str(p.relative_to(root)) if p.is_relative_to(root) else p.name


def localize_command(args: argparse.Namespace) -> int:
    """``statescope localize``: where the trigger's captured states first depart (exit 0), the
    document written to ``--out`` when given."""
    from pathlib import Path

    from statescope.diverge.localize import brief, load_records, localize
    from statescope.errors import InputError

    trigger = load_records(args.records, args.trigger_build)
    control = load_records(args.control, args.control_build)
    if not control:
        raise InputError(f"{args.control}: no records of build {args.control_build!r}")
    doc = localize(trigger, control, args.capture, args.model, clean=args.clean,
                   shift_probes=args.shift_probes, scratch=args.scratch,
                   sources={"capture": _repo_relative(args.capture), "records": _repo_relative(args.records),
                            "control": f"{_repo_relative(args.control)} ({args.control_build})",
                            "model": _repo_relative(args.model)})
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
    print(json.dumps(doc if args.json else brief(doc), indent=1, default=str))
    return 0


def add_localize_subcommand(subparsers: Any) -> None:
    from statescope.results.e2e import E2E_DIR

    p = subparsers.add_parser("localize", help="where a trigger run's captured GDN states first depart from "
                                               "the float64 oracle (digest capture + records + model)")
    p.add_argument("records", nargs="?", default=str(E2E_DIR / "trigger_token_ids.jsonl.gz"),
                   help="trigger records with prompt/output token ids (default: the committed GPU run's)")
    p.add_argument("--trigger-build", default="trigger", help="build name of the trigger records")
    p.add_argument("--control", default=str(E2E_DIR / "records_tiny-gui.jsonl"),
                   help="control records (raw ones, with prompt_token_ids, add the prompt check)")
    p.add_argument("--control-build", default="no_async")
    p.add_argument("--capture", default=str(E2E_DIR / "capture_tiny-gui.tar.gz"),
                   help="the trigger's digest capture: a run directory or a tarball of one")
    p.add_argument("--model", default=str(E2E_DIR.parents[2] / "models" / "tiny-gui"),
                   help="model directory (the oracle's weights)")
    p.add_argument("--clean", type=int, default=6, help="clean requests to calibrate the tolerance on")
    p.add_argument("--shift-probes", type=int, default=12,
                   help="non-divergent requests with an in-place conv shift to compare with the oracle")
    p.add_argument("--scratch", default=None, help="where to unpack a tarball (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write the document here (JSON)")
    p.add_argument("--json", action="store_true", help="print the whole document, not its summary")
    p.set_defaults(func=localize_command)
