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
episodes, each prompt ending 1-3 tokens before a Mamba block boundary (``--prompt-ends before``,
the default) and decoding ``--max-tokens`` tokens past EOS unless ``--stop-at-eos``. ``on_done(n)`` is called after each ``generate`` call with the requests it finished —
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
        raise InputError("--trace and --preset are two workloads; give one")
    if args.trace and trace_opts:
        raise InputError(f"{', '.join(trace_opts)} apply to --preset traces; "
                         "a --trace file carries its own steps, images and geometry")
    if not (args.trace or args.preset):
        if trace_opts:
            raise InputError(f"{', '.join(trace_opts)} need --preset NAME "
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
        raise InputError(f"the workload {info} has no requests")
    return trace, info


def planned_requests(args: argparse.Namespace, trace: list | None) -> int:
    return len(trace) if trace is not None else args.episodes * args.steps


def describe(args: argparse.Namespace, trace: list | None, info: dict) -> dict:
    """The workload plan the manifest records (``workload``)."""
    if trace is None:
        return {"what": f"statescope capture --workload {args.workload}", "episodes": args.episodes,
                "waves_planned": args.steps, "requests_planned": args.episodes * args.steps,
                "max_tokens": args.max_tokens, "seed": args.seed,
                "prompt_ends": args.prompt_ends, "history_lines": args.history_lines, "ignore_eos": not args.stop_at_eos}
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
    block = _align_unit(engine) if args.prompt_ends == "before" else None
    tok = engine.llm.get_tokenizer()
    rows = []
    for step in range(args.steps):
        prompts = [_ending_before(tok, _with_history(guilang.render_prompt(ep, step), args.history_lines),
                                  block, (e + step) % 3) for e, ep in enumerate(episodes)]
        records = counted.generate(prompts, max_tokens=args.max_tokens,
                                   ignore_eos=not args.stop_at_eos)
        rows += [dict(r.to_dict(), episode=e, step=step) for e, r in enumerate(records)]
    return rows


def _with_history(text: str, lines: int) -> str:
    """``lines`` log lines opening the first user turn: the same in every step of an episode, they
    lengthen the history that each step shares with the previous one (a prefix-cache hit needs
    two shared blocks under MTP: vLLM drops the last one)."""
    if not lines:
        return text
    at = text.find("<|im_start|>user\n")
    at = at + len("<|im_start|>user\n") if at >= 0 else 0
    return text[:at] + "".join(f"(log {i}: nothing happened)\n" for i in range(lines)) + text[at:]


def _align_unit(engine: Any) -> int:
    resolved = engine.resolved()
    return int(resolved.get("mamba_block_size") or resolved.get("block_size"))


FILLER = "~"  # one token a character in the embedded tokenizers; checked by the length loop below


def _ending_before(tok: Any, text: str, block: int | None, gap: int) -> list[int]:
    """The prompt's token ids; with ``block``, filler inserted before its last turn's end so that
    the prompt ends ``1 + gap`` tokens before a block boundary: its first decode steps cross the
    boundary with 1-3 accepted tokens (block crossings, in-place conv shifts). The filler sits
    inside the last turn, so the next step's prompt still extends this one's history (prefix-cache
    hits)."""
    ids = list(tok.encode(text, add_special_tokens=False))
    if block is None:
        return ids
    cut = text.rfind("<|im_end|>")
    cut = cut if cut > 0 else len(text)
    n = (block - 1 - gap - len(ids)) % block
    for _ in range(4):  # a filler can merge with its neighbours: re-measure and adjust
        ids = list(tok.encode(text[:cut] + FILLER * n + text[cut:], add_special_tokens=False))
        miss = (block - 1 - gap - len(ids)) % block
        if miss == 0:
            break
        n += miss if miss < block // 2 else miss - block
    return ids


def _run_trace(engine: Any, trace: list, out: Path, on_done: Callable[[int], None]) -> list:
    from statescope.engine.runners import OfflineRunner, run_waves
    from statescope.records import ResultsStore
    from statescope.verdict.reproduce import padder_for, replay_mode, trace_next_step
    from statescope.workload.trace import episodes_of

    runner = OfflineRunner(engine)
    store = ResultsStore(out / "records", time.strftime("capture-%Y%m%d-%H%M%S") + f"-{id(trace) % 10**6}")
    padder = padder_for(trace, runner)
    return run_waves(_Counted(runner, on_done), list(episodes_of(trace)),
                     trace_next_step(trace, padder, replay_mode(trace)), store, build="capture",
                     config_hash="capture", max_tokens=max(s.max_tokens for s in trace),
                     all_at_once=True)
