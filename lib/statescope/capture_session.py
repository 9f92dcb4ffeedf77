"""Record one workload on an in-process engine with capture on: the notebook- and CLI-sized helper.

What it does: ``record(engine, spec, prompts)`` resets the prefix cache, installs capture with
``spec`` (a dict or ``CaptureSpec``), generates greedily, removes capture and returns the
``CaptureRun`` with the generated records. ``boundary_prompts(block_size, n)`` makes distinct
prompts that end just before a Mamba block boundary, so that decoding with MTP crosses it at
different offsets — the workload that exercises every align-mode copy path, in-place shifts
included (1 character = 1 token with the embedded default's byte-level tokenizer).

What it deliberately does not do: start engines or servers (``statescope.engine``,
``statescope.server``), or compare runs (``statescope.capture_diff``).
"""
from __future__ import annotations

from typing import Any, Sequence

from statescope.capture_store import CaptureRun


def boundary_prompts(block_size: int, n: int = 12) -> list[str]:
    """``n`` distinct prompts of ``block_size - 13 + i`` characters (i = 0..n-1)."""
    return [f"{i:02d}" + "abcdefghij"[i % 10] * (block_size - 15 + i) for i in range(n)]


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
