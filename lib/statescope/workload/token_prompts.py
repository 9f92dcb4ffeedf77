"""Prompts of random token ids, shaped for a question about the engine rather than for a model to answer.

What it does: ``sweep_prompts`` gives distinct prompts of ``m`` full blocks plus ``r`` extra tokens
(the prefix-cache hit sweep: how many blocks does a second send reuse?); ``decode_prompts`` many
one-block prompts for long decodes (short steps: the worst case for a per-step cost);
``gui_prompts`` the workbook's GUI-agent shape at random tokens: a few agents, each with several
steps that share a long history and differ in a short observation (long prompts, prefix-cache
hits, short answers). Token ids are drawn below ``vocab - 8`` so that no special token at the top
of a small vocabulary is drawn. Deterministic for a seed.

What it deliberately does not do: tokenize text, or produce anything a model could answer well
(``statescope.workload.guilang`` is the language a trained model speaks).
"""
from __future__ import annotations

import random

from statescope.errors import InputError


def _check(vocab: int, what: str) -> None:
    if vocab <= 8:
        raise InputError(f"{what}: expected a vocabulary of more than 8 tokens, got {vocab}")


def sweep_prompts(block_size: int, vocab: int, *, blocks: tuple = (1, 2, 3, 4, 5),
                  offsets: tuple | None = None, seed: int = 0) -> list[tuple[int, int, list[int]]]:
    """(full blocks, extra tokens, token ids): distinct random prompts of ``m * bs + r`` tokens."""
    if block_size <= 0 or vocab <= 8:
        raise InputError(f"sweep_prompts: expected block_size > 0 and vocab > 8, got {block_size}, {vocab}")
    rng = random.Random(seed)
    offsets = offsets if offsets is not None else (0, 1, block_size // 2)
    return [(m, r, [rng.randrange(0, vocab - 8) for _ in range(m * block_size + r)])
            for m in blocks for r in offsets]


def decode_prompts(block_size: int, vocab: int, n: int = 32, seed: int = 7) -> list[list[int]]:
    """``n`` distinct prompts of one block plus 0..n-1 tokens (the overhead probe's decode workload)."""
    return [ids for _, _, ids in sweep_prompts(block_size, vocab, blocks=(1,), offsets=tuple(range(n)),
                                               seed=seed)]


def gui_prompts(vocab: int, groups: int = 4, per_group: int = 8, prefix: int = 2048, suffix: int = 384,
                seed: int = 11) -> list[list[int]]:
    """``groups`` agents, each with ``per_group`` steps that share a ``prefix``-token history and
    differ in a ``suffix``-token observation."""
    _check(vocab, "gui_prompts")
    if min(groups, per_group, prefix, suffix) <= 0:
        raise InputError(f"gui_prompts: expected positive groups, per_group, prefix and suffix, got "
                         f"{groups}, {per_group}, {prefix}, {suffix}")
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        head = [rng.randrange(0, vocab - 8) for _ in range(prefix)]
        out += [head + [rng.randrange(0, vocab - 8) for _ in range(suffix)] for _ in range(per_group)]
    return out
