"""Results of a bisection: the probes made, the posterior after each, the answer, and its figure.

What it does: ``ProbeRecord`` is one probe (item, failures/requests, the most likely location and
its mass after it); ``BisectResult`` holds all of them with the prior and every posterior (and,
for builds, each build's source census brief: ``statescope.builds.census``, and for live
bisections the cells run, their cost, the checked answer and the trigger arm's labels), says
what the answer means for its mode, serialises to JSON (``to_dict``, what ``statescope bisect
--json`` prints), renders an HTML table in notebooks and a Plotly heatmap of the posterior over
the change location after every probe (``posterior_figure``).

What it deliberately does not do: compute posteriors (``statescope.bisect.model``) or run probes.
"""
from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class ProbeRecord:
    step: int
    index: int
    label: str
    n: int
    k: int
    requests_total: int
    map_index: int
    confidence: float
    info_bits: float | None = None
    seeds: list[int] | None = None  # the seed set the probe ran (confirmed bisection)


@dataclass
class BisectResult:
    """Probes made, the posterior after each, and the answer (first item of the after regime)."""
    method: str
    mode: str
    labels: list[str]
    probes: list[ProbeRecord]
    prior: list[float]
    posteriors: list[list[float]]
    answer_index: int
    confidence: float
    requests_used: int
    stopped: str
    settings: dict = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # label -> why it could not be probed
    census: dict[str, str] = field(default_factory=dict)  # label -> the build's census brief
    # live bisections over builds (statescope bisect --builds): every cell run, what they cost,
    # the answer checked against the probes (statescope.bisect.answer), and the PATCHED /
    # AMPLIFIED / PLANTED labels of the trigger arm every probe carried
    cells: list[dict] = field(default_factory=list)
    cost: dict = field(default_factory=dict)
    check: dict = field(default_factory=dict)
    marks: list[str] = field(default_factory=list)
    # confirmed bisection (statescope.bisect.confirmed): outcome, answer or None, reason, items
    outcome: dict = field(default_factory=dict)

    @property
    def answer(self) -> str:
        """The answer's label; with an outcome, the outcome itself when it names no item."""
        if self.outcome:
            o = self.outcome
            return f"{o['outcome']}: {o['answer']}" if o.get("answer") else o["outcome"]
        return self.labels[self.answer_index]

    @property
    def answer_meaning(self) -> str:
        return ("first item with the higher failure rate" if self.mode == "regression"
                else "first item with the lower failure rate (the fix)")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(answer=self.answer, answer_meaning=self.answer_meaning)
        return json.loads(json.dumps(d, default=float))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BisectResult":
        """Rebuild from ``to_dict`` output (e.g. committed results), for tables and figures."""
        names = [f.name for f in fields(cls)]
        kw = {k: d[k] for k in names if k in d}
        kw["probes"] = [ProbeRecord(**p) for p in d["probes"]]
        return cls(**kw)

    def hypothesis(self, index: int) -> str:
        """The label of change location ``index``; N (the edge hypothesis) is "(none)"."""
        return self.labels[index] if index < len(self.labels) else "(none)"

    def to_frame(self):
        """One row per probe: the build or item probed, its verdict (failed / clean), the counts
        and the most likely change location after it."""
        import pandas as pd

        return pd.DataFrame([{"probe": p.step, "label": p.label, "verdict": "failed" if p.k else "clean",
                              "failed": p.k, "requests": p.n, "requests_so_far": p.requests_total,
                              "most_likely": self.hypothesis(p.map_index), "mass": p.confidence}
                             for p in self.probes],
                            columns=["probe", "label", "verdict", "failed", "requests",
                                     "requests_so_far", "most_likely", "mass"])

    def _repr_html_(self) -> str:
        e = html.escape
        rows = "".join(
            f"<tr><td>{p.step}</td><td>{e(p.label)}</td><td>{p.k}/{p.n}</td><td>{p.requests_total}"
            f"</td><td>{e(self.hypothesis(p.map_index))}</td><td>{p.confidence:.3f}</td></tr>"
            for p in self.probes)
        return (f"<div><b>{e(self.method)} bisection ({e(self.mode)})</b>: {e(self.answer_meaning)} = "
                f"<b>{e(self.answer)}</b>, posterior mass {self.confidence:.3f}, {self.requests_used} "
                f"requests in {len(self.probes)} probes, stopped: {e(self.stopped)}"
                + "".join(f"<br>skipped {e(k)}: {e(v)}" for k, v in self.skipped.items())
                + "".join(f"<br>census of {e(k)}: {e(v)}" for k, v in self.census.items() if v)
                + "<table><tr><th>probe"
                f"</th><th>item</th><th>failed/requests</th><th>requests so far</th><th>most likely"
                f"</th><th>its mass</th></tr>{rows}</table></div>")

    def posterior_figure(self):
        """Plotly heatmap: posterior over the change location (x) after each probe (y)."""
        import plotly.graph_objects as go

        z = [self.prior] + self.posteriors
        ys = list(range(len(z)))
        # with the edge hypotheses the last column is "no change within the items"
        xs = self.labels + (["(none)"] if len(z[0]) == len(self.labels) + 1 else [])
        fig = go.Figure(go.Heatmap(z=z, x=xs, y=ys, colorscale="Blues", zmin=0, zmax=1,
                                   colorbar={"title": "P(change here)"}))
        for failed, colour, symbol in ((True, "#c62828", "x"), (False, "#2e7d32", "circle-open")):
            ps = [p for p in self.probes if (p.k > 0) == failed]
            fig.add_trace(go.Scatter(
                x=[p.label for p in ps], y=[p.step for p in ps], mode="markers",
                marker={"color": colour, "symbol": symbol, "size": 9},
                name="probe with failures" if failed else "clean probe",
                text=[f"{p.k}/{p.n} failed" for p in ps], hoverinfo="text+x+y"))
        marks = "".join(f"{w} " for w in dict.fromkeys(m.split(" ")[0].rstrip(":") for m in self.marks)
                        if w.isupper())
        fig.update_layout(title=f"{marks}{self.method} bisection ({self.mode}): {self.answer} "
                                f"(mass {self.confidence:.2f}, {self.requests_used} requests)",
                          xaxis_title="change location (first item after the change)",
                          yaxis_title="after probe #", height=260 + 14 * len(z), width=760,
                          yaxis={"tick0": 0, "dtick": 1})  # whole probes, no ticks at 0.5
        fig.update_xaxes(type="category")
        return fig
