"""Place prompt ends relative to the resolved align unit (the Mamba block size).

In align mode vLLM keeps one recurrent state per block boundary, and the copy paths differ by
where a request's tokens end relative to a boundary: a prompt ending one token *before* a boundary
crosses it on its first decode step (pre-copy with an accepted bias), one ending *at* it is cached
exactly there, one ending just *after* it starts a new block. ``GeometryPadder`` pads a step's user
turn with neutral filler until the chat-templated prompt length ``P`` satisfies::

    before:  P % B == B - 1 - offset
    at:      P % B == offset            (offset 0: exactly on the boundary)
    after:   P % B == 1 + offset

What it does: count tokens with the model's own tokenizer and chat template (the same rendering the
runners use), pad, and report the achieved residue. What it deliberately does not do: guess ``B``
— pass the *resolved* ``mamba_block_size`` read back from the engine.
"""
from __future__ import annotations

from typing import Any

from statescope.errors import InputError

FILLERS = (" ~", "~", " .", " -", "\n")  # first one that costs exactly one token per repeat wins


class GeometryPadder:
    def __init__(self, model_dir: str, block_size: int) -> None:
        from transformers import AutoTokenizer

        if not isinstance(block_size, int) or block_size < 2:
            raise InputError(f"GeometryPadder block_size={block_size!r}: expected the resolved "
                             "mamba_block_size (an integer >= 2)")
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.block_size = block_size

    def count(self, messages: list[dict]) -> int:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(self.tok.encode(text, add_special_tokens=False))

    def target_residue(self, align: str, offset: int = 0) -> int:
        b = self.block_size
        residue = {"before": b - 1 - offset, "at": offset, "after": 1 + offset}.get(align)
        if residue is None:
            raise InputError(f"geometry align={align!r}: expected before, at or after")
        return residue % b

    def pad(self, messages: list[dict], align: str, offset: int = 0) -> tuple[list[dict], int]:
        """Return (padded messages, prompt length). The last message must be the user turn."""
        want = self.target_residue(align, offset)
        base = messages[-1]["content"]

        def build(filler: str, n: int) -> list[dict]:
            return messages[:-1] + [{"role": "user", "content": _with_filler(base, filler, n)}]

        for filler in FILLERS:
            c1, c2, c3 = (self.count(build(filler, n)) for n in (1, 2, 3))
            if c2 - c1 != 1 or c3 - c2 != 1:
                continue  # the tokenizer merges repeats of this filler
            n = 1 + (want - c1) % self.block_size
            msgs = build(filler, n)
            length = self.count(msgs)
            if length % self.block_size == want:
                return msgs, length
        raise InputError(f"geometry: could not place the prompt end at residue {want} of "
                         f"{self.block_size}: no filler in {FILLERS} costs one token per repeat")


def _with_filler(content: Any, filler: str, n: int) -> Any:
    fill = "\n" + filler * n
    if isinstance(content, str):
        return content + fill
    parts = list(content)
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].get("type") == "text":
            parts[i] = {"type": "text", "text": parts[i]["text"] + fill}
            return parts
    return parts + [{"type": "text", "text": fill}]
