"""The teaching notebook's shared pieces: one real engine, capture runs on it, and check results.

What it does: ``Lesson`` starts one real in-process vLLM engine on the trigger configuration
(prefix caching + align + MTP(2), the embedded tiny model by default) and shares it between the
sections of ``notebooks/07_teach_failure_mode``; ``Lesson.capture`` records a workload with state
capture on (``statescope.capture.session.record``) into a temporary folder. ``LessonCheck`` is what each
section's last cell returns: PASS/FAIL, what was checked, and the evidence; it prints as one
``PASS · ...`` line (which ``statescope render`` puts into the verdict table) and shows as HTML.
``snapshot_layers`` names the GDN layer of each row of a captured snapshot (capture stores them
in vLLM's group order, not model order).

What it deliberately does not do: hold the lessons themselves (``statescope.teach.state``,
``teach_align``, ``teach_copy``, ``teach_race``) or start more than one engine.
"""
from __future__ import annotations

import html
import tempfile
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class LessonCheck:
    """One check cell's result against the real engine."""

    name: str
    ok: bool
    detail: str
    evidence: dict = field(default_factory=dict)

    @property
    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} · {self.name}: {self.detail}"

    def __repr__(self) -> str:
        return self.line

    def _repr_html_(self) -> str:
        colour = "#1a7f37" if self.ok else "#cf222e"
        rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                       for k, v in self.evidence.items())
        return (f"<div><b style='color:{colour}'>{'PASS' if self.ok else 'FAIL'}</b> · "
                f"<b>{html.escape(self.name)}</b>: {html.escape(self.detail)}"
                f"{'<table>' + rows + '</table>' if rows else ''}</div>")


class Lesson:
    """One engine for the whole notebook (engine start dominates its run time)."""

    def __init__(self, model: str | None = None, **overrides: Any) -> None:
        from statescope.engine.offline import OfflineEngine
        from statescope.engine.config import EngineConfig

        config = EngineConfig(**({"model": model} if model else {})).replace(**overrides)
        self.engine = OfflineEngine(config)
        self.resolved = self.engine.resolved()
        self.block_size = int(self.resolved["mamba_block_size"])
        self.model = str(config.model)
        self.out = tempfile.mkdtemp(prefix="statescope-teach-")
        self._runs = 0

    def capture(self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 16, mode: str = "digest",
                first_steps: int = 0, reset_prefix_cache: bool = True) -> tuple[Any, list]:
        """(CaptureRun, request records) for ``prompts`` with capture on."""
        from statescope.capture.session import record

        self._runs += 1
        spec: dict = {"output_dir": self.out, "run_id": f"run{self._runs}", "mode": mode}
        if mode == "full":
            spec["full"] = {"first_steps": first_steps}
        return record(self.engine, spec, prompts, max_tokens=max_tokens,
                      reset_prefix_cache=reset_prefix_cache)

    def summary(self):
        """The engine's resolved settings that the lesson depends on: a table in a notebook
        (``KeyValueTable``; ``.to_dict()`` / ``.to_frame()`` for the values)."""
        from statescope.tables import KeyValueTable

        keys = ("vllm_version", "architecture", "enable_prefix_caching", "mamba_cache_mode",
                "mamba_block_size", "speculative_method", "num_speculative_tokens",
                "async_scheduling", "model_runner")
        return KeyValueTable("the lesson's engine (resolved configuration)",
                             {k: self.resolved.get(k) for k in keys}, {"async_scheduling"})

    def close(self) -> None:
        self.engine.close()


def snapshot_layers(run: Any) -> list[str]:
    """GDN layer name of each row of ``run.snapshot(...)`` (vLLM's group order)."""
    seen: list[str] = []
    for state in run.manifest.get("states", []):
        if state["layer"] not in seen:
            seen.append(state["layer"])
    return seen


def layer_index(name: str) -> int:
    """Model layer index from a vLLM layer name (``model.layers.2.linear_attn`` -> 2)."""
    return next(int(p) for p in name.split(".") if p.isdigit())


def varied_prompt(length: int, seed: int = 0, vocab: tuple[int, int] = (3, 250)) -> list[int]:
    """A deterministic prompt of ordinary token ids (varied, so states differ token to token)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(*vocab) for _ in range(length)]
