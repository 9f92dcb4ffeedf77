"""``statescope capture`` and ``statescope census``: the command-line face of the capture instrument.

What it does: ``add_capture_subcommands(subparsers)`` adds both subcommands to the main parser
(``statescope.cli.main``). ``capture_command`` runs a small shared-prefix multi-step workload on an
in-process engine with a capture spec (``--spec FILE``, or one built from the flags), and prints
where the run was stored, its size, what the run exercised (draft acceptance, in-place conv
shifts, prefix-cache hits: a run that exercises none of them cannot show their corruptions) and
its perturbation report (``statescope.capture.session.perturbation_report``). The workload
(``WORKLOAD_HELP``): ``--episodes`` episodes advance together in ``--steps`` waves; wave k sends
each episode's step-k prompt (the conversation so far, so it shares the previous wave's prompt
as a prefix) and generates up to ``--max-tokens`` tokens greedily. ``--workload gui`` (the
default) renders GUI-agent episodes (``statescope.workload.guilang``) — what ``tiny-gui``, the
capture's default model, was trained on: its MTP head accepts ~0.76 of drafts, so steps accept
1, 2 or 3 tokens and conv windows shift in place; ``text`` is the older free-text episode
workload (``statescope.workload.episodes``). The run's manifest records the plan and how it went
(``ended``); an engine error leaves an ``incomplete`` run and exit status 1. ``census_command`` prints the copy census of a run
(counts by kind, by launch and state kind, and the decoded-vs-observed cross-check). Both take
``--json``. Exit status: 0 when fine, 1 when the run or its census is not trustworthy (capture
errors, or a census that disagrees with the copies the CPU kernels reported), 2 for bad input
(raised as ``InputError`` and mapped by ``statescope.cli.main``).
``capture_overhead_command`` (``statescope capture-overhead``) times interleaved rounds per capture
mode on one engine (``statescope.capture.overhead``) and prints the ratios to capture off; exit 1
when a captured round's capture did not complete cleanly.

What it deliberately does not do: judge whether copies corrupted anything (compare runs with
``statescope.diverge.digest_diff``), or drive servers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from statescope.errors import InputError
from statescope.capture.census import census_report


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
    "The workload: EPISODES episodes advance together in STEPS waves; wave k sends each "
    "episode's step-k prompt (the conversation so far, sharing the previous wave's prompt as a "
    "prefix: prefix-cache hits once prompts span blocks) and generates up to MAX_TOKENS tokens "
    "each, greedily. Requests: EPISODES x STEPS. --workload gui (default): GUI-agent episodes, "
    "what tiny-gui (the default model here) was trained on: its MTP head accepts ~0.76 of "
    "drafts, so steps accept 1-3 tokens and conv windows shift in place; --workload text: "
    "free-text episodes (every prompt carries the previous answers).")
CAPTURE_MODEL = "tiny-gui"  # exercises partial acceptance and in-place shifts (tiny-qwen35 does not)


class _Progress:
    """An engine stand-in that counts the requests each ``generate`` call finished (for the
    run's outcome) and advances the stderr bar (``statescope.progress``) by them."""

    def __init__(self, engine: Any, bar: Any) -> None:
        self.engine, self.bar, self.finished, self.waves = engine, bar, 0, 0

    def generate(self, prompts: Any, **kwargs: Any) -> list:
        out = self.engine.generate(prompts, **kwargs)
        self.finished += len(out)
        self.waves += 1
        self.bar.advance(len(out))
        return out


def _run_workload(engine: Any, args: argparse.Namespace) -> list:
    if args.workload == "text":
        from statescope.workload.episodes import run_episodes, shared_prefix_episodes

        return run_episodes(engine, shared_prefix_episodes(args.episodes, args.steps,
                                                           seed=args.seed),
                            max_tokens=args.max_tokens)
    from statescope.workload import guilang

    episodes = [guilang.generate_episode(args.seed * 100_003 + e, n_steps=max(3, args.steps))
                for e in range(args.episodes)]
    rows = []
    for step in range(args.steps):
        records = engine.generate([guilang.render_prompt(ep, step) for ep in episodes],
                                  max_tokens=args.max_tokens)
        rows += [dict(r.to_dict(), episode=e, step=step) for e, r in enumerate(records)]
    return rows


def exercised(run: Any) -> dict:
    """What a run exercised: decode steps with drafts, how many accepted fewer than all drafts,
    the acceptance rate, in-place conv shifts (census), requests that hit the prefix cache."""
    st, cp = run.steps(), run.copies()
    if st.empty:
        return {"decode_steps": 0}
    dec = st[st["num_drafts"] > 0]
    acc = dec["accepted"].fillna(0)
    shifts = 0 if cp.empty else int(((cp["kind"] == "left_shift_same_block")
                                     & (cp["nbytes"] > 0)).sum())
    hits = int(st.groupby("req_id")["prefix_hit_tokens"].max().fillna(0).gt(0).sum())
    return {"decode_steps": int(len(dec)),
            "partial_accept_steps": int((acc < dec["num_drafts"] + 1).sum()),
            "acceptance": (round(float((acc - 1).sum() / dec["num_drafts"].sum()), 3)
                           if len(dec) else None),
            "in_place_shifts": shifts, "prefix_hit_requests": hits}


def capture_command(args: argparse.Namespace) -> int:
    """Run the workload with capture on; print the run directory, its size, what it exercised."""
    from statescope.capture import recorder as capture
    from statescope.patches import cpu_kernels
    from statescope.capture.store import CaptureRun
    from statescope.engine.offline import OfflineEngine
    from statescope.engine.config import EngineConfig, model_path
    from statescope.engine.modeldir import check_model_dir
    from statescope.verdict.inputs import parse_copy_semantics

    spec = _spec_from_args(args)
    if not spec.enabled:
        raise InputError("statescope capture: the spec's mode is 'off'; nothing would be recorded")
    from statescope.cli.assignments import dataclass_fields, parse_assignments

    for name in ("episodes", "steps", "max_tokens"):  # before the engine starts
        if getattr(args, name) < 1:
            raise InputError(f"statescope capture --{name.replace('_', '-')} "
                             f"{getattr(args, name)}: expected an integer >= 1")
    semantics = parse_copy_semantics(args.copy_semantics)
    overrides = parse_assignments(args.set, "--set", dataclass_fields(EngineConfig))
    config = EngineConfig(model=str(model_path(args.model or CAPTURE_MODEL)), **overrides)
    check_model_dir(config.model)
    if semantics:
        cpu_kernels.set_copy_semantics(*semantics)
    error = None
    from statescope.progress import Progress

    with Progress(args.episodes * args.steps, "capture", "requests") as bar:
        bar.note(f"starting the engine ({config.model})")
        with OfflineEngine(config) as engine:
            bar.note(f"engine ready in {engine.startup_s:.0f} s; capturing ({spec.mode})")
            capture.install(spec)
            capture.note_workload(what=f"statescope capture --workload {args.workload}",
                                  episodes=args.episodes, waves_planned=args.steps,
                                  requests_planned=args.episodes * args.steps,
                                  max_tokens=args.max_tokens)
            progress, rows, outcome = _Progress(engine, bar), [], None
            try:
                rows = _run_workload(progress, args)
            except Exception as exc:  # the run is kept, closed as incomplete; exit 1 below
                error = f"{type(exc).__name__}: {exc}"[:500]
            finally:
                outcome = {"requests_finished": progress.finished,
                           "waves_completed": progress.waves}
                if error:
                    outcome["engine_error"] = error
                dirs = capture.uninstall(outcome)
    from statescope.capture.session import perturbation_report

    runs = [CaptureRun(d) for d in dirs]
    out = {"runs": [{"path": str(r.path), "bytes": r.size_bytes(), "status": r.manifest["status"],
                     "mode": r.manifest["mode"], "steps": len(r.steps()),
                     "ended": r.ending(), "exercised": exercised(r),
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
            print(f"  exercised: {ex}")
            if not r["ended"]["complete"]:
                print(f"  INCOMPLETE: {r['ended']['why']}")
            if ex.get("decode_steps") and not (ex["partial_accept_steps"] or ex["in_place_shifts"]):
                print("  note: every draft was accepted and no conv window shifted in place: this "
                      "run cannot show corruptions on those paths (try --model tiny-gui)")
    if error:
        print(f"statescope capture: the engine raised ({error}); the run is kept, marked "
              "incomplete", file=sys.stderr)
    return 0 if runs and not error and all(r["errors"] == 0 and r["ended"]["complete"]
                                            for r in out["runs"]) else 1


def census_command(args: argparse.Namespace) -> int:
    report = census_report(args.run)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['run']}: {report['copies']} copies over {report['engine_steps']} steps")
        for kind, n in report["counts"].items():
            print(f"  {kind:<24} {n}")
        if report["crosscheck"]:
            print(f"  cross-check against the CPU kernels: "
                  f"{'ok' if report['crosscheck_ok'] else 'MISMATCH'} {report['crosscheck']}")
    return 0 if report["crosscheck_ok"] and not report["capture_errors"] else 1


def recover_command(args: argparse.Namespace) -> int:
    from statescope.capture.spool import recover

    rep = recover(args.run)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print(f"{rep['run']}: {rep['steps_emitted']} spooled step(s) emitted; status {rep['status']}")
    return 0


def add_capture_subcommands(subparsers: Any) -> None:
    c = subparsers.add_parser("capture", help="run a small workload with state capture on",
                              description="Run a small multi-step workload on an in-process "
                                          "engine with GDN state capture on. " + WORKLOAD_HELP)
    c.add_argument("--spec", help="capture spec JSON (overrides the flags below)")
    c.add_argument("--out", default="captures", help="output directory (default: captures)")
    c.add_argument("--mode", choices=("digest", "full"), default="digest")
    c.add_argument("--first-steps", type=int, default=2, help="full mode: snapshot steps 0..K-1")
    c.add_argument("--sample", type=float, default=None, help="fraction of requests to record")
    c.add_argument("--max-bytes", type=int, default=None)
    c.add_argument("--model", default=None,
                   help=f"model directory or name under data/models (default: {CAPTURE_MODEL}, "
                        "which accepts drafts partly; tiny-qwen35 accepts every draft)")
    c.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override an EngineConfig field (e.g. async_scheduling=false for a "
                        "reference run of the same prompts; repeatable)")
    c.add_argument("--workload", choices=("gui", "text"), default="gui",
                   help="gui: GUI-agent episodes (default); text: free-text episodes")
    c.add_argument("--episodes", type=int, default=4,
                   help="episodes advanced together (one request each per wave; default 4)")
    c.add_argument("--steps", type=int, default=3,
                   help="waves: steps per episode, each prompt extending the previous (default 3)")
    c.add_argument("--max-tokens", type=int, default=16,
                   help="tokens generated per request, greedily (default 16)")
    c.add_argument("--seed", type=int, default=0, help="episode seed")
    c.add_argument("--copy-semantics", default=None,
                   help="CPU kernels' copy semantics, e.g. barrierless_tiles:8192 (planted fault)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=capture_command)
    s = subparsers.add_parser("census", help="copy census of a capture run")
    s.add_argument("run", help="capture run directory (or a directory of runs: the latest)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=census_command)
    r = subparsers.add_parser("capture-recover", help="emit the spooled steps a killed capture left "
                                                      "unwritten (emit: idle runs)")
    r.add_argument("run", help="capture run directory")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=recover_command)



def _csv(value: str, where: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in value.split(",") if x.strip())
    if not items:
        from statescope.errors import InputError

        raise InputError(f"{where}: expected a comma-separated list, got {value!r}")
    return items


def overhead_problems(result: dict) -> list[str]:
    """Captured rounds whose capture did not really run (status not complete, hook errors)."""
    bad = []
    for wl, part in result["workloads"].items():
        for r in part["rows"]:
            if r["mode"] != "off" and (r.get("status") != "complete" or r.get("hook_errors")):
                bad.append(f"{wl} {r['mode']} round {r['round']}: status {r.get('status')}, "
                           f"{r.get('hook_errors')} hook errors")
    return bad


def capture_overhead_command(args: argparse.Namespace) -> int:
    """Interleaved timed rounds per capture mode on one engine; exit 1 if a captured round's
    capture did not complete cleanly."""
    import tempfile
    import time

    from statescope.capture.overhead import check_modes
    from statescope.capture.overhead_probe import probe_engine
    from statescope.cli.reproduce import _config_overrides
    from statescope.errors import InputError
    from statescope.engine.config import EngineConfig, model_path
    from statescope.engine.runners import OfflineRunner

    modes = check_modes(_csv(args.modes, "--modes"), "--modes")
    workloads = _csv(args.workloads, "--workloads")
    overrides = _config_overrides(args.set, "--set")
    if args.gpu:  # compiled, CUDA graphs and async scheduling, as the H200 probes ran
        from statescope.gpu.e2e_arms import gpu_extra

        overrides = {"enforce_eager": False, "async_scheduling": True,
                     "extra": dict(gpu_extra(), **overrides.pop("extra", {})), **overrides}
    out_dir = args.capture_dir or tempfile.mkdtemp(prefix="statescope-overhead-")
    deadline = time.time() + args.budget_s if args.budget_s else None
    if args.random_hybrid:  # a random-weight hybrid of the H200 probes (dummy weights; --set ignored)
        from statescope.engine.config import MODELS_DIR
        from statescope.gpu.e2e_run import LARGE_SIZES, large_hybrid_runner

        if args.random_hybrid not in LARGE_SIZES or args.model or args.set:
            raise InputError(f"--random-hybrid {args.random_hybrid!r}: expected one of {sorted(LARGE_SIZES)}, "
                             "without --model or --set (the hybrid's configuration is the probes')")
        runner, facts = large_hybrid_runner(MODELS_DIR / "tiny-gui", cpu=not args.gpu,
                                            **LARGE_SIZES[args.random_hybrid])
        facts.pop("resolved")
    else:
        config = EngineConfig(**({"model": str(model_path(args.model))} if args.model else {}), **overrides)
        runner, facts = OfflineRunner(config), {}
    with runner:
        result = {"model": args.random_hybrid and f"random hybrid {args.random_hybrid}" or str(runner.config.model),
                  "modes": list(modes), **facts,
                  "resolved": {k: runner.resolved().get(k) for k in (
                      "vllm_version", "enforce_eager", "async_scheduling", "enable_prefix_caching",
                      "mamba_cache_mode", "mamba_block_size", "num_speculative_tokens",
                      "model_runner", "runner_version")},
                  **probe_engine(runner, workloads=workloads, modes=modes, rounds=args.rounds,
                                 max_tokens=args.max_tokens, gui_max_tokens=args.gui_max_tokens,
                                 gui_shape={"prefix": args.gui_prefix, "suffix": args.gui_suffix},
                                 deadline=deadline, output_dir=out_dir, profile=args.cprofile,
                                 sync=args.sync_check)}
    problems = overhead_problems(result)
    result["problems"] = problems
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        for wl, part in result["workloads"].items():
            print(f"{wl}: {part['prompts']} prompts of {part['prompt_tokens'][0]}-{part['prompt_tokens'][-1]} "
                  f"tokens, {part['max_tokens']} tokens each, {len({r['round'] for r in part['rows']})} rounds")
            for mode, s in part["summary"].items():
                if mode == "off":
                    print(f"  off     {s['median_tok_s']:9.1f} tok/s (median)")
                    continue
                ci = s.get("paired_ratio_ci")
                print(f"  {mode:<7} ratio of medians {s['ratio_median']:.3f}, paired median "
                      f"{s.get('paired_ratio_median', float('nan')):.3f}"
                      + (f" [{ci['lo']:.3f}, {ci['hi']:.3f}]" if ci else "")
                      + (f", capture host {s['capture_host_ms_per_step']:.2f} ms/step"
                         if "capture_host_ms_per_step" in s else "")
                      + (f", capture CPU share {s['capture_cpu_share']:.3f}" if "capture_cpu_share" in s else ""))
        for p in problems:
            print(f"statescope capture-overhead: {p}")
    return 1 if problems else 0


def add_capture_overhead_subcommand(subparsers: Any) -> None:
    from statescope.capture.overhead import MODES, WORKLOADS

    p = subparsers.add_parser("capture-overhead", help="throughput with capture off vs on, interleaved rounds "
                                                       "on one engine (ratios, paired by round)")
    p.add_argument("--model", default=None, help="model directory or name under data/models")
    p.add_argument("--modes", default="off,digest", help=f"'off' first, then any of {', '.join(MODES[1:])}")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds per mode (after one warm-up each); "
                                                         "6 or more give the paired median an interval")
    p.add_argument("--workloads", default="decode", help=f"some of {', '.join(WORKLOADS)}")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens per request (decode workload)")
    p.add_argument("--gui-max-tokens", type=int, default=64, help="tokens per request (gui workload)")
    p.add_argument("--gui-prefix", type=int, default=2048, help="gui workload: shared history tokens")
    p.add_argument("--gui-suffix", type=int, default=384, help="gui workload: per-step observation tokens")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="override an EngineConfig field of the (trigger) configuration (repeatable)")
    p.add_argument("--gpu", action="store_true", help="compiled, CUDA graphs, async scheduling (the H200 setting)")
    p.add_argument("--random-hybrid", default=None, metavar="SIZE",
                   help="instead of --model: the H200 probes' random-weight hybrid, 1p3b or 7b (for a GPU; "
                        "without --gpu a 4 x 256 hybrid whose 2,176-token blocks make CPU rounds take minutes)")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting rounds after this long")
    p.add_argument("--cprofile", action="store_true", help="add one cProfile'd digest round (names the host cost)")
    p.add_argument("--sync-check", action="store_true",
                   help="add one digest round in CUDA's sync debug mode (statescope's synchronizing calls)")
    p.add_argument("--capture-dir", default=None, help="where the capture runs go (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=capture_overhead_command)
