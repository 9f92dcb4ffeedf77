"""Static images of plotly figures: one PNG export with a timeout and a clear fallback.

What it does: `save_png(fig, path)` writes a PNG through plotly + kaleido, pointing kaleido at
Debian's `chromium` (kaleido needs a Chrome; nothing is downloaded at run time). When kaleido or a
Chrome is missing, or the export exceeds its timeout, it returns None and records why in
`last_export_error`, so a report can say "figure not exported: <why>" instead of crashing.
`save_pngs(figs, paths)` exports many figures through one browser start (a start costs seconds);
`export_png(fig, path)` says in a sentence where the PNG went, or why it did not.

What it deliberately does not do: install a browser, or render HTML (see statescope.share.render).
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable
from pathlib import Path
from typing import Any
from statescope.errors import InputError

CHROME_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
last_export_error: str | None = None


def chrome_path() -> str | None:
    """The Chrome/Chromium kaleido will use: $BROWSER_PATH, else the first one on PATH."""
    env = os.environ.get("BROWSER_PATH")
    if env and Path(env).exists():
        return env
    for name in CHROME_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class _IgnoredPipeNoise(logging.Filter):
    """kaleido's browser channel (choreographer) logs a full traceback when Chrome writes a line
    that is not JSON to its pipe, then ignores the line and the export succeeds; in a rendered
    notebook that traceback reads like a failure. Only that record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("JSONError decoding message")


def _quiet_pipe_noise() -> None:
    try:  # the channel's own logger object (a logistro logger: do not create it ourselves)
        from choreographer.channels import pipe as _pipe

        logger = _pipe._logger
    except (ImportError, AttributeError):
        return
    if not any(isinstance(f, _IgnoredPipeNoise) for f in logger.filters):
        logger.addFilter(_IgnoredPipeNoise())


def _exporter_missing() -> str | None:
    """Why no PNG can be exported here (no Chrome, no kaleido), or None; points kaleido at Chrome."""
    chrome = chrome_path()
    if chrome is None:
        return "no Chrome/Chromium found (install Debian's `chromium`, or set BROWSER_PATH)"
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return "kaleido is not installed (pip install kaleido)"
    os.environ.setdefault("BROWSER_PATH", chrome)
    _quiet_pipe_noise()
    return None


def _run_with_timeout(export: Callable[[], None], timeout_s: float) -> BaseException | str | None:
    """Run `export` in a daemon thread: None when it finished, its exception, or "timeout".

    Reported, never raised: a figure export must not kill a report."""
    outcome: dict[str, BaseException | None] = {"error": None}

    def guarded() -> None:
        try:
            export()
        except BaseException as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=guarded, daemon=True)
    worker.start()
    worker.join(timeout_s)
    return "timeout" if worker.is_alive() else outcome["error"]


def save_png(fig: Any, path: str | Path, *, timeout_s: float = 60.0, scale: float = 1.0) -> Path | None:
    """Write `fig` as a PNG at `path`; None (and `last_export_error` set) when it cannot."""
    global last_export_error
    path = Path(path)
    last_export_error = _exporter_missing()
    if last_export_error is not None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    error = _run_with_timeout(lambda: fig.write_image(str(path), format="png", scale=scale), timeout_s)
    if error == "timeout":
        last_export_error = f"PNG export took longer than {timeout_s:.0f} s (Chrome at {chrome_path()})"
        return None
    if error is not None:
        last_export_error = f"PNG export failed: {type(error).__name__}: {error}"
        return None
    return path


def save_pngs(figs: list[Any], paths: list[str | Path], *, timeout_s: float = 120.0,
              scale: float = 1.0) -> tuple[list[Path | None], str | None]:
    """Export many figures with one Chrome start; ([path or None per figure], why-not or None).

    On a batch failure each figure is retried alone (with `save_png`), so one bad figure costs
    only itself."""
    global last_export_error
    paths = [Path(p) for p in paths]
    if not figs:
        return [], None
    missing = _exporter_missing()
    if missing is not None:
        return [None] * len(figs), missing
    import plotly.io as pio

    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
    error = _run_with_timeout(
        lambda: pio.write_images(figs, [str(p) for p in paths], format="png", scale=scale), timeout_s)
    if error == "timeout":
        last_export_error = f"PNG export of {len(figs)} figures took longer than {timeout_s:.0f} s"
        return [None] * len(figs), last_export_error
    if error is None and all(p.is_file() for p in paths):
        last_export_error = None
        return list(paths), None
    done = [save_png(f, p, timeout_s=min(60.0, timeout_s), scale=scale) for f, p in zip(figs, paths)]
    return done, last_export_error


def export_png(fig: Any, path: str | Path) -> str:
    """Write ``fig`` as a PNG via ``figures.save_png``; a sentence saying where, or why not."""
    out = save_png(fig, path)
    if out is None:
        return f"PNG not exported ({path}): {last_export_error}"
    return f"PNG written: {out}"
