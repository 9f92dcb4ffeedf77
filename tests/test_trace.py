"""Trace files: presets write valid traces; bad files fail with file, line and field."""
from __future__ import annotations

import json

import pytest

from statescope.errors import InputError
from statescope.workload.screenshots import render_png
from statescope.workload.trace import build_messages, episodes_of, read_trace, write_trace
from statescope.workload.episodes import PRESETS, preset_trace


def test_repro288_preset_has_the_reported_shape(tmp_path):
    steps = preset_trace("repro288", vision=True)
    assert len(steps) == 288
    assert all(1 <= s.n_images <= 3 for s in steps)
    back = read_trace(write_trace(steps, tmp_path / "t.jsonl"))
    assert [(s.episode, s.step) for s in back] == [(s.episode, s.step) for s in steps]
    assert all(s.expected for s in back)


def test_presets_are_deterministic():
    for name in PRESETS:
        a, b = preset_trace(name), preset_trace(name)
        assert [s.to_json() for s in a] == [s.to_json() for s in b]
    assert preset_trace("smoke", seed=1)[0].user != preset_trace("smoke", seed=0)[0].user


def test_screenshots_are_real_pngs_and_deterministic():
    spec = {"width": 1280, "height": 800, "title": "Mail - Signup",
            "widgets": [{"id": 3, "role": "textbox", "label": "Name", "value": "kiwi",
                         "bbox": [40, 80, 280, 112]}]}
    png = render_png(spec)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png == render_png(spec)
    from PIL import Image
    import io

    assert Image.open(io.BytesIO(png)).size == (320, 200)


def test_messages_grow_by_real_answers():
    eps = episodes_of(preset_trace("smoke"))
    steps = eps["ep0000"]
    msgs = build_messages(steps, 2, ["first answer", "second answer", "unused"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[2]["content"] == "first answer" and msgs[-1]["content"] == steps[2].user
    with pytest.raises(InputError, match="needs 2 earlier answers"):
        build_messages(steps, 2, ["only one"])


@pytest.mark.parametrize("mutate,needle", [
    (lambda o: o.pop("system"), "field 'system'"),
    (lambda o: o.update(step=-1), "field 'step'"),
    (lambda o: o.update(user=[{"type": "image_url", "image_url": {"url": "nope"}}]), "user[0]"),
    (lambda o: o.update(trace_version=7), "trace_version"),
    (lambda o: o.update(geometry={"align": "sideways"}), "geometry"),
])
def test_bad_lines_name_file_line_and_field(tmp_path, mutate, needle):
    lines = [s.to_json() for s in preset_trace("smoke")[:3]]
    mutate(lines[1])
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    with pytest.raises(InputError) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}:2:") and needle in str(info.value)


def test_not_json_and_gaps(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"trace_version": 1,\n')
    with pytest.raises(InputError, match=r"t.jsonl:1: not valid JSON"):
        read_trace(path)
    lines = [s.to_json() for s in preset_trace("smoke")[:3]]
    del lines[1]
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    with pytest.raises(InputError, match=r"t.jsonl:2: field 'step': episode 'ep0000' expected step 1"):
        read_trace(path)


def test_geometry_places_prompt_ends(tmp_path):
    from statescope.engine.config import default_model
    from statescope.workload.geometry import GeometryPadder

    padder = GeometryPadder(str(default_model()), 64)
    eps = episodes_of(preset_trace("smoke", geometry="mixed"))
    steps = eps["ep0001"]
    assert [s.geometry["align"] for s in steps[:3]] == ["before", "at", "after"]
    msgs = build_messages(steps, 1, ["click(id=3)"])
    for align, residue in (("before", 63), ("at", 0), ("after", 1)):
        padded, length = padder.pad(msgs, align)
        assert length % 64 == residue == padder.count(padded) % 64
    with pytest.raises(InputError, match="resolved mamba_block_size"):
        GeometryPadder(str(default_model()), 0)
