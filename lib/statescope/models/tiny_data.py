"""Training batches for the tiny GUI-agent model: a short-to-long curriculum over guilang episodes.

What it does: builds deterministic (from seed and step) batches of token ids and per-token loss
weights. Each sample is an episode cut down to a subset of its steps (always step 0, which carries
the goal; see ``guilang.transcript_segments(keep=...)``), so every kept answer is still correct.
Early in training the samples keep 1-2 steps (a few hundred tokens: the copy skills are learnt
fast on short contexts); the number of kept steps grows with progress until whole episodes of up to
12 steps (~1.6k tokens) are common, so long prompts work too. A batch holds samples of one size
class and is filled up to a token budget, so short-sample batches hold many samples.

``copy_batch`` gives the dense copy warm-up batches used before the guilang curriculum.

What it deliberately does not do: train, tokenize the tokenizer's training text, or evaluate.
"""
from __future__ import annotations

import random

import torch

from statescope.workload import guilang

TRAIN_SEED_LIMIT = 1_000_000   # training episode seeds are below this; held-out ones start at 1e7
MAX_STEPS = 12                 # longest training episode (held-out episodes have 3-12 steps)


def kept_steps(progress: float, rng: random.Random) -> int:
    """How many steps a sample keeps at training ``progress`` in [0, 1]: the ceiling grows from 2
    (first 30% of training) to MAX_STEPS; the draw is uniform below it."""
    ceiling = 2 if progress < 0.3 else min(MAX_STEPS, 2 + int((progress - 0.3) / 0.5 * (MAX_STEPS - 2) + 0.5))
    return rng.randint(1, ceiling)


def sample(tok, seed: int, n_steps: int, k: int, rng: random.Random,
           variant: dict | None = None) -> tuple[list[int], list[bool]]:
    """Token ids and full-weight flags of episode ``seed`` (``n_steps`` steps) cut to ``k`` kept
    steps: answer tokens, and the value token of every ``value="..."`` on a screen. ``variant``:
    extra ``generate_episode`` arguments (``guilang_seq``); with sequence values every word of a
    screen value (and its closing quote) is flagged, not only the first, and the goal's value is not."""
    ep = guilang.generate_episode(seed, n_steps, **(variant or {}))
    words = {tok.token_to_id(p + w) for w in guilang.SEQ_WORDS for p in ("", "Ġ")} if variant else set()
    goal_text = tok.token_to_id("Ġtext")
    keep = [0] + sorted(rng.sample(range(1, n_steps), min(k, n_steps) - 1))
    ids: list[int] = []
    answer: list[bool] = []
    quote = tok.token_to_id('="')
    for text, is_answer in guilang.transcript_segments(ep, keep):
        piece = tok.encode(text, add_special_tokens=False).ids
        # A filled textbox's value="..." on a screen is the same recall as an answer's text="..."
        # (label -> value from the goal): weigh it like an answer token, for far more signal.
        flags = [is_answer or (j > 0 and piece[j - 1] == quote) for j in range(len(piece))]
        for j in range(1, len(piece)) if words and not is_answer else ():
            if j > 1 and piece[j - 1] == quote and piece[j - 2] == goal_text:
                flags[j] = False  # the goal's own value is random, not a recall
            elif flags[j - 1] and piece[j - 1] in words:  # the rest of a screen's sequence value
                flags[j] = True
        answer += flags
        ids += piece
    return ids, answer


def batch(tok, step: int, total: int, seed: int, token_budget: int, context_weight: float,
          variant: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, T], weights [B, T], answer mask [B, T]) of training step ``step`` of ``total``."""
    from statescope.models import tinymodel as tm

    rng = random.Random(seed * 7919 + step)
    k = kept_steps(step / max(1, total), rng)
    encs: list[tuple[list[int], list[bool]]] = []
    used = 0
    while used < token_budget or not encs:
        n = rng.randint(max(3, k), MAX_STEPS)
        enc = sample(tok, rng.randrange(TRAIN_SEED_LIMIT), n, k, rng, variant)
        if encs and used + len(enc[0]) > token_budget * 1.15:
            break
        encs.append(enc)
        used += len(enc[0])
    t = max(len(i) for i, _ in encs)
    pad = tok.token_to_id("<|endoftext|>")
    ids = torch.full((len(encs), t), pad, dtype=torch.long)
    ans = torch.zeros(len(encs), t, dtype=torch.bool)
    valid = torch.zeros(len(encs), t)
    for b, (i, a) in enumerate(encs):
        ids[b, :len(i)] = torch.tensor(i)
        ans[b, :len(a)] = torch.tensor(a)
        valid[b, :len(i)] = 1
    return ids, tm.token_weights(ans, valid, context_weight), ans


def copy_batch(step: int, seed: int, token_budget: int, n_text_tokens: int,
               half: int = 64, alphabet: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A warm-up batch of random token strings repeated once (``x x``), loss on the repeat only.

    Copying "what followed this context before" is what the answers need (the goal's
    ``text="value"`` and the focus line's ``(id=N`` are copied into the answer), but in guilang
    text only ~2 tokens per ~150 carry that signal, so the circuit forms slowly; a few dense
    copy steps first form it (an induction head: ~150 steps, vs. thousands on guilang alone).
    ``alphabet`` > 0 (opt-in, for sequence values): every other row uses only ``alphabet`` random
    tokens, so the next token is ambiguous from the current one and the copy must match n-grams."""
    g = torch.Generator().manual_seed(seed * 7919 + 1_000_000 + step)
    x = torch.randint(0, n_text_tokens, (max(1, token_budget // (2 * half)), half), generator=g)
    if alphabet:  # opt-in: every other row over its own ``alphabet`` random tokens (n-gram copy)
        for r in range(0, x.shape[0], 2):
            symbols = torch.randperm(n_text_tokens, generator=g)[:alphabet]
            x[r] = symbols[torch.randint(0, alphabet, (half,), generator=g)]
    ids = torch.cat([x, x], 1)
    w = torch.zeros(ids.shape)
    w[:, half + 1:] = 1.0  # the first repeated token is not predictable yet
    return ids, w
