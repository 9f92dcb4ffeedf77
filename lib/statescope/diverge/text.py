"""The terminal form of a divergence report and a hypothesis table: short, integer steps, layer numbers.

What it does: ``report_text(report)`` says how many requests diverge, which block columns were
compared, how rows were paired (token position, or engine step and why), the positions only one
run has (unpaired: not compared), any warning (an incomplete run, a fallback to step pairing,
step counts that differ under step pairing) and note, then one line per diverging request — first
step (the run's; its token position and the reference's step there), origin layer and its kinds,
every layer that differs there, live conv rows, magnitude, the step's events — and under it the
per-layer detail; requests that do not diverge
are counted, not listed (``all_requests`` lists them). ``hypotheses_text(table)`` gives the
finding line (the mechanism that fits, or "no mechanism fits the evidence") and the table.

What it deliberately does not do: compute anything (``statescope.diverge.report``,
``.hypotheses``), or format JSON (the CLI prints ``to_dict()``).
"""
from __future__ import annotations

from typing import Any

from statescope.diverge.digest_diff import COLUMN_NOTES


def short_layer(name: Any) -> str:
    """``model.layers.2.linear_attn`` -> ``2`` (the model's layer number); other names as is."""
    if name is None:
        return ""
    nums = [p for p in str(name).split(".") if p.isdigit()]
    return nums[0] if len(nums) == 1 else str(name)


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(_fmt(v) for v in x) + "]" if x else "-"
    return str(x)


def _events(ev: dict) -> str:
    parts = []
    if ev.get("accepted"):
        parts.append(f"accepted {_fmt(ev['accepted'])}")
    if ev.get("accepted_mismatch"):
        parts.append(f"USED {_fmt(ev.get('accepted_used'))} != sampled")
    if ev.get("same_block_left_shift"):
        parts.append(f"in-place shift at step {_fmt(ev.get('shift_steps'))}")
    if ev.get("postprocess_copy_steps"):
        parts.append(f"post-process copy at step {_fmt(ev['postprocess_copy_steps'])}")
    if ev.get("block_crossing"):
        parts.append("block crossing")
    if ev.get("prefix_hit_tokens"):
        parts.append(f"prefix hit {ev['prefix_hit_tokens']} tokens")
    if ev.get("prefill_steps"):
        parts.append(f"prefill in batch at step {_fmt(ev['prefill_steps'])}")
    return "; ".join(parts) or "-"


def report_text(report: Any, all_requests: bool = False) -> str:
    lines = [f"{len(report.diverged)} of {len(report.requests)} requests diverge "
             f"({report.run} vs reference {report.reference}; magnitude in {report.unit})"]
    if report.columns:
        lines.append(f"compared: {COLUMN_NOTES.get(report.columns, report.columns)}")
    if getattr(report, "pairing", None):
        lines.append(f"paired by: {report.pairing}")
    un = getattr(report, "unpaired_positions", None)
    if un and (un.get("run") or un.get("reference")):
        lines.append(f"unpaired positions: {un['run']} in the run only, {un['reference']} in the "
                     f"reference only ({un['requests']} request(s): a schedule that chunked, hit "
                     "the prefix cache or stopped at another token; not compared, not divergences)")
    lines += [f"WARNING: {w}" for w in report.warnings]
    lines += [f"note: {n}" for n in getattr(report, "notes", None) or []]
    shown = report.requests if all_requests else report.diverged
    if shown:
        lines.append("")
        for r in shown:
            if r["first_step"] is None:
                lines.append(f"{r['req_id']}: no divergence in {r['steps_compared']} steps"
                             + (f" ({r['positions_compared']} token positions)"
                                if r.get("positions_compared") is not None else ""))
                continue
            paired = r.get("reference_step") is not None  # diverge, paired by position
            where = f"step {r['first_step']}" + (f" (token position {r['position']})"
                                                 if r.get("position") is not None and not paired
                                                 else "")
            lines.append(f"{r['req_id']}: first divergence at {where}, origin layer "
                         f"{short_layer(r.get('origin_layer')) or '?'} ({'+'.join(r['kinds'])}); layers "
                         f"{','.join(short_layer(x) for x in r['layers'])}; conv rows "
                         f"{_fmt(r['conv_rows'])}; magnitude {_fmt(r['magnitude'])}"
                         + ("; NaN/Inf" if r.get("nan_or_inf") else "")
                         + (f"; token position {r['position']} (reference step "
                            f"{r['reference_step']})" if paired else ""))
            for pl in r.get("per_layer") or []:
                cols = f", recurrent columns {_fmt(pl['ssm_columns'])}" if pl.get("ssm_columns") else ""
                lines.append(f"    layer {short_layer(pl['layer'])}: {'+'.join(pl['kinds'])}, conv rows "
                             f"{_fmt(pl['conv_rows'])}{cols}, seen by {'+'.join(pl['differs_by'])},"
                             f" magnitude {_fmt(pl['magnitude'])}")
            lines.append(f"    events (steps {_fmt((r.get('events') or {}).get('steps'))}): "
                         f"{_events(r.get('events') or {})}")
    rest = len(report.requests) - len(shown)
    if rest:
        lines.append(f"{rest} other request(s): no divergence (--all lists them)")
    return "\n".join(lines)


def hypotheses_text(table: Any) -> str:
    ctx = table.context
    head = "hypotheses" + (f" (async={ctx.async_scheduling}, spec={ctx.spec}, prefix hits="
                           f"{ctx.prefix_cache_hits}, planted={ctx.planted})" if ctx else "")
    lines = [head + ":", f"finding: {table.finding_line()}"]
    cols = ["rank", "hypothesis", "label", "supports", "contradicts", "not_exercised", "why"]
    frame = table.frame()
    if not frame.empty:
        lines.append(frame[cols].to_string(index=False))
    return "\n".join(lines)
