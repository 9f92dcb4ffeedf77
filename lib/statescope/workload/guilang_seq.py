"""Opt-in "sequence values" variant of guilang, and a mid-value GDN-state sensitivity measurement.

What it does: the committed tiny model answers every ``type`` by a one-hop copy whose attention
query needs only the current token, so damaging GDN state mid-answer changes nothing. In this
variant the typed value is a sequence of words from a small alphabet with repeats
(``guilang.generate_episode(..., value_words=N, value_alphabet=K)``: N-2..N words of the first K
``guilang.SEQ_WORDS``, e.g. ``text="Job Day Pet Job Job"``), so the next word is ambiguous from the
current one and the copy's query must carry the previous words (conv window: current + 3 tokens;
beyond that the recurrent state). ``variant``/``write_variant``/``read_variant`` carry the choice
in a model dir (``guilang_variant.json``, absent for the default language).
``value_sensitivity`` damages one GDN layer's conv window or recurrent state (zero, or another
request's at the same point) right after the ``m``-th word of the value (m = 2 or 3) and counts how
often the rest of the greedy answer changes, for every (layer, part, mode) on each trial prompt;
opt-in, a separately reported swap with another request's state at a *different* point.

What it deliberately does not do: change the default language, train, or run vLLM.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

VARIANT_FILE = "guilang_variant.json"


def variant(value_words: int, value_alphabet: int, value_runs: int = 0) -> dict | None:
    """``generate_episode`` keyword arguments of the variant (None: the default language)."""
    if not value_words:
        return None
    return {"value_words": value_words, "value_alphabet": value_alphabet,
            **({"value_runs": value_runs} if value_runs else {})}


def write_variant(out: Path | str, var: dict | None) -> None:
    if var:
        (Path(out) / VARIANT_FILE).write_text(json.dumps(var, indent=1))


def read_variant(model_dir: Path | str) -> dict:
    """The model dir's variant kwargs ({} for a model of the default language)."""
    f = Path(model_dir) / VARIANT_FILE
    return json.loads(f.read_text()) if f.exists() else {}


def value_point(answer: list[int], quote: int, words: int) -> int | None:
    """Answer tokens emitted when ``words`` value words are out (after ``text="`` + words tokens);
    None if the answer has no value or the value is not longer than that."""
    if quote not in answer:
        return None
    k = answer.index(quote) + 1 + words
    return k if k < len(answer) - 3 else None  # at least one more word, `")` and <|im_end|> to come


def _rest(base, prefix: list[int], n: int, eos: int, edit=None) -> list[int]:
    """Greedy continuation (``n`` tokens at most) after ``prefix``; ``edit(cache)`` runs on the
    cache after the prefill (the first continuation token comes from the clean logits)."""
    out = base(input_ids=torch.tensor([prefix]), use_cache=True)
    cache, logits = out.past_key_values, out.logits[0, -1]
    if edit is not None:
        edit(cache)
    toks: list[int] = []
    for _ in range(n):
        toks.append(int(logits.argmax()))
        if toks[-1] == eos:
            break
        out = base(input_ids=torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1]
    return toks


def _states(cache, layer: int, part: str) -> torch.Tensor:
    lay = cache.layers[layer]
    return (lay.conv_states if part == "conv" else lay.recurrent_states)[0]


def value_sensitivity(base, prompts: list[tuple[list[int], list[int]]], eos: int, quote: int,
                      n_prompts: int = 20, seed: int = 1234, other_point: bool = False) -> dict:
    """Mid-value sensitivity: ``prompts`` are (prompt ids, gold answer ids); trial prompts are
    ``n_prompts`` answers with a value long enough, each damaged after m = 2 or 3 value words in
    every GDN layer x {conv, recurrent} x {zero, swap with another trial's state at its own point}.
    Also reports how often the clean greedy rest equals the gold rest (the copy works).

    ``other_point`` (opt-in) adds a third mode, ``swapother``: the swapped-in state is the swap
    trial's state after a uniformly random token of its prompt + gold answer (another request at a
    *different* point), reported separately (``value_sensitivity_other_point_*``; the grid of zero +
    swapother); the zero/swap grid and its fraction are the same as without it."""
    gdn = [i for i, t in enumerate(base.config.layer_types) if t == "linear_attention"]
    rng = random.Random(seed)
    cands = []
    for p, g in prompts:
        m = rng.choice([2, 3])
        k = value_point(g, quote, m)
        if k is not None:
            cands.append((p, g, k))
    trials = rng.sample(cands, min(n_prompts, len(cands)))
    by: dict[str, list[int]] = {}
    clean_ok = 0
    other_rng = random.Random(seed + 1)
    points: list[dict] = []
    with torch.no_grad():
        for t, (prompt, gold, k) in enumerate(trials):
            n = len(gold) - k + 4
            clean = _rest(base, prompt + gold[:k], n, eos)
            clean_ok += clean == gold[k:]
            op, og, ok = trials[(t + 1) % len(trials)]  # the swap source: the next trial
            other = base(input_ids=torch.tensor([op + og[:ok]]), use_cache=True).past_key_values
            sources = {"zero": None, "swap": other}
            if other_point:  # its own rng: the trials and the zero/swap grid stay as without it
                full = op + og
                at = other_rng.randrange(1, len(full) + 1)
                sources["swapother"] = base(input_ids=torch.tensor([full[:at]]), use_cache=True).past_key_values
                points.append({"trial": t, "source_tokens": at, "source_len": len(full),
                               "source_in_answer": at > len(op)})
            for layer in gdn:
                for part in ("conv", "recurrent"):
                    for mode, src in sources.items():
                        def edit(cache, layer=layer, part=part, src=src):
                            dst = _states(cache, layer, part)
                            dst.zero_() if src is None else dst.copy_(_states(src, layer, part))
                        changed = int(_rest(base, prompt + gold[:k], n, eos, edit) != clean)
                        keys = (f"{part}_{mode}", f"layer{layer}_{part}_{mode}") if mode == "swapother" \
                            else (f"{part}_{mode}", f"layer{layer}_{part}", f"layer{layer}_{part}_{mode}")
                        for key in keys:
                            by.setdefault(key, []).append(changed)

    def grid(modes: tuple[str, ...]) -> list[int]:
        return [v for part in ("conv", "recurrent") for mode in modes for v in by.get(f"{part}_{mode}", [])]

    flat = grid(("zero", "swap"))
    res = {"value_sensitivity_changed_fraction": sum(flat) / max(1, len(flat)),
           "value_sensitivity_trials": len(flat), "value_sensitivity_prompts": len(trials),
           "value_clean_rest_equals_gold": f"{clean_ok}/{len(trials)}",
           "value_sensitivity_by": {key: f"{sum(v)}/{len(v)}" for key, v in sorted(by.items())
                                    if not key.endswith("swapother")}}
    if other_point:  # a separate measurement: zero + swap with another request at another point
        alt = grid(("zero", "swapother"))
        res |= {"value_sensitivity_other_point_changed_fraction": sum(alt) / max(1, len(alt)),
                "value_sensitivity_other_point_trials": len(alt),
                "value_sensitivity_other_point_swap_only": f"{sum(grid(('swapother',)))}/{len(grid(('swapother',)))}",
                "value_sensitivity_other_point_by": {key: f"{sum(v)}/{len(v)}" for key, v in sorted(by.items())
                                                     if key.endswith("swapother")},
                "value_sensitivity_other_point_sources": points}
    return res
