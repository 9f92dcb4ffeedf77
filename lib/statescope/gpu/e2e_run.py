"""One end-to-end GPU arm as a device job runs it, and the capture-overhead engines of random hybrids.

What it does: ``run_e2e_arm`` runs one arm of ``statescope.gpu.e2e_arms`` (trigger or a control) over
the e2e trace into ``OUT/store``, optionally with digest capture on (installed by the vLLM plugin
when the engine starts, summarized by ``capture_summary`` and archived beside the results), a
prefix-cache sweep and the capture overhead (``arm_overhead``: ``statescope.capture.overhead``'s
interleaved rounds on the arm's own engine), and appends the arm's meta to ``OUT/arms_<job>.jsonl``
— what ``statescope gpu-arm`` and ``scripts/gpu_e2e.py arm`` run. ``large_hybrid_runner`` starts an
engine on a random-weight Qwen3.5-architecture hybrid (``load_format="dummy"``, ``LARGE_SIZES``)
in the trigger configuration, compiled with CUDA graphs and async scheduling on a GPU (eager and
4 layers x 256 on the CPU build); ``large_overhead`` measures the capture overhead on it.

What it deliberately does not do: judge (``statescope.verdict.rejudge`` re-judges the stored
records), schedule several arms in one device call or copy files off the device
(``scripts/gpu_e2e.py`` does both).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

# Random-weight hybrids for the capture overhead (load_format="dummy"): ~1.3 B and ~7 B parameters,
# so the ratio is seen where the host, then the GPU, bounds a step.
LARGE_SIZES = {"1p3b": {"layers": 24, "hidden": 2048}, "7b": {"layers": 32, "hidden": 4096}}
ARCHIVE_MAX_BYTES = 15 * 2**20  # what a device call can bring back beside the rest


def append_jsonl(path: Path, obj: dict) -> None:
    """Append one JSON line and make it durable: a job cut off at its limit keeps what it wrote."""
    with open(path, "a") as f:
        f.write(json.dumps(obj, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _block_size(resolved: dict) -> int:
    return int(resolved.get("mamba_block_size") or resolved.get("block_size"))


def arm_overhead(runner: Any, *, rounds: int = 5, max_tokens: int = 64,
                 output_dir: str | os.PathLike | None = None) -> dict:
    """Capture off vs digest on ``runner``'s engine: the decode workload's rows and ratios."""
    from statescope.capture.overhead import overhead_ratios, overhead_rounds, runner_prompts

    prompts = runner_prompts(runner, "decode")
    rows = overhead_rounds(runner, prompts, rounds=rounds, max_tokens=max_tokens,
                           output_dir=output_dir or Path(tempfile.gettempdir()) / "statescope_overhead")
    return {"rows": rows, "ratios": overhead_ratios(rows), "prompts": len(prompts),
            "prompt_tokens": [len(p) for p in prompts][:1], "max_tokens": max_tokens}


def capture_summary(run_dir: str | os.PathLike) -> dict:
    """What a trigger's capture recorded: manifest facts, requests with prefix-cache hits, accepted
    counts, the copy census and the requests with in-place conv shifts."""
    from statescope.capture.census import census_report
    from statescope.capture.store import CaptureRun
    from statescope.diverge.digest_diff import shifts_by_request

    run = CaptureRun(run_dir)
    st = run.steps()
    hits = st[st["prefix_hit_tokens"].fillna(0) > 0]
    cp = run.copies()
    return {"manifest": {k: run.manifest.get(k) for k in ("status", "mode", "vllm_version", "adapter",
                                                           "runner_class", "cudagraph_mode", "block_size",
                                                           "conv_window", "engine_steps", "census_crosscheck",
                                                           "sizes", "hook_errors")},
            "step_rows": len(st), "requests": int(st["req_id"].nunique()),
            "hit_requests": int(hits["req_id"].nunique()),
            "hit_tokens": [int(x) for x in hits["prefix_hit_tokens"]][:400],
            "accepted_mean": float(st["accepted"].dropna().mean()) if "accepted" in st else None,
            "draft_rows": int((st["num_drafts"].fillna(0) > 0).sum()) if "num_drafts" in st else None,
            "census": census_report(run.path, allow_incomplete=True),  # status is in "manifest"
            "census_paths": {"|".join(map(str, k)): int(v) for k, v in
                             cp.groupby(["path", "launch_kind", "state_kind", "kind"]).size().items()}
            if len(cp) else {},
            "in_place_shift_requests": len(shifts_by_request(run))}


def archive_capture(run_dir: str | os.PathLike, out: Path, label: str,
                    max_bytes: int = ARCHIVE_MAX_BYTES) -> dict:
    """``OUT/capture_<label>.tar.gz`` of the run; dropped (and said so) when over ``max_bytes``."""
    archive = shutil.make_archive(str(out / f"capture_{label}"), "gztar", str(run_dir))
    res: dict = {"archive_bytes": os.path.getsize(archive)}
    if res["archive_bytes"] > max_bytes:
        os.remove(archive)
        res["archive_dropped"] = True
    return res


def run_e2e_arm(model: str, arm_name: str, *, out: str | os.PathLike, label: str, job: str,
                seeds: int = 6, episodes: int | None = None, patches: Sequence[str] = (),
                capture: bool = False, sweep: bool = False, overhead: bool = False,
                gpu: bool = True, eager: bool = False, model_label: str | None = None) -> dict:
    """Run arm ``arm_name`` of ``e2e_arms(model)`` (see the module docstring); returns its meta, in
    which the model is named ``model_label`` (default: ``model`` as given; no machine paths)."""
    from statescope.engine.config import model_path
    from statescope.errors import InputError
    from statescope.gpu import e2e_arms

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    compat: list = []
    if gpu:
        from statescope.patches.qwen35_mtp_compat import enable_qwen35_text

        compat = enable_qwen35_text()
    if patches:  # statescope runtime patches, process-wide, before the engine starts
        from statescope.patches.registry import apply_patches, parse_patch

        apply_patches([parse_patch(x) for x in patches], None)
    arms = e2e_arms.e2e_arms(str(model_path(model).resolve()), gpu=gpu, eager=eager)
    if arm_name not in arms:
        raise InputError(f"arm {arm_name!r}: expected one of {sorted(arms)}")
    trace = e2e_arms.e2e_trace(range(seeds), max_episodes=episodes)
    cap_dir = str(Path(tempfile.gettempdir()) / f"statescope_caps_{label}")
    if capture:  # the plugin installs it when the engine starts (statescope.plugin.register)
        spec = Path(cap_dir + ".json")
        spec.write_text(json.dumps({"output_dir": cap_dir, "run_id": f"{label}-trigger", "mode": "digest"}))
        os.environ["STATESCOPE_CAPTURE"] = str(spec)

    def after(runner: Any) -> dict:
        from statescope.capture import recorder

        res: dict = {"compat": compat}
        if capture:
            dirs = recorder.uninstall()
            os.environ.pop("STATESCOPE_CAPTURE", None)
            res["capture"] = (dict(capture_summary(dirs[0]), **archive_capture(dirs[0], out, label))
                              if dirs else {"error": "no capture run written"})
        if sweep:
            vocab = runner.engine.llm.get_tokenizer().vocab_size
            res["sweep"] = e2e_arms.prefix_sweep(runner, _block_size(runner.resolved()), vocab,
                                                 blocks=(1, 2, 3, 4))
        if overhead:
            res["overhead"] = arm_overhead(runner)
        return res

    try:
        meta = e2e_arms.run_one_arm(arms[arm_name], trace, str(out / "store"), f"e2e_{label}", after=after)
    finally:  # an arm that failed must not leave capture on for the next engine of this process
        if capture:
            from statescope.capture import recorder

            os.environ.pop("STATESCOPE_CAPTURE", None)
            if recorder.active() is not None:
                recorder.uninstall()
    meta["label"], meta["model"], meta["patches"] = label, model_label or str(model), list(patches)
    append_jsonl(out / f"arms_{job}.jsonl", meta)
    return meta


def large_hybrid_runner(tokenizer_src: str | os.PathLike, *, cpu: bool, layers: int = 24,
                        hidden: int = 2048) -> tuple[Any, dict]:
    """``(runner, facts)``: an engine on a random-weight hybrid (see the module docstring) and its
    parameter count, conv row bytes, resolved configuration and start time."""
    from statescope.engine.config import EngineConfig
    from statescope.engine.runners import OfflineRunner
    from statescope.gpu.e2e_arms import gpu_extra
    from statescope.models import gpu_models

    if not cpu:
        from statescope.patches.qwen35_mtp_compat import enable_qwen35_text

        enable_qwen35_text()
    d = gpu_models.large_hybrid_dir(tokenizer_src,
                                    str(Path(tempfile.gettempdir()) / f"statescope_large_{layers}x{hidden}"),
                                    **({"layers": 4, "hidden": 256} if cpu else {"layers": layers, "hidden": hidden}))
    cfg = json.loads((d / "config.json").read_text())
    extra = dict(gpu_extra() if not cpu else {}, load_format="dummy")
    config = EngineConfig(model=str(d), enforce_eager=cpu, async_scheduling=True if not cpu else None,
                          kv_cache_memory_bytes=16 * 2**30 if not cpu else 512 * 2**20, extra=extra)
    runner = OfflineRunner(config)
    return runner, {"params": gpu_models.approx_params(cfg), "conv_row_bytes": gpu_models.conv_row_bytes(cfg),
                    "resolved": runner.resolved(), "startup_s": runner.engine.startup_s}


def large_overhead(tokenizer_src: str | os.PathLike, *, cpu: bool, layers: int = 24,
                   hidden: int = 2048) -> dict:
    """``large_hybrid_runner``'s facts with ``arm_overhead`` and vLLM's counters."""
    runner, res = large_hybrid_runner(tokenizer_src, cpu=cpu, layers=layers, hidden=hidden)
    try:
        res.update(arm_overhead(runner))
        res["metrics"] = runner.metrics()
    finally:
        runner.close()
    return res
