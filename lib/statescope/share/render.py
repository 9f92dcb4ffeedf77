"""Execute the workbook's notebooks headless and render them to HTML.

What it does: ``run_notebooks`` executes each ``notebooks/NN_name.ipynb`` (jupytext-paired with a
``py:percent`` twin; the ``.py`` is the source of truth and is synced into the ``.ipynb`` first)
with nbclient in the repository root, and writes ``reports/NN_name.html``. A failing notebook is
reported with its first error line and still rendered (with the traceback), so the report shows
where it stopped.

``render_for_sharing`` is the sharing path (``statescope render``): it executes a notebook with
papermill parameters, records the resolved configuration of every engine the notebook starts,
writes ``<out>/<stem>/`` with ``<stem>.html``, ``<stem>.md`` (GitHub-flavoured, figures as PNG),
``summary.md`` (issue-ready), ``figures/*.png``, ``data/*.json`` (the data behind each figure)
and ``manifest.json`` (``statescope.share.envmanifest``). The writing is
``statescope.share.publish.write_shared``: every artefact made from the scrubbed notebook, then
every file and name checked in every decoded view; a surviving secret refuses the render
(``SecretLeak``; the render's own files are removed and a ``REFUSED.md`` names the file and
pattern). The engines the notebook started are read back before the temporary folder goes. A
cell over the per-cell timeout ends the run; the cells before it are still rendered.

What it deliberately does not do: upload anything, or decide what a notebook computes.
"""
from __future__ import annotations

import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
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


def run_notebook(py_path: Path, out_dir: Path, timeout_s: int = 1800, *, progress=None,
                 keep_warnings: bool = False) -> dict:
    """Execute and render one notebook. ``progress`` (``statescope.progress``) advances per code
    cell; known-benign warnings are dropped from its outputs unless ``keep_warnings``."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from nbconvert import HTMLExporter

    import os

    nb = sync_pair(py_path)
    # Plotly figures must carry an HTML rendering, or nbconvert drops them from the report; the
    # "notebook" renderer puts plotly.js into the page once (offline), "notebook_connected" would
    # load it from a CDN (a blank gap offline). The kernel inherits it at its start.
    saved = os.environ.get("PLOTLY_RENDERER")
    os.environ["PLOTLY_RENDERER"] = "plotly_mimetype+notebook"
    t0 = time.perf_counter()
    error = None
    try:
        NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                       resources={"metadata": {"path": str(REPO)}},
                       on_cell_executed=_cell_hook(progress)).execute()
    except CellExecutionError as exc:
        error = str(exc).strip().splitlines()[-1] if str(exc).strip() else "cell failed"
    finally:
        if saved is None:
            os.environ.pop("PLOTLY_RENDERER", None)
        else:
            os.environ["PLOTLY_RENDERER"] = saved
    if not keep_warnings:
        from statescope.quiet import clean_notebook

        clean_notebook(nb)
    out_dir.mkdir(parents=True, exist_ok=True)
    html_path = out_dir / f"{py_path.stem}.html"
    body, _ = HTMLExporter().from_notebook_node(nbformat.from_dict(nb))
    html_path.write_text(body)
    return {"notebook": py_path.stem, "ok": error is None, "error": error,
            "html": str(html_path), "seconds": time.perf_counter() - t0}


def _cell_hook(progress):
    if progress is None:
        return None

    def on_cell_executed(cell=None, **_):
        if cell is not None and cell.get("cell_type") == "code":
            progress.advance()

    return on_cell_executed


def code_cells(nb) -> int:
    return sum(1 for c in nb.cells if c.cell_type == "code")


def run_notebooks(names: list[str] | None = None, out_dir: str | Path = "reports") -> list[dict]:
    out = Path(out_dir)
    if not out.is_absolute():
        out = REPO / out
    return [run_notebook(p, out) for p in notebook_paths(names)]


HOOK_TAG = "statescope-manifest-hook"


def source_notebook(source: str | Path):
    """(stem, notebook node) for a notebook path (.py percent or .ipynb) or a name in notebooks/."""
    import jupytext

    from statescope.errors import InputError

    path = Path(source)
    if path.suffix in (".py", ".ipynb") and path.is_file():
        if path.suffix == ".py" and path.parent.resolve() == NOTEBOOKS.resolve():
            return path.stem, sync_pair(path)
        try:
            return path.stem, jupytext.read(path)
        except Exception as exc:
            raise InputError(f"{path}: not a readable notebook ({exc})") from exc
    return notebook_paths([str(source)])[0].stem, sync_pair(notebook_paths([str(source)])[0])


def render_for_sharing(source: str | Path, out_dir: str | Path = "reports/share", *,
                       parameters: dict | None = None, png: bool = True,
                       timeout_s: int = 1800, environ: dict | None = None, progress=None,
                       keep_warnings: bool = False) -> dict:
    """Execute one notebook and write its scrubbed, shareable renders; see the module docstring.

    Returns a result dictionary (notebook, ok, error, seconds, files, figures, parameters). A
    failing notebook is still rendered (``ok`` False); a surviving secret raises ``SecretLeak``."""
    import os
    import tempfile

    import nbformat
    import papermill
    from nbclient.exceptions import CellTimeoutError
    from papermill.exceptions import PapermillExecutionError

    from statescope.share import envmanifest, publish
    from statescope.share.scrub import parameter_secrets

    parameter_secrets(parameters)  # a credential value too short to scrub: refused before it runs
    environ = dict(os.environ if environ is None else environ)
    stem, nb = source_notebook(source)
    out = Path(out_dir)
    out = (out if out.is_absolute() else REPO / out) / stem
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PLOTLY_RENDERER", "plotly_mimetype+notebook_connected")
    t0 = time.perf_counter()
    error = None
    with tempfile.TemporaryDirectory(prefix="statescope-render-") as tmp:
        engines_log = Path(tmp) / "engines.jsonl"
        hook = nbformat.v4.new_code_cell(
            f"import statescope.share.envmanifest as _m\n_m.record_engines({str(engines_log)!r})",
            metadata={"tags": [HOOK_TAG]})
        nb.cells.insert(0, hook)
        if progress is not None:  # the hook cell, and papermill's injected-parameters cell
            progress.add_total(1 + bool(parameters))
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.metadata.setdefault("language_info", {"name": "python"})
        src, done = Path(tmp) / f"{stem}.ipynb", Path(tmp) / f"{stem}.out.ipynb"
        nbformat.write(nb, src)
        try:  # saved after each cell: a cell over the timeout still leaves the cells before it
            papermill.execute_notebook(str(src), str(done), parameters=parameters or {},
                                       kernel_name="python3", cwd=str(REPO), progress_bar=False,
                                       request_save_on_cell_execute=True, execution_timeout=timeout_s,
                                       on_cell_executed=_cell_hook(progress))
        except PapermillExecutionError as exc:
            error = f"cell {exc.exec_count}: {exc.ename}: {exc.evalue}"
        except CellTimeoutError:
            error = f"a cell ran longer than the timeout ({timeout_s} s per cell); the cells after it did not run"
        executed = nbformat.read(done, as_version=4) if done.exists() else nb
        engines = envmanifest.read_engines(engines_log)  # before its temporary folder is gone
    if not keep_warnings:
        from statescope.quiet import clean_notebook

        clean_notebook(executed)
    executed.cells = [c for c in executed.cells if HOOK_TAG not in c.get("metadata", {}).get("tags", [])]
    # Every artefact is made from the scrubbed notebook, then checked (statescope.share.publish).
    return publish.write_shared(executed, out, stem, engines=engines, environ=environ,
                                parameters=parameters or {}, error=error,
                                seconds=time.perf_counter() - t0, png=png)


def render_all(out_dir: str | Path = "docs/gallery", names: list[str] | None = None, *,
               on_start=None, on_done=None, **kw) -> list[dict]:
    """``render_for_sharing`` for each notebook (default: every one in notebooks/), plus an index.
    ``on_start(path)`` may return a progress object for that notebook's cells; ``on_done(result)``
    is called as each notebook finishes (the CLI prints its line there)."""
    from statescope.share.scrub import SecretLeak

    out = Path(out_dir) if Path(out_dir).is_absolute() else REPO / out_dir
    results = []
    for p in notebook_paths(names):
        progress = on_start(p) if on_start else None
        try:
            results.append(render_for_sharing(p, out_dir, progress=progress, **kw))
        except SecretLeak as exc:  # one refused notebook must not stop the others; it still fails
            results.append({"notebook": p.stem, "ok": False, "error": f"render refused: {exc}",
                            "seconds": 0.0, "figures": [], "dir": str(out / p.stem), "summary_chars": 0})
        if on_done:
            on_done(results[-1])
    lines = ["# Rendered notebooks (statescope render --all)", "",
             "| notebook | executed | checks | HTML | Markdown | summary |", "|---|---|---|---|---|---|"]
    for r in results:
        n, checks = r["notebook"], r.get("checks", [])
        passed = sum(c.startswith("PASS") for c in checks)
        shown = f"{passed}/{len(checks)} PASS" if checks else "—"
        lines.append(f"| {n} | {'ok' if r['ok'] else 'FAILED'} | {shown} | "
                     f"[{n}.html]({n}/{n}.html) | "
                     f"[{n}.md]({n}/{n}.md) | [summary]({n}/summary.md) |")
    shots = sorted((out / "browser").glob("*.png")) if (out / "browser").is_dir() else []
    if shots:  # written by tests/test_browser.py: the live notebook in JupyterLab
        lines += ["", "Live notebook in JupyterLab (tests/test_browser.py): "
                  + ", ".join(f"[{p.name}](browser/{p.name})" for p in shots)]
    (out / "INDEX.md").write_text("\n".join(lines) + "\n")
    return results
