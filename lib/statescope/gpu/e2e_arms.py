"""The end-to-end GPU arms of the GPU issue, built from the workbook's own pieces.

What it does: ``e2e_arms`` makes the trigger arm (prefix caching + align + MTP(2) + async scheduling,
CUDA graphs on a GPU) and the three controls (async off; prefix caching off; MTP off) from
one ``statescope.verdict.experiment.Experiment`` per control, pointed at one model with the GPU
arms' own engine settings (``gpu_extra``; the device profile adds the machine's). ``e2e_trace`` is the workload: the ``long`` GUI-agent preset repeated over seeds,
episodes renamed per seed. ``run_one_arm`` runs an arm through ``reproduce.run_arm``'s loop into a
results store and returns what the verdict needs besides the records (metrics, resolved config,
lifetimes, the arm's key and guard expectations) as a JSON-able dict, which
``statescope.verdict.rejudge.verdict_rows`` judges later from the stored records.
``prefix_sweep`` measures prefix-cache hits against prompt length in blocks (the MTP "> 2 blocks"
question) with ``statescope.workload.token_prompts.sweep_prompts``.

What it deliberately does not do: decide anything itself (``statescope.verdict`` does), time the
capture (``statescope.capture.overhead``), or drive a device job (``statescope.gpu.e2e_run``).
"""
from __future__ import annotations

import time
from typing import Any

from statescope.verdict.rejudge import CONTROLS

CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96]


def gpu_extra(capture_sizes: list[int] | None = None) -> dict:
    """What the GPU arms set beyond the device profile: few CUDA-graph sizes (a faster start;
    32 sequences x 3 tokens fit in the largest). The machine's own needs (the Triton GDN prefill
    and vLLM's samplers where FlashInfer is missing) come from the profile at every engine start
    (``statescope.patches.device_profiles``: ``cuda-triton`` on the project's H200)."""
    return {"compilation_config": {"cudagraph_capture_sizes": list(capture_sizes or CAPTURE_SIZES)}}


def e2e_arms(model: str, *, gpu: bool = True, eager: bool = False, max_num_seqs: int = 32) -> dict:
    """name -> Arm for the trigger and each control, all on ``model``: one ``Experiment`` per
    control (``statescope.verdict.experiment``), async scheduling on where the arm allows it."""
    from statescope.verdict.experiment import Experiment

    both: dict[str, Any] = {"enforce_eager": eager or not gpu, "max_num_seqs": max_num_seqs,
                            "extra": gpu_extra() if gpu else {}}
    on = {"async_scheduling": True if gpu else None}
    out = {}
    for control in CONTROLS:
        experiment = Experiment(control=control, model=str(model), both_set=both,
                                trigger_set=on, control_set={} if control == "no_async" else on,
                                flags=("GPU arms", "GPU arm trigger", f"GPU arm {control}"))
        trigger, ctl = experiment.arms()
        out.setdefault("trigger", trigger)
        out[control] = ctl
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


def prefix_sweep(runner: Any, block_size: int, vocab: int, **kw: Any) -> list[dict]:
    """Send each sweep prompt twice on a fresh prefix cache; the second's cached tokens = the hit."""
    from statescope.workload.token_prompts import sweep_prompts

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
