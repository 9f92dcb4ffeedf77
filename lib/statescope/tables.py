"""Small result objects that render themselves in a notebook (``_repr_html_``) and as JSON.

What it does: ``KeyValueTable`` (a titled mapping, e.g. a resolved configuration, with rows that
carry a warning highlighted) and ``RecordsTable`` (a titled list of row dicts). Notebooks show these
objects directly instead of printing them.

What it deliberately does not do: plotting (``statescope.plots``) or styling beyond a few inline
rules, so the HTML survives GitHub and nbconvert.
"""
from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return html.escape(json.dumps(value, default=str))
    return html.escape(str(value))


@dataclass
class KeyValueTable:
    title: str
    values: dict
    highlight: set = field(default_factory=set)

    def to_dict(self) -> dict:
        return dict(self.values)

    def to_frame(self):
        """A pandas DataFrame (field, value) to filter and export."""
        import pandas as pd

        return pd.DataFrame({"field": list(self.values), "value": list(self.values.values())})

    def _repr_html_(self) -> str:
        rows = []
        for key, value in self.values.items():
            style = ' style="background:#fde2e1;font-weight:bold"' if key in self.highlight else ""
            rows.append(f"<tr{style}><th style='text-align:left'>{html.escape(str(key))}</th>"
                        f"<td style='text-align:left'>{_cell(value)}</td></tr>")
        return f"<table><caption>{html.escape(self.title)}</caption>{''.join(rows)}</table>"

    def __repr__(self) -> str:
        width = max((len(str(k)) for k in self.values), default=0)
        lines = [self.title] + [f"  {str(k):<{width}}  {v}" for k, v in self.values.items()]
        return "\n".join(lines)


@dataclass
class RecordsTable:
    title: str
    rows: list[dict]
    columns: list[str] | None = None

    def to_dict(self) -> list[dict]:
        return list(self.rows)

    def to_frame(self):
        """A pandas DataFrame, one row per record, to filter and export."""
        import pandas as pd

        return pd.DataFrame(self.rows, columns=self._cols())

    def _cols(self) -> list[str]:
        if self.columns:
            return self.columns
        cols: list[str] = []
        for row in self.rows:
            cols += [c for c in row if c not in cols]
        return cols

    def _repr_html_(self) -> str:
        cols = self._cols()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c, ''))}</td>" for c in cols) + "</tr>"
                       for r in self.rows)
        return (f"<table><caption>{html.escape(self.title)}</caption><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>")

    def __repr__(self) -> str:
        cols = self._cols()
        lines = [self.title, "  " + " | ".join(cols)]
        lines += ["  " + " | ".join(str(r.get(c, "")) for c in cols) for r in self.rows]
        return "\n".join(lines)
