"""Record one workload on an in-process engine with capture on: the notebook- and CLI-sized helper.

What it does: ``record(engine, spec, prompts)`` resets the prefix cache, installs capture with
``spec`` (a dict or ``CaptureSpec``), generates greedily, removes capture and returns the
``CaptureRun`` with the generated records. ``boundary_prompts(block_size, n)`` makes distinct
token-id prompts that end just before a Mamba block boundary, so that decoding with MTP crosses
it at different offsets — the workload that exercises every align-mode copy path, in-place
shifts included. Token ids, not text, because a trained tokenizer merges characters.

What it deliberately does not do: start engines or servers (``statescope.engine``,
``statescope.server``), or compare runs (``statescope.capture_diff``).
"""
from __future__ import annotations

from typing import Any, Sequence

from statescope.capture_store import CaptureRun
from statescope.errors import InputError


def boundary_prompts(block_size: int, n: int = 12, token_range: tuple[int, int] = (3, 250)
                     ) -> list[list[int]]:
    """``n`` distinct token-id prompts; prompt i has ``block_size - 13 + i`` tokens (a unique
    opening token, then one repeated token). Ids are drawn from ``token_range``, which must hold
    ordinary tokens of the model's vocabulary (the default suits the embedded tiny models)."""
    lo, hi = token_range
    if hi - lo < 2 * n or block_size < 14:
        raise InputError(f"boundary_prompts: token_range {token_range} too small for {n} prompts, "
                         f"or block_size {block_size} < 14")
    return [[lo + i] + [lo + n + i % 10] * (block_size - 14 + i) for i in range(n)]


def record(engine: Any, spec: Any, prompts: Sequence[Any], *, max_tokens: int = 24,
           ignore_eos: bool = True, reset_prefix_cache: bool = True) -> tuple[CaptureRun, list]:
    """Run ``prompts`` once with capture on; returns (the run, the engine's request records)."""
    from statescope import capture

    if reset_prefix_cache:
        engine.reset_prefix_cache()
    capture.install(spec)
    try:
        records = engine.generate(list(prompts), max_tokens=max_tokens, ignore_eos=ignore_eos)
    finally:
        dirs = capture.uninstall()
    return CaptureRun(dirs[-1]), records
