"""The end-to-end GPU arms of the GPU issue, built from the workbook's own pieces.

What it does: ``e2e_arms`` makes the trigger arm (prefix caching + align + MTP(2) + async scheduling,
CUDA graphs on a GPU) and the three controls (async off; prefix caching off; MTP off) from
``statescope.verdict.reproduce.standard_arms``, pointed at one model with the GPU engine settings
(``gpu_extra``). ``e2e_trace`` is the workload: the ``long`` GUI-agent preset repeated over seeds,
episodes renamed per seed. ``run_one_arm`` runs an arm through ``reproduce.run_arm`` into a results
store and returns what the verdict needs besides the records (metrics, resolved config, lifetimes,
the arm's key and guard expectations) as a JSON-able dict. ``verdict_rows`` rebuilds the arms from
those dicts and the stored records and judges the trigger against each control with
``reproduce.label_rows``/``summarize_arm`` and ``stats.decide`` — the same code path on the device and in
the tests that re-check committed results. ``prefix_sweep`` measures prefix-cache hits against
prompt length in blocks (the MTP "> 2 blocks" question); ``overhead_rounds``/``overhead_ratios``
time capture off vs digest in interleaved rounds on one engine and turn raw timings into ratios.

What it deliberately does not do: decide anything itself (``stats.decide`` does), or start engines
for the verdict (records are re-read).
"""
from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any, Callable

from statescope.errors import InputError

CONTROLS = ("no_async", "no_prefix_cache", "no_mtp")
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96]


def gpu_extra(capture_sizes: list[int] | None = None) -> dict:
    """vLLM settings the H200 runs need (FlashInfer is not carried; few CUDA-graph sizes)."""
    return {"additional_config": {"gdn_prefill_backend": "triton"},
            "compilation_config": {"cudagraph_capture_sizes": list(capture_sizes or CAPTURE_SIZES)}}


def e2e_arms(model: str, *, gpu: bool = True, eager: bool = False, max_num_seqs: int = 32) -> dict:
    """name -> Arm for the trigger and each control, all on ``model``."""
    from statescope.verdict.reproduce import standard_arms

    arms = {}
    for control in CONTROLS:
        trigger, ctl = standard_arms(control)
        arms.setdefault("trigger", trigger)
        arms[control] = ctl
    out = {}
    for name, arm in arms.items():
        changes: dict[str, Any] = {"model": str(model), "enforce_eager": eager or not gpu,
                                   "max_num_seqs": max_num_seqs, "extra": gpu_extra() if gpu else {}}
        if name in ("trigger", "no_prefix_cache", "no_mtp"):
            changes["async_scheduling"] = True if gpu else None
        out[name] = dataclasses.replace(arm, config=arm.config.replace(**changes))
    return out


def e2e_trace(seeds: range | list[int] = range(6), preset: str = "long",
              max_episodes: int | None = None) -> list:
    """The ``preset`` GUI-agent trace for each seed (``statescope.workload.episodes.seeds_trace``)."""
    from statescope.workload.episodes import seeds_trace

    return seeds_trace(preset, seeds, max_episodes=max_episodes)


def run_one_arm(arm: Any, trace: list, store_root: str, run_id: str, *,
                after: Any = None) -> dict:
    """Run ``arm`` over ``trace`` into ``store_root/run_id``; the arm's meta (JSON-able).

    The loop is ``reproduce.run_arm``'s (one fresh engine, ``run_waves`` over every episode with
    ``trace_next_step``), kept open so that ``after(runner)`` can measure more on the same engine
    once the arm's metrics are read; its return value goes under ``after``.
    """
    from statescope.verdict.reproduce import trace_next_step
    from statescope.engine.runners import OfflineRunner, run_waves
    from statescope.records import ResultsStore
    from statescope.workload.trace import episodes_of

    t0 = time.perf_counter()
    episodes = list(episodes_of(trace))
    store = ResultsStore(store_root, run_id)
    with store:
        store.start(resolved_config={"arm": arm.name, "config": arm.config.to_dict()})
        runner = OfflineRunner(arm.config)
        try:
            startup = getattr(runner.engine, "startup_s", None)
            t1 = time.perf_counter()
            run_waves(runner, episodes, trace_next_step(trace), store, build=arm.name,
                      config_hash=arm.key(), max_tokens=max(s.max_tokens for s in trace))
            workload_s = time.perf_counter() - t1
            metrics, resolved = runner.metrics(), runner.resolved()
            extra = after(runner) if after is not None else None
        finally:
            runner.close()
    return {"arm": arm.name, "key": arm.key(), "expect_prefix_cache": arm.expect_prefix_cache,
            "expect_spec": arm.expect_spec, "config": arm.config.to_dict(), "metrics": metrics,
            "resolved": resolved, "lifetimes": {ep: 0 for ep in episodes}, "startup_s": startup,
            "workload_s": workload_s, "wall_s": time.perf_counter() - t0, "after": extra}


def _arm_run(meta: dict, records: list[dict]) -> Any:
    from statescope.engine.config import EngineConfig
    from statescope.verdict.reproduce import Arm, ArmRun

    arm = Arm(meta["arm"], EngineConfig(), expect_prefix_cache=meta["expect_prefix_cache"],
              expect_spec=meta["expect_spec"])
    rows = [r for r in records if r["build"] == meta["arm"] and r["config_hash"] == meta["key"]]
    return ArmRun(arm, rows, engagement_metrics(meta["metrics"], rows), meta["resolved"],
                  meta["lifetimes"], run_dir=meta.get("source"))


def engagement_metrics(metrics: dict, rows: list[dict]) -> dict:
    """vLLM's counters with the guard pairs from the best source (``statescope.resolved``)."""
    from statescope.resolved import engagement_metrics as best

    return best(metrics, rows)


def verdict_rows(metas: list[dict], records: list[dict], *, unit: str = "episode",
                 alpha: float = 0.01, label: str = "") -> list[dict]:
    """Trigger vs each control present: one row per pair with outcome, counts, p and guards."""
    from statescope.workload import guilang
    from statescope.verdict.reproduce import check_comparable, label_rows, summarize_arm
    from statescope.verdict.stats import decide

    by_name = {m["arm"]: m for m in metas}
    if "trigger" not in by_name:
        return [{"model": label, "control": c, "outcome": "not run (trigger arm missing)"}
                for c in CONTROLS]
    trg = _arm_run(by_name["trigger"], records)
    out = []
    for control in CONTROLS:
        if control not in by_name:
            out.append({"model": label, "control": control, "outcome": "not run"})
            continue
        ctl = _arm_run(by_name[control], records)
        check_comparable(trg, ctl)  # refuses arms that share no request (other seeds)
        # As reproduce() does: grade action syntax only when the control speaks the language.
        valid = [guilang.is_valid_action(r["text"]) for r in ctl.rows]
        check = guilang.is_valid_action if valid and sum(valid) / len(valid) >= 0.9 else None
        v = decide(summarize_arm(trg, label_rows(trg, ctl, action_validator=check), unit),
                   summarize_arm(ctl, label_rows(ctl, None, action_validator=check), unit), alpha=alpha)
        out.append({"model": label, "control": control, "outcome": v.outcome, "unit": unit,
                    "trigger_failed": v.trigger.n_failed_units, "trigger_units": v.trigger.n_units,
                    "control_failed": v.control.n_failed_units, "control_units": v.control.n_units,
                    "fisher_p": v.fisher_p, "action_syntax_graded": check is not None,
                    "guards": {g.name: g.passed for g in v.guards},
                    "guard_details": {g.name: g.detail for g in v.guards}})
    return out


def sweep_prompts(block_size: int, vocab: int, *, blocks: tuple = (1, 2, 3, 4, 5),
                  offsets: tuple | None = None, seed: int = 0) -> list[tuple[int, int, list[int]]]:
    """(full blocks, extra tokens, token ids): distinct random prompts of ``m * bs + r`` tokens."""
    if block_size <= 0 or vocab <= 8:
        raise InputError(f"sweep_prompts: expected block_size > 0 and vocab > 8, got {block_size}, {vocab}")
    rng = random.Random(seed)
    offsets = offsets if offsets is not None else (0, 1, block_size // 2)
    return [(m, r, [rng.randrange(0, vocab - 8) for _ in range(m * block_size + r)])
            for m in blocks for r in offsets]


def prefix_sweep(runner: Any, block_size: int, vocab: int, **kw: Any) -> list[dict]:
    """Send each sweep prompt twice on a fresh prefix cache; the second's cached tokens = the hit."""
    runner.reset_prefix_cache()
    rows = []
    for m, r, ids in sweep_prompts(block_size, vocab, **kw):
        first = runner.generate([ids], max_tokens=4, logprobs=0)[0]
        second = runner.generate([ids], max_tokens=4, logprobs=0)[0]
        rows.append({"block_size": block_size, "full_blocks": m, "extra_tokens": r,
                     "prompt_tokens": len(ids), "cached_first": first.num_cached_tokens,
                     "cached_second": second.num_cached_tokens,
                     "hit_blocks": second.num_cached_tokens // block_size})
    return rows


def overhead_rounds(runner: Any, prompts: list, *, rounds: int = 5, max_tokens: int = 64,
                    capture_dir: str, modes: tuple = ("off", "digest"),
                    clock: Callable[[], Any] | None = None) -> list[dict]:
    """Interleaved timed rounds per capture mode on one engine (one warm-up round per mode first).
    ``clock``: makes an object with ``attach(recorder)`` and ``seconds`` (the capture's own host
    time, e.g. benchmarks/bench_capture.CaptureClock); its seconds and the run's engine steps are
    added to each captured round, so a ratio can be explained in host milliseconds per step."""
    from statescope.capture import recorder as capture
    from statescope.capture.store import CaptureRun

    out = []
    for r in range(-1, rounds):
        for mode in modes:
            runner.reset_prefix_cache()
            timer = None
            if mode != "off":
                rec = capture.install({"output_dir": capture_dir, "run_id": f"{mode}{r}", "mode": mode,
                                       "full": {"first_steps": 1}})
                if clock is not None:
                    timer = clock()
                    timer.attach(rec)
            t0 = time.perf_counter()
            recs = runner.generate(prompts, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
            dt = time.perf_counter() - t0  # generate returns finished outputs: the device work is done
            dirs = capture.uninstall() if mode != "off" else []
            if r >= 0:
                row = {"mode": mode, "round": r, "seconds": dt,
                       "tokens": sum(len(x.output_token_ids) for x in recs)}
                if timer is not None:
                    row["capture_host_s"] = timer.seconds
                if dirs:  # which digest kernel ran: a ratio is only meaningful with its path named
                    man = CaptureRun(dirs[-1]).manifest
                    row["engine_steps"], row["digest_kernel"] = man.get("engine_steps"), man.get("digest_kernel")
                out.append(row)
    return out


def overhead_ratios(rows: list[dict]) -> dict:
    """Per mode: median and best tokens/s, and their ratios to capture off."""
    rates: dict[str, list[float]] = {}
    for r in rows:
        rates.setdefault(r["mode"], []).append(r["tokens"] / r["seconds"])
    if "off" not in rates:
        raise InputError("overhead rows: expected an 'off' mode to compare against")
    med_off, best_off = statistics.median(rates["off"]), max(rates["off"])
    return {m: {"median_tok_s": statistics.median(v), "best_tok_s": max(v),
                "ratio_median": statistics.median(v) / med_off, "ratio_best": max(v) / best_off,
                "rounds": len(v)} for m, v in rates.items()}
