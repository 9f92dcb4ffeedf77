"""Place prompt ends — or an image — relative to the resolved align unit (the Mamba block size).

In align mode vLLM keeps one recurrent state per block boundary, and the copy paths differ by
where a request's tokens end relative to a boundary: a prompt ending one token *before* a boundary
crosses it on its first decode step (pre-copy with an accepted bias), one ending *at* it is cached
exactly there, one ending just *after* it starts a new block. ``GeometryPadder`` pads a step's user
turn with neutral filler until the chat-templated prompt length ``P`` satisfies::

    before:  P % B == B - 1 - offset
    at:      P % B == offset            (offset 0: exactly on the boundary)
    after:   P % B == 1 + offset

``image_across`` instead pads *in front of* the turn's first image until a block boundary falls
inside that image's tokens (start ``S``, ``n`` tokens: ``S % B == (B - n // 2 + offset) % B``), so
a prefill chunk that vLLM ends on a block boundary ends inside the image (what vLLM 0.28.0 then
does is recorded in ``docs/tiny-vl.md``).

What it does: count tokens with the model's own tokenizer and chat template (the same rendering the
runners use) — for a vision model each image counts the tokens its processor expands it to — pad,
and report the achieved residue. What it deliberately does not do: guess ``B`` — pass the
*resolved* ``mamba_block_size`` read back from the engine.
"""
from __future__ import annotations

import hashlib
from typing import Any

from statescope.errors import InputError

FILLERS = (" ~", "~", " .", " -", "\n")  # first one that costs exactly one token per repeat wins


class GeometryPadder:
    def __init__(self, model_dir: str, block_size: int) -> None:
        from transformers import AutoTokenizer

        from statescope.workload.model_files import is_multimodal, load_processor, tokenizer_dir

        if not isinstance(block_size, int) or block_size < 2:
            raise InputError(f"GeometryPadder block_size={block_size!r}: expected the resolved "
                             "mamba_block_size (an integer >= 2)")
        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir(model_dir)))
        self.block_size = block_size
        self.processor = None
        if is_multimodal(model_dir):
            self.processor = load_processor(model_dir)
            self.image_pad_id = self.tok.convert_tokens_to_ids("<|image_pad|>")
        self._image_tokens: dict[str, int] = {}

    # -- counting ---------------------------------------------------------------------------
    def _tokens_of_image(self, url: str) -> int:
        key = hashlib.sha1(url.encode()).hexdigest()
        if key not in self._image_tokens:
            from statescope.workload.images import open_image

            grid = self.processor.image_processor(images=[open_image(url)])["image_grid_thw"][0]
            merge = self.processor.image_processor.merge_size
            self._image_tokens[key] = int(grid.prod()) // (merge * merge)
        return self._image_tokens[key]

    def _layout(self, messages: list[dict]) -> tuple[int, list[tuple[int, int]]]:
        """(prompt length, [(start, length)] of every image) as the engine will see them."""
        from statescope.workload.images import image_urls

        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tok.encode(text, add_special_tokens=False)
        urls = list(image_urls(messages)) if self.processor is not None else []
        if not urls:
            return len(ids), []
        spans, shift, k = [], 0, 0
        for pos, tid in enumerate(ids):
            if tid == self.image_pad_id and k < len(urls):
                n = self._tokens_of_image(urls[k])
                spans.append((pos + shift, n))
                shift += n - 1
                k += 1
        return len(ids) + shift, spans

    def count(self, messages: list[dict]) -> int:
        return self._layout(messages)[0]

    def image_spans(self, messages: list[dict]) -> list[tuple[int, int]]:
        """(start, number of tokens) of each image of the prompt (empty for a text-only model)."""
        return self._layout(messages)[1]

    # -- padding ----------------------------------------------------------------------------
    def target_residue(self, align: str, offset: int = 0) -> int:
        b = self.block_size
        residue = {"before": b - 1 - offset, "at": offset, "after": 1 + offset}.get(align)
        if residue is None:
            raise InputError(f"geometry align={align!r}: expected before, at, after or image_across")
        return residue % b

    def pad(self, messages: list[dict], align: str, offset: int = 0) -> tuple[list[dict], int]:
        """Return (padded messages, prompt length). The last message must be the user turn."""
        if not messages or messages[-1].get("role") != "user":
            raise InputError("geometry: the last message must be the user turn to pad, got "
                             f"{(messages[-1].get('role') if messages else None)!r}")
        if align == "image_across":
            return self._pad_image(messages, offset)
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

    def _pad_image(self, messages: list[dict], offset: int) -> tuple[list[dict], int]:
        base = messages[-1]["content"]
        first = next((i for i, p in enumerate(base) if p.get("type") == "image_url"), None) \
            if isinstance(base, list) else None
        if first is None or self.processor is None:
            why = "the model has no vision tower" if self.processor is None else \
                "the user turn carries no image"
            raise InputError(f"geometry image_across: {why} (use a vision model such as tiny-vl "
                             "and a trace with screenshots: --vision)")
        from statescope.workload.images import image_urls

        n_before = len(list(image_urls(messages[:-1])))  # images of earlier turns come first

        def build(filler: str, n: int) -> list[dict]:
            fill = {"type": "text", "text": filler * n + "\n"}
            return messages[:-1] + [{"role": "user", "content": base[:first] + [fill] + base[first:]}]

        b = self.block_size
        for filler in FILLERS:
            starts = [self.image_spans(build(filler, n))[n_before][0] for n in (1, 2, 3)]
            if starts[1] - starts[0] != 1 or starts[2] - starts[1] != 1:
                continue
            length = self.image_spans(build(filler, 1))[n_before][1]
            if length < 2:
                raise InputError(f"geometry image_across: the image has {length} token(s); a "
                                 "block boundary cannot fall inside it")
            want = (b - length // 2 + offset) % b
            if want == 0:
                want = 1  # a boundary exactly at the image start is not inside it
            msgs = build(filler, 1 + (want - starts[0]) % b)
            start, n_img = self.image_spans(msgs)[n_before]
            if start % b == want:
                return msgs, self.count(msgs)
        raise InputError(f"geometry image_across: could not place the image start at residue "
                         f"{want} of {b}: no filler in {FILLERS} costs one token per repeat")


def boundary_inside(start: int, length: int, block_size: int) -> bool:
    """Whether a block boundary lies strictly inside the token span [start, start + length)."""
    return (start // block_size + 1) * block_size < start + length


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
