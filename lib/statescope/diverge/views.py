"""Figures and widgets for state divergence: conv-window diff viewer, per-request timeline, PNGs.

What it does:

* ``conv_window_figure(run, reference, req_id, req_step, layer)`` — three plotly heatmaps of one
  conv window's live rows × channels: reference, run, and run − reference (row 0 = the leading,
  oldest row; the last = the newest), the difference titled in tolerance units when given one.
* ``conv_diff_viewer(run, reference)`` — ipywidgets: pick request, layer and step; redraws the
  figure above. In a headless render only its initial state shows: pair it with a static figure.
* ``request_timeline(run, req_id, report=None)`` — one request's steps against token position:
  prompt/prefill chunks, block boundaries, drafts scheduled and tokens accepted, copies from the
  census (by kind), prefix-cache hit, and the first divergence from a ``DivergenceReport``.

What it deliberately does not do: compute differences (``statescope.diverge.noise``) or decide what
diverged (``statescope.diverge.by_position``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from statescope.errors import InputError


def conv_window_figure(run: Any, reference: Any, req_id: str, req_step: int, layer: str,
                       tolerance: Any = None):
    """Reference / run / difference heatmaps of one live conv window (rows × channels)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    hit = run.steps[(run.steps.req_id == req_id) & (run.steps.req_step == req_step)]
    if hit.empty:
        raise InputError(f"conv window: no captured step {req_step} of request {req_id!r}")
    step = hit.iloc[0]
    mine = run.get(req_id, int(req_step), "conv").get(layer)
    if mine is None:
        raise InputError(f"conv window: no layer {layer!r} (have {sorted(run.get(req_id, int(req_step), 'conv'))})")
    ref = reference.at(step.prompt_sha, int(step.conv_position), "conv")
    ref_t = None if ref is None else ref.get(layer)
    diff = None if ref_t is None else (mine - ref_t.to(mine.dtype))
    scale = tolerance.tol(layer, "conv") if tolerance is not None else 1.0
    unit = "tolerance units" if tolerance is not None else "absolute"
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=(f"reference: {getattr(reference, 'label', 'reference')}",
                                        "run", f"run − reference ({unit})"))
    rows = [f"row {i}" + (" (leading)" if i == 0 else "") for i in range(mine.shape[0])]
    for r, (z, cs) in enumerate(((ref_t, "RdBu"), (mine, "RdBu"),
                                 (None if diff is None else diff / scale, "PuOr")), start=1):
        if z is None:
            fig.add_annotation(text="no reference state at this position", row=r, col=1,
                               showarrow=False, xref="x domain", yref="y domain", x=0.5, y=0.5)
            continue
        # reference and run share one colour axis (comparable colours), the difference its own
        fig.add_trace(go.Heatmap(z=z.numpy(), y=rows, coloraxis="coloraxis2" if r == 3 else "coloraxis"),
                      row=r, col=1)
        fig.update_yaxes(title_text="conv row", row=r, col=1)
    fig.update_layout(
        height=560, margin={"t": 110},
        title={"text": f"conv window, request {req_id} step {req_step} "
                       f"(position {int(step.conv_position)}), {layer}", "y": 0.98, "yanchor": "top"},
        coloraxis={"colorscale": "RdBu", "cmid": 0,
                   "colorbar": {"title": {"text": "state value"}, "len": 0.6, "y": 0.68}},
        coloraxis2={"colorscale": "PuOr", "cmid": 0,
                    "colorbar": {"title": {"text": f"difference ({unit})"}, "len": 0.3, "y": 0.14}})
    fig.update_xaxes(title_text="channel", row=3, col=1)
    return fig


def conv_diff_viewer(run: Any, reference: Any, tolerance: Any = None):
    """An ipywidgets viewer: request / layer dropdowns and a step slider over the conv diff."""
    import ipywidgets as w
    import plotly.graph_objects as go

    steps = run.steps.sort_values(["req_id", "req_step"])
    reqs = list(dict.fromkeys(steps["req_id"]))
    if not reqs:
        raise InputError("conv diff viewer: the run has no captured steps")
    layers = sorted(run.get(reqs[0], int(steps[steps.req_id == reqs[0]].req_step.iloc[0]), "conv"))
    req_w = w.Dropdown(options=reqs, description="request")
    layer_w = w.Dropdown(options=layers, description="layer")
    step_w = w.IntSlider(description="step", min=0, max=0)
    figure = go.FigureWidget()

    def redraw(*_: Any) -> None:
        mine = steps[steps.req_id == req_w.value]
        step_w.max = int(mine.req_step.max())
        new = conv_window_figure(run, reference, req_w.value, int(step_w.value), layer_w.value,
                                 tolerance)
        with figure.batch_update():
            figure.data = []
            figure.add_traces(list(new.data))
            figure.layout = new.layout

    for widget in (req_w, layer_w, step_w):
        widget.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([req_w, layer_w, step_w]), figure])


def request_timeline(run: Any, req_id: str, report: Any = None):
    """One request's steps by token position, with copies, hits, accepts and first divergence."""
    import plotly.graph_objects as go

    from statescope.diverge.replay import step_positions

    st = step_positions(run.run if hasattr(run, "run") else run)
    mine = st[st.req_id == req_id].sort_values("req_step")
    if mine.empty:
        raise InputError(f"timeline: no request {req_id!r} in the run")
    capture = run.run if hasattr(run, "run") else run
    bs = int(mine["block_size"].iloc[0]) if "block_size" in mine else 0
    fig = go.Figure()
    starts, ends = mine["num_computed_tokens"], mine["end_position"]
    fig.add_trace(go.Bar(x=(ends - starts + 1), base=starts, y=["steps"] * len(mine),
                         orientation="h", name="tokens of each step",
                         text=[f"step {s}" for s in mine.req_step], hovertext=[
                             f"step {s}: drafts {d}, accepted {a}" for s, d, a in
                             zip(mine.req_step, mine.num_drafts, mine.accepted)]))
    decode = mine[mine["num_drafts"] > 0]
    fig.add_trace(go.Scatter(x=decode["end_position"], y=["accepted / drafts"] * len(decode),
                             mode="markers+text", name="accepted / drafts",
                             text=[f"{a}/{d}" for a, d in zip(decode.accepted, decode.num_drafts)],
                             textposition="top center"))
    cp = capture.copies()
    if not cp.empty:
        mc = cp[(cp.req_id == req_id) & (cp.nbytes > 0)].drop_duplicates(["engine_step", "kind"])
        pos = dict(zip(mine.engine_step, mine.end_position))
        mc = mc[mc.engine_step.isin(pos)]
        fig.add_trace(go.Scatter(x=[pos[e] for e in mc.engine_step], y=[f"copy: {k}" for k in mc.kind],
                                 mode="markers", marker={"symbol": "diamond", "size": 10},
                                 name="copies (census)"))
    hits = int(mine["prefix_hit_tokens"].fillna(0).max()) if "prefix_hit_tokens" in mine else 0
    if hits:  # below the first divergence's label, so the two never share a spot
        fig.add_vline(x=hits, line_dash="dot", annotation_text=f"prefix hit ({hits} tokens)",
                      annotation_position="top right", annotation_y=0.9)
    lo, hi = int(starts.min()), int(ends.max())
    view = (max(lo, hi - 40) - 1, hi + 2)
    bounds = list(range((lo // bs + 1) * bs if bs else hi + 1, hi + 1, bs or 1))
    for b in bounds:
        fig.add_vline(x=b - 0.5, line_color="grey")
    # block numbers go on the axis ticks (one label per boundary, never stacked at one height);
    # every k-th boundary when the window shows more than 12
    shown = [b for b in bounds if view[0] <= b - 0.5 <= view[1]]
    shown = shown[::-(-len(shown) // 12)] if shown else shown
    if len(shown) >= 2:
        fig.update_xaxes(tickvals=[b - 0.5 for b in shown],
                         ticktext=[f"{b}<br>block {b // bs}" for b in shown])
    elif shown:  # one boundary in view: the default ticks stay, one label names it
        fig.add_annotation(x=shown[0] - 0.5, y=0, yref="paper", yanchor="bottom", xanchor="right",
                           showarrow=False, text=f"block boundary {shown[0]}")
        shown = []
    first = None if report is None else next(
        (r for r in report.diverged if r["req_id"] == req_id), None)
    if first is not None:
        x = first.get("position")
        if x is None:
            x = int(mine[mine.req_step == first["first_step"]]["end_position"].iloc[0])
        fig.add_vline(x=x, line_color="red", line_width=3, annotation_position="top left",
                      annotation_text=f"first divergence: step {first['first_step']}, "
                                      f"{'+'.join(first['kinds'])}")
    fig.update_layout(title=f"request {req_id}: steps by token position", height=400,
                      xaxis_title="token position" + (
                          " (ticks: block boundaries, the block starting there)" if shown else ""),
                      yaxis_title="event", barmode="overlay",
                      legend={"orientation": "h", "y": -0.35}, xaxis_range=list(view))
    return fig


