"""The engine configuration: the knobs this bug family depends on, and where models live.

What it does: ``EngineConfig`` holds prefix caching, Mamba cache mode and block size, speculative
method and token count, async scheduling, chunked prefill, eager mode, batch limits, seed and KV
memory, validates them before vLLM sees them and maps them onto vLLM's engine arguments;
``model_path`` resolves a model name (``tiny-gui``, ``tiny-qwen35``, ``tiny-vl``) or a path, ``default_model``
the embedded default (``STATESCOPE_MODEL`` overrides it). ``EngineConfig.with_overrides`` is the
one override rule of every command (``statescope.engine.overrides``).

What it deliberately does not do: import vLLM or start anything (``statescope.engine.offline``).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from statescope.errors import InputError

MAMBA_CACHE_MODES = ("none", "align", "all")

SPEC_METHODS = ("mtp",)


@dataclass(frozen=True)
class EngineConfig:
    """One engine configuration. ``None`` means "leave vLLM's default" (recorded as resolved)."""

    model: str = field(default_factory=lambda: str(default_model()))
    enable_prefix_caching: bool = True
    mamba_cache_mode: str | None = "align"
    mamba_block_size: int | None = None
    speculative_method: str | None = "mtp"
    num_speculative_tokens: int = 2
    async_scheduling: bool | None = None
    enable_chunked_prefill: bool | None = True
    enforce_eager: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 32
    max_model_len: int = 4096
    seed: int = 0
    kv_cache_memory_bytes: int = 512 * 2**20
    dtype: str = "bfloat16"
    mamba_ssm_cache_dtype: str = "float32"
    # "v1" / "v2": force vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER=0/1 for this engine);
    # None leaves the build's default. The resolved config reads back which runner really ran.
    model_runner: str | None = None
    gpu_memory_utilization: float | None = None  # None: vLLM's default (0.9 of the device)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> None:
            raise InputError(f"EngineConfig.{name}={getattr(self, name)!r}: expected {expected}")

        def is_int(value: Any) -> bool:  # True is an int to Python, never a count to us
            return isinstance(value, int) and not isinstance(value, bool)

        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "true or false")
        for name in ("async_scheduling", "enable_chunked_prefill"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                bad(name, "true, false or None")
        if isinstance(self.model, os.PathLike):  # a path is a model name's other spelling
            object.__setattr__(self, "model", os.fspath(self.model))
        for name in ("model", "dtype", "mamba_ssm_cache_dtype"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                bad(name, "a non-empty string")
        if not is_int(self.seed):
            bad("seed", "an integer")
        if not isinstance(self.extra, dict):
            bad("extra", "a dict of further vLLM engine arguments")
        if self.mamba_cache_mode is not None and self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            bad("mamba_cache_mode", f"one of {MAMBA_CACHE_MODES} or None")
        if self.speculative_method is not None and self.speculative_method not in SPEC_METHODS:
            bad("speculative_method", f"one of {SPEC_METHODS} or None")
        if not is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 0:
            bad("num_speculative_tokens", "an integer >= 0")
        if self.speculative_method and self.num_speculative_tokens == 0:
            bad("num_speculative_tokens", f">= 1 when speculative_method={self.speculative_method!r}")
        for name in ("max_num_seqs", "max_model_len", "kv_cache_memory_bytes"):
            if not is_int(getattr(self, name)) or getattr(self, name) <= 0:
                bad(name, "a positive integer")
        for name in ("mamba_block_size", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value <= 0):
                bad(name, "a positive integer or None")
        share = self.gpu_memory_utilization
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share <= 1):
            bad("gpu_memory_utilization", "a fraction in (0, 1] or None")
        if self.model_runner not in (None, "v1", "v2"):
            bad("model_runner", "'v1', 'v2' or None (the build's default)")
        if self.enable_prefix_caching and self.mamba_cache_mode == "none":
            bad("mamba_cache_mode", "'align' or 'all' (or None) when enable_prefix_caching=True")

    @property
    def speculative(self) -> bool:
        return bool(self.speculative_method) and self.num_speculative_tokens > 0

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def with_overrides(self, overrides: Mapping[str, Any] | None, *,
                       where: str = "overrides") -> "EngineConfig":
        """This configuration with ``overrides`` applied by THE override rule every command uses
        (``statescope.engine.overrides``: field names or vLLM's flag spellings, values typed or
        as command-line text, checked against the field types and vLLM's choices; prefix caching
        off clears ``mamba_cache_mode``; 0 speculative tokens turns speculation off). A model
        name (``tiny-gui``) resolves to its directory."""
        from statescope.engine.overrides import resolve_overrides

        changes = resolve_overrides(self, overrides or {}, where)
        if "model" in changes:
            changes["model"] = str(model_path(changes["model"]))
        try:
            return dataclasses.replace(self, **changes)
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _repr_html_(self) -> str:
        from statescope.tables import KeyValueTable

        return KeyValueTable("EngineConfig (requested)", self.to_dict())._repr_html_()

    def engine_env(self) -> dict[str, str]:
        """Environment variables this configuration sets for its engine (the runner choice)."""
        return {} if self.model_runner is None else {
            "VLLM_USE_V2_MODEL_RUNNER": "1" if self.model_runner == "v2" else "0"}

    def engine_kwargs(self) -> dict:
        """Keyword arguments for ``vllm.LLM`` / ``EngineArgs``."""
        kw: dict[str, Any] = dict(
            model=str(self.model), dtype=self.dtype, mamba_ssm_cache_dtype=self.mamba_ssm_cache_dtype,
            enable_prefix_caching=self.enable_prefix_caching, enforce_eager=self.enforce_eager,
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len, seed=self.seed,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, disable_log_stats=False,
        )
        if self.gpu_memory_utilization is not None:
            kw["gpu_memory_utilization"] = float(self.gpu_memory_utilization)
        if self.mamba_cache_mode is not None:
            kw["mamba_cache_mode"] = self.mamba_cache_mode
        if self.mamba_block_size is not None:
            kw["mamba_block_size"] = self.mamba_block_size
        if self.speculative:
            kw["speculative_config"] = {"method": self.speculative_method,
                                        "num_speculative_tokens": self.num_speculative_tokens}
        for name in ("async_scheduling", "enable_chunked_prefill", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        from statescope.workload.model_files import tokenizer_dir

        tok = tokenizer_dir(self.model)
        if tok != Path(self.model):
            kw["tokenizer"] = str(tok)  # a model with its tokenizer in a folder of its own (tiny-vl)
        kw.update(self.extra)
        return kw

MODELS_DIR = Path(__file__).resolve().parents[3] / "data" / "models"

# The embedded default: the trained GUI-agent model (docs/tiny-model.md; the model that showed the
# real race on the H200). Its geometry resolves 128-token blocks on CPU (64 with block_size=64),
# so GUI prompts of 141-1,600 tokens engage the prefix cache; its answers are confident (no
# near-ties), so a flip against the control means something. `STATESCOPE_MODEL=tiny-qwen35` (the
# structured placeholder, 384-token blocks) or `tiny-vl` (the VLM, docs/tiny-vl.md) or a path
# switches.
DEFAULT_MODEL = "tiny-gui"


def default_model() -> Path:
    """The embedded default model directory (absolute, so notebooks may run from any folder)."""
    return model_path(os.environ.get("STATESCOPE_MODEL") or DEFAULT_MODEL).resolve()


def model_path(name_or_path: str | Path) -> Path:
    """Resolve a model name from ``data/models`` or a path."""
    p = Path(name_or_path)
    if p.exists():
        return p
    named = MODELS_DIR / str(name_or_path)
    return named if named.exists() else p
