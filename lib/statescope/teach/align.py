"""Lessons 2–4: align mode's block table, what a prefix-cache hit restores, how MTP picks state.

What it does: ``block_table`` lays one request's captured steps out (computed and scheduled
tokens, drafts, accepted count, the positional Mamba block table of the first group, the running
column, the live conv rows) and ``block_table_figure`` draws it. Three checks against the real
engine: ``check_running_column`` (the running column is the block the newest scheduled token
falls in: one state per block boundary), ``check_prefix_hit`` (a hit restores exactly the state a
cold prefill computes: same hit size in whole blocks, same greedy output), and
``check_accepted_window`` (after each verification step the live conv rows, chosen by the accepted
count, equal the oracle's window after the last accepted token).

What it deliberately does not do: decide what a divergence means (``statescope.diverge.report``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from statescope.teach.lesson import LessonCheck, layer_index, snapshot_layers


def block_table(run: Any, req_id: str | None = None) -> pd.DataFrame:
    st = run.steps()
    req_id = req_id or st.req_id.iloc[0]
    mine = st[st.req_id == req_id].sort_values("req_step")
    return pd.DataFrame({
        "step": mine.req_step, "computed": mine.num_computed_tokens,
        "scheduled": mine.num_scheduled_tokens, "drafts": mine.num_drafts,
        "accepted": mine.accepted, "prefix_hit": mine.prefix_hit_tokens,
        "block_table (group 0)": [list(b[0]) for b in mine.mamba_block_ids],
        "running_col": mine.running_col, "conv_live_rows": [f"{o}..{o + 2}" for o in mine.conv_live_offset],
    }).reset_index(drop=True)


def block_table_figure(run: Any, req_id: str | None = None) -> Any:
    """Steps × block-table columns; the number is the physical block, the frame the running column."""
    import plotly.graph_objects as go

    table = block_table(run, req_id)
    rows = [list(r) for r in table["block_table (group 0)"]]
    width = max(len(r) for r in rows)
    grid = np.array([r + [0] * (width - len(r)) for r in rows], dtype=float)
    running = np.zeros_like(grid)
    for i, col in enumerate(table.running_col):
        running[i, int(col)] = 1
    # the colour is two-valued (running column or not): a two-tick colorbar names both colours
    fig = go.Figure(go.Heatmap(z=running, text=grid.astype(int), texttemplate="%{text}",
                               colorscale=[[0, "#f0f0f0"], [1, "#f4a261"]], zmin=0, zmax=1,
                               colorbar={"title": {"text": "column"}, "tickvals": [0, 1],
                                         "ticktext": ["other", "running"], "len": 0.6},
                               x=[f"col {c} (tokens {c}·bs…)" for c in range(width)],
                               y=[f"step {s}" for s in table.step]))
    fig.update_layout(height=140 + 28 * len(table), width=760, yaxis_autorange="reversed",
                      title="Mamba block table (physical block ids); orange = running column",
                      xaxis_title="block-table column (group 0)", yaxis_title="request step",
                      margin=dict(t=50, b=50))
    return fig


def check_running_column(run: Any, block_size: int) -> LessonCheck:
    st = run.steps()
    expect = (st.num_computed_tokens + st.num_scheduled_tokens - 1) // block_size
    bad = st[st.running_col != expect]
    nonzero = [sum(1 for b in table[0] if b) for table in st.mamba_block_ids]
    return LessonCheck("running column = block of the newest scheduled token", bad.empty and len(st) > 0,
                 f"{len(st) - len(bad)}/{len(st)} steps agree; block size {block_size}; "
                 f"at most {max(nonzero)} non-null blocks held per request",
                 {"columns seen": sorted(set(int(c) for c in st.running_col)),
                  "mismatches": bad[["req_id", "req_step", "running_col"]].to_dict("records")[:5]})


def check_prefix_hit(lesson: Any, prefix: list[int], suffix: list[int]) -> LessonCheck:
    """Cold run of prefix+suffix, then prefix alone, then prefix+suffix again (a hit)."""
    engine, bs = lesson.engine, lesson.block_size
    engine.reset_prefix_cache()
    cold = engine.generate([prefix + suffix], max_tokens=12, ignore_eos=True)[0]
    engine.reset_prefix_cache()
    engine.generate([prefix], max_tokens=4, ignore_eos=True)
    hit = engine.generate([prefix + suffix], max_tokens=12, ignore_eos=True)[0]
    ok = (hit.num_cached_tokens > 0 and hit.num_cached_tokens % bs == 0
          and hit.output_token_ids == cold.output_token_ids)
    return LessonCheck("a prefix-cache hit restores the state a cold prefill computes", ok,
                 f"hit of {hit.num_cached_tokens} tokens ({hit.num_cached_tokens // bs} block(s) of "
                 f"{bs}); outputs {'identical' if hit.output_token_ids == cold.output_token_ids else 'DIFFER'}",
                 {"cold output": cold.output_token_ids, "hit output": hit.output_token_ids})


def check_accepted_window(lesson: Any, prompt: list[int], steps: int = 6, tol: float = 0.02) -> LessonCheck:
    """The live conv rows after each verification step equal the oracle's window at that point."""
    from statescope.diverge import oracle

    run, records = lesson.capture([prompt], max_tokens=3 * steps, mode="full", first_steps=steps)
    st = run.steps().sort_values("req_step")
    req = st.req_id.iloc[0]
    tokens = prompt + records[0].output_token_ids
    snaps = run.snapshots()
    have = set(snaps[(snaps.req_id == req) & (snaps.kind == "conv")].req_step)
    rows = st[st.req_step.isin(have)]
    # Last token whose effect the state keeps: the step's own tokens (without drafts), plus the
    # accepted drafts (accepted counts the bonus token too, which is not processed yet).
    last = {int(r.req_step): int(r.num_computed_tokens + r.num_scheduled_tokens - r.num_drafts + r.accepted - 2)
            for r in rows.itertuples()}
    want = oracle.gdn_states(lesson.model, tokens[:max(last.values()) + 1], positions=sorted(set(last.values())))
    order = sorted(set(last.values()))
    names = snapshot_layers(run)
    errors = []
    for r in rows.itertuples():
        conv = run.snapshot(req, int(r.req_step), "conv").double().numpy()
        off = int(r.conv_live_offset)
        for row, name in enumerate(names):
            w = want[layer_index(name)][order.index(last[int(r.req_step)])][0].numpy()
            live = conv[row, off:off + w.shape[0]]
            errors.append(float(np.linalg.norm(live - w) / max(np.linalg.norm(w), 1e-12)))
    ok = bool(errors) and max(errors) < tol and len(rows) >= 2
    return LessonCheck("accepted count selects the conv rows (= oracle window after the last accepted token)",
                 ok, f"{len(rows)} steps × {len(names)} layers, worst relative error "
                     f"{max(errors) if errors else float('nan'):.4f} (tolerance {tol})",
                 {"accepted per step": [int(a) for a in rows.accepted],
                  "live row offset per step": [int(o) for o in rows.conv_live_offset]})
