"""Localize where the GPU trigger run's captured GDN states first depart from a clean reference.

Inputs: the digest-mode capture of the compiled trigger run (tarball), the trigger run's raw
records (full prompt/output token ids) and the eager control records. Three checks, per request step
(a request step's states are read after the step; positions from the runner's computed count):

1. **Exact conv-window continuity** (``statescope.diverge.conv_continuity``; no tolerance, capture only,
   every request): after a decode step with ``a`` accepted tokens the conv block holds the inputs
   of positions ``c-2..c+2``; the next step's rows 0,1 must be this step's rows ``a, a+1`` bit for
   bit (per-row checksums). The row pair it actually holds gives the shift the conv update
   applied, i.e. the accepted count it read; a shift other than ``a`` is a wrong conv read offset.
2. **Float64 oracle** (``statescope.diverge.oracle``; selected requests): the digest statistics (sum,
   sumsq, proj0-2; same ``Digester`` weights) of the oracle's recurrent state at the step's
   position, and the oracle's conv input rows' sums against the captured ``row_sums`` of the rows
   whose position is known. Differences in tolerance units, calibrated on non-divergent step-2
   requests with 2640 cached tokens over their steps before any continuity break
   (``tol = max(2 x largest clean difference, floor)``).
3. **In-place conv shifts** (census ``left_shift_same_block``, digest read after the shift): the
   rows the shift leaves duplicated must agree bit for bit (row j == row j+b); requests with a
   shift are also compared with the oracle at the shift step and the next ("shift probes").

The first step beyond tolerance feeds ``statescope.diverge.hypotheses.hypothesis_table`` with the
capture's own events (``statescope.diverge.report.step_events``) and the continuity check's frame.

Runtime ~75 s on one CPU thread (oracle for ~24 requests). Writes data/results/gpu/e2e/localization.json.
Usage: python scripts/gpu_localize.py [TRIGGER_RECORDS] [--control RAW_CONTROL_RECORDS]
       [--capture TARBALL] [--model DIR] [--out JSON] [--scratch DIR]
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import tarfile
import tempfile
import time
from pathlib import Path

import statescope  # noqa: F401  (CPU import shims first)
import numpy as np
import pandas as pd
import torch

from statescope.workload.trace import prompt_sha
from statescope.capture.store import CaptureRun
from statescope.diverge.conv_continuity import conv_shift_check, continuity_summary, inplace_shift_bias
from statescope.capture.digest import Digester
from statescope.diverge.report import step_events
from statescope.diverge.hypotheses import hypothesis_table, run_context
from statescope.diverge.oracle import gdn_states

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {0: "model.layers.0.linear_attn", 1: "model.layers.1.linear_attn",
          2: "model.layers.2.linear_attn"}
SSM_STATS = ["sum", "sumsq", "proj0", "proj1", "proj2"]
MARGIN, FLOOR_REL = 2.0, {"conv": 2.0 ** -8, "ssm": 2.0 ** -16}


def load_records(path: str, build: str | None) -> list[dict]:
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if build is None or r["build"] == build]


def divergent(trigger: list[dict], control: list[dict]) -> dict[str, int | None]:
    """{prompt_sha: first differing output index or None} against the control arm."""
    ctl = {(c["episode"], int(c["step"])): c["output_token_ids"] for c in control}
    out = {}
    for r in trigger:
        a, b = r["output_token_ids"], ctl[(r["episode"], int(r["step"]))]
        first = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        out[prompt_sha(r["prompt_token_ids"])] = first
    return out


def oracle_frame(rid: str, m: pd.DataFrame, dig: pd.DataFrame, tokens: list[int],
                 model: str, digester: Digester, bias: dict) -> pd.DataFrame:
    """Per (step, layer, kind): abs differences of the capture from the float64 oracle."""
    lo = int(m.num_computed_runner.min()) - 4
    positions = list(range(lo, len(tokens)))
    states = gdn_states(model, tokens, positions)
    at = {p: k for k, p in enumerate(positions)}
    zero = torch.zeros(1, 1, dtype=torch.long)
    out = []
    for s in m.itertuples():
        c, n, d, a = int(s.num_computed_runner), int(s.num_scheduled_tokens), int(s.num_drafts), int(s.accepted)
        if d == 0:  # prefill chunk: rows 0..2 = last 3 inputs, state after the last token
            ssm_pos, conv_pos = c + n - 1, {j: c + n - 3 + j for j in range(3)}
        else:  # decode: rows = c-2..c+2 (drafts), valid up to the last accepted one; an
            # in-place post-process shift by b moves row j+b to row j and the recurrent state
            # of draft column b into the running column
            b = bias.get((rid, int(s.engine_step)), 0)
            layout = {j: c - 2 + j + (b if j <= 4 - b else 0) for j in range(5)}
            ssm_pos, conv_pos = c + b, {j: p for j, p in layout.items() if p <= c + a - 1}
        for li, name in LAYERS.items():
            got = dig[(dig.req_id == rid) & (dig.req_step == s.req_step) & (dig.layer == name)]
            for kind in ("conv", "ssm"):
                g = got[got.kind == kind]
                if g.empty:
                    continue
                g = g.iloc[0]
                if kind == "ssm":
                    if ssm_pos not in at:
                        continue
                    ref = states[li][at[ssm_pos]][1].float()  # (h, v, k) layout: matches as is
                    st, _ = digester.digest([ref.unsqueeze(0)], zero)
                    names = digester.names
                    refv = np.array([float(st[0, 0, names.index(x)]) for x in SSM_STATS])
                    capv = np.array([float(g[x]) for x in SSM_STATS])
                    parts = np.abs(capv - refv)
                    scale = float(np.abs(refv).max())
                    pos = ssm_pos
                else:
                    parts, scale = [], 0.0
                    for j in range(5):
                        p = conv_pos.get(j)
                        if p is None or p not in at:
                            parts.append(float("nan"))
                            continue
                        ref_row = states[li][at[p]][0][-1].to(torch.bfloat16).float()
                        parts.append(abs(float(g.row_sums[j]) - float(ref_row.sum())))
                        scale = max(scale, float(ref_row.abs().sum()))
                    parts = np.array(parts)
                    pos = max(conv_pos.values())
                finite = parts[np.isfinite(parts)]
                out.append({"req_id": rid, "req_step": int(s.req_step), "engine_step": int(s.engine_step),
                            "position": int(pos), "layer": name, "kind": kind,
                            "max_abs": float(finite.max()) if len(finite) else float("nan"),
                            "parts": [None if not math.isfinite(x) else float(x) for x in parts],
                            "scale": scale, "nan_or_inf": bool(g["nan"] or g["inf"])})
    return pd.DataFrame(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="?", default=str(ROOT / "data/results/gpu/e2e/trigger_token_ids.jsonl.gz"),
                    help="trigger records with prompt/output token ids (default: the committed ones)")
    ap.add_argument("--control", default=str(ROOT / "data/results/gpu/e2e/records_tiny-gui.jsonl"),
                    help="control records (the raw ones, with prompt_token_ids, add the prompt check)")
    ap.add_argument("--control-build", default="no_async")
    ap.add_argument("--capture", default=str(ROOT / "data/results/gpu/e2e/capture_tiny-gui.tar.gz"))
    ap.add_argument("--model", default=str(ROOT / "data/models/tiny-gui"))
    ap.add_argument("--scratch", default=str(Path(tempfile.gettempdir()) / "statescope_localize"))
    ap.add_argument("--out", default=str(ROOT / "data/results/gpu/e2e/localization.json"))
    ap.add_argument("--clean", type=int, default=6, help="clean step-2 requests for calibration")
    ap.add_argument("--shift-probes", type=int, default=12,
                    help="non-divergent requests with an in-place conv shift to check against the oracle")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()

    scratch = Path(args.scratch)
    if not (scratch / "manifest.json").is_file():
        scratch.mkdir(parents=True, exist_ok=True)
        with tarfile.open(args.capture) as tf:
            tf.extractall(scratch, filter="data")
    run = CaptureRun(scratch)
    steps, dig = run.steps(), run.digests()
    trigger = load_records(args.records, "trigger")
    control = load_records(args.control, args.control_build)
    first_diff = divergent(trigger, control)
    ctl_prompt = {(c["episode"], int(c["step"])): c.get("prompt_token_ids") for c in control}
    by_sha = {prompt_sha(r["prompt_token_ids"]): r for r in trigger}
    req_of = steps.groupby("prompt_sha")["req_id"].first().to_dict()

    # 1. exact continuity, every request
    bias = inplace_shift_bias(run.copies())
    cont = conv_shift_check(run)
    cont_summary = continuity_summary(cont)
    breaks = cont[~cont.ok]
    per_req_break = breaks.groupby("req_id")["req_step"].min().to_dict()

    # 2. oracle comparison for the divergent and a few clean step-2 requests
    bad = [s for s, f in first_diff.items() if f is not None]
    clean = [s for s, r in sorted(by_sha.items(), key=lambda kv: req_of[kv[0]])
             if first_diff[s] is None and int(r["step"]) == 2 and int(r["num_cached_tokens"]) == 2640
             and len(r["prompt_token_ids"]) in (2866, 2868)][:args.clean]
    shift_reqs = sorted({r for r, _ in bias})
    probes = [s for s, f in sorted(first_diff.items(), key=lambda kv: req_of[kv[0]])
              if f is None and req_of[s] in shift_reqs and s not in clean][:args.shift_probes]
    digester = Digester(projections=int(run.manifest["spec"].get("projections", 3)),
                        seed=int(run.manifest["spec"].get("digest_seed", 0)))
    frames = {}
    for sha in bad + clean + probes:
        r = by_sha[sha]
        rid = req_of[sha]
        m = steps[steps.req_id == rid].sort_values("req_step")
        frames[sha] = oracle_frame(rid, m, dig, r["prompt_token_ids"] + r["output_token_ids"],
                                   args.model, digester, bias)

    # calibration: clean requests, steps before their first continuity break
    cal = []
    for sha in clean:
        f = frames[sha]
        brk = per_req_break.get(req_of[sha], 10**9)
        cal.append(f[f.req_step < brk])
    cal = pd.concat(cal, ignore_index=True)
    tol = cal.groupby(["layer", "kind"]).agg(measured=("max_abs", "max"), scale=("scale", "median"),
                                             points=("max_abs", "size")).reset_index()
    tol["floor"] = [FLOOR_REL[k] * s for k, s in zip(tol.kind, tol.scale)]
    tol["tol"] = [max(MARGIN * m, f) for m, f in zip(tol.measured, tol["floor"])]
    tolmap = {(l, k): t for l, k, t in zip(tol.layer, tol.kind, tol["tol"])}

    ctx = run_context(run)
    results = []
    for sha in bad + clean + probes:
        r, rid, f = by_sha[sha], req_of[sha], frames[sha].copy()
        f["tol"] = [tolmap[(l, k)] for l, k in zip(f.layer, f.kind)]
        f["units"] = f.max_abs / f.tol
        f["parts_out"] = [[i for i, v in enumerate(p) if v is not None and v > t]
                          for p, t in zip(f.parts, f.tol)]
        f["out"] = f.units > 1.0
        m = steps[steps.req_id == rid].sort_values("req_step")
        first_rec = {"req_id": rid, "prompt_sha": sha, "first_step": None, "kinds": [], "layers": [],
                     "conv_rows": [], "heads": [], "ssm_lag": None, "events": {}}
        out = f[f.out]
        if len(out):
            fs = int(out.req_step.min())
            at = out[out.req_step == fs]
            ssm_bad = out[out.kind == "ssm"].req_step
            first_rec.update(
                first_step=fs, position=int(at.position.min()), kinds=sorted(at.kind.unique()),
                layers=sorted(at.layer.unique()),
                conv_rows=sorted({i for p in at[at.kind == "conv"].parts_out for i in p}),
                ssm_lag=(int(ssm_bad.min()) - fs) if len(ssm_bad) else None,
                magnitude_units=float(at.units.max()),
                detail=[{"layer": l, "kind": k, "position": int(q), "units": round(float(u), 2),
                         "parts_out": po} for l, k, q, u, po in
                        zip(at.layer, at.kind, at.position, at.units, at.parts_out)],
                events=step_events(run, rid, list(range(max(0, fs - 2), fs + 1))))
        srow = m.set_index("req_step")
        shift_steps = [int(srow.index[srow.engine_step == e][0]) for (q, e) in bias
                       if q == rid and (srow.engine_step == e).any()]
        cb = cont[cont.req_id == rid]
        if first_rec["first_step"] is not None:
            fs = first_rec["first_step"]
            before = f[f.req_step < fs]
            tr = cb[(cb.req_step == fs) & (cb.layer == LAYERS[1])]
            first_rec["coincides"] = {
                "max_units_before": round(float(before.units.max()), 2) if len(before) else None,
                "prefix_hit_step": int(m[m.prefix_hit_tokens.fillna(0) > 0].req_step.min())
                if (m.prefix_hit_tokens.fillna(0) > 0).any() else None,
                "block_boundary_crossed": first_rec["events"].get("block_crossing"),
                "inplace_conv_shift_at_or_before": first_rec["events"].get("shift_steps"),
                "census_copies_in_first_step": {
                    str(k): int(v) for k, v in run.copies().query(
                        "req_id == @rid and engine_step == @e", local_dict={
                            "rid": rid, "e": int(srow.loc[fs, "engine_step"])})["kind"].value_counts().items()},
                "accepted_prev_sampled": int(srow.loc[fs - 1, "num_accepted_sampled"]) if fs - 1 in srow.index else None,
                "accepted_prev_used_postprocess": int(srow.loc[fs - 1, "num_accepted_used"]) if fs - 1 in srow.index else None,
                "conv_shift_applied": (tr.observed_shifts.iloc[0] if len(tr) else None),
                "batch_row_moved": (f"{int(tr.batch_row_prev.iloc[0])}->{int(tr.batch_row.iloc[0])}"
                                    if len(tr) and tr.batch_row_prev.iloc[0] != tr.batch_row.iloc[0] else None),
                "prefill_rows_in_batch": int(((steps.engine_step == srow.loc[fs, "engine_step"])
                                              & (steps.num_drafts == 0)).sum()),
            }
        results.append({
            "episode": r["episode"], "step": int(r["step"]), "req_id": rid, "prompt_sha": sha,
            "role": "divergent" if sha in bad else "clean-calibration" if sha in clean else "shift-probe",
            "divergent": first_diff[sha] is not None, "first_output_diff": first_diff[sha],
            "prompt_same_as_control": (None if ctl_prompt[(r["episode"], int(r["step"]))] is None else
                                       r["prompt_token_ids"] == ctl_prompt[(r["episode"], int(r["step"]))]),
            "inplace_shift_steps": sorted(shift_steps),
            "prompt_tokens": len(r["prompt_token_ids"]), "num_cached_tokens": int(r["num_cached_tokens"]),
            "first_oracle_departure": first_rec,
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
    table = hypothesis_table([x["first_oracle_departure"] for x in results if x["divergent"]], ctx,
                             continuity=cont)

    # continuity breaks over the whole run vs divergence
    req_div = {req_of[s]: first_diff[s] is not None for s in first_diff}
    brk_req = set(per_req_break)
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
            for r in cont_summary["observed_vs_expected"]],
    }
    summary["request_transitions_prev_accepted_3"] = [
        {"moved": r["moved"], "prefill_rows_in_batch": r["prefill_in_batch"],
         "transitions": r["transitions"], "broken": r["broken"]}
        for r in cont_summary["contingency"] if r["expected_shift"] == 3]
    summary["contingency_by_expected_shift"] = cont_summary["contingency"]
    shifts = cont[cont.inplace_shift_bias > 0]
    summary["breaks_per_layer_agree"] = cont_summary["breaks_per_layer_agree"]
    convd = dig[dig.kind == "conv"].set_index(["req_id", "engine_step", "layer"])["row_checksums"]
    all_intact = []
    for (q, e), b in bias.items():  # every census event: duplicated rows after the shift agree
        for name in LAYERS.values():
            if (q, e, name) in convd.index:
                c = [int(x) for x in convd[(q, e, name)]]
                all_intact.append(all(c[j] == c[j + b] for j in range(5) if 4 - 2 * b < j <= 4 - b))
    summary["inplace_shifts_all_census_events"] = {"events_x_layers": len(all_intact),
                                                   "duplicated_rows_intact": int(sum(all_intact))}
    summary["inplace_shifts"] = {"events_checked": int(len(shifts)) // len(LAYERS),
                                 "census_events": len(bias),
                                 "events_x_layers": int(len(shifts)),
                                 "intact": int(shifts.inplace_shift_intact.fillna(False).sum()),
                                 "requests": int(shifts.req_id.nunique())}
    doc_notes = {
        "ssm_parts": "for kind ssm, parts/parts_out index the digest stats [sum, sumsq, proj0, proj1, proj2]",
        "conv_parts": "for kind conv, parts/parts_out index conv rows 0..4 (row sums vs the oracle's bf16-rounded input rows)",
        "positions": "runner-side computed count (num_computed_runner); the scheduler's count is optimistic under async",
    }
    def rel(path: str) -> str:  # repo-relative where it can be: no machine paths in committed results
        p = Path(path).resolve()
        return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name

    doc = {"notes": doc_notes, "capture": rel(args.capture), "records": rel(args.records),
           "control": f"{rel(args.control)} ({args.control_build})", "model": rel(args.model),
           "tolerance": {"margin": MARGIN, "floor_rel": FLOOR_REL,
                         "calibrated_on": [req_of[s] for s in clean],
                         "layers": tol.to_dict(orient="records")},
           "continuity": summary, "requests": results,
           "hypotheses": table.to_dict(), "runtime_s": round(time.time() - t0, 1)}
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
    print(json.dumps({"continuity": summary, "ranking": table.ranking()[:3],
                      "first": [(x["episode"], x["step"], x["first_oracle_departure"]["first_step"],
                                 x["first_oracle_departure"]["kinds"],
                                 x["first_oracle_departure"].get("magnitude_units"),
                                 (x["first_continuity_break"] or {}).get("req_step"))
                                for x in results], "runtime_s": doc["runtime_s"]}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
