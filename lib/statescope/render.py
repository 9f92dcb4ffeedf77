"""Execute the workbook's notebooks headless and render them to HTML.

What it does: ``run_notebooks`` executes each ``notebooks/NN_name.ipynb`` (jupytext-paired with a
``py:percent`` twin; the ``.py`` is the source of truth and is synced into the ``.ipynb`` first)
with nbclient in the repository root, and writes ``reports/NN_name.html``. A failing notebook is
reported with its first error line and still rendered (with the traceback), so the report shows
where it stopped.

What it deliberately does not do (yet): parameters, Markdown/PNG export and scrubbing for issue
threads — the sharing issue extends this module.
"""
from __future__ import annotations

import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"


def notebook_paths(names: list[str] | None = None) -> list[Path]:
    from statescope.errors import InputError

    if not names:
        return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    paths = []
    for name in names:
        stem = Path(name).stem
        p = NOTEBOOKS / f"{stem}.py"
        if not p.is_file():
            raise InputError(f"notebook {name!r}: no {p} (expected one of "
                             f"{[q.stem for q in notebook_paths()]})")
        paths.append(p)
    return paths


def sync_pair(py_path: Path):
    """Read the percent-format source and write its paired .ipynb (outputs stripped)."""
    import jupytext

    nb = jupytext.read(py_path)
    nb.metadata["jupytext"] = {"formats": "ipynb,py:percent"}
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    ipynb = py_path.with_suffix(".ipynb")
    # Rewrite only when the cells changed: a rewrite draws new cell ids and dirties the checkout.
    if not ipynb.exists() or _cells(jupytext.read(ipynb)) != _cells(nb):
        jupytext.write(nb, ipynb, fmt="ipynb")
    return nb


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def run_notebook(py_path: Path, out_dir: Path, timeout_s: int = 1800) -> dict:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from nbconvert import HTMLExporter

    import os

    nb = sync_pair(py_path)
    # Plotly figures must carry an HTML rendering, or nbconvert drops them from the report.
    os.environ.setdefault("PLOTLY_RENDERER", "plotly_mimetype+notebook_connected")
    t0 = time.perf_counter()
    error = None
    try:
        NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                       resources={"metadata": {"path": str(REPO)}}).execute()
    except CellExecutionError as exc:
        error = str(exc).strip().splitlines()[-1] if str(exc).strip() else "cell failed"
    out_dir.mkdir(parents=True, exist_ok=True)
    html_path = out_dir / f"{py_path.stem}.html"
    body, _ = HTMLExporter().from_notebook_node(nbformat.from_dict(nb))
    html_path.write_text(body)
    return {"notebook": py_path.stem, "ok": error is None, "error": error,
            "html": str(html_path), "seconds": time.perf_counter() - t0}


def run_notebooks(names: list[str] | None = None, out_dir: str | Path = "reports") -> list[dict]:
    out = Path(out_dir)
    if not out.is_absolute():
        out = REPO / out
    return [run_notebook(p, out) for p in notebook_paths(names)]
