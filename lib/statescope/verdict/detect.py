"""Degenerate-output detection for one generated output, and flip classification against a control.

What it does: ``classify_output`` flags the symptoms of garbage recurrent state (empty output, an
immediate end-of-sequence, runs of '!' / token id 0 — what argmax gives on NaN or flat logits —
punctuation runs, repetition loops, and actions an optional validator rejects);
``compare_to_control`` says whether a token sequence differs from the control's and whether the first
difference sits at a near-tie of the control (benign nondeterminism) or at a confident position;
``label_requests`` labels one arm's requests as ``reproduce`` counts failures (degenerate, or the
first step of an episode whose answer flips confidently from the control's) — the one rule every
verdict, the shrink and the exported plain-vLLM script apply; ``label_records`` adds the
degeneracy fields to stored records. The functions ``label_requests`` needs use no statescope
import (``InputError`` aside): ``statescope.share.repro_script`` embeds their source in a script
that runs without statescope. What it deliberately does not do: decode tokens, call a model or
judge task success beyond the validator it is given.
"""
from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from statescope.errors import InputError

REASONS = ("empty", "immediate_eos", "bang_run", "punct_run", "repetition_loop", "invalid_action")
BANG_TOKEN_ID = 0  # '!' in Qwen tokenizers


@dataclass
class Degeneracy:
    degenerate: bool
    reasons: list[str] = field(default_factory=list)


@dataclass
class Flip:
    identical: bool
    first_diff: int | None
    kind: str  # 'identical' | 'near_tie_flip' | 'confident_flip' | 'length_only'
    control_margin_at_diff: float | None
    margin_known: bool


def _longest_run(items: Sequence[Any], pred: Callable[[Any], bool]) -> int:
    best = cur = 0
    for x in items:
        cur = cur + 1 if pred(x) else 0
        best = max(best, cur)
    return best


def _tail_loop(seq: Sequence[Any], max_period: int, min_repeats: int, min_span: int) -> bool:
    """True if the end of seq is >= min_repeats full copies (and >= min_span items) of one period."""
    n = len(seq)
    for p in range(1, max_period + 1):
        if p * min_repeats > n:
            break
        # Length of the longest suffix with period p: walk back while seq[i] == seq[i + p].
        i = n - p - 1
        while i >= 0 and seq[i] == seq[i + p]:
            i -= 1
        span = n - 1 - i
        if span // p >= min_repeats and (span // p) * p >= min_span:
            return True
    return False


def _is_punct(ch: str) -> bool:
    return unicodedata.category(ch).startswith("P")


def classify_output(text: str, token_ids: list[int] | None, finish_reason: str | None, *,
                    action_validator: Callable[[str], bool] | None = None,
                    bang_run: int = 4, punct_run: int = 8, loop_min_repeats: int = 4,
                    loop_max_period_chars: int = 32, loop_min_span_chars: int = 16,
                    loop_max_period_tokens: int = 16, loop_min_span_tokens: int = 12) -> Degeneracy:
    """Flag one output as degenerate, with every reason that applies (vocabulary: REASONS).

    Repetition loops must sit at the end (a loop runs until max_tokens) and cover at least
    loop_min_span_* items, so ordinary endings such as '10000' or '...' are not loops.
    action_validator(text) -> bool is called when given; its exceptions propagate.
    """
    if not isinstance(text, str):
        raise InputError(f"classify_output text: expected str, got {type(text).__name__}")
    if token_ids is not None:
        token_ids = list(token_ids)
        if not all(isinstance(t, int) or hasattr(t, "__index__") for t in token_ids):
            raise InputError("classify_output token_ids: expected a list of ints or None")
        token_ids = [int(t) for t in token_ids]
    reasons: list[str] = []
    blank = not text.strip()
    if blank or (token_ids is not None and len(token_ids) == 0):
        reasons.append("empty")
    if finish_reason == "stop" and blank and (token_ids is None or len(token_ids) <= 1):
        reasons.append("immediate_eos")
    if (_longest_run(text, lambda ch: ch == "!") >= bang_run
            or (token_ids and _longest_run(token_ids, lambda t: t == BANG_TOKEN_ID) >= bang_run)):
        reasons.append("bang_run")
    if _longest_run(text, _is_punct) >= punct_run:
        reasons.append("punct_run")
    if (_tail_loop(text, loop_max_period_chars, loop_min_repeats, loop_min_span_chars)
            or (token_ids and _tail_loop(token_ids, loop_max_period_tokens, loop_min_repeats,
                                         loop_min_span_tokens))):
        reasons.append("repetition_loop")
    if action_validator is not None and not action_validator(text):
        reasons.append("invalid_action")
    return Degeneracy(bool(reasons), reasons)


def compare_to_control(arm_tokens: Sequence[int], control_tokens: Sequence[int],
                       control_margins: Sequence[float | None] | None,
                       near_tie: float = 0.1) -> Flip:
    """Classify how arm_tokens differ from control_tokens.

    control_margins[i] is the control's top-1 minus top-2 logprob (nats) at output position i; None
    (or no list) means unknown, which is treated as a confident flip with margin_known=False. A
    margin <= near_tie makes the first difference a near-tie flip.
    """
    arm, ctl = [int(t) for t in arm_tokens], [int(t) for t in control_tokens]
    if control_margins is not None:
        control_margins = list(control_margins)
        if len(control_margins) != len(ctl):
            raise InputError(f"compare_to_control control_margins: expected one entry per control "
                             f"token ({len(ctl)}), got {len(control_margins)}")
        for i, m in enumerate(control_margins):
            if m is not None and (isinstance(m, float) and math.isnan(m) or m < 0):
                raise InputError(f"compare_to_control control_margins[{i}]: expected a top-1 minus "
                                 f"top-2 logprob >= 0 or None, got {m!r}")
    if not near_tie >= 0:
        raise InputError(f"compare_to_control near_tie: expected >= 0, got {near_tie!r}")
    if arm == ctl:
        return Flip(True, None, "identical", None, True)
    diff = next((i for i, (a, c) in enumerate(zip(arm, ctl)) if a != c), None)
    if diff is None:  # one is a prefix of the other: only the stopping point differs
        return Flip(False, min(len(arm), len(ctl)), "length_only", None, True)
    margin = control_margins[diff] if control_margins is not None else None
    if margin is None:
        return Flip(False, diff, "confident_flip", None, False)
    kind = "near_tie_flip" if margin <= near_tie else "confident_flip"
    return Flip(False, diff, kind, float(margin), True)


def label_requests(rows: Iterable[dict], control: dict | None = None, *, near_tie: float = 0.1,
                   action_validator: Callable[[str], bool] | None = None) -> list[dict]:
    """One label per request of an arm, in (episode, step) order: what ``reproduce`` counts.

    ``rows``: the arm's answers ('episode', 'step', 'text', 'output_token_ids', 'finish_reason').
    ``control``: (episode, step) -> the control arm's answer to that request ('output_token_ids',
    'margins'), or None for no comparison (the control's own labels). A request fails when its
    output is degenerate (``classify_output`` with ``action_validator``), or when it is the first
    step of its episode whose answer differs from the control's and the control was confident
    there (``compare_to_control``: 'confident_flip'). Later steps of an episode that differed are
    not compared: their prompts already differ.
    """
    out, diverged = [], set()
    for r in sorted(rows, key=lambda r: (r["episode"], int(r["step"]))):
        deg = classify_output(r["text"], list(r["output_token_ids"]), r["finish_reason"],
                              action_validator=action_validator)
        flip = None
        c = control.get((r["episode"], int(r["step"]))) if control else None
        if c is not None and r["episode"] not in diverged:
            margins = c.get("margins")
            f = compare_to_control(list(r["output_token_ids"]), list(c["output_token_ids"]),
                                   None if margins is None else list(margins), near_tie=near_tie)
            flip = f.kind
            if not f.identical:
                diverged.add(r["episode"])
        out.append({"episode": r["episode"], "step": int(r["step"]), "text": r["text"],
                    "degenerate": deg.degenerate, "reasons": deg.reasons, "flip": flip,
                    "failed": deg.degenerate or flip == "confident_flip"})
    return out


def failure_reasons(label: dict) -> list[str]:
    """Why a ``label_requests`` label failed: its degenerate reasons, and 'confident_flip';
    empty when it did not fail."""
    return list(label["reasons"]) + (["confident_flip"] if label["flip"] == "confident_flip" else [])


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def label_records(records: Iterable[dict] | Any, *,
                  action_validator: Callable[[str], bool] | None = None,
                  **thresholds: int) -> list[dict]:
    """Return copies of the records with 'degenerate' and 'degenerate_reasons' added.

    Each record needs 'text', 'output_token_ids' and 'finish_reason' (None allowed for the last
    two). A pandas DataFrame is accepted and read row by row; the input is not modified.
    """
    if hasattr(records, "to_dict") and hasattr(records, "columns"):
        records = records.to_dict("records")
    out = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise InputError(f"label_records record {i}: expected a dict, got {type(rec).__name__}")
        missing = [k for k in ("text", "output_token_ids", "finish_reason") if k not in rec]
        if missing:
            raise InputError(f"label_records record {i}: missing field(s) {missing}; expected "
                             "'text', 'output_token_ids' and 'finish_reason'")
        text = "" if _missing(rec["text"]) else rec["text"]
        ids = None if _missing(rec["output_token_ids"]) else rec["output_token_ids"]
        reason = None if _missing(rec["finish_reason"]) else rec["finish_reason"]
        try:
            d = classify_output(text, ids, reason, action_validator=action_validator, **thresholds)
        except InputError as exc:
            raise InputError(f"label_records record {i}: {exc}") from None
        out.append({**rec, "degenerate": d.degenerate, "degenerate_reasons": d.reasons})
    return out
