"""What the capture costs in throughput: timed rounds per capture mode on one engine, and their ratios.

What it does: ``timed_round`` serves one batch of prompts with one capture mode (``MODES``: ``off``
= no hooks at all; ``hooks`` = every hook and the step bookkeeping, no request selected; ``digest``
= the CUDA-graph digest, rows made when the engine idles; ``digest_eager`` = the digest launched
eagerly; ``digest_bg`` = rows made by the flusher thread while the engine steps; ``digest+drafts``
= the speculative columns too; ``full`` = snapshots of each request's first 2 steps) on a fresh
prefix cache, and returns its wall seconds, tokens, process CPU seconds and — with capture on —
the capture's own thread-CPU seconds split by sink method (``statescope.capture.clock``), the
close's cost and what the run's manifest says ran (status, hook errors, digest kernel, engine
steps). ``overhead_rounds`` interleaves the modes round by round (one warm-up round per mode
first), so drift on a machine hits every mode alike. ``overhead_ratios`` turns rows into ratios to
capture off: of medians, of bests, and paired by round (round k of a mode over round k of off)
with the distribution-free interval of the paired median (``statescope.verdict.stats.median_interval``,
from 6 pairs), plus the capture's host milliseconds per engine step. ``probe_workloads`` runs the
rounds for the ``decode`` and/or ``gui`` workloads (``statescope.workload.token_prompts``) within a
deadline; ``same_digests`` checks that the graph and eager digests of the last rounds agree.

What it deliberately does not do: start or configure engines (it takes any runner with
``generate``/``reset_prefix_cache``), or judge a ratio against a goal
(``statescope.results.overhead`` reads committed probes against issue 7's goal).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

from statescope.errors import InputError

MODES = ("off", "hooks", "digest", "digest_eager", "digest_bg", "digest+drafts", "full")
WORKLOADS = ("decode", "gui")
MIN_PAIRS_FOR_INTERVAL = 6  # fewer paired rounds cannot give a 95 % order-statistic interval
NO_REQUEST = "no-such-request"  # an id no offline request has: hooks run, nothing is selected


def check_modes(modes: Iterable[str], where: str = "modes") -> tuple[str, ...]:
    """``modes`` as a tuple, ``off`` first (the ratios' base); an ``InputError`` otherwise."""
    modes = tuple(modes)
    if not modes or modes[0] != "off" or not set(modes) <= set(MODES) or len(set(modes)) != len(modes):
        raise InputError(f"{where}: expected 'off' first, then distinct modes of {MODES}, got {list(modes)}")
    return modes


def spec_for(mode: str, run_id: str, output_dir: str | os.PathLike) -> dict | None:
    """The capture spec of ``mode`` (None for ``off``)."""
    if mode not in MODES:
        raise InputError(f"capture mode {mode!r}: expected one of {MODES}")
    if mode == "off":
        return None
    spec: dict = {"output_dir": str(output_dir), "run_id": run_id,
                  "mode": "full" if mode == "full" else "digest"}
    if mode == "hooks":
        spec["requests"] = {"ids": [NO_REQUEST]}
    elif mode == "digest_bg":
        spec["emit"] = "background"
    elif mode == "digest+drafts":
        spec["draft_columns"] = True
    elif mode == "full":
        spec["full"] = {"first_steps": 2}
    return spec


def _run_facts(run_dir: Path, mode: str) -> dict:
    """What the run's manifest says ran; a ratio is only meaningful with its digest path named."""
    from statescope.capture.store import CaptureRun

    run = CaptureRun(run_dir)
    man = run.manifest
    facts = {"engine_steps": man.get("engine_steps"), "digest_kernel": man.get("digest_kernel"),
             "status": man.get("status"), "hook_errors": int(man.get("error_count") or 0),
             "block_table_source": man.get("block_table_source")}
    if mode != "hooks":
        digests = run.digests()
        facts["digest_rows"] = 0 if digests is None else len(digests)
    facts.update(digest_graph=man.get("digest_graph"), emit=man.get("emit"),
                 emit_ms_total=man.get("emit_ms_total"), run_dir=str(run_dir),
                 capture_bytes=run.size_bytes())
    return facts


def timed_round(runner: Any, prompts: list, mode: str, *, run_id: str, max_tokens: int,
                output_dir: str | os.PathLike, count_close: bool = False) -> dict:
    """One round of ``prompts`` under capture ``mode`` (see the module docstring).

    ``seconds`` is the wall time of ``generate`` (its outputs are finished, so the device work is
    done); with ``count_close`` it also holds the capture's close (where rows of an idle-emission run
    are made), as ``close_counted`` says."""
    from statescope.capture import recorder
    from statescope.capture.clock import CLOCK, CaptureClock
    from statescope.capture.digest_graph import ENV_GRAPH

    spec = spec_for(mode, run_id, output_dir)
    clock = None
    graph_env = os.environ.get(ENV_GRAPH)
    try:
        if spec is not None:
            os.environ[ENV_GRAPH] = "0" if mode == "digest_eager" else "1"  # read when the run starts
            rec = recorder.install(spec)
            clock = CaptureClock()
            CLOCK[:] = [clock]  # the flusher's emission is timed through this list
            clock.attach(rec)
        runner.reset_prefix_cache()
        t0, c0 = time.perf_counter(), time.process_time()
        outputs = runner.generate(prompts, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
        seconds = time.perf_counter() - t0
        row = {"mode": mode, "seconds": seconds, "tokens": sum(len(r.output_token_ids) for r in outputs)}
        if clock is not None:
            in_run = clock.seconds
            t1, th1 = time.perf_counter(), time.thread_time()
            dirs = recorder.uninstall()
            row["close_s"] = time.perf_counter() - t1
            row["capture_host_s"] = clock.seconds  # the emission at close included
            row["capture_cpu_s"] = in_run + time.thread_time() - th1  # the whole close included
            row["by_name_ms"] = {k: round(v * 1e3, 2) for k, v in sorted(clock.by_name.items())}
            if count_close:
                row["seconds"] = seconds + row["close_s"]
        row["cpu_seconds"] = time.process_time() - c0  # before the run is read back below
        row["close_counted"] = bool(count_close and clock is not None)
        if clock is not None and dirs:
            row.update(_run_facts(Path(dirs[-1]), mode))
    finally:
        CLOCK[:] = []
        if spec is not None:
            if recorder.active() is not None:  # generate raised: leave no hooks behind
                recorder.uninstall()
            if graph_env is None:
                os.environ.pop(ENV_GRAPH, None)
            else:
                os.environ[ENV_GRAPH] = graph_env
    return row


def overhead_rounds(runner: Any, prompts: list, *, modes: Iterable[str] = ("off", "digest"),
                    rounds: int = 5, max_tokens: int = 64, output_dir: str | os.PathLike | None = None,
                    label: str = "", warmup: bool = True, stop_at: float | None = None,
                    count_close: bool = False) -> list[dict]:
    """Interleaved timed rounds (``round`` 0..rounds-1), each mode once per round, after one
    warm-up round per mode (Triton compile, pinned pools, graphs). ``stop_at`` (a ``time.time()``)
    ends the rounds early: whole rounds only, so every mode has the same pairs."""
    modes = check_modes(modes)
    if rounds < 1 or max_tokens < 1:
        raise InputError(f"overhead_rounds: expected rounds >= 1 and max_tokens >= 1, got {rounds}, {max_tokens}")
    out_dir = Path(output_dir or Path(tempfile.gettempdir()) / "statescope_overhead")
    prefix = f"{label}-" if label else ""
    kw = dict(max_tokens=max_tokens, output_dir=out_dir, count_close=count_close)
    if warmup:
        for mode in modes:
            timed_round(runner, prompts, mode, run_id=f"warm-{prefix}{mode}", **kw)
    rows = []
    for r in range(rounds):
        if stop_at is not None and time.time() > stop_at:
            break
        for mode in modes:
            rows.append(dict(timed_round(runner, prompts, mode, run_id=f"{prefix}{mode}{r}", **kw), round=r))
    return rows


def _rates(rows: list[dict], mode: str) -> list[float]:
    return [r["tokens"] / r["seconds"] for r in rows if r["mode"] == mode]


def paired_ratios(rows: list[dict], mode: str, base: str = "off") -> list[float]:
    """Round k of ``mode`` over round k of ``base`` (by ``round`` when every row has one, else in
    row order), tokens per second."""
    mine = [r for r in rows if r["mode"] == mode]
    ref = [r for r in rows if r["mode"] == base]
    if all("round" in r for r in mine + ref):
        by_ref = {r["round"]: r["tokens"] / r["seconds"] for r in ref}
        return [r["tokens"] / r["seconds"] / by_ref[r["round"]] for r in mine if r["round"] in by_ref]
    return [a / b for a, b in zip(_rates(mine, mode), _rates(ref, base))]


def _median_per_step(rs: list[dict], value: Any) -> float:
    return statistics.median(value(r) / r["engine_steps"] for r in rs if r.get("engine_steps"))


def overhead_ratios(rows: list[dict], modes: Iterable[str] | None = None) -> dict[str, dict]:
    """Per mode (default: every mode in ``rows``, in order): throughput and its ratios to ``off``
    (see the module docstring); the capture's costs where the rows carry them."""
    from statescope.intervals import median_interval

    modes = list(modes) if modes is not None else list(dict.fromkeys(r["mode"] for r in rows))
    off = _rates(rows, "off")
    if not off:
        raise InputError("overhead rows: expected an 'off' mode to compare against")
    off_cpu = [r["cpu_seconds"] for r in rows if r["mode"] == "off" and "cpu_seconds" in r]
    out = {}
    for m in modes:
        rs = [r for r in rows if r["mode"] == m]
        rates = _rates(rows, m)
        if not rates:
            raise InputError(f"overhead rows: mode {m!r} has no rows")
        paired = paired_ratios(rows, m)
        s = {"median_tok_s": statistics.median(rates), "best_tok_s": max(rates),
             "ratio_median": statistics.median(rates) / statistics.median(off),
             "ratio_best": max(rates) / max(off), "rounds": len(rates)}
        if paired:
            s["paired_ratio_median"] = statistics.median(paired)
            s["paired_ratios"] = [round(x, 4) for x in paired]
        if m != "off" and len(paired) >= MIN_PAIRS_FOR_INTERVAL:
            lo, hi, cov = median_interval(paired)
            s["paired_ratio_ci"] = {"lo": round(lo, 4), "hi": round(hi, 4), "coverage": round(cov, 4)}
        closes = [r["close_s"] for r in rs if r.get("close_s") is not None]
        if closes:
            s["close_s_median"] = statistics.median(closes)
            if any(r.get("engine_steps") for r in rs):
                s["emit_ms_per_step"] = _median_per_step(rs, lambda r: r.get("emit_ms_total") or 0)
            s["digest_graph"] = sorted({str(r.get("digest_graph")) for r in rs})
        timed = [r for r in rs if r.get("engine_steps") and r.get("capture_host_s") is not None]
        if timed:
            s["capture_host_ms_per_step"] = _median_per_step(timed, lambda r: r["capture_host_s"] * 1e3)
            names = sorted({k for r in timed for k in r.get("by_name_ms", {})})
            s["by_name_ms_per_step"] = {k: round(_median_per_step(
                timed, lambda r: r.get("by_name_ms", {}).get(k, 0)), 4) for k in names}
        cpu = [r for r in rs if r.get("cpu_seconds")]
        if cpu and off_cpu:  # the capture's CPU seconds over an off round's: the shared machine's noise out
            s["ratio_cpu_time"] = (max(r["tokens"] / r["cpu_seconds"] for r in cpu)
                                   / max(r["tokens"] / r["cpu_seconds"] for r in rows
                                         if r["mode"] == "off" and r.get("cpu_seconds")))
            s["capture_cpu_share"] = (statistics.median(r.get("capture_cpu_s", 0.0) for r in cpu)
                                      / statistics.median(off_cpu))
        if rs and "capture_bytes" in rs[-1]:
            s["capture_bytes"] = rs[-1]["capture_bytes"]
        out[m] = s
    return out


def same_digests(rows: list[dict]) -> dict | None:
    """The last ``digest`` round (graph) vs the last ``digest_eager`` round: checksums per (prompt,
    request step, layer, kind, column) — a graph replay must see exactly what eager launches see."""
    from statescope.capture.store import CaptureRun

    last = {r["mode"]: r["run_dir"] for r in rows if r.get("run_dir")}
    if not {"digest", "digest_eager"} <= set(last):
        return None
    key = ["prompt_sha", "req_step", "layer", "kind", "column_offset"]
    try:
        a, b = (CaptureRun(last[m]).digests().set_index(key)["checksum"] for m in ("digest", "digest_eager"))
    except Exception as exc:  # a probe's result must not be lost to its own check
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    both = a.to_frame("graph").join(b.to_frame("eager"), how="inner")
    return {"rows_graph": len(a), "rows_eager": len(b), "rows_compared": len(both),
            "identical": int((both["graph"] == both["eager"]).sum())}


def workload_prompts(workload: str, block_size: int, vocab: int, gui_shape: dict | None = None) -> list:
    """The probe's prompts: ``decode`` = 32 prompts of one block + 0..31 tokens; ``gui`` = 4 agents
    x 8 steps sharing a 2,048-token history (``gui_shape`` overrides ``gui_prompts``' sizes)."""
    from statescope.workload.token_prompts import decode_prompts, gui_prompts

    if workload == "decode":
        return decode_prompts(block_size, vocab)
    if workload == "gui":
        return gui_prompts(vocab, **(gui_shape or {}))
    raise InputError(f"workload {workload!r}: expected one of {WORKLOADS}")


def runner_prompts(runner: Any, workload: str, gui_shape: dict | None = None) -> list:
    """``workload_prompts`` for the engine behind ``runner``: its resolved Mamba block size (the
    block size when none) and its tokenizer's vocabulary."""
    resolved = runner.resolved()
    block_size = int(resolved.get("mamba_block_size") or resolved.get("block_size"))
    return workload_prompts(workload, block_size, runner.engine.llm.get_tokenizer().vocab_size, gui_shape)


def probe_workloads(runner: Any, *, workloads: Iterable[str] = ("decode",),
                    modes: Iterable[str] = ("off", "digest"), rounds: int = 6, max_tokens: int = 160,
                    gui_max_tokens: int = 64, gui_shape: dict | None = None,
                    deadline: float | None = None, output_dir: str | os.PathLike | None = None,
                    on_workload: Any = None) -> dict:
    """``{workload: {rows, summary, prompts, prompt_tokens, max_tokens, graph_vs_eager}}`` on one
    engine; each workload gets a fair share of the time left before ``deadline`` (10 s kept for
    the next, 60 s after the last: the caller's profile rounds). ``on_workload(name, part)`` is
    called as each finishes (a probe writes its file there)."""
    workloads, modes = tuple(workloads), check_modes(modes)
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        raise InputError(f"workloads: expected some of {WORKLOADS}, got {list(workloads)}")
    out: dict = {}
    for i, wl in enumerate(workloads):
        stop_at = None
        if deadline is not None:  # a fair share of what is left, less what the next one needs
            share = time.time() + (deadline - time.time()) / (len(workloads) - i)
            stop_at = share - (60 if i == len(workloads) - 1 else 10)
        prompts = runner_prompts(runner, wl, gui_shape)
        mt = gui_max_tokens if wl == "gui" else max_tokens
        rows = overhead_rounds(runner, prompts, modes=modes, rounds=rounds, max_tokens=mt,
                               output_dir=output_dir, label=wl, stop_at=stop_at)
        part: dict = {}
        done = len({r["round"] for r in rows})
        if done < rounds:
            part["stopped_early_after_rounds"] = done
        part.update(rows=rows, summary=overhead_ratios(rows, modes) if rows else {},
                    prompts=len(prompts), prompt_tokens=sorted({len(p) for p in prompts}),
                    max_tokens=mt, graph_vs_eager=same_digests(rows))
        out[wl] = part
        if on_workload is not None:
            on_workload(wl, part)
    return out
