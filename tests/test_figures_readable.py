"""Figures a reader can read: the conv-window figure has axis titles, colorbars with units, integer
conv rows, and a title clear of its subplot titles. The run and reference are small stand-ins
holding real tensors (the figure is a pure function of them)."""
from __future__ import annotations

from types import SimpleNamespace

import pandas as pd


def test_conv_window_figure_has_colorbars_with_units_and_axis_titles():
    import torch

    from statescope.diverge.views import conv_window_figure

    layer = "model.layers.2.linear_attn"
    mine = torch.arange(24, dtype=torch.float32).reshape(3, 8)
    run = SimpleNamespace(
        steps=pd.DataFrame({"req_id": ["r0"], "req_step": [4], "prompt_sha": ["p"], "conv_position": [17]}),
        get=lambda req, step, kind: {layer: mine})
    reference = SimpleNamespace(label="clean", at=lambda sha, pos, kind: {layer: mine * 0.5})
    fig = conv_window_figure(run, reference, "r0", 4, layer)
    lay = fig.layout
    assert lay.coloraxis.colorbar.title.text == "state value"
    assert lay.coloraxis2.colorbar.title.text == "difference (absolute)"
    assert [t.coloraxis for t in fig.data] == ["coloraxis", "coloraxis", "coloraxis2"]
    assert lay.yaxis.title.text == lay.yaxis3.title.text == "conv row" and lay.xaxis3.title.text == "channel"
    assert list(fig.data[0].y) == ["row 0 (leading)", "row 1", "row 2"]  # categories, not -0.5..2.5
    # the title sits at the top of the figure (container coordinates), the subplot titles at the
    # top of the plot area (paper y = 1), which starts 110 px lower: they cannot overlap
    assert max(a.y for a in lay.annotations) == 1.0 and lay.margin.t >= 100
    assert lay.title.y >= 0.95 and lay.title.yanchor == "top" and (lay.title.yref or "container") == "container"
