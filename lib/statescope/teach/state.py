"""Lesson 1: how one GDN layer's conv window and recurrent state evolve, token by token.

What it does: ``Walk`` holds the float64 oracle states (``statescope.diverge.oracle``) of one GDN layer
after every token of a prompt; ``Walk.figure(t)`` draws the conv window (kernel − 1 rows × the
first channels) and the recurrent state of one head after token ``t``, next to how much each
token changed the recurrent state; ``explorer(walk)`` wraps that in a ``FigureWidget`` driven by
a token-position slider (ipywidgets). ``check_prefill_matches_oracle`` compares the real engine's
full state snapshot after a prefill with the oracle, layer by layer.

What it deliberately does not do: model the speculative extra conv rows (the oracle has none; the
engine check compares the live rows only) or run the engine itself (``statescope.teach.lesson.Lesson``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from statescope.teach.lesson import LessonCheck, layer_index, snapshot_layers

CHANNELS = 48  # channels shown of the conv window (the whole window is 512 wide on the tiny model)


@dataclass
class Walk:
    tokens: list[int]
    layer: int
    conv: np.ndarray  # [T, kernel-1, conv_dim]
    ssm: np.ndarray  # [T, heads, v, k]

    @property
    def change(self) -> np.ndarray:
        """Relative change of the recurrent state made by each token (what the state 'forgets')."""
        prev = np.concatenate([np.zeros_like(self.ssm[:1]), self.ssm[:-1]])
        num = np.linalg.norm((self.ssm - prev).reshape(len(self.tokens), -1), axis=1)
        return num / np.maximum(np.linalg.norm(self.ssm.reshape(len(self.tokens), -1), axis=1), 1e-12)

    def figure(self, t: int, widget: bool = False) -> Any:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        # wide gaps: each heatmap's colorbar sits in the gap right of its own panel
        fig = make_subplots(rows=1, cols=3, column_widths=[0.4, 0.25, 0.35], horizontal_spacing=0.15,
                            subplot_titles=(f"conv window ({self.conv.shape[1]} rows)",
                                            "recurrent state (corner)",
                                            "relative change per token"))
        conv_rows = [f"row {i}" + (" (oldest)" if i == 0 else "") for i in range(self.conv.shape[1])]
        fig.add_trace(go.Heatmap(z=self.conv[t, :, :CHANNELS], y=conv_rows, coloraxis="coloraxis",
                                 name="conv"), 1, 1)
        fig.add_trace(go.Heatmap(z=self.ssm[t, 0, :32, :32], coloraxis="coloraxis2", name="ssm"), 1, 2)
        fig.add_trace(go.Scatter(y=self.change, mode="lines", name="change"), 1, 3)
        fig.add_trace(go.Scatter(x=[t], y=[self.change[t]], mode="markers", marker_size=12,
                                 name="token t"), 1, 3)

        def bar(col: int, title: str) -> dict:
            right = fig.layout[f"xaxis{'' if col == 1 else col}"].domain[1]
            return {"colorscale": "RdBu", "cmid": 0, "colorbar": {
                "title": {"text": title, "side": "right"}, "x": right + 0.005, "xanchor": "left",
                "thickness": 10, "len": 0.8}}

        fig.update_layout(height=360, width=980, showlegend=False, margin=dict(t=90, b=50, l=110),
                          title={"text": f"GDN layer {self.layer} after token {t} (id {self.tokens[t]})",
                                 "y": 0.97, "yanchor": "top"},
                          coloraxis=bar(1, "conv value"), coloraxis2=bar(2, "state value"))
        fig.update_xaxes(title_text="channel", row=1, col=1)
        fig.update_yaxes(title_text="conv row", autorange="reversed", row=1, col=1)
        fig.update_xaxes(title_text="key dim", row=1, col=2)
        fig.update_yaxes(title_text="value dim (head 0)", autorange="reversed", row=1, col=2)
        fig.update_xaxes(title_text="token position", row=1, col=3)
        fig.update_yaxes(title_text="relative change", row=1, col=3)
        return go.FigureWidget(fig) if widget else fig


def walk(model: str, tokens: list[int], layer: int = 0) -> Walk:
    """Oracle states of GDN layer ``layer`` (model index) after every token of ``tokens``."""
    from statescope.diverge import oracle

    states = oracle.gdn_states(model, tokens)[layer]
    conv = np.stack([c.numpy() for c, _ in states])
    ssm = np.stack([s.numpy() for _, s in states])
    return Walk(list(tokens), layer, conv, ssm)


def explorer(w: Walk, start: int | None = None) -> Any:
    """A token-position slider driving a FigureWidget (needs a live kernel to move)."""
    import ipywidgets as widgets

    t0 = len(w.tokens) - 1 if start is None else start
    fig = w.figure(t0, widget=True)
    slider = widgets.IntSlider(value=t0, min=0, max=len(w.tokens) - 1, description="token t",
                               continuous_update=False, layout=widgets.Layout(width="600px"))
    slider.add_class("statescope-token-slider")

    def update(change: dict) -> None:
        t = change["new"]
        with fig.batch_update():
            fig.data[0].z = w.conv[t, :, :CHANNELS]
            fig.data[1].z = w.ssm[t, 0, :32, :32]
            fig.data[3].x, fig.data[3].y = [t], [w.change[t]]
            fig.layout.title.text = f"GDN layer {w.layer} after token {t} (id {w.tokens[t]})"

    slider.observe(update, names="value")
    return widgets.VBox([slider, fig])


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def check_prefill_matches_oracle(lesson: Any, tokens: list[int], tol: float = 0.02) -> LessonCheck:
    """After a prefill, the engine's conv windows and recurrent states equal the oracle's."""
    from statescope.diverge import oracle

    run, _ = lesson.capture([tokens], max_tokens=2, mode="full", first_steps=1)
    req = run.snapshots().req_id.iloc[0]
    conv, ssm = run.snapshot(req, 0, "conv").double().numpy(), run.snapshot(req, 0, "ssm").double().numpy()
    # The snapshot follows the request's first step: with blocks shorter than the prompt, align
    # mode ends that prefill chunk on a block boundary, so compare at the chunk's last token.
    st = run.steps()
    first = st[(st["req_id"] == req) & (st["req_step"] == 0)].iloc[0]
    end = min(int(first["num_computed_tokens"] + first["num_scheduled_tokens"]), len(tokens))
    want = oracle.gdn_states(lesson.model, tokens[:end], positions=[end - 1])
    width = next(iter(want.values()))[0][0].shape[0]
    errors = {}
    for row, name in enumerate(snapshot_layers(run)):
        c, s = (x.numpy() for x in want[layer_index(name)][0])
        # Prefill leaves the live rows at the start of the window; the recurrent state's last two
        # axes are the transpose of the oracle's on this build.
        errors[name] = (round(_rel(conv[row, :width], c), 4), round(_rel(ssm[row].swapaxes(-1, -2), s), 4))
    ok = bool(errors) and all(max(e) < tol for e in errors.values())
    return LessonCheck("prefill state equals the float64 oracle", ok,
                 f"{len(errors)} GDN layers after {end} of {len(tokens)} prompt tokens, worst "
                 f"relative error {max(max(e) for e in errors.values()):.4f} (tolerance {tol}, "
                 "bf16 weights)",
                 {f"{k} (conv, ssm)": v for k, v in errors.items()})
