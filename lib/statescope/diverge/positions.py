"""Which token position each captured state stands for, from the step records alone.

Two runs of one prompt under different schedules (async scheduling on or off, another
``max_num_batched_tokens``, other batch partners, another speculative acceptance) take different
numbers of engine steps to reach the same token, so their states line up by token position, not by
request step. This module says, per step row, where the state after that step stands.

What it does: ``token_positions(steps)`` adds to a capture's ``steps`` table

- ``advance``: tokens the step moved the request's state on: the non-draft tokens scheduled
  (``num_scheduled_tokens - num_drafts``: a prefill chunk, or the one sampled token of a decode
  step) plus the drafts accepted (``num_accepted_sampled - 1``, older name ``accepted``; 0 when the
  step scheduled no drafts). Null where the step scheduled drafts but recorded no accepted count;
- ``computed``: tokens the state held before the step: the previous captured step's ``computed +
  advance`` (``carried``: a request's consecutive steps, not a fresh or resumed request), else —
  at a request's first captured step, after a missed step or a step of unknown advance — the
  runner's own count (``num_computed_runner``) where recorded, else the scheduler's
  ``num_computed_tokens``. ``computed_from`` says which (``carried``, ``runner``, ``scheduler``).
  Carried first: under async scheduling the scheduler's count runs ahead — it counts the previous
  step's drafts before their rejection is known (+1/+2 in 252 of 604 rows of the committed H200
  trigger capture, ``data/results/gpu/cli/captures/trigger``) — and Model Runner V2's host count
  mirrors the scheduler's (``statescope.capture.runner_view``). The V1 runner's count equals the
  carried count in every row of that capture;
- ``end_position``: the position (0-based) of the last token whose state the step leaves behind,
  ``computed + advance - 1``; null where ``advance`` is.

``digest_positions(digests, steps)`` gives each digest row its position: the conv window
(running column) ends at ``end_position``; the recurrent state in column ``column_offset`` after
the running one is the state after token ``end_position - conv_live_offset + column_offset``.
Columns past ``conv_live_offset`` hold states of rejected drafts — tokens that are not in the
sequence — and get no position (null). ``position_support(run)`` names the columns a run lacks
for this (None when it has them); ``position_checks(steps)`` counts rows whose recorded counts
differ from the carried one, and rows with no position.

What it deliberately does not do: compare states (``statescope.diverge.digest_diff``,
``statescope.diverge.noise``) or read snapshots (``statescope.diverge.replay``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

NEEDED = ("req_id", "req_step", "num_computed_tokens", "num_scheduled_tokens", "num_drafts")
SPEC_NEEDED = ("accepted", "conv_live_offset")  # only when some step scheduled drafts


def _accepted(st: pd.DataFrame) -> pd.Series:
    for col in ("num_accepted_sampled", "accepted"):
        if col in st:
            return pd.to_numeric(st[col], errors="coerce")
    return pd.Series(np.nan, index=st.index)


def position_support(run: Any) -> str | None:
    """Why ``run``'s states cannot be placed by token position (None: they can)."""
    st = run.steps()
    if st.empty:
        return None
    missing = [c for c in NEEDED if c not in st]
    if "num_drafts" in st and (st["num_drafts"].fillna(0) > 0).any():
        if "num_accepted_sampled" not in st and "accepted" not in st:
            missing.append("accepted")
        if "conv_live_offset" not in st:
            missing.append("conv_live_offset")
    if missing:
        return f"capture run {getattr(run, 'path', run)}: its steps table lacks {missing}"
    return None


def token_positions(st: pd.DataFrame) -> pd.DataFrame:
    """``st`` plus ``advance``, ``computed``, ``computed_from`` and ``end_position`` (see the
    module docstring), in the order of ``st``."""
    if st.empty:
        return st.assign(advance=pd.Series(dtype=float), computed=pd.Series(dtype=float),
                         computed_from=pd.Series(dtype=object),
                         end_position=pd.Series(dtype="Int64"))
    s = st.sort_values(["req_id", "req_step"], kind="stable")
    drafts = s["num_drafts"].fillna(0).astype(int)
    acc = _accepted(s)
    acc_drafts = np.where(drafts > 0, (acc - 1).clip(lower=0), 0.0)
    advance = (s["num_scheduled_tokens"] - drafts).astype(float) + acc_drafts
    sched = s["num_computed_tokens"].astype(float)
    runner = (pd.to_numeric(s["num_computed_runner"], errors="coerce") if "num_computed_runner" in s
              else pd.Series(np.nan, index=s.index))
    is_new = s["is_new"].fillna(False).astype(bool) if "is_new" in s else \
        pd.Series(False, index=s.index)
    same_req = s["req_id"].eq(s["req_id"].shift(1))
    follows = same_req & s["req_step"].eq(s["req_step"].shift(1) + 1) & ~is_new
    # a segment of a request's consecutive steps, restarted where the chain cannot carry: a new
    # or resumed request, a missed step, a step before it of unknown advance
    seg_start = ~follows | advance.shift(1).isna()
    seg = seg_start.cumsum()
    anchor = runner.where(runner.notna(), sched).where(seg_start)
    base = anchor.groupby(seg).transform("first")
    before = advance.groupby(seg).cumsum() - advance  # this segment's advance before the row
    computed = base + before
    origin = np.where(~seg_start, "carried", np.where(runner.notna(), "runner", "scheduler"))
    end = computed + advance - 1
    out = s.assign(advance=advance, computed=computed, computed_from=origin,
                   end_position=end.round().astype("Int64"))
    return out.loc[st.index]


def position_checks(st: pd.DataFrame) -> dict[str, int]:
    """Counts over a ``token_positions`` table: rows whose scheduler count differs from the
    carried one (``scheduler_differs``: async scheduling runs ahead), rows whose runner count
    does (``runner_differs``: Model Runner V2 under async scheduling), rows with no position
    (``unplaced``: drafts scheduled, no accepted count)."""
    if st.empty:
        return {"scheduler_differs": 0, "runner_differs": 0, "unplaced": 0}
    carried = st["computed"].where(st["computed_from"] == "carried")
    runner = (pd.to_numeric(st["num_computed_runner"], errors="coerce")
              if "num_computed_runner" in st else pd.Series(np.nan, index=st.index))
    return {"scheduler_differs": int((carried.notna() & (st["num_computed_tokens"] != carried)).sum()),
            "runner_differs": int((carried.notna() & runner.notna() & (runner != carried)).sum()),
            "unplaced": int(st["end_position"].isna().sum())}


def digest_positions(d: pd.DataFrame) -> pd.Series:
    """Per digest row (merged with its step's ``end_position`` and ``conv_live_offset``): the
    token position its state stands for; null for rejected-draft columns and unplaced steps."""
    end = d["end_position"].astype(float)
    off = d["conv_live_offset"].fillna(0).astype(float)
    col = (d["column_offset"] if "column_offset" in d else pd.Series(0, index=d.index)) \
        .fillna(0).astype(float)
    conv = d["kind"] == "conv"
    pos = np.where(conv, end, end - off + col)
    pos = np.where(~conv & (col > off), np.nan, pos)  # a rejected draft's state
    return pd.Series(pos, index=d.index).round().astype("Int64")
