"""Configuration matrix: one fresh engine per cell, every cell judged against one control.

What it does: ``config_matrix(axes, trace, ...)`` takes the cartesian product of setting axes
(e.g. ``{"enable_prefix_caching": [True, False], "num_speculative_tokens": [0, 2]}``), runs the
trace through a fresh real engine per cell, labels outputs against a shared control run (the
reference configuration by default), and returns a ``MatrixResult``: one row per cell with the
*requested* values, the *resolved* values (two cells that resolve to the same configuration are
flagged — the CPU platform, for instance, resolves every async setting to off), the build's
source census brief (``census``: which fixes it contains, ``statescope.builds.census``), the failure rate
with its Clopper–Pearson interval, and the engagement counters. ``heatmap()`` draws it (plotly).

What it deliberately does not do: cross builds (``statescope.builds``, the bisection issue) or
explain failures.
"""
from __future__ import annotations

import html
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statescope.engine.config import EngineConfig
from statescope.errors import InputError
from statescope.verdict.reproduce import Arm, ArmRun, label_rows, run_arm
from statescope.verdict.units import summarize_arm
from statescope.verdict.stats import clopper_pearson
from statescope.records import ResultsStore

RESOLVED_KEYS = ("enable_prefix_caching", "mamba_cache_mode", "num_speculative_tokens",
                 "async_scheduling", "mamba_block_size")


def cell_config(base: EngineConfig, cell: dict) -> EngineConfig:
    """Apply one cell's settings by the one override rule (``EngineConfig.with_overrides``: no
    cache mode without caching, 0 speculative tokens turn speculation off), as ``reproduce``
    applies its ``--trigger-set``."""
    return base.with_overrides(cell, where="cell settings")


@dataclass
class MatrixResult:
    rows: list[dict]
    axes: dict
    census: str | None = None  # brief source census of the build the cells ran in

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.rows)

    def to_frame(self):
        """``frame()``: one row per cell, a pandas DataFrame (the name every result uses)."""
        return self.frame()

    def to_dict(self) -> dict:
        return {"axes": self.axes, "cells": self.rows, "census": self.census}

    def heatmap(self, x: str | None = None, y: str | None = None):
        import plotly.graph_objects as go

        names = list(self.axes)
        x, y = x or names[0], y or (names[1] if len(names) > 1 else names[0])
        xs, ys = list(self.axes[x]), list(self.axes[y])
        z, text = [], []
        for yv in ys:
            zr, tr = [], []
            for xv in xs:
                cells = [r for r in self.rows if r[x] == xv and r[y] == yv]
                k = sum(r["failed"] for r in cells)
                n = sum(r["units"] for r in cells)
                zr.append(k / n if n else None)
                tr.append(f"{k}/{n}" + ("<br>same as another cell" if any(
                    r["duplicate_of"] for r in cells) else ""))
            z.append(zr)
            text.append(tr)
        fig = go.Figure(go.Heatmap(z=z, x=[str(v) for v in xs], y=[str(v) for v in ys], text=text,
                                   texttemplate="%{text}", colorscale="Reds", zmin=0,
                                   colorbar={"title": "failure rate"}))
        # category axes: values such as "0" / "2" would otherwise become a numeric axis with
        # ticks at -0.5 ... 2.5 between the cells
        fig.update_layout(xaxis_title=x, yaxis_title=y, height=360, width=520,
                          xaxis_type="category", yaxis_type="category",
                          title="failed units per cell (requested settings)")
        return fig

    def _repr_html_(self) -> str:
        cols = list(self.axes) + ["resolved", "failed", "units", "rate", "ci95", "hits",
                                  "accepted", "duplicate_of"]
        head = "".join(f"<th>{c}</th>" for c in cols)
        body = ""
        for r in self.rows:
            cells = [r[c] for c in self.axes] + [
                ", ".join(f"{k}={r['resolved'].get(k)}" for k in RESOLVED_KEYS),
                r["failed"], r["units"], f"{r['rate']:.1%}",
                f"[{r['ci95'][0]:.1%}, {r['ci95'][1]:.1%}]", r["prefix_cache_hits"],
                r["spec_accepted_tokens"], r["duplicate_of"] or ""]
            style = " style='background:#fff3cd'" if r["duplicate_of"] else ""
            body += f"<tr{style}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>"
        caption = f"<caption>build census: {html.escape(self.census)}</caption>" if self.census else ""
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def config_matrix(axes: dict[str, list], trace: list, *, store_root: str | Path, run_id: str,
                  base: EngineConfig | None = None, control: EngineConfig | None = None,
                  control_run: ArmRun | None = None, unit: str = "episode",
                  runner: str = "offline", census: str | None = None) -> MatrixResult:
    """Run every cell of ``axes`` (fresh engine each) and label it against one control run.
    ``census``: the build's one-line source census to show beside the cells (the caller reads it:
    ``statescope.builds.installed_brief()``; the builds wing sits above this one)."""
    if not axes or any(not isinstance(v, list) or not v for v in axes.values()):
        raise InputError("config_matrix axes: expected {setting: [values, ...]} with non-empty lists")
    base = base or EngineConfig()
    control = control or base.replace(enable_prefix_caching=False, mamba_cache_mode=None,
                                      speculative_method=None, num_speculative_tokens=0)
    store = ResultsStore(Path(store_root), run_id)
    rows: list[dict] = []
    with store:
        store.start(resolved_config={"axes": axes, "base": base.to_dict()})
        ctl = control_run or run_arm(Arm("control", control), trace, store, runner=runner)
        seen: dict[tuple, str] = {}
        for values in itertools.product(*axes.values()):
            cell = dict(zip(axes, values))
            name = "cell-" + "-".join(f"{k}={v}" for k, v in cell.items())
            config = cell_config(base, cell)
            arm = Arm(name, config, expect_prefix_cache=config.enable_prefix_caching,
                      expect_spec=config.speculative)
            run = run_arm(arm, trace, store, runner=runner)
            summary = summarize_arm(run, label_rows(run, ctl), unit)
            resolved_key = tuple(run.resolved.get(k) for k in RESOLVED_KEYS)
            rows.append({**cell, "resolved": {k: run.resolved.get(k) for k in RESOLVED_KEYS},
                         "warnings": run.resolved.get("warnings", []),
                         "failed": summary.n_failed_units, "units": summary.n_units,
                         "rate": summary.n_failed_units / summary.n_units if summary.n_units else 0.0,
                         "ci95": clopper_pearson(summary.n_failed_units, summary.n_units),
                         "prefix_cache_hits": summary.prefix_cache_hits,
                         "spec_accepted_tokens": summary.spec_accepted_tokens,
                         "duplicate_of": seen.get(resolved_key)})
            seen.setdefault(resolved_key, name)
    return MatrixResult(rows, axes, census=census)
