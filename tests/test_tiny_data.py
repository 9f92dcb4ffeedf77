"""tiny_data: the curriculum grows from short to whole episodes, batches are deterministic and keep
to their token budget, full-weight flags mark answers and screen values, copy warm-up batches."""
import random

import pytest
import torch

from statescope.workload import guilang
from statescope.models import tiny_data
from statescope.models import tinymodel as tm


@pytest.fixture(scope="module")
def tok():
    texts = ["".join(t for t, _ in guilang.transcript_segments(guilang.generate_episode(s, n)))
             for s in range(30) for n in (3, 8, 12)]
    return tm.train_tokenizer(texts, vocab_size=500)


def test_curriculum_starts_short_and_reaches_whole_episodes():
    rng = random.Random(0)
    early = [tiny_data.kept_steps(0.1, rng) for _ in range(200)]
    late = [tiny_data.kept_steps(0.95, rng) for _ in range(200)]
    assert max(early) == 2 and min(early) == 1
    assert max(late) == tiny_data.MAX_STEPS
    assert sum(late) / len(late) > 2 * sum(early) / len(early)


def test_sample_flags_answers_and_screen_values(tok):
    ids, full = tiny_data.sample(tok, 7, 9, 3, random.Random(1))
    flagged = tok.decode([i for i, f in zip(ids, full) if f], skip_special_tokens=False)
    ep = guilang.generate_episode(7, 9)
    value = ep.fields[0][1]
    assert flagged.count("<|im_end|>") == 3  # three kept answers, each closed
    assert flagged.count(f'text="{value}")') == sum(ep.steps[i].kind == "type" for i in range(9)
                                                     if f"{ep.steps[i].action}<|im_end|>" in flagged)
    # a screen's value="..." token is flagged too (here: the first token of the value)
    screen_values = [i for j, (i, f) in enumerate(zip(ids, full)) if f and j and ids[j - 1] == tok.token_to_id('="')]
    assert len(screen_values) > flagged.count("text=")
    assert "Goal:" not in flagged and "Screen" not in flagged  # the rest of the prompt is context
    assert tok.decode(ids).count("Goal:") == 1


def test_batches_are_deterministic_and_budgeted(tok):
    a = tiny_data.batch(tok, 5, 100, 0, 2048, 0.1)
    b = tiny_data.batch(tok, 5, 100, 0, 2048, 0.1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    ids, w, ans = a
    assert ids.shape[0] >= 2 and int((w > 0).sum()) <= 2048 * 1.15
    assert {round(v, 6) for v in w.unique().tolist()} <= {0.0, 0.1, 1.0} and bool((w[ans] == 1).all())
    c = tiny_data.batch(tok, 6, 100, 0, 2048, 0.1)[0]
    assert c.shape != ids.shape or not torch.equal(c, ids)
    late = tiny_data.batch(tok, 95, 100, 0, 2048, 0.1)[0]
    assert late.shape[1] > ids.shape[1]  # late batches hold longer samples


def test_copy_batch_repeats_and_weighs_only_the_predictable_half():
    ids, w = tiny_data.copy_batch(3, 0, 1024, 500, half=32)
    assert ids.shape == (16, 64) and int(ids.max()) < 500
    assert torch.equal(ids[:, :32], ids[:, 32:])
    assert float(w[:, :33].sum()) == 0 and bool((w[:, 33:] == 1).all())
    assert not torch.equal(ids, tiny_data.copy_batch(4, 0, 1024, 500, half=32)[0])
