"""What a capture run exercised: counts of the geometry the bug family needs, from its tables.

Why: a capture that never hit the prefix cache, never accepted a draft partly, never shifted a
conv window in place and never crossed a block boundary cannot show a corruption on any of those
paths, however clean it reads (issue 28: the old default workload did 0 in-place shifts and 0
prefix-cache hits). ``exercised(run)`` counts, per run:

- ``prefix_cache_hits``: requests whose first scheduled step resumed from cached tokens
  (``steps.prefix_hit_tokens`` > 0);
- ``partial_accepts``: decode steps with drafts that accepted fewer than all of them;
- ``inplace_conv_shifts``: copies of kind ``left_shift_same_block`` that moved bytes (the
  in-place conv shift of H-copy: same block, bias > 0);
- ``block_crossings``: decode steps whose tokens cross a Mamba block boundary
  (``num_computed_tokens`` .. ``+ num_scheduled_tokens`` spans a multiple of ``block_size``);

and, as before, ``decode_steps`` and the draft ``acceptance`` rate (the older key names
``partial_accept_steps``, ``in_place_shifts``, ``prefix_hit_requests`` are kept for readers of
earlier reports). ``GEOMETRY`` names the four counts; ``nothing_exercised(counts)`` is true when
all four are zero.

What it deliberately does not do: judge a run's correctness, or read the engine's own metrics
(the capture's tables are what the comparison tools will read).
"""
from __future__ import annotations

from typing import Any

GEOMETRY = ("prefix_cache_hits", "partial_accepts", "inplace_conv_shifts", "block_crossings")


def exercised(run: Any) -> dict:
    """The run's counts (see the module docstring); every count 0 for a run without steps."""
    st, cp = run.steps(), run.copies()
    if st.empty:
        return {"decode_steps": 0, **{k: 0 for k in GEOMETRY}, "acceptance": None,
                "partial_accept_steps": 0, "in_place_shifts": 0, "prefix_hit_requests": 0}
    dec = st[st["num_drafts"] > 0]
    acc = dec["accepted"].fillna(0)
    shifts = 0 if cp.empty else int(((cp["kind"] == "left_shift_same_block")
                                     & (cp["nbytes"] > 0)).sum())
    hits = int(st.groupby("req_id")["prefix_hit_tokens"].max().fillna(0).gt(0).sum()) \
        if "prefix_hit_tokens" in st else 0
    partial = int((acc < dec["num_drafts"] + 1).sum())
    crossings = 0
    if "block_size" in st and len(st):
        start = st["num_computed_tokens"].astype("int64")
        end = start + st["num_scheduled_tokens"].astype("int64")
        bs = st["block_size"].fillna(0).astype("int64").clip(lower=1)
        decode = (start > 0) & (st["num_scheduled_tokens"] <= st["num_drafts"] + 1)
        crossings = int((decode & ((end - 1) // bs > (start - 1) // bs)).sum())
    return {"decode_steps": int(len(dec)), "prefix_cache_hits": hits, "partial_accepts": partial,
            "inplace_conv_shifts": shifts, "block_crossings": crossings,
            "acceptance": (round(float((acc - 1).sum() / dec["num_drafts"].sum()), 3)
                           if len(dec) else None),
            "partial_accept_steps": partial, "in_place_shifts": shifts, "prefix_hit_requests": hits}


def nothing_exercised(counts: dict) -> bool:
    """True when the run exercised none of the four geometries (``GEOMETRY``)."""
    return not any(counts.get(k) for k in GEOMETRY)
