"""Turning an executed notebook into shareable files: figures as PNG + data, HTML, GitHub Markdown.

What it does: ``extract_figures`` finds every plotly figure in a notebook's outputs, writes its
data (the figure JSON) under ``data/`` and a static PNG under ``figures/`` (one Chrome start for
all; a figure that cannot be exported is listed with the reason), and adds the PNG after the
interactive figure. ``to_html`` renders the whole notebook; ``to_markdown`` renders GitHub-flavoured
Markdown in which each plotly figure is its PNG (or a "not exported: why" line), widgets become a
note, and HTML tables lose the ``<style>`` blocks GitHub would show as text.

What it deliberately does not do: execute notebooks (``statescope.share.render``) or scrub
(``statescope.share.publish`` scrubs the notebook before any of this runs on it).
"""
from __future__ import annotations

import base64
import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statescope.share.decoded import ANSI

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
STYLE_BLOCK = re.compile(r"<style[^>]*>.*?</style>", re.S)
# tqdm progress bars (vLLM's weight loading) become widgets in a kernel: dropped from renders.
PROGRESS_BAR = re.compile(r"\d+%.*\|.*(?:it/s|s/it)")
WIDGET_NOTE = "*(interactive widget: open the notebook in JupyterLab with a live kernel to use it)*"


@dataclass
class Figure:
    cell: int
    index: int
    png: str | None  # path relative to the output folder
    data: str  # path relative to the output folder
    error: str | None


def extract_figures(nb: Any, out_dir: Path, stem: str, *, png: bool = True,
                    timeout_s: float = 180.0) -> list[Figure]:
    """Write each plotly figure's JSON and PNG; add the PNG to the notebook after the figure."""
    import plotly.graph_objects as go

    from statescope.share.figures import save_pngs

    found: list[tuple[int, int, dict]] = []
    for ci, cell in enumerate(nb.cells):
        for oi, out in enumerate(cell.get("outputs", [])):
            spec = out.get("data", {}).get(PLOTLY_MIME)
            if spec is not None:
                found.append((ci, oi, spec))
    figures: list[Figure] = []
    figs, pngs = [], []
    for k, (ci, _oi, spec) in enumerate(found):
        name = f"{stem}-cell{ci:02d}-fig{k:02d}"
        data_rel = f"data/{name}.json"
        (out_dir / "data").mkdir(parents=True, exist_ok=True)
        (out_dir / data_rel).write_text(json.dumps(spec, default=str))
        figures.append(Figure(ci, k, f"figures/{name}.png", data_rel, None))
        figs.append(go.Figure(spec))
        pngs.append(out_dir / "figures" / f"{name}.png")
    if png and figs:
        written, why = save_pngs(figs, pngs, timeout_s=timeout_s)
    else:
        written, why = [None] * len(figs), "PNG export switched off (--no-png)"
    for fig, path in zip(figures, written):
        if path is None:
            fig.png, fig.error = None, why or "export failed"
    # Insert the PNGs after their figures, last first so earlier output indices stay valid.
    for (ci, oi, _spec), fig in reversed(list(zip(found, figures))):
        if fig.png:
            b64 = base64.b64encode((out_dir / fig.png).read_bytes()).decode()
            nb.cells[ci].outputs.insert(oi + 1, _display({"image/png": b64,
                                                          "text/plain": f"<static {fig.png}>"},
                                                         {"statescope": "static-figure"}))
    return figures


def _display(data: dict, metadata: dict | None = None) -> Any:
    import nbformat

    return nbformat.v4.new_output("display_data", data=data, metadata=metadata or {})


# plotly.js goes into the page once, after the leak check passed (``embed_plotly_js``): it is the
# installed plotly package's own bundle, not notebook data, and 4.8 MB of minified JavaScript
# would cost minutes of scanning and trip the credential-assignment shape on its own code.
PLOTLY_JS_SLOT = "/* statescope: plotly.js is inserted here once the render passed its leak check */"
PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
{scripts}
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; }}
pre, .highlight {{ background: #f6f8fa; padding: .6em; overflow-x: auto; font-size: 13px; }}
.jp-InputArea pre {{ border-left: 3px solid #8ab; }}
table {{ border-collapse: collapse; font-size: 13px; }} td, th {{ border: 1px solid #ccc; padding: 2px 6px; }}
img {{ max-width: 100%; }}
</style></head><body>
{body}
</body></html>
"""


def _progress_bar(out: Any) -> bool:
    data = out.get("data", {})
    return WIDGET_MIME in data and bool(PROGRESS_BAR.search(str(data.get("text/plain", ""))))


def to_html(nb: Any, title: str) -> str:
    """A light standalone page (nbconvert's "basic" body, a few lines of CSS): widgets become a note."""
    import html

    import nbformat
    from nbconvert import HTMLExporter

    page_nb = _without_widgets(nb)
    figures = _offline_figures(page_nb)
    body, _ = HTMLExporter(template_name="basic").from_notebook_node(nbformat.from_dict(page_nb))
    scripts = f"<script>{PLOTLY_JS_SLOT}</script>" if figures else ""
    return PAGE.format(title=html.escape(title), body=body, scripts=scripts)


def _offline_figures(nb: Any) -> int:
    """Each plotly figure drawn by the page itself (``Plotly.newPlot`` on its spec) instead of the
    notebook renderer's snippet, which loads plotly.js from a CDN (a blank gap offline); plotly's
    loader outputs are dropped. Returns the number of figures."""
    n = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_MIME in data:
                spec = data[PLOTLY_MIME]
                height = int((spec.get("layout") or {}).get("height") or 450)
                payload = json.dumps({"data": spec.get("data", []), "layout": spec.get("layout", {})},
                                     default=str).replace("</", "<\\/")
                div = f"statescope-figure-{n}"
                out = _display({"text/html": (
                    f'<div id="{div}" class="plotly-graph-div" style="height:{height}px"></div>'
                    f'<script>(function(){{var f={payload};Plotly.newPlot("{div}",f.data,f.layout,'
                    f'{{responsive:true}});}})();</script>')}, out.get("metadata"))
                n += 1
            elif "<script" in data.get("text/html", "") and "text/plain" not in data:
                continue  # the renderer's plotly.js loader (from the CDN)
            outputs.append(out)
        cell.outputs = outputs
    return n


def embed_plotly_js(html_path: Path) -> bool:
    """Put the installed plotly.js bundle into the page's slot (once); False when there is none."""
    text = html_path.read_text()
    if PLOTLY_JS_SLOT not in text:
        return False
    from plotly.offline import get_plotlyjs

    bundle = get_plotlyjs().replace("</script", "<\\/script")
    html_path.write_text(text.replace(PLOTLY_JS_SLOT, bundle, 1))
    return True


def _without_widgets(nb: Any) -> Any:
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)  # saved widget state: megabytes (anywidget ships its JS) and dead
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [_display({"text/markdown": WIDGET_NOTE}) if WIDGET_MIME in o.get("data", {})
                            else o for o in cell.get("outputs", []) if not _progress_bar(o)]
    return nb


def markdown_copy(nb: Any, figures: list[Figure]) -> Any:
    """A copy of ``nb`` whose outputs GitHub can show: PNG links, no widgets, no style blocks."""
    md = copy.deepcopy(nb)
    md.metadata.pop("widgets", None)
    by_cell: dict[int, list[Figure]] = {}
    for f in figures:
        by_cell.setdefault(f.cell, []).append(f)
    for ci, cell in enumerate(md.cells):
        if cell.cell_type != "code":
            continue
        queue = list(by_cell.get(ci, []))
        outputs = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if out.get("metadata", {}).get("statescope") == "static-figure":
                continue  # the link below replaces it
            if PLOTLY_MIME in data:
                f = queue.pop(0) if queue else None
                text = (f"![figure]({f.png})\n\n<sub>data: [{f.data}]({f.data})</sub>" if f and f.png
                        else f"*figure not exported as PNG: {f.error if f else 'unknown'}*")
                outputs.append(_display({"text/markdown": text}))
            elif _progress_bar(out):
                continue
            elif WIDGET_MIME in data:
                outputs.append(_display({"text/markdown": WIDGET_NOTE}))
            elif "<script" in data.get("text/html", "") and "text/plain" not in data:
                continue  # plotly's loader snippet: nothing GitHub would show
            else:
                if "text/html" in data:
                    data["text/html"] = STYLE_BLOCK.sub("", data["text/html"])
                if isinstance(out.get("text"), str):  # GitHub shows terminal colour codes as text
                    out["text"] = ANSI.sub("", out["text"])
                if isinstance(data.get("text/plain"), str):
                    data["text/plain"] = ANSI.sub("", data["text/plain"])
                outputs.append(out)
        cell.outputs = outputs
    return md


def to_markdown(nb: Any, out_dir: Path, stem: str, written: set[str] | None = None) -> str:
    """GitHub-flavoured Markdown; other images (e.g. matplotlib) are written under figures/ (their
    names, relative to ``out_dir``, are added to ``written``)."""
    import nbformat
    from nbconvert import MarkdownExporter

    body, resources = MarkdownExporter().from_notebook_node(
        nbformat.from_dict(nb), resources={"output_files_dir": "figures"})
    for name, blob in (resources.get("outputs") or {}).items():
        target = out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(blob)
        if written is not None:
            written.add(name)
    return body


def without_plotly_js(text: str) -> str:
    """A page with its embedded plotly.js bundle put back to the slot (what the leak check read)."""
    from plotly.offline import get_plotlyjs

    return text.replace(get_plotlyjs().replace("</script", "<\\/script"), PLOTLY_JS_SLOT, 1)
