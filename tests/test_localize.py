"""``statescope localize`` (``statescope.diverge.localize``) on the committed GPU capture and records.

Fast (no engine, no oracle): the requests it examines are picked from the committed records as the
committed document says (the 6 whose text left the async-off control, and 6 clean ones of the
divergent requests' shape); the capture's GDN layers map to model layers; bad inputs are one clear
error naming the file or field, and the command exits 2. Slow (the float64 oracle over 24 requests,
~1-2 minutes on one thread): the command reproduces data/results/gpu/e2e/localization.json exactly
(all but its runtime) — the tolerance now comes from ``statescope.diverge.noise.calibrate``, the
rule the old script had a copy of.
"""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from statescope.diverge import localize as loc
from statescope.errors import InputError
from statescope.results.e2e import E2E_DIR

TRIGGER = E2E_DIR / "trigger_token_ids.jsonl.gz"
CONTROL = E2E_DIR / "records_tiny-gui.jsonl"
CAPTURE = E2E_DIR / "capture_tiny-gui.tar.gz"
COMMITTED = E2E_DIR / "localization.json"


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads(COMMITTED.read_text())


def test_examined_requests_are_the_committed_ones(committed):
    from statescope.workload.trace import prompt_sha

    trigger = loc.load_records(TRIGGER, "trigger")
    control = loc.load_records(CONTROL, "no_async")
    first = loc.first_output_diffs(trigger, control)
    divergent = {s for s, f in first.items() if f is not None}
    assert divergent == {r["prompt_sha"] for r in committed["requests"] if r["role"] == "divergent"}
    assert {r["prompt_sha"]: r["first_output_diff"] for r in committed["requests"]} == \
        {s: first[s] for s in (r["prompt_sha"] for r in committed["requests"])}
    step, cached, lengths = loc.clean_shape(trigger, first)
    assert (step, cached, lengths) == (2, 2640, {2866, 2868})
    clean = [r for r in committed["requests"] if r["role"] == "clean-calibration"]
    assert len(clean) == 6 and all((r["step"], r["num_cached_tokens"]) == (step, cached)
                                   and r["prompt_tokens"] in lengths and not r["divergent"] for r in clean)
    shas = {prompt_sha(r["prompt_token_ids"]) for r in trigger}
    assert {r["prompt_sha"] for r in committed["requests"]} <= shas


def test_gdn_layers_come_from_the_capture(tmp_path):
    from statescope.capture.store import CaptureRun
    from statescope.diverge.localize_oracle import gdn_layers

    with tarfile.open(CAPTURE) as tf:
        tf.extractall(tmp_path, filter="data")
    layers = gdn_layers(CaptureRun(tmp_path).digests())
    assert layers == {i: f"model.layers.{i}.linear_attn" for i in range(3)}


def test_bad_inputs_are_one_clear_error(tmp_path):
    trigger = loc.load_records(TRIGGER, "trigger")[:3]
    control = loc.load_records(CONTROL, "no_async")
    with pytest.raises(InputError, match="nowhere.jsonl: records file missing"):
        loc.load_records(tmp_path / "nowhere.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"build": "trigger"}\nnot json\n')
    with pytest.raises(InputError, match="bad.jsonl:2: expected one JSON object per line"):
        loc.load_records(bad)
    with pytest.raises(InputError, match="control records, record 1: field 'output_token_ids' missing"):
        loc.localize(trigger, [{"episode": "e", "step": 0}], CAPTURE, E2E_DIR.parents[2] / "models/tiny-gui")
    with pytest.raises(InputError, match="expected a model directory with config.json"):
        loc.localize(trigger, control, CAPTURE, tmp_path)
    with pytest.raises(InputError, match="expected a capture run directory or a tarball"):
        loc.localize(trigger, control, bad, E2E_DIR.parents[2] / "models/tiny-gui")
    with pytest.raises(InputError, match="no request for episode 'nope'"):
        loc.first_output_diffs([dict(trigger[0], episode="nope")], control)


def test_cli_exits_2_on_a_bad_capture(tmp_path, capsys):
    from statescope.cli.main import main

    assert main(["localize", "--capture", str(tmp_path / "missing.tar.gz")]) == 2
    assert "missing.tar.gz: expected a capture run directory or a tarball" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_reproduces_the_committed_localization(tmp_path, capsys, committed):
    from statescope.cli.main import main

    out = tmp_path / "localization.json"
    assert main(["localize", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    doc = json.loads(out.read_text())
    assert doc.pop("runtime_s") > 0
    want = dict(committed)
    want.pop("runtime_s")
    assert list(doc) == list(want)  # the same document, key for key, in the same order
    for key in want:
        assert doc[key] == want[key], key
    assert printed["ranking"][0] == "H-accept" and printed["continuity"] == want["continuity"]
