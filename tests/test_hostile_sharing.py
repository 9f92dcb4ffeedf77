"""Issue 24's sharing cases: every token shape and every encoding, scrubbed and caught one by one;
the whole render path (figure pixels included) on a notebook with planted fakes.

None of the planted strings is a real credential. Each row asserts that the raw form is seen
(``leaks_in_text`` is not empty — the row can fail), that ``Scrubber.scrub`` leaves nothing the
final check sees, and (fail closed) that the check alone refuses it when scrubbing is skipped.
"""
from __future__ import annotations

import base64
import html
import io
import json
import struct
import urllib.parse
import zlib
from pathlib import Path

import pytest

from statescope.share import decoded, publish
from statescope.share.leakcheck import check_tree, leaks_in_bytes, leaks_in_text
from statescope.share.scrub import Scrubber, SecretLeak, allowed_env

HOME = "/home/alice-hostile"
ENV = {"HOME": HOME, "DB_PASS": "opaque-db-pass-4711", "OMP_NUM_THREADS": "1"}
SHAPES = {
    "huggingface": "hf_" + "Ab1" * 12,
    "openai project key": "sk-proj-" + "Z9y8" * 8,
    "stripe live key": "sk_live_" + "4eC39HqLyjWDarjt",
    "slack bot token": "xoxb-" + "123456789012-1234567890123-AbCdEfGhIjKl",
    "google api key": "AIza" + "SyA-1234567890abcdefghijklmnopqrstu",
    "gitlab token": "glpat-" + "x" * 20,
    "npm token": "npm_" + "a1" * 18,
    "github token": "ghp_" + "x1Y2" * 9,
    "github fine-grained": "github_pat_" + "A1_" * 15,
    "aws key id": "AKIA" + "ABCDEFGH23456789",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
    "pem private key": "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA1234567890\n-----END RSA PRIVATE KEY-----",
    "bearer": "Authorization: Bearer " + "abc.def" * 4,
    "url credentials": "https://bob:pa55word-x@proxy.example:3128/",
    "DB_PASS assignment": "DB_PASS=correct-horse",
    "password in JSON": '{"password": "hunter2-battery"}',
    "aws secret assignment": "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "value of an env secret": "connecting with opaque-db-pass-4711 now",
    "home path": f"{HOME}/projects/x",
}
# How a secret hides behind an encoding a reader undoes without noticing.
ENCODINGS = {
    "raw": lambda s: s,
    "html entities": lambda s: "".join(f"&#{ord(c)};" if c in "/:=_-" else html.escape(c) for c in s),
    "json \\u escapes": lambda s: json.dumps(s)[1:-1].replace("/", "\\u002f").replace("_", "\\u005f"),
    "url encoding": lambda s: urllib.parse.quote(s, safe=""),
    "double html": lambda s: html.escape("".join(f"&#{ord(c)};" if c in "/_-" else c for c in s)),
    "base64": lambda s: base64.b64encode(s.encode()).decode(),
    "reversed": lambda s: s[::-1],
    "wrapped over lines": lambda s: s[:len(s) // 2] + "\n        " + s[len(s) // 2:],
    "split by a tag": lambda s: s[:len(s) // 2] + "<span>" + s[len(s) // 2:],
    "zero-width space": lambda s: s[:len(s) // 2] + "\u200b" + s[len(s) // 2:],
}
SPLITS = ("wrapped over lines", "split by a tag", "zero-width space")


def _applies(shape: str, encoding: str) -> bool:
    """A path is identifying in textual views only (not inside base64 or reversed), and a split
    inside a multi-part shape (an assignment split at its '=', a PEM block) is not one token."""
    if shape == "home path" and encoding in ("base64", "reversed"):
        return False
    multi_part = shape in ("pem private key", "bearer", "url credentials", "home path") or "assignment" in shape or "JSON" in shape
    return not (encoding in SPLITS and multi_part)


ROWS = [(shape, enc) for shape in sorted(SHAPES) for enc in sorted(ENCODINGS) if _applies(shape, enc)]


@pytest.fixture
def scrubber(monkeypatch):
    from statescope.share import scrub

    monkeypatch.setattr(scrub, "_host_names", lambda: ["hostile-host.example"])
    return Scrubber.for_environment(ENV)


@pytest.mark.parametrize("shape,encoding", ROWS, ids=[f"{a} / {b}" for a, b in ROWS])
def test_each_shape_in_each_encoding_is_seen_then_scrubbed(shape, encoding, scrubber):
    text = f"before {ENCODINGS[encoding](SHAPES[shape])} after"
    assert leaks_in_text(text, scrubber), f"{shape} in {encoding} not seen"
    cleaned = scrubber.scrub(text)
    assert leaks_in_text(cleaned, scrubber) == [], cleaned
    assert "before" in cleaned and "after" in cleaned


def test_ordinary_text_is_left_alone(scrubber):
    text = ("vLLM 0.28.0, torch 2.13.0+cpu, max_tokens: 100, num_speculative_tokens=2, "
            "token_ids=[1, 2], password=None, a[1::2], 12:30:45, 127.0.0.1, ::1, task-list, "
            "bearer of news, &amp; 50%25")
    assert leaks_in_text(text, scrubber) == []
    assert scrubber.scrub(text) == text


def test_ip_addresses_both_families_are_replaced(scrubber):
    out = scrubber.scrub("from 10.2.3.4 and 2001:db8:85a3::8a2e:370:7334 via 127.0.0.1 and ::1")
    assert "10.2.3.4" not in out and "2001:db8" not in out and out.count("[ip]") == 2
    assert "127.0.0.1" in out and "::1" in out


def _png_with(kind: bytes, body: bytes) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (200, 10, 10)).save(buf, format="PNG")
    png = buf.getvalue()
    chunk = struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return png[:33] + chunk + png[33:]  # after IHDR


@pytest.mark.parametrize("kind,body", [
    (b"tEXt", b"Comment\0" + SHAPES["github token"].encode()),
    (b"zTXt", b"Comment\0\0" + zlib.compress(SHAPES["github token"].encode())),
    (b"iTXt", b"Comment\0\x01\0en\0\0" + zlib.compress(SHAPES["github token"].encode())),
], ids=["tEXt", "zTXt", "iTXt"])
def test_png_text_chunks_are_read_and_stripped_with_the_pixels_kept(kind, body, scrubber, tmp_path):
    from PIL import Image

    png = _png_with(kind, body)
    assert any("GitHub token" in h for h in leaks_in_bytes(png, scrubber)), kind
    (tmp_path / "f.png").write_bytes(png)
    with pytest.raises(SecretLeak, match="f.png"):
        check_tree(tmp_path, ENV, scrubber)
    clean = decoded.strip_image_metadata(png)
    assert leaks_in_bytes(clean, scrubber) == [] and decoded.png_texts(clean) == []
    assert Image.open(io.BytesIO(clean)).tobytes() == Image.open(io.BytesIO(png)).tobytes()
    # the same PNG inside an HTML page, base64-embedded
    page = f'<img src="data:image/png;base64,{base64.b64encode(png).decode()}">'
    assert leaks_in_text(page, scrubber)


def test_jpeg_comment_and_exif_are_stripped(scrubber):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(buf, format="JPEG")
    jpg = buf.getvalue()
    com = b"\xff\xfe" + struct.pack(">H", 2 + 40) + SHAPES["github token"].encode()[:40]
    planted = jpg[:2] + com + jpg[2:]
    assert leaks_in_bytes(planted, scrubber)
    clean = decoded.strip_image_metadata(planted)
    assert leaks_in_bytes(clean, scrubber) == [] and clean == jpg


def test_file_and_folder_names_are_checked_never_printed(tmp_path, scrubber):
    bad = tmp_path / SHAPES["github token"]
    bad.mkdir()
    (bad / "ok.txt").write_text("nothing")
    with pytest.raises(SecretLeak) as info:
        check_tree(tmp_path, ENV, scrubber)
    assert "file name" in str(info.value) and SHAPES["github token"] not in str(info.value)


def test_manifest_is_an_allowlist_without_credentials_or_proxies():
    from statescope.share import envmanifest

    env = dict(ENV, VLLM_SOMETHING_URL="http://user:secretpw@internal.example:80/x",
               VLLM_HTTP_PROXY="http://u:pw@proxy:3128", HTTPS_PROXY="http://u:pw@proxy:3128",
               PATH="/usr/bin", CUDA_VISIBLE_DEVICES="0")
    got = allowed_env(env)
    assert "VLLM_HTTP_PROXY" not in got and "HTTPS_PROXY" not in got and "PATH" not in got
    assert "secretpw" not in got["VLLM_SOMETHING_URL"] and got["CUDA_VISIBLE_DEVICES"] == "0"
    manifest = envmanifest.collect([{"model": "m", "block_size": 16, "password_file": "x"}], env)
    assert manifest["resolved_configs"] == [{"model": "m", "block_size": 16}]
    assert manifest["resolved_fields_left_out"] == ["password_file"]


def test_summary_is_cut_after_scrubbing(scrubber):
    import nbformat

    from statescope.share.summary import summary_markdown

    key = SHAPES["openai project key"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    # the key sits exactly where the cut would split it
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout",
                                                  text="x " * 5_970 + key + " y" * 20_000)]
    result = {"notebook": "n", "ok": True, "error": None, "seconds": 1.0, "figures": []}
    raw = summary_markdown(result, nb, "")  # cut first: a piece of the key survives the cut
    assert key[:10] in raw and key not in raw and not leaks_in_text(raw, Scrubber({}))  # unseen
    text = summary_markdown(result, publish.scrub_notebook(nb, scrubber), "")
    assert "characters cut" in text and key[:8] not in text


def _figure_spec(title: str) -> dict:
    import plotly.graph_objects as go

    fig = go.Figure(go.Bar(y=[1, 3, 2]), layout=dict(title_text=title, width=300, height=200))
    return json.loads(fig.to_json())


def _planted_notebook():
    import nbformat

    title = f"key {SHAPES['openai project key']} tok {SHAPES['github token']} pw opaque-db-pass-4711"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(f"print('{SHAPES['jwt']}')")])
    nb.cells[0].outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="PASS · planted\n" + SHAPES["pem private key"]),
        nbformat.v4.new_output("display_data", data={
            "text/html": ENCODINGS["html entities"](SHAPES["password in JSON"]) + " "
            + ENCODINGS["html entities"](HOME + "/x"), "text/plain": "html"}),
        nbformat.v4.new_output("display_data", data={
            "application/json": {"path": ENCODINGS["json \\u escapes"](HOME)}, "text/plain": "j"}),
        nbformat.v4.new_output("display_data", data={
            "image/png": base64.b64encode(_png_with(b"zTXt", b"c\0\0" + zlib.compress(
                SHAPES["slack bot token"].encode()))).decode(), "text/plain": "img"}),
        nbformat.v4.new_output("display_data", data={
            "application/vnd.plotly.v1+json": _figure_spec(title), "text/plain": "fig"}),
        nbformat.v4.new_output("error", ename="ValueError", evalue=SHAPES["url credentials"],
                               traceback=[SHAPES["aws secret assignment"]]),
    ]
    return nb, title


def test_the_render_path_scrubs_every_artefact_and_the_figure_pixels(tmp_path, scrubber, monkeypatch):
    """``write_shared`` on a notebook full of fakes: no file, name or printed result leaks, and
    the exported PNG equals the one drawn from the scrubbed title — not the planted one."""
    from PIL import Image

    from statescope.share import scrub
    from statescope.share.figures import chrome_path, save_pngs

    if chrome_path() is None:
        pytest.fail("no Chromium: the figure-pixel check needs Debian's chromium (bin/setup)")
    monkeypatch.setattr(scrub, "_host_names", lambda: ["hostile-host.example"])
    nb, title = _planted_notebook()
    out = tmp_path / "share" / "planted"
    out.mkdir(parents=True)
    result = publish.write_shared(nb, out, "planted", engines=[], environ=ENV,
                                  parameters={"password": "hunter2-param", "n": 3}, error=None,
                                  seconds=1.0)
    from statescope.share.export import without_plotly_js

    def content(path: Path) -> bytes:  # the page's plotly.js is the package's bundle, not data
        return without_plotly_js(path.read_text()).encode() if path.suffix == ".html" else path.read_bytes()

    for path in out.rglob("*"):
        if path.is_file():
            assert leaks_in_bytes(content(path), scrubber) == [], path
    text = "\n".join(content(p).decode("utf-8", "replace") for p in out.rglob("*") if p.is_file())
    for planted in ("opaque-db-pass-4711", "hunter2", "pa55word", HOME, "wJalrXUt"):
        assert planted not in text, planted
    assert result["parameters"] == {"password": "[redacted:password]", "n": 3}
    assert leaks_in_text(json.dumps(result), scrubber) == []
    fig = result["figures"][0]
    assert fig["png"], fig
    import plotly.graph_objects as go

    refs = [tmp_path / "clean.png", tmp_path / "planted.png"]
    written, why = save_pngs([go.Figure(_figure_spec(scrubber.scrub(title))), go.Figure(_figure_spec(title))], refs)
    assert all(written), why
    pixels = [Image.open(p).convert("RGB").tobytes() for p in (out / fig["png"], *refs)]
    assert pixels[0] == pixels[1], "the shared PNG is not the figure drawn from scrubbed input"
    assert pixels[0] != pixels[2], "the planted title does not change the pixels: the check is blind"


def test_fail_closed_when_scrubbing_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(Scrubber, "scrub", lambda self, text: text)
    monkeypatch.setattr(Scrubber, "scrub_obj", lambda self, obj: obj)
    nb, _ = _planted_notebook()
    out = tmp_path / "planted"
    out.mkdir()
    with pytest.raises(SecretLeak):
        publish.write_shared(nb, out, "planted", engines=[], environ=ENV, parameters={},
                             error=None, seconds=1.0, png=False)
    assert sorted(p.name for p in out.iterdir()) == ["REFUSED.md"]


def test_render_json_output_is_scrubbed(monkeypatch, capsys, tmp_path):
    from statescope.cli import render as cli_render

    monkeypatch.setenv("DB_PASS", "opaque-db-pass-4711")
    got = cli_render._shareable([{"notebook": "n", "ok": False, "dir": str(tmp_path),
                                  "error": "failed with opaque-db-pass-4711",
                                  "parameters": {"token_value": SHAPES["github token"]}}])
    text = json.dumps(got)
    assert "opaque-db-pass-4711" not in text and SHAPES["github token"] not in text


def test_a_cell_over_the_timeout_still_renders_the_cells_before_it(tmp_path):
    """A real kernel: the second cell sleeps past ``timeout_s``; the render says so and keeps
    the first cell's output (it used to leave an empty folder and a CellTimeoutError)."""
    from statescope.share.render import render_for_sharing

    src = tmp_path / "slow.py"
    src.write_text("# %%\nprint('PASS · first cell ran')\n\n# %%\nimport time\ntime.sleep(60)\n")
    result = render_for_sharing(src, tmp_path / "out", png=False, timeout_s=5)
    assert not result["ok"] and "longer than the timeout" in result["error"]
    html_text = (Path(result["dir"]) / "slow.html").read_text()
    assert "first cell ran" in html_text
    assert "| first cell ran | PASS |" in (Path(result["dir"]) / "summary.md").read_text()
