"""``statescope capture-overhead``: capture's cost, capture off vs on, in interleaved rounds on one engine.

What it does: ``capture_overhead_command`` times interleaved rounds per capture mode on one engine
(``statescope.capture.overhead``) and prints the ratios to capture off; exit 1 when a captured
round's capture did not complete cleanly, 2 for bad input. ``overhead_problems`` names those rounds.

What it deliberately does not do: record a capture to keep (``statescope capture``).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from statescope.cli.exit_codes import add_json_flag


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
    from statescope.cli.reproduce import config_overrides
    from statescope.errors import InputError
    from statescope.engine.config import EngineConfig, model_path
    from statescope.engine.runners import OfflineRunner

    modes = check_modes(_csv(args.modes, "--modes"), "--modes")
    workloads = _csv(args.workloads, "--workloads")
    overrides = config_overrides(args.set, "--set")
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
    add_json_flag(p)
    p.set_defaults(func=capture_overhead_command)
    p.epilog = ("exit status: 0 every captured round completed cleanly, 1 some did not, 2 bad "
                "input")
