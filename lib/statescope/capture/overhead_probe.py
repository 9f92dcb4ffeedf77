"""The capture-overhead probe of one engine: timed rounds per workload, then where the host time goes.

What it does: ``probe_engine`` runs ``statescope.capture.overhead.probe_workloads`` (interleaved
timed rounds per capture mode, for the ``decode`` and/or ``gui`` workloads) and, time allowing,
``profile_round`` and ``sync_round``, and returns one JSON-able document (the format of
``overhead_probe.json`` per engine, and of ``statescope capture-overhead --json``).
``profile_round`` serves one batch under digest capture with ``cProfile`` on the calling thread
(the engine's, in-process) and lists statescope's functions by own time, then the functions outside
statescope that statescope's capture code calls (torch ops, numpy, pickle) with the own time spent
on its behalf — so the in-step host cost behind a ratio has names. ``sync_round`` serves one batch
under digest capture with ``torch.cuda.set_sync_debug_mode("warn")`` and counts every synchronizing
CUDA call whose Python stack passes through statescope, with one stack each (a sync in a hook would
cancel async scheduling's overlap, which a host-time clock does not show).

What it deliberately does not do: start engines (``statescope.gpu.e2e_run.large_hybrid_runner``,
``statescope capture-overhead``), time a ratio from a profiled round (it is slower), or run
``sync_round`` without CUDA (the debug mode is CUDA's).
"""
from __future__ import annotations

import cProfile
import os
import pstats
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from statescope.capture.overhead import probe_workloads, runner_prompts, spec_for

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


def probe_engine(runner: Any, *, workloads: tuple = ("decode",), modes: tuple = ("off", "digest"),
                 rounds: int = 6, max_tokens: int = 160, gui_max_tokens: int = 64,
                 gui_shape: dict | None = None, deadline: float | None = None,
                 output_dir: str | os.PathLike | None = None, profile: bool = True, sync: bool = True,
                 on_workload: Any = None) -> dict:
    """``{"workloads": {...}, <the first workload's part>, "profile", "sync", "metrics"}``: the
    first workload stays at the top level (as the probe files before workloads had it); the profile
    (40 s before ``deadline``) and sync (30 s before, CUDA only) rounds use the last workload's
    prompts."""
    import torch

    res: dict = {"workloads": probe_workloads(
        runner, workloads=workloads, modes=modes, rounds=rounds, max_tokens=max_tokens,
        gui_max_tokens=gui_max_tokens, gui_shape=gui_shape, deadline=deadline, output_dir=output_dir,
        on_workload=on_workload)}
    res.update(res["workloads"][workloads[0]])
    prompts = runner_prompts(runner, workloads[-1], gui_shape)
    if profile and (deadline is None or time.time() < deadline - 40):
        res["profile"] = profile_round(runner, prompts, max_tokens, output_dir=output_dir)
    if sync and torch.cuda.is_available() and (deadline is None or time.time() < deadline - 30):
        res["sync"] = sync_round(runner, prompts, max_tokens, output_dir=output_dir)
    res["metrics"] = runner.metrics()
    return res

