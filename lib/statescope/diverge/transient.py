"""Differences the next state does not inherit: a digest read that was not the state carried on.

What it does: ``mark_transient(m)`` takes a position-paired ``digest_diff`` frame and, per prompt,
finds the token positions where some row differs while at a later paired position of the
request (after a run of differing ones, if any) every row (every GDN layer, conv window and
recurrent state) agrees again. A recurrent state feeds
the next one (``h' = f(h, x)`` in float32, and the conv rows the next step convolves with), so a
state that really differed leaves the next state different; when a later one agrees the digests
read before it were not the states the engine carried on — on the H200 captures, the block of a
prefix hit's pre-copy digested after the copy and before the prefill's write (the cached state
at the hit position, not the state at the step's end). Those rows become ``same`` with
``transient`` True; ``attrs["transient_positions"]`` counts the positions.

What it deliberately does not do: forgive the last paired position of a request (no successor
says anything), a difference whose successor differs too (a real divergence always does), or
apply to step pairing (the successor there is another schedule's step).
"""
from __future__ import annotations

import pandas as pd


def mark_transient(m: pd.DataFrame) -> pd.DataFrame:
    """``m`` with ``transient`` (bool) and the transient rows' ``same`` set True (see above)."""
    m = m.assign(transient=False)
    if m.empty:
        m.attrs["transient_positions"] = 0
        return m
    per_pos = (m.groupby(["prompt_sha", "position"])["same"].all().astype(bool)
               .reset_index().sort_values(["prompt_sha", "position"]))
    # the next agreeing position of the request, looking back over a run of differing ones
    nxt = (per_pos["same"].where(per_pos["same"]).groupby(per_pos["prompt_sha"])
           .transform(lambda s: s.bfill().shift(-1)))
    per_pos["transient"] = ~per_pos["same"] & nxt.fillna(False).astype(bool)
    keys = set(per_pos.loc[per_pos["transient"], ["prompt_sha", "position"]]
               .itertuples(index=False, name=None))
    hit = pd.Series([k in keys for k in zip(m["prompt_sha"], m["position"])], index=m.index)
    m.loc[hit, "transient"] = True
    m.loc[hit, "same"] = True
    m.attrs["transient_positions"] = len(keys)
    return m
