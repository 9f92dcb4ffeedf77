"""The live teaching notebook in a real browser: JupyterLab + Debian's chromium driven by Playwright.

Starts JupyterLab on loopback with a token (serving a copy of notebook 07, so autosave cannot
write outputs into the repository), opens it in headless chromium, runs all cells, moves the
token-position slider and checks that the figure changed. Widgets must render as widgets (slider
and plotly DOM), not as a raw JSON blob. Screenshots go to docs/gallery/browser/ (or
$STATESCOPE_SCREENSHOTS). Nothing downloads a browser: Playwright drives /usr/bin/chromium.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "07_teach_failure_mode.ipynb"
SHOTS = Path(os.environ.get("STATESCOPE_SCREENSHOTS", REPO / "docs" / "gallery" / "browser"))
CHROMIUM = os.environ.get("STATESCOPE_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
RUN_ALL_TIMEOUT_S = 420
# The title of the figure in the slider's own output area (plotly draws it as SVG text).
TITLE_JS = ("() => { const s = document.querySelector('.statescope-token-slider');"
            " const o = s && s.closest('.jp-OutputArea-output');"
            " const t = o && o.querySelector('.gtitle'); return t ? t.textContent : null; }")

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """(base URL, token) of a JupyterLab serving a copy of notebook 07 on loopback."""
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} missing: bin/setup installs Debian's chromium"
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)
    port, token = _free_port(), secrets.token_hex(16)
    # Settings for this lab only: every cell stays in the DOM (no windowing), no news prompt.
    settings = tmp_path / "lab-settings"
    for plugin, values in (("@jupyterlab/notebook-extension/tracker", '{"windowingMode": "none"}'),
                           ("@jupyterlab/apputils-extension/notification", '{"fetchNews": "false"}')):
        target = settings / f"{plugin}.jupyterlab-settings"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(values)
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="ERROR",
               JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
               JUPYTERLAB_SETTINGS_DIR=str(settings))
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
         "--ip=127.0.0.1", f"--port={port}", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={tmp_path}", "--LabApp.news_url=", "--LabApp.check_for_updates_class="
         "jupyterlab.NeverCheckForUpdate"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield base, token
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the lab and the kernels it started (its own group)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_notebook_07_runs_in_jupyterlab_and_the_slider_moves_the_figure(lab, tmp_path):
    from playwright.sync_api import sync_playwright

    lab_dir = tmp_path  # failure artifacts (screenshot, the widget's DOM) stay with pytest's tmp

    base, token = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_selector("#jp-main-statusbar >> text=Idle", timeout=120_000)
            page.locator(".lm-MenuBar-itemLabel:text-is('Run')").click(timeout=30_000)
            page.locator(".lm-Menu-itemLabel:text-is('Run All Cells')").click(timeout=30_000)
            # Finished = every code cell has an execution number (none pending "[*]").
            page.wait_for_function(
                """() => { const p = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
                           return p.length > 0 && p.every(e => /\\[\\d+\\]/.test(e.textContent)); }""",
                timeout=RUN_ALL_TIMEOUT_S * 1000, polling=2000)
            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] "
                                  ":text('Traceback')").count()
            assert errors == 0, "a cell raised in the browser run"
            assert page.locator("text=FAIL ·").count() == 0, "a check cell failed in the browser run"
            assert page.locator("text=PASS").count() >= 8, "the check cells did not all report"
            # Widgets rendered as widgets: the slider's DOM and the FigureWidget's plotly DOM.
            slider = page.locator(".statescope-token-slider")
            slider.wait_for(timeout=60_000)
            assert page.locator(".jp-OutputArea :text('application/vnd.jupyter.widget-view+json')").count() == 0
            assert page.locator(":text('Error displaying widget')").count() == 0
            news = page.locator(".jp-toast-button:text-is('No')")  # JupyterLab's news prompt
            if news.count():
                news.first.click()
            slider.scroll_into_view_if_needed()
            widget_out = slider.locator("xpath=ancestor::div[contains(@class,'jp-OutputArea-output')]")
            widget_out.locator(".js-plotly-plot").wait_for(timeout=60_000)
            try:
                page.wait_for_function(f"() => ({TITLE_JS})() !== null", timeout=180_000)
            except Exception:
                page.screenshot(path=str(lab_dir / "failure.png"), full_page=False)
                (lab_dir / "widget.html").write_text(widget_out.inner_html())
                raise
            before = page.evaluate(TITLE_JS)
            widget_out.screenshot(path=str(SHOTS / "07-slider-before.png"))
            readout = slider.locator(".widget-readout")
            readout.click()
            page.keyboard.press("Control+A")
            page.keyboard.type("3")
            page.keyboard.press("Enter")
            page.wait_for_function(f"(b) => {{ const t = ({TITLE_JS})(); return t !== null && t !== b; }}",
                                   arg=before, timeout=60_000)
            after = page.evaluate(TITLE_JS)
            widget_out.screenshot(path=str(SHOTS / "07-slider-after.png"))
            page.screenshot(path=str(SHOTS / "07-lab.png"))
        finally:
            browser.close()
    assert "after token 3 " in after and after != before, (before, after)
