"""Localize where a trigger run's captured GDN states first depart from a clean reference.

Inputs: a digest-mode capture of the trigger run (directory or tarball), the trigger's records with
full prompt/output token ids, a control arm's records (which requests' text departed) and the model
directory (for the float64 oracle). Three checks, per request step (a request step's states are read
after the step; positions from the runner's computed count):

1. **Exact conv-window continuity** (``statescope.diverge.conv_continuity``; no tolerance, every
   request): the row pair the next step's window holds gives the shift the conv update applied,
   i.e. the accepted count it read.
2. **Float64 oracle** (``statescope.diverge.oracle``; the divergent requests, a few clean ones and a
   few with in-place shifts): the digest statistics (sum, sumsq, proj0-2; the capture's own
   ``Digester`` weights) of the oracle's recurrent state at the step's position, and the oracle's
   conv input rows' sums against the captured ``row_sums`` of the rows whose position is known.
   Differences in tolerance units (``statescope.diverge.noise.calibrate``: the one noise rule),
   calibrated on clean requests shaped like the divergent ones (their most common request step and
   cached-token count, the same prompt lengths), over their steps before any continuity break.
3. **In-place conv shifts** (census ``left_shift_same_block``, digest read after the shift): the
   rows the shift leaves duplicated must agree bit for bit.

The first step beyond tolerance feeds ``statescope.diverge.hypotheses.hypothesis_table`` with the
capture's own events (``statescope.diverge.report.step_events``) and the continuity frame.
``localize`` returns the document ``data/results/gpu/e2e/localization.json`` holds;
``statescope localize`` writes it.

What it deliberately does not do: decide whether outputs are corrupted (the control comparison only
picks which requests to examine), or run an engine (the oracle is statescope's own float64 model).
"""
from __future__ import annotations

import gzip
import json
import os
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd

from statescope.errors import InputError

NOTES = {
    "ssm_parts": "for kind ssm, parts/parts_out index the digest stats [sum, sumsq, proj0, proj1, proj2]",
    "conv_parts": "for kind conv, parts/parts_out index conv rows 0..4 (row sums vs the oracle's bf16-rounded input rows)",
    "positions": "runner-side computed count (num_computed_runner); the scheduler's count is optimistic under async",
}


def load_records(path: str | os.PathLike, build: str | None = None) -> list[dict]:
    """JSON lines (``.gz`` too) of request records, those of ``build`` only when given."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: records file missing")
    rows = []
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        for i, line in enumerate(f):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path}:{i + 1}: expected one JSON object per line ({exc})") from None
    return [r for r in rows if build is None or r.get("build") == build]


def _need_fields(records: list[dict], what: str, fields: tuple[str, ...]) -> None:
    for i, r in enumerate(records):
        missing = [k for k in fields if k not in r]
        if missing:
            raise InputError(f"{what} records, record {i + 1}: field {missing[0]!r} missing (expected "
                             f"{', '.join(fields)})")


def first_output_diffs(trigger: list[dict], control: list[dict]) -> dict[str, int | None]:
    """{prompt_sha: first output index where the trigger's tokens leave the control's, or None}."""
    from statescope.workload.trace import prompt_sha

    ctl = {(c["episode"], int(c["step"])): c["output_token_ids"] for c in control}
    out = {}
    for r in trigger:
        key = (r["episode"], int(r["step"]))
        if key not in ctl:
            raise InputError(f"control records: no request for episode {key[0]!r} step {key[1]}")
        a, b = r["output_token_ids"], ctl[key]
        first = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        out[prompt_sha(r["prompt_token_ids"])] = first
    return out


def clean_shape(trigger: list[dict], first_diff: dict[str, int | None]) -> tuple[int, int, set[int]]:
    """(request step, cached tokens, prompt lengths) of the divergent requests' most common shape
    (of every request when none diverged): clean requests of that shape calibrate the tolerance."""
    from statescope.workload.trace import prompt_sha

    pool = [r for r in trigger if first_diff[prompt_sha(r["prompt_token_ids"])] is not None] or trigger
    (step, cached), _ = Counter((int(r["step"]), int(r["num_cached_tokens"])) for r in pool).most_common(1)[0]
    lengths = {len(r["prompt_token_ids"]) for r in pool
               if (int(r["step"]), int(r["num_cached_tokens"])) == (step, cached)}
    return step, cached, lengths


def _open_capture(capture: str | os.PathLike, scratch: str | os.PathLike | None) -> tuple[Any, Any]:
    """(capture directory, the temporary directory to clean up or None)."""
    capture = Path(capture)
    if capture.is_dir():
        return capture, None
    if not capture.is_file() or not tarfile.is_tarfile(capture):
        raise InputError(f"{capture}: expected a capture run directory or a tarball of one")
    tmp = None if scratch else tempfile.TemporaryDirectory(prefix="statescope-localize-")
    where = Path(scratch or tmp.name)
    if not (where / "manifest.json").is_file():
        where.mkdir(parents=True, exist_ok=True)
        with tarfile.open(capture) as tf:
            tf.extractall(where, filter="data")
    return where, tmp


def _select(trigger: list[dict], first_diff: dict, req_of: dict, shift_reqs: set, clean: int,
            shift_probes: int) -> tuple[list[str], list[str], list[str]]:
    """(divergent, clean-calibration, shift-probe) prompt shas: the divergent ones in record order,
    the others in capture request-id order."""
    from statescope.workload.trace import prompt_sha

    by_sha = {prompt_sha(r["prompt_token_ids"]): r for r in trigger}
    missing = [s for s in by_sha if s not in req_of]
    if missing:
        raise InputError(f"capture: no captured request has the prompt of trigger request {missing[0]} "
                         "(records and capture from different runs?)")
    step, cached, lengths = clean_shape(trigger, first_diff)
    ordered = sorted(by_sha, key=lambda s: req_of[s])
    bad = [s for s, f in first_diff.items() if f is not None]
    calib = [s for s in ordered if first_diff[s] is None and int(by_sha[s]["step"]) == step
             and int(by_sha[s]["num_cached_tokens"]) == cached
             and len(by_sha[s]["prompt_token_ids"]) in lengths][:clean]
    probes = [s for s in ordered if first_diff[s] is None and req_of[s] in shift_reqs
              and s not in calib][:shift_probes]
    return bad, calib, probes


def _tolerance(frames: dict, calib: list[str], req_of: dict, per_req_break: dict) -> Any:
    """``noise.calibrate`` on the clean requests' steps before their first continuity break."""
    from statescope.diverge.noise import calibrate

    if not calib:
        raise InputError("localize: no clean request shaped like the divergent ones to calibrate the "
                         "tolerance on (expected non-divergent requests of the same step, cached "
                         "tokens and prompt length)")
    cal = []
    for sha in calib:
        f = frames[sha]
        cal.append(f[f.req_step < per_req_break.get(req_of[sha], 10**9)])
    return calibrate(cal, [f"{req_of[s]} vs the float64 oracle" for s in calib])


def _first_departure(run: Any, rid: str, sha: str, f: pd.DataFrame, m: pd.DataFrame, cb: pd.DataFrame,
                     steps: pd.DataFrame, layer: str) -> dict:
    """The first request step beyond tolerance, what departed and what the capture recorded there."""
    from statescope.diverge.report import step_events

    rec: dict = {"req_id": rid, "prompt_sha": sha, "first_step": None, "kinds": [], "layers": [],
                 "conv_rows": [], "heads": [], "ssm_lag": None, "events": {}}
    out = f[f.out]
    if not len(out):
        return rec
    fs = int(out.req_step.min())
    at = out[out.req_step == fs]
    ssm_bad = out[out.kind == "ssm"].req_step
    rec.update(
        first_step=fs, position=int(at.position.min()), kinds=sorted(at.kind.unique()),
        layers=sorted(at.layer.unique()),
        conv_rows=sorted({i for p in at[at.kind == "conv"].parts_out for i in p}),
        ssm_lag=(int(ssm_bad.min()) - fs) if len(ssm_bad) else None,
        magnitude_units=float(at.units.max()),
        detail=[{"layer": l, "kind": k, "position": int(q), "units": round(float(u), 2), "parts_out": po}
                for l, k, q, u, po in zip(at.layer, at.kind, at.position, at.units, at.parts_out)],
        events=step_events(run, rid, list(range(max(0, fs - 2), fs + 1))))
    srow = m.set_index("req_step")
    before = f[f.req_step < fs]
    tr = cb[(cb.req_step == fs) & (cb.layer == layer)]
    hit = m.prefix_hit_tokens.fillna(0) > 0
    engine_step = int(srow.loc[fs, "engine_step"])
    rec["coincides"] = {
        "max_units_before": round(float(before.units.max()), 2) if len(before) else None,
        "prefix_hit_step": int(m[hit].req_step.min()) if hit.any() else None,
        "block_boundary_crossed": rec["events"].get("block_crossing"),
        "inplace_conv_shift_at_or_before": rec["events"].get("shift_steps"),
        "census_copies_in_first_step": {str(k): int(v) for k, v in run.copies().query(
            "req_id == @rid and engine_step == @e", local_dict={"rid": rid, "e": engine_step}
        )["kind"].value_counts().items()},
        "accepted_prev_sampled": int(srow.loc[fs - 1, "num_accepted_sampled"]) if fs - 1 in srow.index else None,
        "accepted_prev_used_postprocess": int(srow.loc[fs - 1, "num_accepted_used"]) if fs - 1 in srow.index else None,
        "conv_shift_applied": (tr.observed_shifts.iloc[0] if len(tr) else None),
        "batch_row_moved": (f"{int(tr.batch_row_prev.iloc[0])}->{int(tr.batch_row.iloc[0])}"
                            if len(tr) and tr.batch_row_prev.iloc[0] != tr.batch_row.iloc[0] else None),
        "prefill_rows_in_batch": int(((steps.engine_step == engine_step) & (steps.num_drafts == 0)).sum()),
    }
    return rec


def _continuity_summary(cont: pd.DataFrame, bias: dict, dig: pd.DataFrame, layers: dict,
                        req_div: dict) -> dict:
    """Continuity breaks over the whole run against divergence, and every in-place shift's rows."""
    from statescope.diverge.conv_continuity import continuity_summary

    cs = continuity_summary(cont)
    breaks = cont[~cont.ok]
    brk_req = set(breaks.groupby("req_id")["req_step"].min().to_dict())
    summary = {
        "requests": len(req_div), "with_continuity_break": len(brk_req),
        "divergent_with_break": sum(req_div[r] for r in brk_req),
        "divergent_total": sum(req_div.values()),
        "break_engine_steps": sorted({int(x) for x in breaks.engine_step}),
        "break_transitions": int(breaks.groupby(["req_id", "req_step"]).ngroups),
        "break_transitions_with_batch_row_change": int(
            breaks[breaks.batch_row != breaks.batch_row_prev].groupby(["req_id", "req_step"]).ngroups),
        "decode_transitions_checked": int(cont.groupby(["req_id", "req_step"]).ngroups),
        "note": "per (request, step) transition; every layer gives the same verdict (breaks_per_layer_agree)",
        "observed_vs_expected_per_transition": [
            {"expected_shift": r["expected_shift"], "obs": r["observed_shifts"], "n": r["transitions"]}
            for r in cs["observed_vs_expected"]],
    }
    summary["request_transitions_prev_accepted_3"] = [
        {"moved": r["moved"], "prefill_rows_in_batch": r["prefill_in_batch"],
         "transitions": r["transitions"], "broken": r["broken"]}
        for r in cs["contingency"] if r["expected_shift"] == 3]
    summary["contingency_by_expected_shift"] = cs["contingency"]
    shifts = cont[cont.inplace_shift_bias > 0]
    summary["breaks_per_layer_agree"] = cs["breaks_per_layer_agree"]
    convd = dig[dig.kind == "conv"].set_index(["req_id", "engine_step", "layer"])["row_checksums"]
    intact = []
    for (q, e), b in bias.items():  # every census event: the rows the shift duplicated agree
        for name in layers.values():
            if (q, e, name) in convd.index:
                c = [int(x) for x in convd[(q, e, name)]]
                intact.append(all(c[j] == c[j + b] for j in range(5) if 4 - 2 * b < j <= 4 - b))
    summary["inplace_shifts_all_census_events"] = {"events_x_layers": len(intact),
                                                   "duplicated_rows_intact": int(sum(intact))}
    summary["inplace_shifts"] = {"events_checked": int(len(shifts)) // len(layers),
                                 "census_events": len(bias), "events_x_layers": int(len(shifts)),
                                 "intact": int(shifts.inplace_shift_intact.fillna(False).sum()),
                                 "requests": int(shifts.req_id.nunique())}
    return summary


def _document(run: Any, trigger: list[dict], control: list[dict], model: str, clean: int,
              shift_probes: int) -> dict:
    """tolerance, continuity, requests and hypotheses of the localisation document."""
    from statescope.capture.digest import Digester
    from statescope.diverge.conv_continuity import conv_shift_check, inplace_shift_bias
    from statescope.diverge.hypotheses import hypothesis_table, run_context
    from statescope.diverge.localize_oracle import gdn_layers, oracle_frame
    from statescope.diverge.noise import FLOOR_REL, in_units
    from statescope.workload.trace import prompt_sha

    steps, dig = run.steps(), run.digests()
    if dig is None or dig.empty:
        raise InputError(f"capture run {run.path}: no digests (expected a digest-mode capture)")
    layers = gdn_layers(dig)
    first_diff = first_output_diffs(trigger, control)
    ctl_prompt = {(c["episode"], int(c["step"])): c.get("prompt_token_ids") for c in control}
    by_sha = {prompt_sha(r["prompt_token_ids"]): r for r in trigger}
    req_of = steps.groupby("prompt_sha")["req_id"].first().to_dict()
    bias = inplace_shift_bias(run.copies())  # 1. exact continuity, every request
    cont = conv_shift_check(run)
    per_req_break = cont[~cont.ok].groupby("req_id")["req_step"].min().to_dict()
    bad, calib, probes = _select(trigger, first_diff, req_of, {r for r, _ in bias}, clean, shift_probes)
    spec = run.manifest["spec"]  # 2. the oracle, with the capture's own digest weights
    digester = Digester(projections=int(spec.get("projections", 3)), seed=int(spec.get("digest_seed", 0)))
    frames = {}
    for sha in bad + calib + probes:
        r, rid = by_sha[sha], req_of[sha]
        m = steps[steps.req_id == rid].sort_values("req_step")
        frames[sha] = oracle_frame(rid, m, dig, r["prompt_token_ids"] + r["output_token_ids"], model,
                                   digester, bias, layers)
    tol = _tolerance(frames, calib, req_of, per_req_break)
    layer_for_row = list(layers.values())[min(1, len(layers) - 1)]  # every layer agrees on continuity
    results = []
    for sha in bad + calib + probes:
        r, rid = by_sha[sha], req_of[sha]
        f = in_units(frames[sha], tol)
        m = steps[steps.req_id == rid].sort_values("req_step")
        cb = cont[cont.req_id == rid]
        srow = m.set_index("req_step")
        shift_steps = [int(srow.index[srow.engine_step == e][0]) for (q, e) in bias
                       if q == rid and (srow.engine_step == e).any()]
        key = (r["episode"], int(r["step"]))
        results.append({
            "episode": r["episode"], "step": int(r["step"]), "req_id": rid, "prompt_sha": sha,
            "role": "divergent" if sha in bad else "clean-calibration" if sha in calib else "shift-probe",
            "divergent": first_diff[sha] is not None, "first_output_diff": first_diff[sha],
            "prompt_same_as_control": (None if ctl_prompt[key] is None else r["prompt_token_ids"] == ctl_prompt[key]),
            "inplace_shift_steps": sorted(shift_steps),
            "prompt_tokens": len(r["prompt_token_ids"]), "num_cached_tokens": int(r["num_cached_tokens"]),
            "first_oracle_departure": _first_departure(run, rid, sha, f, m, cb, steps, layer_for_row),
            "first_continuity_break": (None if rid not in per_req_break else
                                       cb[~cb.ok].sort_values("req_step").iloc[0][
                                           ["req_step", "engine_step", "expected_shift", "used_recorded",
                                            "observed_shifts", "batch_row_prev", "batch_row",
                                            "block_change"]].to_dict()),
            "per_step_units": [{"req_step": int(k), "engine_step": int(srow.loc[k, "engine_step"]),
                                "computed": int(srow.loc[k, "num_computed_runner"]),
                                "accepted": int(srow.loc[k, "accepted"]),
                                "batch_row": int(srow.loc[k, "batch_row"]),
                                "units": {f"{l.split('.')[2]}/{kd}": round(float(u), 2)
                                          for l, kd, u in zip(g.layer, g.kind, g.units)}}
                               for k, g in f.groupby("req_step")
                               if sha not in probes or any(abs(int(k) - q) <= 1 for q in shift_steps)],
        })
    table = hypothesis_table([x["first_oracle_departure"] for x in results if x["divergent"]],
                             run_context(run), continuity=cont)
    req_div = {req_of[s]: first_diff[s] is not None for s in first_diff}
    tolerance = {"margin": tol.margin, "floor_rel": dict(FLOOR_REL), "calibrated_on": [req_of[s] for s in calib],
                 "layers": tol.table.to_dict(orient="records")}
    return {"tolerance": tolerance, "continuity": _continuity_summary(cont, bias, dig, layers, req_div),
            "requests": results, "hypotheses": table.to_dict()}


def localize(trigger: list[dict], control: list[dict], capture: str | os.PathLike, model: str | os.PathLike,
             *, clean: int = 6, shift_probes: int = 12, sources: dict | None = None,
             scratch: str | os.PathLike | None = None) -> dict:
    """The localisation document (see the module docstring). ``trigger``/``control``: raw records
    of the trigger arm and of one control arm; ``clean``: clean requests to calibrate on;
    ``shift_probes``: non-divergent requests with an in-place conv shift to compare with the oracle;
    ``sources``: how the document names its inputs (default: the paths given); ``scratch``: where
    a tarball is unpacked (default: a temporary directory, removed after)."""
    from statescope.capture.store import CaptureRun

    _need_fields(trigger, "trigger", ("episode", "step", "prompt_token_ids", "output_token_ids",
                                      "num_cached_tokens"))
    _need_fields(control, "control", ("episode", "step", "output_token_ids"))  # prompts: optional
    if not trigger:
        raise InputError("trigger records: none given (expected the trigger arm's raw records)")
    if not Path(model, "config.json").is_file():
        raise InputError(f"{model}: expected a model directory with config.json (the oracle's weights)")
    if clean < 1 or shift_probes < 0:
        raise InputError(f"localize: expected clean >= 1 and shift_probes >= 0, got {clean}, {shift_probes}")
    t0 = time.time()
    where, tmp = _open_capture(capture, scratch)
    try:
        doc = _document(CaptureRun(where), trigger, control, str(model), clean, shift_probes)
    finally:
        if tmp is not None:
            tmp.cleanup()
    src = {"capture": str(capture), "records": "trigger records", "control": "control records",
           "model": str(model), **(sources or {})}
    return {"notes": NOTES, **{k: src[k] for k in ("capture", "records", "control", "model")}, **doc,
            "runtime_s": round(time.time() - t0, 1)}


def brief(doc: dict) -> dict:
    """What ``statescope localize`` prints: continuity, the top hypotheses, each request's first
    departure (episode, step, first step, kinds, units, first continuity break)."""
    return {"continuity": doc["continuity"],
            "ranking": [r["hypothesis"] for r in doc["hypotheses"]["rows"]][:3],
            "first": [(x["episode"], x["step"], x["first_oracle_departure"]["first_step"],
                       x["first_oracle_departure"]["kinds"],
                       x["first_oracle_departure"].get("magnitude_units"),
                       (x["first_continuity_break"] or {}).get("req_step"))
                      for x in doc["requests"]], "runtime_s": doc["runtime_s"]}
