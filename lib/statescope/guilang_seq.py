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
often the rest of the greedy answer changes, for every (layer, part, mode) on each trial prompt.

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
                      n_prompts: int = 20, seed: int = 1234) -> dict:
    """Mid-value sensitivity: ``prompts`` are (prompt ids, gold answer ids); trial prompts are
    ``n_prompts`` answers with a value long enough, each damaged after m = 2 or 3 value words in
    every GDN layer x {conv, recurrent} x {zero, swap with another trial's state at its own point}.
    Also reports how often the clean greedy rest equals the gold rest (the copy works)."""
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
    with torch.no_grad():
        for t, (prompt, gold, k) in enumerate(trials):
            n = len(gold) - k + 4
            clean = _rest(base, prompt + gold[:k], n, eos)
            clean_ok += clean == gold[k:]
            op, og, ok = trials[(t + 1) % len(trials)]  # the swap source: the next trial
            other = base(input_ids=torch.tensor([op + og[:ok]]), use_cache=True).past_key_values
            for layer in gdn:
                for part in ("conv", "recurrent"):
                    for mode in ("zero", "swap"):
                        def edit(cache, layer=layer, part=part, mode=mode):
                            dst = _states(cache, layer, part)
                            dst.zero_() if mode == "zero" else dst.copy_(_states(other, layer, part))
                        changed = int(_rest(base, prompt + gold[:k], n, eos, edit) != clean)
                        for key in (f"{part}_{mode}", f"layer{layer}_{part}", f"layer{layer}_{part}_{mode}"):
                            by.setdefault(key, []).append(changed)
    flat = [v for key, vs in by.items() if key.count("_") == 1 and not key.startswith("layer")
            for v in vs]
    return {"value_sensitivity_changed_fraction": sum(flat) / max(1, len(flat)),
            "value_sensitivity_trials": len(flat), "value_sensitivity_prompts": len(trials),
            "value_clean_rest_equals_gold": f"{clean_ok}/{len(trials)}",
            "value_sensitivity_by": {key: f"{sum(v)}/{len(v)}" for key, v in sorted(by.items())}}
