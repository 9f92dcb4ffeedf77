"""Where the capture's host time goes, by name: a profiled digest round and a CUDA sync check.

What it does: ``profile_round`` serves one batch under digest capture with ``cProfile`` on the
calling thread (the engine's, in-process) and lists statescope's functions by own time, then the
functions outside statescope that statescope's capture code calls (torch ops, numpy, pickle) with
the own time spent on its behalf — so the in-step host cost of ``statescope.capture.overhead``'s
ratios has names. ``sync_round`` serves one batch under digest capture with
``torch.cuda.set_sync_debug_mode("warn")`` and counts every synchronizing CUDA call whose Python
stack passes through statescope, with one stack each (a sync in a hook would cancel async
scheduling's overlap, which a host-time clock does not show).

What it deliberately does not do: time rounds for a ratio (a profiled round is slower; use
``overhead_rounds``), or run ``sync_round`` without CUDA (the debug mode is CUDA's).
"""
from __future__ import annotations

import cProfile
import os
import pstats
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

from statescope.capture.overhead import spec_for

# statescope modules that call into vLLM itself (the hooks call the wrapped originals; the runners
# call generate): time they "spend" on callees is vLLM's, not the capture's
_DRIVERS = ("statescope/capture/hooks.py", "statescope/engine/runners.py", "statescope/engine/offline.py")


def _ours(filename: str) -> bool:
    return "statescope" in filename


def profile_round(runner: Any, prompts: list, max_tokens: int, *,
                  output_dir: str | os.PathLike | None = None, top: int = 60) -> list[dict]:
    """``[{"profile_total_own_s"}, {"fn", "calls", "own_ms", "cum_ms"[, "called_by_statescope"]}...]``,
    the ``top`` rows by own time."""
    from statescope.capture import recorder

    out_dir = output_dir or Path(tempfile.gettempdir()) / "statescope_overhead"
    recorder.install(spec_for("digest", "profile", out_dir))
    runner.reset_prefix_cache()
    prof = cProfile.Profile()
    prof.enable()
    try:
        runner.generate(prompts, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    finally:
        prof.disable()
        recorder.uninstall()
    st = pstats.Stats(prof)
    rows = []
    for (fname, line, func), (_cc, nc, tt, ct, callers) in st.stats.items():  # type: ignore[attr-defined]
        name = f"{Path(fname).name}:{line}:{func}"
        if _ours(fname):
            rows.append({"fn": name, "calls": nc, "own_ms": round(tt * 1e3, 2), "cum_ms": round(ct * 1e3, 2)})
            continue
        mine = [v for (cf, _, _), v in callers.items()
                if _ours(cf) and not cf.replace(os.sep, "/").endswith(_DRIVERS)]
        if mine:  # cProfile keeps a callee's time per caller: the share statescope's code asked for
            rows.append({"fn": name, "calls": sum(v[1] for v in mine),
                         "own_ms": round(sum(v[2] for v in mine) * 1e3, 2),
                         "cum_ms": round(sum(v[3] for v in mine) * 1e3, 2), "called_by_statescope": True})
    rows.sort(key=lambda r: -r["own_ms"])
    total = sum(v[2] for v in st.stats.values())  # type: ignore[attr-defined]
    return [{"profile_total_own_s": round(total, 3)}] + rows[:top]


def sync_round(runner: Any, prompts: list, max_tokens: int, *,
               output_dir: str | os.PathLike | None = None) -> dict:
    """``{"statescope_sync_sites": {file:line: count}, "stacks": {file:line: stack}}``."""
    import torch

    from statescope.capture import recorder

    hits: dict[str, int] = {}
    stacks: dict[str, str] = {}

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
             line: Any = None) -> None:
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if _ours(f.filename)]
        if ours:
            key = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}"
            hits[key] = hits.get(key, 0) + 1
            stacks.setdefault(key, "".join(traceback.format_list(stack[-8:])) + str(message)[:200])

    out_dir = output_dir or Path(tempfile.gettempdir()) / "statescope_overhead"
    recorder.install(spec_for("digest", "sync", out_dir))
    runner.reset_prefix_cache()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show  # restored by catch_warnings
            torch.cuda.set_sync_debug_mode("warn")
            try:
                runner.generate(prompts, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        recorder.uninstall()
    return {"statescope_sync_sites": hits, "stacks": stacks}
