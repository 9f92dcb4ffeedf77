"""Figures a reader can read: the conv-window figure has axis titles, colorbars with units, integer
conv rows, and a title clear of its subplot titles. The run and reference are small stand-ins
holding real tensors (the figure is a pure function of them)."""
from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest


def test_conv_window_figure_has_colorbars_with_units_and_axis_titles(tmp_path):
    fig = _conv_window(tmp_path)
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


# ---- every figure builder: axis titles, titled colorbars, annotations apart ---------------------

def _steps_rows() -> list[dict]:
    """Four steps of one request in align mode (block size 4): two prefill chunks, two decodes."""
    rows = []
    for step, (computed, scheduled, drafts, accepted) in enumerate(
            [(0, 8, 0, 1), (8, 6, 0, 1), (14, 3, 2, 3), (17, 3, 2, 1)]):
        rows.append({"engine_step": step, "req_id": "r0", "req_step": step, "prompt_sha": "p",
                     "num_computed_tokens": computed, "num_scheduled_tokens": scheduled,
                     "num_drafts": drafts, "accepted": accepted, "prefix_hit_tokens": 4 if step == 0 else 0,
                     "mamba_block_ids": [[1, 2, 3, 4, 5, 0][: 2 + step]], "block_size": 4,
                     "running_col": (computed + scheduled - 1) // 4, "conv_live_offset": 0})
    return rows


def _capture_run(tmp_path):
    """A real capture run on disk (the writer every capture uses), steps and copies only."""
    from statescope.capture.store import CaptureRun, CaptureWriter

    writer = CaptureWriter(tmp_path / "run", {"mode": "digest"}, max_bytes=1 << 20)
    writer.add_rows("steps", _steps_rows())
    writer.add_rows("copies", [{"engine_step": 2, "req_id": "r0", "kind": "conv", "nbytes": 64},
                               {"engine_step": 3, "req_id": "r0", "kind": "ssm", "nbytes": 128}])
    writer.close()
    return CaptureRun(tmp_path / "run")


def _walk_figure(tmp_path):
    import numpy as np

    from statescope.teach.state import Walk

    rng = np.random.default_rng(0)
    return Walk([5, 6, 7, 8], 0, rng.normal(size=(4, 3, 64)), rng.normal(size=(4, 2, 32, 32))).figure(2)


def _block_table_figure(tmp_path):
    from statescope.teach.align import block_table_figure

    steps = pd.DataFrame(_steps_rows()).assign(conv_live_offset=[0, 0, 1, 2])
    return block_table_figure(SimpleNamespace(steps=lambda: steps))


def _poison_figure(tmp_path):
    from statescope.teach.accept_race import poison_figure

    return poison_figure(pd.DataFrame({
        "phase": ["after poisoning"] * 3 + ["after prefix-cache reset"],
        "request": ["prefix + suffix 0", "prefix + suffix 1", "unrelated prompt", "prefix + suffix 0"],
        "cached_tokens": [16, 16, 0, 0], "'!' (token 0) share": [1.0, 0.75, 0.0, 0.0]}))


def _shift_animation(tmp_path):
    from statescope.teach.inplace_shift import animation

    return animation(n=16, shift=4, tile=8)


def _timeline(tmp_path):
    from statescope.diverge.views import request_timeline

    report = SimpleNamespace(diverged=[{"req_id": "r0", "first_step": 3, "kinds": ["conv"]}])
    return request_timeline(_capture_run(tmp_path), "r0", report)


def _conv_window(tmp_path):
    import torch

    from statescope.diverge.views import conv_window_figure

    layer = "model.layers.2.linear_attn"
    mine = torch.arange(24, dtype=torch.float32).reshape(3, 8)
    run = SimpleNamespace(
        steps=pd.DataFrame({"req_id": ["r0"], "req_step": [4], "prompt_sha": ["p"], "conv_position": [17]}),
        get=lambda req, step, kind: {layer: mine})
    reference = SimpleNamespace(label="clean", at=lambda sha, pos, kind: {layer: mine * 0.5})
    return conv_window_figure(run, reference, "r0", 4, layer)


def _divergence_heatmap(tmp_path):
    from statescope.diverge.report import DivergenceReport

    cells = pd.DataFrame([{"prompt_sha": "p", "req_step": s, "layer": f"model.layers.{l}.linear_attn",
                           "kind": k, "magnitude": (1e-3 if s >= 2 else 0.0) * (l + 1)}
                          for s in range(4) for l in (0, 1) for k in ("conv", "ssm")])
    req = {"req_id": "r0", "prompt_sha": "p", "first_step": 2, "kinds": ["conv", "ssm"],
           "layers": ["model.layers.0.linear_attn"], "conv_rows": [0], "magnitude": 2e-3,
           "nan_or_inf": False, "events": {"shift_steps": [1, 2], "postprocess_copy_steps": [2]}}
    return DivergenceReport("run", "ref", requests=[req], cells=cells).heatmap()


def _matrix_heatmap(tmp_path):
    return _matrix().heatmap()


def _matrix():
    from statescope.verdict.matrix import MatrixResult

    rows = [{"enable_prefix_caching": pc, "num_speculative_tokens": k, "resolved": {}, "failed": f,
             "units": 20, "rate": f / 20, "ci95": (0.0, 0.2), "prefix_cache_hits": 3,
             "spec_accepted_tokens": 5, "duplicate_of": None, "warnings": []}
            for (pc, k), f in zip([(True, 0), (True, 2), (False, 0), (False, 2)], [0, 7, 0, 0])]
    return MatrixResult(rows, {"enable_prefix_caching": [True, False], "num_speculative_tokens": [0, 2]})


def _posterior(tmp_path):
    return _bisection().posterior_figure()


def _bisection():
    from statescope.bisect.result import BisectResult, ProbeRecord

    labels = ["v0.24", "v0.25", "v0.26", "v0.27"]
    probes = [ProbeRecord(1, 2, "v0.26", 8, 3, 8, 2, 0.7), ProbeRecord(2, 1, "v0.25", 8, 0, 16, 2, 0.9)]
    return BisectResult("binary", "regression", labels, probes, [0.25] * 4,
                        [[0.1, 0.1, 0.7, 0.1], [0.02, 0.03, 0.9, 0.05]], 2, 0.9, 16, "confident")


FIGURES = {"teach.state.Walk.figure": _walk_figure, "teach.align.block_table_figure": _block_table_figure,
           "teach.accept_race.poison_figure": _poison_figure,
           "teach.inplace_shift.animation": _shift_animation,
           "diverge.views.request_timeline": _timeline, "diverge.views.conv_window_figure": _conv_window,
           "diverge.report.DivergenceReport.heatmap": _divergence_heatmap,
           "verdict.matrix.MatrixResult.heatmap": _matrix_heatmap,
           "bisect.result.BisectResult.posterior_figure": _posterior}


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_every_figure_titles_its_axes_and_colorbars_and_keeps_labels_apart(name, tmp_path):
    fig = FIGURES[name](tmp_path)
    lay = fig.layout
    axes = set()
    for trace in fig.data:
        axes.add("xaxis" + (trace.xaxis or "x")[1:])
        axes.add("yaxis" + (trace.yaxis or "y")[1:])
    assert axes, name
    # a shared axis shows its ticks (and title) once, under the bottom panel
    untitled = sorted(a for a in axes if not (lay[a].title.text or "").strip()
                      and not (lay[a].matches and lay[a].showticklabels is False))
    assert not untitled, f"{name}: axes without a title: {untitled}"
    for trace in (t for t in fig.data if t.type == "heatmap"):
        if trace.coloraxis:
            bar = lay[trace.coloraxis]
            assert bar.showscale is not False, f"{name}: {trace.coloraxis} hides its colorbar"
        else:
            bar = trace
            assert trace.showscale is not False, f"{name}: heatmap {trace.name!r} hides its colorbar"
        assert (bar.colorbar.title.text or "").strip(), f"{name}: colorbar without a title"
        # a heatmap over a handful of rows names them (no ticks at -0.5 ... 2.5)
        if len(trace.z) <= 6:
            assert trace.y is not None or lay[("yaxis" + (trace.yaxis or "y")[1:])].dtick == 1, name
    spots = [(a.xref, a.yref, a.x, a.y, a.xanchor, a.yanchor) for a in lay.annotations]
    assert len(spots) == len(set(spots)), f"{name}: annotations share a position: {spots}"
    if lay.title.text and any(a.y == 1 and a.yref == "paper" for a in lay.annotations
                              if a.yanchor == "bottom"):
        # subplot titles stand on the plot area: the figure title must sit in a tall top margin
        assert lay.margin.t >= 80 and lay.title.yanchor == "top", name


def test_timeline_puts_block_numbers_on_ticks_and_zero_bars_have_labels(tmp_path):
    fig = _timeline(tmp_path)
    assert list(fig.layout.xaxis.ticktext) == ["4<br>block 1", "8<br>block 2", "12<br>block 3",
                                               "16<br>block 4"]
    assert not any("block boundary" in (a.text or "") for a in fig.layout.annotations)
    bars = _poison_figure(tmp_path).data[0]
    assert list(bars.text) == ["100%", "75%", "0 (clean)", "0 (clean)"]
