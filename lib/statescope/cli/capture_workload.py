"""The workloads ``statescope capture`` drives: its own short wave workload, or any ``reproduce`` trace.

What it does: ``trace_from_args(args)`` builds the trace ``reproduce`` would run from the same
options, with the same workload functions and the same refusals (``--trace FILE`` through
``statescope.workload.trace.read_trace``; ``--preset NAME [--seeds A:B] [--vision] [--geometry
G]`` through ``statescope.workload.episodes.preset_trace`` / ``seeds_trace``), or None for the
capture's own workload. ``planned_requests(args, trace)`` is the plan written into the capture
manifest before the engine steps. ``run_workload(engine, args, trace, out, on_done)`` drives it on
an in-process engine: a trace through ``statescope.engine.runners.run_waves`` (the lock-step waves
``reproduce``'s in-process runner runs, geometry padding included), its records stored under
``OUT/records/``; the short workload as waves of ``statescope.workload.guilang`` (or free-text)
episodes. ``on_done(n)`` is called after each ``generate`` call with the requests it finished —
the capture command makes their rows durable there.

What it deliberately does not do: install capture or judge a run (``statescope.cli.capture``).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

from statescope.errors import InputError


def trace_from_args(args: argparse.Namespace) -> tuple[list | None, dict]:
    """(trace, what it is) for ``--trace`` / ``--preset``; (None, {}) for the short workload."""
    from statescope.workload.episodes import parse_seeds, preset_trace, seeds_trace
    from statescope.workload.trace import read_trace

    trace_opts = [f for f, v in (("--seeds", args.seeds), ("--vision", args.vision),
                                 ("--geometry", args.geometry)) if v]
    if args.trace and args.preset:
        raise InputError("statescope capture: --trace and --preset are two workloads; give one")
    if args.trace and trace_opts:
        raise InputError(f"statescope capture: {', '.join(trace_opts)} apply to --preset traces; "
                         "a --trace file carries its own steps, images and geometry")
    if not (args.trace or args.preset):
        if trace_opts:
            raise InputError(f"statescope capture: {', '.join(trace_opts)} need --preset NAME "
                             "(the short workload has its own shape: --episodes/--steps)")
        return None, {}
    if args.trace:
        from statescope.workload.importer import read_manifest

        trace, info = read_trace(args.trace), read_manifest(args.trace) or {"trace": args.trace}
    elif args.seeds:
        trace = seeds_trace(args.preset, parse_seeds(args.seeds), vision=args.vision,
                            geometry=args.geometry)
        info = {"preset": args.preset, "seeds": args.seeds, "vision": args.vision,
                "geometry": args.geometry}
    else:
        trace = preset_trace(args.preset, vision=args.vision, geometry=args.geometry)
        info = {"preset": args.preset, "vision": args.vision, "geometry": args.geometry}
    if not trace:
        raise InputError(f"statescope capture: the workload {info} has no requests")
    return trace, info


def planned_requests(args: argparse.Namespace, trace: list | None) -> int:
    return len(trace) if trace is not None else args.episodes * args.steps


def describe(args: argparse.Namespace, trace: list | None, info: dict) -> dict:
    """The workload plan the manifest records (``workload``)."""
    if trace is None:
        return {"what": f"statescope capture --workload {args.workload}", "episodes": args.episodes,
                "waves_planned": args.steps, "requests_planned": args.episodes * args.steps,
                "max_tokens": args.max_tokens, "seed": args.seed,
                "prompt_pad_lines": args.pad_lines}
    episodes = len({s.episode for s in trace})
    return {"what": "statescope capture " + " ".join(
                f"--{k} {v}" if v is not True else f"--{k}" for k, v in info.items()
                if v not in (None, False) and k in ("trace", "preset", "seeds", "vision", "geometry")),
            "trace": {k: v for k, v in info.items() if isinstance(v, (str, int, float, bool))},
            "episodes": episodes, "requests_planned": len(trace),
            "max_tokens": max(s.max_tokens for s in trace)}


class _Counted:
    """A runner stand-in that reports each ``generate`` call's finished requests to ``on_done``."""

    def __init__(self, runner: Any, on_done: Callable[[int], None]) -> None:
        self.runner, self.on_done = runner, on_done
        self.kind = getattr(runner, "kind", "offline")
        self.config = getattr(runner, "config", None)

    def generate(self, prompts: Any, **kwargs: Any) -> list:
        out = self.runner.generate(prompts, **kwargs)
        self.on_done(len(out))
        return out


def run_workload(engine: Any, args: argparse.Namespace, trace: list | None, out: Path,
                 on_done: Callable[[int], None]) -> list:
    """Drive the workload on ``engine`` (an ``OfflineEngine``); returns its request rows."""
    if trace is not None:
        return _run_trace(engine, trace, out, on_done)
    counted = _Counted(engine, on_done)
    if args.workload == "text":
        from statescope.workload.episodes import run_episodes, shared_prefix_episodes

        return run_episodes(counted, shared_prefix_episodes(args.episodes, args.steps,
                                                            seed=args.seed),
                            max_tokens=args.max_tokens)
    from statescope.workload import guilang

    episodes = [guilang.generate_episode(args.seed * 100_003 + e, n_steps=max(3, args.steps))
                for e in range(args.episodes)]
    pad = "".join(f"(log {i}: nothing happened)\n" for i in range(args.pad_lines))
    rows = []
    for step in range(args.steps):
        records = counted.generate([pad + guilang.render_prompt(ep, step) for ep in episodes],
                                   max_tokens=args.max_tokens)
        rows += [dict(r.to_dict(), episode=e, step=step) for e, r in enumerate(records)]
    return rows


def _run_trace(engine: Any, trace: list, out: Path, on_done: Callable[[int], None]) -> list:
    from statescope.engine.runners import OfflineRunner, run_waves
    from statescope.records import ResultsStore
    from statescope.verdict.reproduce import _padder_for, replay_mode, trace_next_step
    from statescope.workload.trace import episodes_of

    runner = OfflineRunner(engine)
    store = ResultsStore(out / "records", time.strftime("capture-%Y%m%d-%H%M%S") + f"-{id(trace) % 10**6}")
    padder = _padder_for(trace, runner)
    return run_waves(_Counted(runner, on_done), list(episodes_of(trace)),
                     trace_next_step(trace, padder, replay_mode(trace)), store, build="capture",
                     config_hash="capture", max_tokens=max(s.max_tokens for s in trace),
                     all_at_once=True)
