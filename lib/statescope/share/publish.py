"""Writing a shareable render from an executed notebook: scrub first, write, check, or refuse.

What it does: ``write_shared`` takes an executed notebook and writes ``<out>/`` — ``<stem>.html``,
``<stem>.md``, ``summary.md``, ``figures/*.png``, ``data/*.json``, ``manifest.json`` — in this
order, so that no artefact is ever made from unscrubbed input:

1. ``scrub_notebook``: every string of the notebook (cell sources, stream and error outputs, every
   text MIME bundle, the plotly figure specs, metadata) through ``Scrubber.scrub`` /
   ``scrub_obj``; images lose their metadata (``decoded.strip_image_metadata``). Figures are
   therefore scrubbed *before* they are exported: a secret in a figure title never reaches the
   PNG's pixels.
2. figure export and the renders, all from the scrubbed notebook; the manifest is the allowlist of
   ``statescope.share.envmanifest``, scrubbed; the summary is cut only after it was scrubbed.
   Secrets split across outputs and cells are found in the concatenation of everything printed;
   figures' typed arrays and number lists that spell a secret are zeroed.
3. a second scrub of every text file written and metadata stripping of every image written —
   only the files this render wrote (it tracks them); the user's own files are never touched.
4. ``statescope.share.leakcheck.check_files``: every written file in every decoded view, every
   name, the printed outputs read across cells, the figures' numbers read as text. A leak removes
   the files this render (or an earlier render of the notebook) wrote, writes ``REFUSED.md``
   (naming the file and pattern, never the value) and raises ``SecretLeak``.
5. plotly.js into the HTML page (once, from the installed package: ``export.embed_plotly_js``).

The result dictionary it returns is scrubbed too (it is printed by ``render --json``).

What it deliberately does not do: execute notebooks (``statescope.share.render``), or read pixels
of images a notebook drew itself (matplotlib): those can only be as clean as what was drawn.
"""
from __future__ import annotations

import base64
import binascii
import copy
import html
import json
from pathlib import Path
from typing import Any

from statescope.share import decoded, leakcheck
from statescope.share.scrub import Scrubber, SecretLeak, apply_spans, parameter_secrets

TEXT_SUFFIXES = (".html", ".md", ".json", ".txt", ".svg", ".csv")
IMAGE_MIMES = ("image/png", "image/jpeg")


def _text(value: Any) -> Any:
    return "".join(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value


def _clean_image(b64: Any) -> Any:
    try:
        raw = base64.b64decode(_text(b64), validate=False)
    except (binascii.Error, ValueError, TypeError):
        return b64
    cleaned = decoded.strip_image_metadata(raw)
    return base64.b64encode(cleaned).decode() if cleaned != raw else b64


def _scrub_bundle(data: dict, scrubber: Scrubber) -> dict:
    out = {}
    for mime, value in data.items():
        if mime in IMAGE_MIMES:
            out[mime] = _clean_image(value)  # pixels cannot be scrubbed; their metadata can
        elif isinstance(value, (dict, list)) and not isinstance(_text(value), str):
            out[mime] = scrubber.scrub_obj(value)
        else:
            out[mime] = scrubber.scrub(_text(value))
    return out


def _printed(nb: Any) -> list[tuple[dict, str, str]]:
    """(holder, key, text) of every printed text of ``nb`` in order: streams, plain-text results,
    error values; what a reader reads as one run of text from cell to cell."""
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if isinstance(o.get("text"), str):
                out.append((o, "text", o["text"]))
            data = o.get("data", {})
            if isinstance(data.get("text/plain"), str):
                out.append((data, "text/plain", data["text/plain"]))
            if isinstance(o.get("evalue"), str):
                out.append((o, "evalue", o["evalue"]))
    return out


def printed_text(nb: Any) -> str:
    """Every printed text of ``nb`` concatenated (``_printed``): the view a cross-cell check reads."""
    return "".join(t for _h, _k, t in _printed(nb))


def _scrub_across_outputs(nb: Any, scrubber: Scrubber) -> None:
    """A secret printed half in one cell and half in the next: found in the concatenation of all
    printed texts, and each part replaced in its own output (the first part gets the marker)."""
    pieces = _printed(nb)
    if len(pieces) < 2:
        return
    whole = "".join(t for _h, _k, t in pieces)
    bounds, pos = [], 0
    for _h, _k, t in pieces:
        bounds.append((pos, pos + len(t)))
        pos += len(t)
    found = scrubber.value_spans(whole) + scrubber.split_spans(whole)
    edits: dict[int, list[tuple[int, int, str]]] = {}
    for start, end, repl in found:
        crossing = [i for i, (a, b) in enumerate(bounds) if a < end and start < b]
        if len(crossing) < 2:
            continue  # inside one output: its own scrub already saw it
        for n, i in enumerate(crossing):
            a, b = bounds[i]
            edits.setdefault(i, []).append((max(start, a) - a, min(end, b) - a, repl if n == 0 else ""))
    for i, spans in edits.items():
        holder, key, text = pieces[i]
        holder[key] = apply_spans(text, spans)


def scrub_notebook(nb: Any, scrubber: Scrubber) -> Any:
    """A copy of ``nb`` with every string scrubbed (also secrets split across outputs and cells)
    and image metadata stripped."""
    nb = copy.deepcopy(nb)
    nb.metadata = type(nb.metadata)(scrubber.scrub_obj(dict(nb.metadata)))
    for cell in nb.cells:
        cell.source = scrubber.scrub(_text(cell.source))
        cell.metadata = type(cell.metadata)(scrubber.scrub_obj(dict(cell.metadata)))
        for name, att in (cell.get("attachments") or {}).items():
            cell.attachments[name] = _scrub_bundle(att, scrubber)
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = scrubber.scrub(_text(out["text"]))
            if "data" in out:
                out["data"] = type(out["data"])(_scrub_bundle(out["data"], scrubber))
            if "metadata" in out:
                out["metadata"] = type(out["metadata"])(scrubber.scrub_obj(dict(out["metadata"])))
            for key in ("ename", "evalue"):
                if key in out:
                    out[key] = scrubber.scrub(out[key])
            if "traceback" in out:
                out["traceback"] = [scrubber.scrub(line) for line in out["traceback"]]
    _scrub_across_outputs(nb, scrubber)
    return nb


def _clean_written(paths: list[Path], scrubber: Scrubber) -> None:
    """Belt and braces over what the exporters wrote (only those files): text scrubbed again,
    images stripped."""
    for path in paths:
        if not path.is_file():
            continue
        data = path.read_bytes()
        if data.startswith((decoded.PNG_MAGIC, decoded.JPEG_MAGIC)):
            cleaned = decoded.strip_image_metadata(data)
            if cleaned != data:
                path.write_bytes(cleaned)
        elif path.suffix in TEXT_SUFFIXES:
            text = data.decode("utf-8", "replace")
            cleaned_text = scrubber.scrub(text)
            if cleaned_text != text:
                path.write_text(cleaned_text)


def render_outputs(out: Path, stem: str) -> list[Path]:
    """The files a render of ``stem`` writes into ``out`` (this one's or an earlier one's): the
    only files a refusal removes — the user's own files in the folder are never touched."""
    names = [out / n for n in (f"{stem}.html", f"{stem}.md", "summary.md", "manifest.json", "REFUSED.md")]
    names += sorted((out / "data").glob(f"{stem}-cell*-fig*.json"))
    names += sorted((out / "figures").glob(f"{stem}-cell*-fig*.png"))
    names += sorted((out / "figures").glob("output_*_*.*"))  # nbconvert's Markdown images
    return [p for p in names if p.is_file()]


def refuse(out: Path, stem: str, written: set[Path], exc: SecretLeak, scrubber: Scrubber) -> None:
    """Nothing of a refused render may stay where it could be committed or pasted: every file this
    render (or an earlier render of the notebook) wrote is removed; nothing else is touched."""
    for path in sorted(set(written) | set(render_outputs(out, stem))):
        path.unlink(missing_ok=True)
    for folder in (out / "data", out / "figures"):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "REFUSED.md").write_text(scrubber.scrub(f"render refused: {exc}\n"))


def write_shared(executed: Any, out: Path, stem: str, *, engines: list[dict], environ: dict,
                 parameters: dict, error: str | None, seconds: float, png: bool = True) -> dict:
    """Write the scrubbed renders of ``executed`` under ``out`` (see the module docstring); returns
    the scrubbed result dictionary, or raises ``SecretLeak`` after removing what it wrote. Only
    the files it writes are rewritten, checked and (on a refusal) removed."""
    from statescope.share import envmanifest
    from statescope.share import export as render_share
    from statescope.share import summary as render_summary

    secrets = parameter_secrets(parameters)  # -p db_password=...: removed wherever printed
    scrubber = Scrubber.for_environment(environ, scratch=True, secrets=secrets)  # what the render shows
    # the result names where the render was written: the caller opens those paths
    result_scrubber = Scrubber.for_environment(environ, secrets=secrets)
    written: set[Path] = set()
    try:
        leakcheck.check_text(stem, "the notebook's name", scrubber)
        nb = scrub_notebook(executed, scrubber)
        # fail closed: what the scrubbed notebook prints, read across cells, and the numbers of
        # its figures (typed arrays) read as text
        leakcheck.check_text(printed_text(nb), f"{stem}: the notebook's outputs read across cells",
                             scrubber)
        for cell in nb.cells:
            for o in cell.get("outputs", []):
                spec = o.get("data", {}).get(render_share.PLOTLY_MIME)
                if spec is not None:
                    leakcheck.check_numbers(spec, f"{stem}: a figure's data", scrubber)
        manifest = scrubber.scrub_obj(envmanifest.collect(engines, environ))
        # a re-render after cells moved must not leave the old cells' figure files behind
        stale = [*(out / "data").glob(f"{stem}-cell*-fig*.json")]
        stale += [*(out / "figures").glob(f"{stem}-cell*-fig*.png")] if png else []
        for f in stale:
            f.unlink()
        figures = render_share.extract_figures(nb, out, stem, png=png)
        written |= {out / f.data for f in figures} | {out / f.png for f in figures if f.png}
        for cell in nb.cells:  # the PNGs just inserted: metadata off before any render embeds them
            for o in cell.get("outputs", []):
                if "image/png" in o.get("data", {}):
                    o["data"]["image/png"] = _clean_image(o["data"]["image/png"])
        result = result_scrubber.scrub_obj({
            "notebook": stem, "ok": error is None, "error": error, "seconds": seconds,
            "parameters": parameters or {}, "figures": [vars(f) for f in figures], "dir": str(out),
            "checks": [f"{v} · {what}" for v, what in render_summary.checks_in(nb)]})
        manifest_md = envmanifest.to_markdown(manifest)
        footer = "\n\n---\n\n## Environment (statescope manifest)\n\n" + manifest_md
        manifest_json = json.dumps(manifest, indent=1, default=str)
        md_images: set[str] = set()
        files = {
            f"{stem}.html": render_share.to_html(nb, stem).replace(
                "</body>", f"<details><summary>Environment (statescope manifest)</summary><pre>"
                           f"{html.escape(manifest_json)}</pre></details></body>"),
            f"{stem}.md": render_share.to_markdown(render_share.markdown_copy(nb, figures), out, stem,
                                                   written=md_images) + footer,
            "summary.md": render_summary.summary_markdown(result, nb, manifest_md),
            "manifest.json": manifest_json,
        }
        written |= {out / n for n in md_images}
        for name, text in files.items():
            (out / name).write_text(scrubber.scrub(text))
            written.add(out / name)
        paths = sorted(written)
        _clean_written(paths, scrubber)
        result["files"] = sorted(str(p.relative_to(out)) for p in paths)
        leakcheck.check_files(out, paths, scrubber)
        leakcheck.check_text(json.dumps(result, default=str), "the render's result", result_scrubber)
    except SecretLeak as exc:
        refuse(out, stem, written, exc, scrubber)
        raise
    # plotly.js into the page: the package's own bundle, after the check (export.PLOTLY_JS_SLOT)
    render_share.embed_plotly_js(out / f"{stem}.html")
    (out / "REFUSED.md").unlink(missing_ok=True)  # an earlier refusal's note: this render passed
    result["summary_chars"] = len((out / "summary.md").read_text())
    return result
