"""``statescope capture`` and ``statescope census``: the command-line face of the capture instrument.

What it does: ``add_capture_subcommands(subparsers)`` adds both subcommands to the main parser
(``statescope.cli.main``). ``capture_command`` runs a small shared-prefix multi-step workload on an
in-process engine with a capture spec (``--spec FILE``, or one built from the flags), and prints
where the run was stored, its size and its perturbation report
(``statescope.capture.session.perturbation_report``). ``census_command`` prints the copy census of a run
(counts by kind, by launch and state kind, and the decoded-vs-observed cross-check). Both take
``--json``. Exit status: 0 when fine, 1 when the run or its census is not trustworthy (capture
errors, or a census that disagrees with the copies the CPU kernels reported), 2 for bad input
(raised as ``InputError`` and mapped by ``statescope.cli.main``).

What it deliberately does not do: judge whether copies corrupted anything (compare runs with
``statescope.diverge.digest_diff``), or drive servers.
"""
from __future__ import annotations

import argparse
import json
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


def capture_command(args: argparse.Namespace) -> int:
    """Run the workload with capture on; print the run directory and its size."""
    from statescope.capture import recorder as capture
    from statescope.patches import cpu_kernels
    from statescope.capture.store import CaptureRun
    from statescope.engine.offline import OfflineEngine
    from statescope.engine.config import EngineConfig
    from statescope.workload.episodes import run_episodes, shared_prefix_episodes

    spec = _spec_from_args(args)
    if not spec.enabled:
        raise InputError("statescope capture: the spec's mode is 'off'; nothing would be recorded")
    config = EngineConfig(**({"model": args.model} if args.model else {}))
    if args.copy_semantics:
        name, _, tile = args.copy_semantics.partition(":")
        cpu_kernels.set_copy_semantics(name, int(tile) if tile else cpu_kernels.DEFAULT_TILE_BYTES)
    from statescope.progress import Progress

    with Progress(args.episodes * args.steps, "capture", "requests") as bar:
        bar.note(f"starting the engine ({config.model})")
        with OfflineEngine(config) as engine:
            bar.note(f"engine ready in {engine.startup_s:.0f} s; capturing ({spec.mode})")
            capture.install(spec)
            try:
                rows = run_episodes(engine, shared_prefix_episodes(args.episodes, args.steps,
                                                                   seed=args.seed),
                                    max_tokens=args.max_tokens, progress=bar)
            finally:
                dirs = capture.uninstall()
    from statescope.capture.session import perturbation_report

    runs = [CaptureRun(d) for d in dirs]
    out = {"runs": [{"path": str(r.path), "bytes": r.size_bytes(), "status": r.manifest["status"],
                     "mode": r.manifest["mode"], "steps": len(r.steps()),
                     "truncated": r.manifest.get("truncated"),
                     "errors": r.manifest.get("error_count", 0),
                     "perturbation": perturbation_report(r)} for r in runs],
           "requests": len(rows)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for r in out["runs"]:
            p = r["perturbation"]
            print(f"{r['path']}  {r['bytes'] / 2**20:.1f} MiB  mode={r['mode']} "
                  f"steps={r['steps']} status={r['status']}  forced_sync={p['forced_sync']} "
                  f"forced_eager={p['forced_eager']} measured_overhead={p['measured_overhead']}")
    return 0 if runs and all(r["errors"] == 0 for r in out["runs"]) else 1


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
    c = subparsers.add_parser("capture", help="run a small workload with state capture on")
    c.add_argument("--spec", help="capture spec JSON (overrides the flags below)")
    c.add_argument("--out", default="captures", help="output directory (default: captures)")
    c.add_argument("--mode", choices=("digest", "full"), default="digest")
    c.add_argument("--first-steps", type=int, default=2, help="full mode: snapshot steps 0..K-1")
    c.add_argument("--sample", type=float, default=None, help="fraction of requests to record")
    c.add_argument("--max-bytes", type=int, default=None)
    c.add_argument("--model", default=None, help="model directory or name under data/models")
    c.add_argument("--episodes", type=int, default=4)
    c.add_argument("--steps", type=int, default=3)
    c.add_argument("--max-tokens", type=int, default=16)
    c.add_argument("--seed", type=int, default=0)
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

