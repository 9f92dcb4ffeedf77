"""Tests for statescope.verdict.detect: every degeneracy reason, false positives, and flip kinds."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from statescope.verdict.detect import REASONS, classify_output, compare_to_control, label_records
from statescope.errors import InputError

NORMAL = "I will open the settings menu first, then enable dark mode."


def _reasons(text, ids=None, finish="length", **kw):
    return classify_output(text, ids, finish, **kw).reasons


# -- normal outputs are not degenerate --------------------------------------------------------------
@pytest.mark.parametrize("text", [
    NORMAL, "Done! The file is saved.", "click(id=3)", "type(text='hello world')",
    "The total is 10000.", "Wait...", "He said: \"stop!\" and left.", "ok ok ok",
    '{"action": "click", "x": 120, "y": 455}',
])
def test_normal_outputs_are_not_degenerate(text):
    d = classify_output(text, [11, 22, 33, 44, 55], "stop")
    assert not d.degenerate and d.reasons == []


def test_normal_token_ids_with_short_repeats_are_not_degenerate():
    # '10000' in a digit-per-token tokenizer: 4 repeats of one id, but a span below the minimum.
    assert _reasons("The total is 10000", [785, 2790, 374, 220, 16, 15, 15, 15, 15]) == []


# -- each reason ------------------------------------------------------------------------------------
def test_empty():
    assert "empty" in _reasons("", [])
    assert "empty" in _reasons("   \n\t", [198, 198])
    assert "empty" in _reasons("", None)
    assert _reasons("x", None) == []


def test_immediate_eos():
    r = _reasons("", [151645], finish="stop")
    assert "immediate_eos" in r and "empty" in r
    assert "immediate_eos" in _reasons("", [], finish="stop")
    assert "immediate_eos" not in _reasons("", [1, 2], finish="stop")  # more than one token
    assert "immediate_eos" not in _reasons("", [151645], finish="length")
    assert "immediate_eos" not in _reasons("a", [64], finish="stop")


def test_bang_run_text_and_token_zero():
    assert "bang_run" in _reasons("click(id=3)!!!!")
    assert "bang_run" not in _reasons("Great!!!")  # three is below the default threshold
    assert "bang_run" in _reasons("abc", [5, 0, 0, 0, 0, 9])
    assert "bang_run" not in _reasons("abc", [5, 0, 0, 0, 9, 0])
    assert "bang_run" in _reasons("Great!!!", bang_run=3)


def test_punct_run():
    assert "punct_run" in _reasons("answer: ?.,;:!?.")
    assert "punct_run" not in _reasons("answer: ?.,;:!?")  # seven
    assert "punct_run" not in _reasons("a = b + c ++ d")  # symbols, not punctuation


def test_repetition_loop_text():
    assert "repetition_loop" in _reasons(NORMAL + " the the the the the the")
    assert "repetition_loop" in _reasons("click(id=3) " * 4)
    assert "repetition_loop" in _reasons("x" * 40)
    # A loop that stopped before the end is not a trailing loop.
    assert "repetition_loop" not in _reasons("abcdabcdabcdabcdabcd then a normal ending.")
    # Three repeats are not enough; a period over 32 chars is out of range.
    assert "repetition_loop" not in _reasons("hello there! " * 3)
    long_period = "this sentence is longer than thirty-two chars. "
    assert "repetition_loop" not in _reasons(long_period * 5)
    assert "repetition_loop" in _reasons(long_period * 5, loop_max_period_chars=64)


def test_repetition_loop_tokens():
    ids = [10, 11, 12] + [7, 8, 9] * 4
    assert "repetition_loop" in _reasons("some text", ids)
    assert "repetition_loop" not in _reasons("some text", [10, 11, 12] + [7, 8, 9] * 3)
    assert "repetition_loop" not in _reasons("some text", [7, 8, 9] * 4 + [1, 2])


def test_invalid_action():
    def valid(text: str) -> bool:
        return text.startswith("click(") and text.endswith(")")

    assert _reasons("click(id=3)", action_validator=valid) == []
    assert _reasons("open the door", action_validator=valid) == ["invalid_action"]


def test_reasons_come_from_the_vocabulary_and_combine():
    d = classify_output("!!!!!!!!!!!!!!!!!!!!", [0] * 20, "length")
    assert d.degenerate
    assert {"bang_run", "punct_run", "repetition_loop"} <= set(d.reasons)
    assert set(d.reasons) <= set(REASONS)


def test_bad_input():
    with pytest.raises(InputError, match="text"):
        classify_output(None, [1], "stop")
    with pytest.raises(InputError, match="token_ids"):
        classify_output("a", ["x"], "stop")


# -- flips ----------------------------------------------------------------------------------------
def test_identical():
    f = compare_to_control([1, 2, 3], [1, 2, 3], [0.5, 0.5, 0.5])
    assert f.identical and f.kind == "identical" and f.first_diff is None


def test_near_tie_and_confident_flips():
    margins = [2.0, 0.03, 1.5, 3.0]
    near = compare_to_control([1, 9, 3, 4], [1, 2, 3, 4], margins)
    assert (near.kind, near.first_diff, near.control_margin_at_diff) == ("near_tie_flip", 1, 0.03)
    assert near.margin_known and not near.identical
    conf = compare_to_control([1, 2, 9, 4], [1, 2, 3, 4], margins)
    assert (conf.kind, conf.first_diff, conf.control_margin_at_diff) == ("confident_flip", 2, 1.5)
    # Only the first difference counts: a confident later diff after a near tie stays a near tie.
    assert compare_to_control([1, 9, 9, 9], [1, 2, 3, 4], margins).kind == "near_tie_flip"
    # The threshold is a parameter.
    assert compare_to_control([1, 2, 9, 4], [1, 2, 3, 4], margins, near_tie=2.0).kind == "near_tie_flip"


def test_unknown_margin_is_confident_and_flagged():
    f = compare_to_control([1, 9], [1, 2], [0.5, None])
    assert f.kind == "confident_flip" and not f.margin_known and f.control_margin_at_diff is None
    g = compare_to_control([1, 9], [1, 2], None)
    assert g.kind == "confident_flip" and not g.margin_known


def test_length_only():
    f = compare_to_control([1, 2, 3], [1, 2, 3, 4, 5], [1.0] * 5)
    assert (f.kind, f.first_diff, f.identical) == ("length_only", 3, False)
    assert compare_to_control([1, 2, 3, 4], [1, 2], [1.0, 1.0]).first_diff == 2


def test_compare_bad_margins():
    with pytest.raises(InputError, match="one entry per control token"):
        compare_to_control([1], [1, 2], [0.1])
    with pytest.raises(InputError, match=r"control_margins\[1\]"):
        compare_to_control([1, 3], [1, 2], [0.1, -0.5])


# -- records ----------------------------------------------------------------------------------------
RECORDS = [
    {"text": NORMAL, "output_token_ids": [40, 686, 1787], "finish_reason": "stop", "step": 0},
    {"text": "!!!!!!!!", "output_token_ids": [0] * 8, "finish_reason": "length", "step": 1},
    {"text": "", "output_token_ids": [151645], "finish_reason": "stop", "step": 2},
]


def test_label_records_adds_fields_without_mutating():
    original = json.loads(json.dumps(RECORDS))
    out = label_records(RECORDS)
    assert RECORDS == original
    assert [r["degenerate"] for r in out] == [False, True, True]
    assert "bang_run" in out[1]["degenerate_reasons"]
    assert out[2]["degenerate_reasons"] == ["empty", "immediate_eos"]
    assert out[0]["step"] == 0


def test_label_records_accepts_dataframe_and_generators():
    df = pd.DataFrame(RECORDS)
    assert [r["degenerate"] for r in label_records(df)] == [False, True, True]
    assert len(label_records(r for r in RECORDS)) == 3
    out = label_records(RECORDS, action_validator=lambda t: t.startswith("I will"))
    assert out[0]["degenerate"] is False and "invalid_action" in out[1]["degenerate_reasons"]


def test_label_records_missing_field():
    with pytest.raises(InputError, match=r"record 1: missing field\(s\) \['finish_reason'\]"):
        label_records([RECORDS[0], {"text": "a", "output_token_ids": [1]}])
