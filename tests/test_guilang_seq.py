"""guilang_seq: the opt-in sequence-value variant (values from a small alphabet with repeats, typed
verbatim, graded), its training flags and warm-up rows, and that the defaults are unchanged."""
import random
from pathlib import Path

import pytest
import torch

from statescope.workload import guilang as g
from statescope.workload import guilang_seq
from statescope.models import tiny_data

VAR = {"value_words": 7, "value_alphabet": 4}
TOKENIZER = Path(__file__).resolve().parents[1] / "data/models/tiny-gui/tokenizer.json"


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(TOKENIZER))


def test_default_episode_is_unchanged():
    for seed, n in [(0, 3), (7, 9), (123, 12)]:
        assert g.generate_episode(seed, n) == g.generate_episode(seed, n, value_words=0)
        assert g.generate_episode(seed, n).fields[0][1] in g.VALUES


@pytest.mark.parametrize("seed", range(40))
def test_sequence_values_are_typed_verbatim(seed):
    ep = g.generate_episode(seed, 3 + seed % 10, **VAR)
    value = ep.fields[0][1]
    words = value.split(" ")
    assert 5 <= len(words) <= 7 and set(words) <= set(g.SEQ_WORDS[:4])
    assert f'with text="{value}"' in ep.goal
    assert not {lab for lab, _ in ep.fields} & set(g.SEQ_WORDS)  # alphabet words are not labels
    assert {v for _, v in ep.fields} == {value}
    for step in ep.steps:
        if step.kind == "type":
            assert g.parse_action(step.action)["text"] == value
            assert g.grade(step.action, step) == {"valid": True, "correct": True}
            wrong = step.action.replace(value, " ".join(words[:-1] + [words[-2]]
                                                          if words[-1] != words[-2] else words[:-1]))
            assert g.grade(wrong, step) == {"valid": True, "correct": False}
    assert ep == g.generate_episode(seed, 3 + seed % 10, **VAR)


def test_sequence_values_repeat_words_and_bad_arguments():
    values = [g.generate_episode(s, 6, **VAR).fields[0][1].split() for s in range(50)]
    assert all(len(set(v)) < len(v) for v in values)  # >= 5 words of 4: a word repeats
    with pytest.raises(ValueError):
        g.generate_episode(0, 6, value_words=2)
    with pytest.raises(ValueError):
        g.generate_episode(0, 6, value_words=5, value_alphabet=len(g.SEQ_WORDS) + 1)


def test_alphabet_words_are_one_token_in_both_positions(tok):
    for w in g.SEQ_WORDS:
        assert tok.encode(f'="{w}', add_special_tokens=False).tokens == ['="', w]
        assert tok.encode(f'="x {w}', add_special_tokens=False).tokens[-1] == "Ġ" + w


def test_variant_file_roundtrip(tmp_path):
    assert guilang_seq.variant(0, 4) is None
    guilang_seq.write_variant(tmp_path, None)
    assert guilang_seq.read_variant(tmp_path) == {}
    guilang_seq.write_variant(tmp_path, guilang_seq.variant(7, 4))
    assert guilang_seq.read_variant(tmp_path) == VAR


def test_value_point(tok):
    ep = g.generate_episode(3, 6, **VAR)
    step = next(s for s in ep.steps if s.kind == "type")
    ans = tok.encode(step.action + "<|im_end|>", add_special_tokens=False).ids
    k = guilang_seq.value_point(ans, tok.token_to_id('="'), 2)
    assert tok.decode(ans[:k]).endswith('text="' + " ".join(ep.fields[0][1].split()[:2]))
    assert guilang_seq.value_point(ans, tok.token_to_id('="'), 99) is None
    assert guilang_seq.value_point([1, 2, 3], tok.token_to_id('="'), 2) is None


def test_sample_flags_every_screen_value_word_not_the_goal(tok):
    ids, full = tiny_data.sample(tok, 7, 9, 9, random.Random(1), VAR)
    ep = g.generate_episode(7, 9, **VAR)
    n_type = sum(s.kind == "type" for s in ep.steps)
    flagged = tok.decode([i for i, f in zip(ids, full) if f], skip_special_tokens=False)
    value = ep.fields[0][1]
    assert flagged.count(f'text="{value}")') == n_type
    # the goal's value is context; every later copy (answers and filled screen fields) is flagged
    assert flagged.count(value) == tok.decode(ids, skip_special_tokens=False).count(value) - 1
    assert tiny_data.sample(tok, 7, 9, 3, random.Random(1)) == \
        tiny_data.sample(tok, 7, 9, 3, random.Random(1), None)


def test_copy_batch_alphabet_rows():
    base, _ = tiny_data.copy_batch(3, 0, 1024, 500, half=32)
    assert torch.equal(base, tiny_data.copy_batch(3, 0, 1024, 500, half=32, alphabet=0)[0])
    ids, w = tiny_data.copy_batch(3, 0, 1024, 500, half=32, alphabet=4)
    assert torch.equal(ids[:, :32], ids[:, 32:]) and torch.equal(w, tiny_data.copy_batch(3, 0, 1024, 500, 32)[1])
    assert all(len(set(ids[r].tolist())) <= 4 for r in range(0, ids.shape[0], 2))
    assert torch.equal(ids[1::2], base[1::2])  # odd rows: the full-vocabulary strings as before


@pytest.mark.parametrize("seed", range(20))
def test_run_values_come_in_runs(seed):
    ep = g.generate_episode(seed, 6, value_words=14, value_alphabet=3, value_runs=2)
    words = ep.fields[0][1].split()
    assert 12 <= len(words) <= 14 and set(words) <= set(g.SEQ_WORDS[:3])
    runs = [w for i, w in enumerate(words) if i == 0 or words[i - 1] != w]
    assert len(runs) == 2
    assert guilang_seq.variant(14, 3, 2) == {"value_words": 14, "value_alphabet": 3, "value_runs": 2}


def test_value_sensitivity_other_point_is_separate(tok):
    """The opt-in different-point swap adds its own keys and leaves the zero/swap grid unchanged."""
    from statescope.models import tinymodel as tm
    base = tm.new_base_model(tm.model_config(tok), 0).eval()
    quote, eos = tok.token_to_id('="'), tok.token_to_id("<|im_end|>")
    rng = random.Random(5)
    prompts = [([rng.randrange(800) for _ in range(20 + 3 * i)],
                [5, 6, quote] + [rng.randrange(800) for _ in range(6)] + [eos]) for i in range(3)]
    plain = guilang_seq.value_sensitivity(base, prompts, eos, quote, n_prompts=3)
    both = guilang_seq.value_sensitivity(base, prompts, eos, quote, n_prompts=3, other_point=True)
    assert {k: v for k, v in both.items() if "other_point" not in k} == plain
    assert both["value_sensitivity_other_point_trials"] == plain["value_sensitivity_trials"] == 3 * 3 * 2 * 2
    assert set(both["value_sensitivity_other_point_by"]) == \
        {f"{p}_swapother" for p in ("conv", "recurrent")} | \
        {f"layer{i}_{p}_swapother" for i in range(3) for p in ("conv", "recurrent")}
    assert len(both["value_sensitivity_other_point_sources"]) == 3
