"""Issue 32's leaks, one test each: a ``-p`` credential printed by the notebook, an ANSI colour code
inside a token (and no over-redaction across HTML markup), a token split over two cells, a token
spelt by a plotly typed array, a Markdown-escaped ``hf\\_...``; a refusal removes only the files the
render wrote; the manifest lists the engines a notebook started.

None of the planted strings is a real credential.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from statescope.errors import InputError
from statescope.share import publish
from statescope.share.leakcheck import leaks_in_numbers, leaks_in_text
from statescope.share.scrub import Scrubber, SecretLeak, parameter_secrets

HF = "hf_" + "Ab1" * 12
GHP = "ghp_" + "x1Y2" * 9
PARAM = "opaque-param-pw-0815"
ENV = {"HOME": "/home/share-test", "OMP_NUM_THREADS": "1"}


def _nb(*cell_outputs: list):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(f"cell {i}")
                                         for i in range(len(cell_outputs))])
    for cell, outputs in zip(nb.cells, cell_outputs):
        cell.outputs = outputs
    return nb


def _stream(text: str):
    import nbformat

    return nbformat.v4.new_output("stream", name="stdout", text=text)


def _all_text(folder: Path) -> str:
    return "\n".join(p.read_bytes().decode("utf-8", "replace") for p in folder.rglob("*") if p.is_file())


@pytest.fixture(autouse=True)
def _no_host_names(monkeypatch):
    from statescope.share import scrub

    monkeypatch.setattr(scrub, "_host_names", lambda: ["share-test-host.example"])


# -- a -p credential ---------------------------------------------------------------------------
def test_a_credential_parameter_is_removed_wherever_the_notebook_prints_it(tmp_path):
    import nbformat

    fig = {"data": [{"type": "bar", "y": [1, 2]}], "layout": {"title": {"text": f"pw {PARAM}"}}}
    nb = _nb([_stream(f"connecting as admin with {PARAM}\n")],
             [nbformat.v4.new_output("display_data", data={
                 "text/html": f"<b>{PARAM}</b>", "text/plain": "x",
                 "application/vnd.plotly.v1+json": fig}),
              nbformat.v4.new_output("error", ename="ValueError", evalue=f"bad {PARAM}",
                                     traceback=[f"ValueError: bad {PARAM}"])])
    out = tmp_path / "p"
    out.mkdir()
    result = publish.write_shared(nb, out, "p", engines=[], environ=ENV,
                                  parameters={"db_password": PARAM, "token": "abcdefgh-1"},
                                  error=None, seconds=1.0, png=False)
    text = _all_text(out)
    assert PARAM not in text and "abcdefgh-1" not in text
    assert "[redacted:db_password]" in (out / "summary.md").read_text()
    assert "[redacted:db_password]" in (out / "p.html").read_text()
    assert PARAM not in json.dumps(result)


def test_credential_parameter_names_and_a_value_too_short_to_scrub():
    got = parameter_secrets({"db_password": PARAM, "token": "abcd", "ssh_key": "k" * 9,
                             "max_tokens": 8, "label": "plain", "num_speculative_tokens": 2})
    assert got == {"db_password": PARAM, "token": "abcd", "ssh_key": "k" * 9}
    with pytest.raises(InputError, match="db_password"):
        parameter_secrets({"db_password": "abc"})


# -- terminal colour codes ---------------------------------------------------------------------
def test_an_ansi_colour_code_inside_a_token_is_seen_and_scrubbed():
    s = Scrubber.for_environment(ENV)
    text = f"loaded \x1b[32m{HF[:10]}\x1b[1m{HF[10:]}\x1b[0m ok"
    assert leaks_in_text(text, s), "the check is blind to a coloured token"
    cleaned = s.scrub(text)
    assert leaks_in_text(cleaned, s) == [] and HF[10:] not in cleaned
    assert "loaded" in cleaned and cleaned.endswith(" ok")


def test_a_token_split_by_html_markup_keeps_the_markup():
    """nbconvert turns ANSI codes into spans: redacting the token must not eat a tag."""
    s = Scrubber.for_environment(ENV)
    page = f'<pre>key <span class="ansi-green-fg">{HF[:12]}</span>{HF[12:]} done</pre>'
    cleaned = s.scrub(page)
    assert leaks_in_text(cleaned, s) == [] and HF[12:] not in cleaned
    assert cleaned.count("<span") == cleaned.count("</span>") == 1
    assert cleaned.startswith("<pre>key ") and cleaned.endswith(" done</pre>")


def test_ansi_in_a_render_reaches_no_file(tmp_path):
    nb = _nb([_stream(f"token \x1b[1;31m{HF[:15]}\x1b[0m{HF[15:]}\n")])
    out = tmp_path / "a"
    out.mkdir()
    publish.write_shared(nb, out, "a", engines=[], environ=ENV, parameters={}, error=None,
                         seconds=1.0, png=False)
    text = _all_text(out)
    assert HF[15:] not in text and "\x1b[" not in (out / "summary.md").read_text()


# -- across cells ------------------------------------------------------------------------------
def test_a_token_printed_half_in_one_cell_half_in_the_next_is_scrubbed(tmp_path):
    nb = _nb([_stream("first half: " + GHP[:20])], [_stream(GHP[20:] + " <- second half\n")])
    s = Scrubber.for_environment(ENV)
    assert leaks_in_text(publish.printed_text(nb), s), "the cross-cell view does not see it"
    clean = publish.scrub_notebook(nb, s)
    assert GHP[:20] not in clean.cells[0].outputs[0]["text"]
    assert GHP[20:] not in clean.cells[1].outputs[0]["text"]
    assert "second half" in clean.cells[1].outputs[0]["text"]
    out = tmp_path / "x"
    out.mkdir()
    publish.write_shared(nb, out, "x", engines=[], environ=ENV, parameters={}, error=None,
                         seconds=1.0, png=False)
    assert GHP[20:] not in _all_text(out) and GHP[:20] not in _all_text(out)


def test_a_cross_cell_token_the_scrubber_missed_refuses_the_render(tmp_path, monkeypatch):
    monkeypatch.setattr(publish, "_scrub_across_outputs", lambda nb, scrubber: None)
    nb = _nb([_stream(GHP[:20])], [_stream(GHP[20:])])
    out = tmp_path / "x"
    out.mkdir()
    with pytest.raises(SecretLeak, match="across cells"):
        publish.write_shared(nb, out, "x", engines=[], environ=ENV, parameters={}, error=None,
                             seconds=1.0, png=False)
    assert sorted(p.name for p in out.iterdir()) == ["REFUSED.md"]


# -- plotly typed arrays -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["u1", "i4", "f8"])
def test_a_token_spelt_by_a_typed_array_is_zeroed_before_export(dtype):
    import numpy as np

    values = np.array([ord(c) for c in HF], dtype=dtype)
    spec = {"data": [{"type": "bar", "y": {"dtype": dtype, "bdata": base64.b64encode(values.tobytes()).decode()}}],
            "layout": {}}
    s = Scrubber.for_environment(ENV)
    assert leaks_in_numbers(spec, s), f"{dtype}: the check does not read the numbers"
    clean = s.scrub_obj(spec)
    y = clean["data"][0]["y"]
    assert y["dtype"] == dtype and base64.b64decode(y["bdata"]) == bytes(len(values.tobytes()))
    assert leaks_in_numbers(clean, s) == []
    ordinary = {"dtype": "f8", "bdata": base64.b64encode(np.linspace(0, 1, 50).tobytes()).decode()}
    assert s.scrub_obj(ordinary) == ordinary


def test_a_token_spelt_by_a_plain_number_list_is_zeroed():
    s = Scrubber.for_environment(ENV)
    spec = {"y": [ord(c) for c in GHP], "x": list(range(len(GHP)))}
    clean = s.scrub_obj(spec)
    assert clean["y"] == [0] * len(GHP) and clean["x"] == list(range(len(GHP)))


def test_a_render_of_a_typed_array_figure_never_draws_the_token(tmp_path):
    import nbformat
    import numpy as np

    y = {"dtype": "u1", "bdata": base64.b64encode(HF.encode()).decode()}
    fig = {"data": [{"type": "bar", "y": y}], "layout": {"title": {"text": "bytes"}}}
    nb = _nb([nbformat.v4.new_output("display_data", data={
        "application/vnd.plotly.v1+json": fig, "text/plain": "fig"})])
    out = tmp_path / "t"
    out.mkdir()
    result = publish.write_shared(nb, out, "t", engines=[], environ=ENV, parameters={}, error=None,
                                  seconds=1.0, png=False)
    data = json.loads((out / result["figures"][0]["data"]).read_text())
    drawn = base64.b64decode(data["data"][0]["y"]["bdata"])
    assert drawn == bytes(len(HF)) and not np.frombuffer(drawn, "u1").any()


# -- Markdown escapes --------------------------------------------------------------------------
def test_a_markdown_escaped_token_is_seen_and_scrubbed():
    s = Scrubber.for_environment(ENV)
    for text in ("see hf\\_" + HF[3:] + " here", "see " + GHP.replace("_", "\\_") + " here",
                 json.dumps("see hf\\_" + HF[3:])):
        assert leaks_in_text(text, s), text
        cleaned = s.scrub(text)
        assert leaks_in_text(cleaned, s) == [] and HF[3:] not in cleaned, cleaned


# -- only the render's own files ---------------------------------------------------------------
def test_a_refusal_removes_only_what_the_render_wrote(tmp_path, monkeypatch):
    out = tmp_path / "share" / "n"
    (out / "mine").mkdir(parents=True)
    (out / "notes.txt").write_text("my notes: /home/share-test/x\n")
    (out / "mine" / "keep.md").write_text("keep me")
    (out / "n.old.html").write_text("an older file of mine")
    nb = _nb([_stream("PASS · fine\n")])
    publish.write_shared(nb, out, "n", engines=[], environ=ENV, parameters={}, error=None,
                         seconds=1.0, png=False)
    # a successful render neither rewrites nor checks the user's files
    assert (out / "notes.txt").read_text() == "my notes: /home/share-test/x\n"
    assert (out / "summary.md").is_file()
    monkeypatch.setattr(Scrubber, "scrub", lambda self, text: text)
    monkeypatch.setattr(Scrubber, "scrub_obj", lambda self, obj: obj)
    with pytest.raises(SecretLeak):
        publish.write_shared(_nb([_stream(GHP + "\n")]), out, "n", engines=[], environ=ENV,
                             parameters={}, error=None, seconds=1.0, png=False)
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert left == ["REFUSED.md", "mine", "mine/keep.md", "n.old.html", "notes.txt"], left
    assert GHP not in (out / "REFUSED.md").read_text()


def test_a_passing_render_clears_an_earlier_refusal_note(tmp_path):
    out = tmp_path / "n"
    out.mkdir()
    (out / "REFUSED.md").write_text("render refused: earlier")
    result = publish.write_shared(_nb([_stream("ok\n")]), out, "n", engines=[], environ=ENV,
                                  parameters={}, error=None, seconds=1.0, png=False)
    assert not (out / "REFUSED.md").exists() and "REFUSED.md" not in result["files"]
    assert sorted(result["files"]) == ["manifest.json", "n.html", "n.md", "summary.md"]


# -- the manifest's engines --------------------------------------------------------------------
def test_render_verbose_keeps_warnings_and_still_writes_the_manifest(tmp_path):
    """``render --verbose`` (keep_warnings) used to crash with UnboundLocalError: 'engines'."""
    from statescope.share.render import render_for_sharing

    src = tmp_path / "warn.py"
    src.write_text("# %%\nimport sys\nprint('Warning: NUMA binding: Using MEMBIND policy', "
                   "file=sys.stderr)\nprint('PASS · ran')\n")
    result = render_for_sharing(src, tmp_path / "out", png=False, keep_warnings=True)
    assert result["ok"], result["error"]
    out = Path(result["dir"])
    assert "NUMA binding" in (out / "warn.md").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["resolved_configs"] == "no engine started by this notebook"


@pytest.mark.engine
def test_the_manifest_lists_the_engine_a_notebook_started(tmp_path):
    """A real tiny engine in the rendered notebook: its config, runner and build are in the
    manifest (they were lost when engines.jsonl was read after its folder was gone)."""
    from statescope.share.render import render_for_sharing

    src = tmp_path / "engine.py"
    src.write_text("# %%\nfrom statescope.engine import EngineConfig, OfflineEngine\n"
                   "engine = OfflineEngine(EngineConfig())\nprint('PASS · started')\n")
    result = render_for_sharing(src, tmp_path / "out", png=False)
    assert result["ok"], result["error"]
    manifest = json.loads((Path(result["dir"]) / "manifest.json").read_text())
    configs = manifest["resolved_configs"]
    assert isinstance(configs, list) and len(configs) == 1, configs
    got = configs[0]
    assert got["engine"] == "offline (in-process)" and got["model_runner"], got
    assert got["build"].startswith(f"vllm {got['vllm_version']} (") and got["enable_prefix_caching"]
    summary = (Path(result["dir"]) / "summary.md").read_text()
    assert "no engine started by this notebook" not in summary


# -- offline HTML ------------------------------------------------------------------------------
def test_the_html_report_embeds_plotly_js_once_and_loads_nothing_from_a_cdn(tmp_path):
    import nbformat
    from plotly.offline import get_plotlyjs

    from statescope.share.export import PLOTLY_JS_SLOT, without_plotly_js

    fig = {"data": [{"type": "bar", "y": [1, 2]}], "layout": {"title": {"text": "one"}}}
    loader = nbformat.v4.new_output("display_data", data={
        "text/html": '<script src="https://cdn.plot.ly/plotly-3.0.1.min.js"></script>'})
    figure = lambda: nbformat.v4.new_output("display_data", data={  # noqa: E731
        "application/vnd.plotly.v1+json": fig, "text/plain": "fig",
        "text/html": '<script>require(["https://cdn.plot.ly/plotly.js"])</script>'})
    nb = _nb([loader, figure()], [figure()])
    out = tmp_path / "h"
    out.mkdir()
    publish.write_shared(nb, out, "h", engines=[], environ=ENV, parameters={}, error=None,
                         seconds=1.0, png=False)
    page = (out / "h.html").read_text()
    assert page.count(get_plotlyjs()[:400]) == 1 and PLOTLY_JS_SLOT not in page
    own = without_plotly_js(page)  # the page without the bundle (which names its topojson CDN)
    assert PLOTLY_JS_SLOT in own and "cdn.plot.ly" not in own and "require(" not in own
    assert own.count("Plotly.newPlot(") == 2


# -- concise text ------------------------------------------------------------------------------
def test_the_summary_log_cuts_a_long_result_repr():
    import nbformat

    from statescope.share.summary import summary_markdown

    nb = _nb([nbformat.v4.new_output("execute_result", execution_count=1,
                                     data={"text/plain": "DivergenceReport(" + "x=1, " * 1000 + ")"}),
              _stream("PASS · printed\n")])
    result = {"notebook": "n", "ok": True, "error": None, "seconds": 1.0, "figures": []}
    text = summary_markdown(result, nb, "")
    assert "more characters of this result" in text and len(text) < 3000
    assert "| printed | PASS |" in text


def test_a_divergence_report_prints_a_few_lines_and_a_table():
    from statescope.diverge.report import DivergenceReport

    reqs = [{"req_id": f"r{i}", "first_step": 3 if i % 2 else None, "origin_layer": "model.layers.2.linear_attn",
             "kinds": ["conv"], "layers": ["model.layers.2.linear_attn"], "conv_rows": [0, 1],
             "magnitude": 0.5, "nan_or_inf": False, "events": {}} for i in range(30)]
    report = DivergenceReport(run="a", reference="b", requests=reqs)
    text = repr(report)
    assert text.startswith("DivergenceReport: 15 of 30 requests diverge") and len(text.splitlines()) < 14
    assert "22 more rows" in text and "req_id" in text
    assert len(report.to_frame()) == 30 and list(report.to_frame()["req_id"])[:2] == ["r0", "r1"]
    assert report._repr_html_().count("<tr>") < 45
