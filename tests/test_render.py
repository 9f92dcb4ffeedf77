"""Rendering for sharing: planted secrets and paths never reach the files; a surviving one fails."""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import pytest

from statescope.share import render
from statescope.share import scrub
from statescope.share.render import REPO, render_for_sharing
from statescope.share.summary import COMMENT_LIMIT, summary_markdown

HF = "hf_" + "Q7" * 18
OPAQUE = "opaque-db-password-4711"
SK = "sk-" + "live" * 6

# Cells that print secrets (from the environment and built at run time), paths, an IP and a host,
# and put a secret into a figure's title (so it reaches the figure's data file).
NOTEBOOK = '''# %% tags=["parameters"]
label = "default"

# %%
import os, socket, plotly.graph_objects as go
print("PASS · label is", label)
print(os.environ["HF_TOKEN"], os.environ["STATESCOPE_TEST_PASSWORD"], "sk-" + "live" * 6)
print(os.getcwd(), os.path.expanduser("~"), socket.gethostname(), "10.11.12.13")
print("Authorization: Bearer " + "abc.def" * 4)
import tempfile; print("scratch run:", tempfile.mkdtemp(prefix="statescope-capture-"))

# %%
go.Figure(go.Scatter(y=[1, 3, 2]), layout_title_text="key " + os.environ["HF_TOKEN"])
'''


@pytest.fixture
def planted(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setenv("STATESCOPE_TEST_PASSWORD", OPAQUE)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(scrub, "_host_names", lambda: ["render-test-host.example"])
    src = tmp_path / "planted.py"
    src.write_text(NOTEBOOK)
    return src


def _all_text(folder: Path) -> str:
    return "\n".join(p.read_bytes().decode("utf-8", "ignore") for p in folder.rglob("*") if p.is_file())


def test_render_writes_scrubbed_shareable_files(planted, tmp_path):
    result = render_for_sharing(planted, tmp_path / "out", parameters={"label": "from-papermill"})
    assert result["ok"], result["error"]
    out = Path(result["dir"])
    for name in ("planted.html", "planted.md", "summary.md", "manifest.json"):
        assert (out / name).is_file(), name
    assert result["figures"] and result["figures"][0]["png"], result["figures"]
    assert (out / result["figures"][0]["png"]).read_bytes()[:4] == b"\x89PNG"
    text = _all_text(out)
    home = os.path.expanduser("~")
    for leaked in (HF, OPAQUE, SK, str(REPO), "10.11.12.13", "abc.defabc.def"):
        assert leaked not in text, f"{leaked!r} reached the rendered files"
    assert not re.search(re.escape(home) + r"\b", text) or home == "/"
    assert "[redacted:HF_TOKEN]" in text and "[redacted:STATESCOPE_TEST_PASSWORD]" in text
    assert "[repo]" in text and "[ip]" in text
    # a scratch run's temp folder is shown as [tmp]; the result still names the real output folder
    assert "scratch run: [tmp]/statescope-capture-" in text
    assert tempfile.gettempdir() + "/statescope-capture-" not in text
    summary = (out / "summary.md").read_text()
    assert summary.index("| what | verdict |") < summary.index("<details>")
    assert "| label is from-papermill | PASS |" in summary
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["environment"].get("OMP_NUM_THREADS") == "1"
    assert "HF_TOKEN" not in manifest["environment"] and manifest["statescope"]
    assert re.fullmatch(r"[0-9a-f]{40}", manifest["git_commit"] or ""), manifest["git_commit"]
    assert "Environment (statescope manifest)" in (out / "planted.html").read_text()
    assert "![figure](figures/" in (out / "planted.md").read_text()


def test_a_surviving_secret_fails_the_render(planted, tmp_path, monkeypatch):
    # A scrubber that lets everything through: the final check must still refuse the render.
    monkeypatch.setattr(scrub.Scrubber, "scrub", lambda self, text: text)
    with pytest.raises(scrub.SecretLeak) as info:
        render_for_sharing(planted, tmp_path / "out")
    assert "planted" in str(info.value)
    left = sorted(p.name for p in (tmp_path / "out" / "planted").rglob("*"))
    assert left == ["REFUSED.md"], left
    assert HF not in (tmp_path / "out" / "planted" / "REFUSED.md").read_text()


def test_summary_stays_under_githubs_comment_limit():
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="PASS · first\n"
                                                  + "log line\n" * 40_000)]
    result = {"notebook": "big", "ok": True, "error": None, "seconds": 1.0, "figures": []}
    text = summary_markdown(result, nb, "| field | value |\n" + "| x | y |\n" * 3000)
    assert len(text) < COMMENT_LIMIT
    assert text.startswith("### statescope: `big`") and "| first | PASS |" in text
    assert "characters cut" in text


def test_render_cli_rejects_unknown_notebook(capsys):
    from statescope.cli.main import main

    assert main(["render", "no_such_notebook"]) == 2
    assert "no_such_notebook" in capsys.readouterr().err
    assert main(["render"]) == 2


def test_summary_lists_reproduce_verdicts_with_planted_label():
    import nbformat

    box = ("<div><div style='font-weight:bold'>corruption detected</div><table></table>"
           "<p>Trigger 16/16, control 0/16 failed requests: more. NOTE: PLANTED FAULT nan_conv.</p></div>")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    nb.cells[0].outputs = [nbformat.v4.new_output("display_data", data={"text/html": box})]
    result = {"notebook": "r", "ok": True, "error": None, "seconds": 1.0, "figures": []}
    text = summary_markdown(result, nb, "")
    row = next(line for line in text.splitlines() if "reproduce verdict" in line)
    assert "**corruption detected**" in row and "16/16" in row and "PLANTED" in row


def test_markdown_drops_progress_bars_and_notes_real_widgets():
    import nbformat

    from statescope.share.export import WIDGET_MIME, WIDGET_NOTE, markdown_copy

    widget = lambda text: nbformat.v4.new_output(  # noqa: E731
        "display_data", data={WIDGET_MIME: {"model_id": "x", "version_major": 2, "version_minor": 0},
                              "text/plain": text})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    nb.cells[0].outputs = [widget("Loading shards:  50% Completed | 1/2 [00:01<00:01, 1.0it/s]"),
                           widget("VBox(children=(IntSlider(value=3),))")]
    outs = markdown_copy(nb, []).cells[0].outputs
    assert [o["data"].get("text/markdown") for o in outs] == [WIDGET_NOTE]


def test_png_export_drops_only_the_browser_channels_ignored_json_noise():
    """kaleido's channel logs a traceback for a non-JSON line from Chrome and carries on; that one
    record must not reach a rendered notebook (it read as a failure in CI), any other error must."""
    import io
    import logging

    from statescope.share import figures

    # bin/setup installs Chromium where none is present: a missing exporter is a broken setup
    missing = figures._exporter_missing()
    assert missing is None, f"PNG export unavailable ({missing}); bin/setup should have installed Chromium"
    from choreographer.channels import pipe

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    pipe._logger.addHandler(handler)
    try:
        figures._exporter_missing()  # idempotent: one filter however often it runs
        assert sum(type(f).__name__ == "_IgnoredPipeNoise" for f in pipe._logger.filters) == 1
        pipe._logger.error("JSONError decoding message. Ignoring")
        pipe._logger.error("Error in trying to decode JSON off our read.")
    finally:
        pipe._logger.removeHandler(handler)
    assert buf.getvalue() == "Error in trying to decode JSON off our read.\n"
