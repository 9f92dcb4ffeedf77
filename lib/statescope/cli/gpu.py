"""``statescope gpu-results``, ``gpu-arm`` and ``racecheck``: the GPU verdicts, re-derived and run.

``statescope gpu-results [DIR] [--json]``: the committed GPU verdicts, re-derived, in a terminal.

What it does: for a results folder written by ``statescope.results.files.collect`` (default: the
factor check, ``data/results/gpu/e2e_factors/``) it recomputes the trigger-vs-control verdicts from
the records and lists the trigger's departed requests against the async-off control; where the
folder holds a ``factors/`` set it adds the factor check; for the patch check (``e2e_patch_check``:
the trigger with and without the ``accept_sync`` patch) the patched-vs-unpatched verdicts against
the factor check's controls; for the capture-overhead probes (``overhead_graph_digest``,
``overhead_compact_record``) the throughput ratios and the goal check
(``statescope.results.overhead``); for a folder of ``statescope reproduce`` runs (``data/results/gpu/cli``)
each seed set's verdict and the pooled one per trigger-vs-control pair. Exit status
(``statescope.cli.exit_codes``): 1 when a verdict is not "no evidence" (corruption detected or a
guard failed; for reproduce runs the pooled verdict decides), 0 otherwise, 2 for a folder that
is not a results folder.

``statescope gpu-arm`` runs one of those arms (``statescope.gpu.e2e_run.run_e2e_arm``: trigger or a
control on a model, with capture, prefix sweep and capture overhead on request) into a results
folder, as the device jobs do; ``statescope racecheck`` probes the copy kernel.

What it deliberately does not do: judge while running (``gpu-results`` re-judges the stored records),
or read the capture archives (``statescope continuity`` / ``diverge`` / ``localize`` do).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from statescope.cli.exit_codes import add_json_flag, exit_epilog, shown_choices
from statescope.errors import InputError
from statescope.gpu.racecheck import (positive_int, preset_shift_classes, racecheck_table,
                                      require_cuda, sweep_shift_classes)


def gpu_results_report(d: Path) -> dict:
    """{"manifest", "verdicts", "departures", "factors", "patch"} for results folder ``d``."""
    from statescope.results import e2e
    from statescope.results import files
    from statescope.results import factors
    from statescope.results import patch_check

    d = Path(d)
    if not any(d.glob("arms_*.jsonl")):
        raise InputError(f"{d}: expected a GPU results folder with arms_*.jsonl (see data/results/gpu/README.md)")
    man = files.manifest(d) if (d / "manifest.json").is_file() else {}
    arms = {m["arm"] for m in files.arms(d) if m.get("label") == "tiny-gui"}
    patch = {}
    if (d / f"records_{patch_check.ARMS['accept_sync']}.jsonl").is_file():  # the patch check's layout
        patch = {"verdicts": [{k: v for k, v in r.items() if k != "guard_details"}
                              for r in patch_check.patch_verdicts(d)],
                 "table": patch_check.patch_table(d),
                 "patched_vs_unpatched": patch_check.patched_vs_unpatched(d)}
    return {"dir": str(d), "patch": patch,
            "manifest": {k: man.get(k) for k in ("vllm", "torch", "gpu", "driver", "date_utc")},
            "verdicts": patch.get("verdicts") or [{k: v for k, v in r.items() if k != "guard_details"}
                                                  for r in e2e.verdict_table(d)],
            "departures": factors.departures(d) if {"trigger", "no_async"} <= arms else [],
            "factors": factors.factor_table(d) if (d / "factors").is_dir() else []}


def gpu_results_command(args: Any) -> int:
    from statescope.results import factors
    from statescope.verdict.stats import NO_EVIDENCE

    from statescope.results import overhead

    d = Path(args.dir) if args.dir else factors.FACTORS_DIR
    if overhead.is_overhead_probe_dir(d):  # capture-overhead probes: no verdicts
        return overhead_command(d, args.json)
    if any(d.glob("repro_*/stdout.json")):  # the CLI's own reproduce runs, one per seed set
        return cli_runs_command(d, args.json)
    rep = gpu_results_report(d)
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        import pandas as pd

        m = rep["manifest"]
        print(f"{rep['dir']}: vLLM {m.get('vllm')} on {m.get('gpu')} (driver {m.get('driver')}), {m.get('date_utc')}")
        cols = ["model", "trigger_build", "control", "outcome", "trigger_failed", "trigger_units", "control_failed",
                "control_units", "fisher_p"]
        v = pd.DataFrame(rep["verdicts"])
        print(v[[c for c in cols if c in v]].to_string(index=False))
        for key, title in (("departures", "trigger requests that differ from the async-off control"),
                           ("factors", "each configuration vs the eager async-off control (288 shared requests)")):
            if rep[key]:
                print(f"\n{title}:")
                print(pd.DataFrame(rep[key]).drop(columns=["which"], errors="ignore").to_string(index=False))
        if rep["patch"]:
            print("\neach trigger vs each of the factor check's controls (requests whose output differs):")
            print(pd.DataFrame(rep["patch"]["table"]).to_string(index=False))
            pv = rep["patch"]["patched_vs_unpatched"]
            print(f"\nunpatched {pv['unpatched_failed_episodes']}/{pv['unpatched_episodes']} episodes vs "
                  f"accept_sync {pv['patched_failed_episodes']}/{pv['patched_episodes']}: one-sided Fisher "
                  f"p = {pv['fisher_p_one_sided']:.2g}")
    # corruption, or a guard that failed (control broken, geometry not exercised...), is exit 1;
    # a cell that was not run says nothing either way
    return 1 if any(r.get("outcome") not in (NO_EVIDENCE, "not run", None)
                    for r in rep["verdicts"]) else 0


def cli_runs_command(d: Path, as_json: bool) -> int:
    """``statescope reproduce`` runs of one folder (``data/results/gpu/cli``): each seed set's
    verdict and the pooled one per trigger-vs-control pair; exit 1 when a pooled verdict (or a
    set without a pool) is not 'no evidence'."""
    from statescope.results.cli_runs import pooled_verdicts
    from statescope.verdict.stats import NO_EVIDENCE

    rows = pooled_verdicts(d)
    if as_json:
        print(json.dumps({"dir": str(d), "verdicts": rows}, indent=2, default=str))
    else:
        import pandas as pd

        print(f"{d}: statescope reproduce runs, each seed set and pooled per trigger-vs-control "
              "pair (the pooled row is the verdict)")
        print(pd.DataFrame(rows).drop(columns=["pooled"]).to_string(index=False))
    pooled = {(r["control"], r["trigger_patch"]) for r in rows if r["pooled"]}
    deciding = [r for r in rows if r["pooled"] or (r["control"], r["trigger_patch"]) not in pooled]
    return 0 if all(r["outcome"] == NO_EVIDENCE for r in deciding) else 1


def overhead_command(d: Path, as_json: bool) -> int:
    """The capture-overhead probes: throughput ratios with intervals and the goal check (exit 0);
    the compact-record probe also pools its two calls of the same code (a secondary reading)."""
    from statescope.results import overhead

    rep = {"dir": str(d), "rows": overhead.overhead_rows(d), "goal": overhead.goal_check(d),
           "pooled": (overhead.pooled_check(d) if overhead.probe_files(d) == overhead.COMPACT_RECORD_PROBES
                      else [])}
    if as_json:
        print(json.dumps(rep, indent=2))
    else:
        import pandas as pd

        print(f"{d}: capture overhead, 6.7 B random hybrid (ratios to capture off, paired by round)")
        print(pd.DataFrame(rep["rows"]).to_string(index=False))
        print("\ngoal (digest mode >= 0.97 of capture off, the whole interval):")
        print(pd.DataFrame(rep["goal"]).to_string(index=False))
        if rep["pooled"]:
            print("\npooled over the calls of the same code (secondary):")
            print(pd.DataFrame(rep["pooled"]).to_string(index=False))
    return 0


def add_gpu_results_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("gpu-results",
                              epilog=exit_epilog("a verdict (one seed set's or the pooled one) is "
                                                 "not 'no evidence'"),
                              help="the committed GPU verdicts, recomputed from their records "
                                                  "(exit 1 if corruption was detected)")
    p.add_argument("dir", nargs="?", help="results folder (default: data/results/gpu/e2e_factors; "
                                          "data/results/gpu/e2e_patch_check for the accept_sync patch, "
                                          "data/results/gpu/overhead_graph_digest or "
                                          "overhead_compact_record for the capture's cost)")
    add_json_flag(p)
    p.set_defaults(func=gpu_results_command)


def add_racecheck_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``statescope racecheck`` on an argparse subparsers object."""
    p = subparsers.add_parser("racecheck",
                              epilog=exit_epilog('the unpatched kernel corrupted a copy'),
                              help="probe vLLM's Mamba copy kernel for the in-place shift race "
                                                "(needs a CUDA GPU)")
    from statescope.gpu.racecheck import PRESETS

    p.add_argument("--preset", default="tiny", choices=shown_choices((*PRESETS, "sweep")), help="tiny | qwen35-27b | sweep")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (splits conv_dim)")
    p.add_argument("--copies", type=int, default=100_000, help="copies per shift class")
    p.add_argument("--unpatched-only", action="store_true", help="skip the overlap-safe wrapper arm")
    add_json_flag(p)
    p.set_defaults(func=racecheck_command)
    return p


def racecheck_command(args: argparse.Namespace) -> int:
    """Run the probe for the chosen preset; exit 1 when the unpatched kernel corrupted any copy."""
    classes = (sweep_shift_classes() if args.preset == "sweep"
               else preset_shift_classes(args.preset, tp=args.tp))
    positive_int(args.copies, "--copies")
    require_cuda()
    modes = (False,) if args.unpatched_only else (False, True)
    table = racecheck_table(classes, args.copies, patched_modes=modes)
    if args.json:
        print(json.dumps(table.to_dict(orient="records"), indent=2))
    else:
        print(table.to_string(index=False), file=sys.stdout)
    return 1 if int(table.loc[~table["patched"], "corrupted"].sum()) else 0


def gpu_arm_command(args: argparse.Namespace) -> int:
    """``statescope gpu-arm``: one end-to-end arm into ``--out`` (records, meta, capture archive)."""
    from statescope.gpu.e2e_run import run_e2e_arm

    meta = run_e2e_arm(args.model, args.arm, out=args.out, label=args.label, job=args.job,
                       seeds=args.seeds, episodes=args.episodes, patches=args.patch or (),
                       capture=args.capture, sweep=args.sweep, overhead=args.overhead,
                       gpu=not args.cpu, eager=args.eager)
    brief = {k: meta[k] for k in ("arm", "key", "label", "model", "startup_s", "workload_s", "wall_s")}
    print(json.dumps(dict(brief, metrics=meta["metrics"]) if args.json else brief, indent=2, default=str))
    return 0


def add_gpu_arm_subcommand(subparsers: Any) -> None:
    from statescope.verdict.rejudge import CONTROLS

    p = subparsers.add_parser("gpu-arm",
                              epilog=exit_epilog(),
                              help="one end-to-end arm of the GPU verdicts (trigger or a control) "
                                              "into a results folder; gpu-results re-judges them")
    p.add_argument("--model", required=True, help="model directory or name under data/models")
    p.add_argument("--arm", required=True, choices=("trigger",) + CONTROLS)
    p.add_argument("--label", required=True, help="the model's label in the results (records_<label>.jsonl)")
    p.add_argument("--out", required=True, help="results folder (store/, arms_<job>.jsonl, capture archive)")
    p.add_argument("--job", default="cli", help="names arms_<job>.jsonl (one per device job)")
    p.add_argument("--seeds", type=int, default=6, help="seeds of the 'long' GUI-agent preset")
    p.add_argument("--episodes", type=int, default=None, help="episodes per seed (default: all)")
    p.add_argument("--patch", action="append",
                   help="statescope runtime patch (statescope.patches.registry), repeatable")
    p.add_argument("--capture", action="store_true", help="digest capture on (summary + archive)")
    p.add_argument("--sweep", action="store_true", help="prefix-cache hit sweep on the arm's engine")
    p.add_argument("--overhead", action="store_true", help="capture off vs digest rounds on the arm's engine")
    p.add_argument("--cpu", action="store_true", help="the CPU build (eager, no GPU settings)")
    p.add_argument("--eager", action="store_true", help="enforce_eager on a GPU (no CUDA graphs)")
    add_json_flag(p)
    p.set_defaults(func=gpu_arm_command)
