"""What did the workbook's own command line find on the H200? The committed ``statescope reproduce``
runs of ``data/results/gpu/cli/`` (vLLM 0.26.0) and ``data/results/gpu/releases/`` (0.26.0 … 0.32.0).

Each run folder holds what one CLI command wrote: ``stdout.json`` (its ``--json`` report),
``stderr.log``, ``rc``, and under ``runs/<run-id>/`` the results store (records compacted to the
fields a verdict reads, ``lifetimes.jsonl``, ``manifest.json``). ``verdict_of(folder)`` re-derives
the verdict of one reproduce run from its stored records with the reproduce code path
(``load_arm_run``, ``label_rows``, ``summarize_arm``, ``decide``) and returns it beside what the CLI
printed, so a test can hold the two equal. ``reproduce_table`` lists every reproduce run of a
folder; ``seed_spread`` gives the trigger's failed episodes per seed set, unpatched and with
``accept_sync``, and the pooled figures with exact intervals and Fisher's test;
``pooled_verdicts`` each seed set's verdict and the pooled one per trigger-vs-control pair
(``statescope gpu-results data/results/gpu/cli``).

What it deliberately does not do: start anything, or compare runs that answered different traces
(each seed set is its own trace: pooling adds each arm's counts over seed sets, it never compares
one seed set's trigger with another's control).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from statescope.errors import InputError
from statescope.results.files import E2E_DIR
from statescope.verdict.stats import clopper_pearson, fisher_exact_one_sided

CLI_DIR = E2E_DIR.parent / "cli"
RELEASES_DIR = E2E_DIR.parent / "releases"


def _report(folder: Path) -> dict:
    path = Path(folder) / "stdout.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: missing (a CLI run folder holds its command's --json report)") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not JSON ({exc})") from None


def run_id_of(report: dict) -> str:
    """The results store folder name of a reproduce report (``run_dir``'s last part)."""
    return str(report["run_dir"]).rstrip("/").split("/")[-1]


def verdict_of(folder: str | Path, runs: str | Path | None = None) -> dict:
    """One reproduce run's verdict, re-derived from its stored records, beside the CLI's own."""
    from statescope.verdict.reproduce import label_rows, load_arm_run
    from statescope.verdict.units import summarize_arm
    from statescope.verdict.stats import decide
    from statescope.workload.guilang import action_validator_for

    folder = Path(folder)
    rep = _report(folder)
    store = Path(runs or folder.parent / "runs") / run_id_of(rep)
    control_name = rep["control"]["name"]
    trg = load_arm_run(store, "trigger")
    trg.arm.expect_prefix_cache = trg.arm.expect_spec = True  # what standard_arms' trigger expects
    # a --control-run reuses a control stored in another run folder: its report names it
    ctl_store = store if any(True for _ in _arm_rows(store, control_name)) else \
        Path(runs or folder.parent / "runs") / _control_run_of(folder)
    ctl = load_arm_run(ctl_store, control_name)
    check = action_validator_for(r["text"] for r in ctl.rows)
    v = decide(summarize_arm(trg, label_rows(trg, ctl, action_validator=check), rep["unit"]),
               summarize_arm(ctl, label_rows(ctl, None, action_validator=check), rep["unit"]),
               alpha=rep["alpha"])
    return {"recomputed": {"outcome": v.outcome, "trigger": (v.trigger.n_failed_units, v.trigger.n_units),
                           "control": (v.control.n_failed_units, v.control.n_units), "p": v.fisher_p},
            "reported": {"outcome": rep["outcome"],
                         "trigger": (rep["trigger"]["n_failed_units"], rep["trigger"]["n_units"]),
                         "control": (rep["control"]["n_failed_units"], rep["control"]["n_units"]),
                         "p": rep["fisher_p"]}}


def _arm_rows(store: Path, name: str):
    path = store / "records.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip() and json.loads(line)["build"] == name:
                yield line


def _control_run_of(folder: Path) -> str:
    """The ``--control-run`` folder a reproduce command was given (from commands.txt or the name)."""
    name = folder.name
    for base in (folder.parent / "commands.txt", *folder.parent.glob("commands_*.txt")):
        if base.is_file():
            for line in base.read_text().splitlines():
                if line.startswith(name + "\t") and "--control-run" in line:
                    return line.split("--control-run", 1)[1].split()[0].rstrip("/").split("/")[-1]
    raise InputError(f"{folder}: its control arm is not in its own store and no --control-run "
                     "is recorded for it")


def _seeds_and_patch(name: str) -> tuple[str, str]:
    # folder names: repro_<A>-<B>_<control or patch>  (scripts/gpu_cli.sh)
    _, seeds, what = name.split("_", 2)
    return seeds.replace("-", ":"), what


def reproduce_table(d: str | Path = CLI_DIR) -> list[dict]:
    """One row per ``statescope reproduce`` run of ``d``: seeds, control, patch, verdict, counts."""
    rows = []
    for folder in sorted(Path(d).glob("repro_*")):
        rep = _report(folder)
        seeds, what = _seeds_and_patch(folder.name)
        t, c = rep["trigger"], rep["control"]
        srcs = t.get("engagement_sources") or {}
        rows.append({"seeds": seeds, "control": c["name"],
                     "trigger_patch": ", ".join(rep["labels"]["trigger"]) or "none",
                     "outcome": rep["outcome"], "trigger_failed": t["n_failed_units"],
                     "trigger_units": t["n_units"], "control_failed": c["n_failed_units"],
                     "control_units": c["n_units"], "fisher_p": rep["fisher_p"],
                     "prefix_cache_source": srcs.get("prefix_cache_source"),
                     "spec_source": srcs.get("spec_source"),
                     "runner": (t.get("resolved") or {}).get("runner_version"),
                     "async_scheduling": (t.get("resolved") or {}).get("async_scheduling"),
                     "folder": folder.name})
    return rows


def seed_spread(d: str | Path = CLI_DIR) -> list[dict]:
    """Per seed set (vs the async-off control): the trigger's failed episodes unpatched and with
    ``accept_sync``; then the pooled row (counts added over seed sets) with 95 % Clopper-Pearson
    intervals and Fisher's one-sided p of unpatched over patched."""
    rows = [r for r in reproduce_table(d) if r["control"] == "no_async"]
    by_seed: dict[str, dict] = {}
    for r in rows:
        slot = "patched" if "accept_sync" in r["trigger_patch"] else "unpatched"
        by_seed.setdefault(r["seeds"], {})[slot] = (r["trigger_failed"], r["trigger_units"])
    out = []
    tot = {"unpatched": [0, 0], "patched": [0, 0]}
    for seeds, arms in sorted(by_seed.items(), key=lambda kv: int(kv[0].split(":")[0])):
        row: dict[str, Any] = {"seeds": seeds}
        for slot in ("unpatched", "patched"):
            if slot in arms:
                k, n = arms[slot]
                tot[slot][0] += k
                tot[slot][1] += n
                lo, hi = clopper_pearson(k, n)
                row[slot] = f"{k}/{n}"
                row[f"{slot}_ci95"] = (round(lo, 4), round(hi, 4))
        out.append(row)
    (ku, nu), (kp, np_) = tot["unpatched"], tot["patched"]
    pooled: dict[str, Any] = {"seeds": "pooled"}
    for slot, (k, n) in (("unpatched", (ku, nu)), ("patched", (kp, np_))):
        if n:
            lo, hi = clopper_pearson(k, n)
            pooled[slot], pooled[f"{slot}_ci95"] = f"{k}/{n}", (round(lo, 4), round(hi, 4))
    if nu and np_:
        pooled["fisher_p_unpatched_over_patched"] = fisher_exact_one_sided(ku, nu, kp, np_)
    return out + [pooled]


def pooled_verdicts(d: str | Path = CLI_DIR, alpha: float | None = None) -> list[dict]:
    """Each seed set's verdict and the pooled verdict, per trigger-vs-control pair of ``d``: the
    stored reports' arm summaries of one pair (same control, same trigger patches) added over
    their seed sets and judged once more by ``decide`` (guards included), at each report's alpha
    unless ``alpha`` is given. Rows: ``{"seeds", "control", "trigger_patch", "outcome",
    "trigger", "control_counts", "fisher_p", "pooled"}``; a pair's pooled row follows its sets."""
    from statescope.verdict.rule import pool_summaries, summary_from_dict
    from statescope.verdict.stats import decide

    groups: dict[tuple, list[tuple[str, dict]]] = {}
    for folder in sorted(Path(d).glob("repro_*")):
        rep = _report(folder)
        seeds, _ = _seeds_and_patch(folder.name)
        key = (rep["control"]["name"], ", ".join(rep["labels"]["trigger"]) or "none", rep["unit"])
        groups.setdefault(key, []).append((seeds, rep))
    rows = []
    for (control, patch, unit), reps in groups.items():
        reps.sort(key=lambda sr: int(sr[0].split(":")[0]))
        level = alpha if alpha is not None else max(r["alpha"] for _, r in reps)
        for seeds, rep in reps:
            rows.append({"seeds": seeds, "control": control, "trigger_patch": patch, "unit": unit,
                         "outcome": rep["outcome"],
                         "trigger": f"{rep['trigger']['n_failed_units']}/{rep['trigger']['n_units']}",
                         "control_counts": f"{rep['control']['n_failed_units']}/"
                                           f"{rep['control']['n_units']}",
                         "fisher_p": rep["fisher_p"], "pooled": False})
        if len(reps) < 2:
            continue
        v = decide(pool_summaries([summary_from_dict(r["trigger"]) for _, r in reps]),
                   pool_summaries([summary_from_dict(r["control"]) for _, r in reps]), alpha=level)
        rows.append({"seeds": "pooled " + "+".join(s for s, _ in reps), "control": control,
                     "trigger_patch": patch, "unit": unit, "outcome": v.outcome,
                     "trigger": f"{v.trigger.n_failed_units}/{v.trigger.n_units}",
                     "control_counts": f"{v.control.n_failed_units}/{v.control.n_units}",
                     "fisher_p": v.fisher_p, "pooled": True})
    return rows
