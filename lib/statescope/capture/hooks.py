"""Install (and remove) the capture's wrappers around vLLM's model-runner step and state copies.

What it does: ``install_hooks(sink)`` wraps, at class or module level (so it works for a runner
that already exists, and for the CPU runner, which inherits these methods):

- ``GPUModelRunner.execute_model``  -> ``sink.begin_step(runner, scheduler_output)`` before,
  ``sink.end_step(runner)`` after when it returned an output itself (nothing to sample);
- ``GPUModelRunner._update_states_after_model_execute`` -> ``sink.note_sampled(runner, ids)``;
- ``GPUModelRunner.sample_tokens`` -> ``sink.end_step(runner)`` after the step's last kernel
  (post-process copies included) has been enqueued;
- ``mamba_utils.collect_mamba_copy_meta`` / ``do_mamba_copy_block`` (module attributes: the
  runner's ``preprocess_mamba`` looks them up at call time) -> scalar copy census;
- ``MambaSpecDecodeGPUContext.run_fused_precopy`` / ``run_fused_postprocess`` -> fused census,
  told before the launch (``sink.fused_launch``) and after it (``sink.launch_done``);
- ``statescope.patches.cpu_kernels`` copy listener (CPU build only) -> ``sink.observed_copy(event)``;
- ``gpu_worker.Worker.shutdown`` -> ``sink.worker_shutdown()`` (closes the runs cleanly);
- scheduler side: ``KVCacheManager.get_computed_blocks`` -> ``sink.prefix_begin`` /
  ``sink.prefix_end``, and every single-type manager's ``find_longest_cache_hit`` classmethod
  -> ``sink.prefix_group`` (per-group hit lengths, ``statescope.capture.prefix_log``).

On Model Runner V2 (``statescope.capture.runner_view``; the sink is handed the runner's
``V2RunnerView``, not the runner):

- V2 ``GPUModelRunner.execute_model`` (not its dummy runs) -> ``view.note_schedule`` and
  ``sink.begin_step(view, scheduler_output)``; ``end_step`` as on V1;
- V2 ``GPUModelRunner.prepare_inputs`` -> ``view.note_batch(input_batch)`` (its return value);
- V2 ``GPUModelRunner.postprocess_sampled`` -> ``sink.note_accepted(view, num_sampled)``;
- V2 ``GPUModelRunner.sample_tokens`` -> ``sink.end_step(view)``;
- V2 ``BlockTables.append_block_ids`` -> ``runner_view.note_blocks`` (host mirror of block ids);
- ``MambaSpecDecodeGPUContext.run_fused_precopy`` / ``run_fused_postprocess_align`` -> fused
  census (``sink.fused_launch`` with kinds "precopy" / "postprocess_align").

Which runner's hooks are installed follows the adapter (``statescope.capture.adapters``); on a
release whose V1 runner is not covered, V1 ``execute_model`` is wrapped to refuse the first real
step (``EnvironmentBroken``) rather than run without a record.

Wrapping methods, not modules, keeps the hooks outside anything CUDA graphs or torch.compile
capture. Every wrapper calls the original exactly once with the same arguments and returns its
result unchanged; sink errors are handed to ``sink.hook_error`` (which may re-raise).

What it deliberately does not do: compute or store anything (``statescope.capture.recorder``).
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

from statescope.capture import runner_view
from statescope.capture.adapters import (MAMBA_MODULE, RUNNER_MODULE, V2_BLOCK_TABLE_MODULE,
                                         V2_RUNNER_MODULE, refuse_runner)

_originals: dict[tuple[Any, str], Any] = {}
_sink: list[Any] = [None]  # the active sink; a list so wrappers see replacements


def active_sink() -> Any:
    return _sink[0]


def _guard(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    sink = _sink[0]
    try:
        return fn(*args)
    except Exception as exc:  # capture must not silently vanish, nor break the step by default
        sink.hook_error(what, exc)
        return None


def _wrap(owner: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> None:
    key = (owner, name)
    if key in _originals:
        return
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    _originals[key] = original
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    wrapper._statescope_capture = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _runner_hooks(cls: type) -> None:
    def execute_model(orig):
        def wrapper(self, scheduler_output, *args, **kwargs):
            sink = _sink[0]
            if sink is not None:
                _guard("begin_step", sink.begin_step, self, scheduler_output)
            out = orig(self, scheduler_output, *args, **kwargs)
            if sink is not None and out is not None:
                _guard("end_step", sink.end_step, self)
            return out
        return wrapper

    def update_after(orig):
        def wrapper(self, output_token_ids, *args, **kwargs):
            out = orig(self, output_token_ids, *args, **kwargs)
            sink = _sink[0]
            if sink is not None:
                _guard("note_sampled", sink.note_sampled, self, output_token_ids)
            return out
        return wrapper

    def sample_tokens(orig):
        def wrapper(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            sink = _sink[0]
            if sink is not None:
                _guard("end_step", sink.end_step, self)
            return out
        return wrapper

    _wrap(cls, "execute_model", execute_model)
    _wrap(cls, "_update_states_after_model_execute", update_after)
    _wrap(cls, "sample_tokens", sample_tokens)


def _copy_hooks(mu: Any, fused_precopy: bool) -> None:
    def collect(orig):
        def wrapper(copy_bufs, kv_cache_config, copy_funcs, group_ids, src_block_idx,
                    dest_block_idx, accept_token_bias, req_state, *args, **kwargs):
            before = copy_bufs.offset
            out = orig(copy_bufs, kv_cache_config, copy_funcs, group_ids, src_block_idx,
                       dest_block_idx, accept_token_bias, req_state, *args, **kwargs)
            sink = _sink[0]
            if sink is not None:
                _guard("scalar_meta", sink.scalar_meta, before, copy_bufs.offset,
                       req_state.req_id, int(src_block_idx), int(dest_block_idx),
                       int(accept_token_bias))
            return out
        return wrapper

    def do_copy(orig):
        def wrapper(copy_bufs, *args, **kwargs):
            sink = _sink[0]
            if sink is not None and copy_bufs.offset > 0:
                _guard("scalar_launch", sink.scalar_launch, copy_bufs)
            out = orig(copy_bufs, *args, **kwargs)
            if sink is not None:
                _guard("launch_done", sink.launch_done)
            return out
        return wrapper

    _wrap(mu, "collect_mamba_copy_meta", collect)
    _wrap(mu, "do_mamba_copy_block", do_copy)
    ctx = mu.MambaSpecDecodeGPUContext
    _wrap(ctx, "run_fused_postprocess", _fused_hook("postprocess"))
    if fused_precopy:
        _wrap(ctx, "run_fused_precopy", _fused_hook("precopy"))


def _worker_hooks() -> None:
    """Close the runs when vLLM shuts its worker down: worker processes leave through
    ``os._exit``, so neither atexit nor multiprocessing finalizers run there."""
    try:
        worker_mod = importlib.import_module("vllm.v1.worker.gpu_worker")
    except ImportError:
        return
    cls = getattr(worker_mod, "Worker", None)
    if cls is None or "shutdown" not in cls.__dict__:
        return

    def shutdown(orig):
        def wrapper(self, *args, **kwargs):
            sink = _sink[0]
            if sink is not None:
                _guard("worker_shutdown", sink.worker_shutdown)
            return orig(self, *args, **kwargs)
        return wrapper

    _wrap(cls, "shutdown", shutdown)


def _wrap_classmethod(cls: type, name: str, make: Callable[[Any], Callable[..., Any]]) -> None:
    key = (cls, name)
    if key in _originals:
        return
    original = cls.__dict__[name]  # the classmethod object itself, restored as is
    _originals[key] = original
    func = original.__func__
    wrapper = make(func)
    functools.update_wrapper(wrapper, func)
    wrapper._statescope_capture = True  # type: ignore[attr-defined]
    setattr(cls, name, classmethod(wrapper))


def _scheduler_hooks() -> None:
    """Prefix-cache lookups, in whichever process runs the scheduler (engine core)."""
    import inspect

    try:
        kvm = importlib.import_module("vllm.v1.core.kv_cache_manager")
        stm = importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
    except ImportError:
        return

    def computed_blocks(orig):
        def wrapper(self, request, *args, **kwargs):
            sink = _sink[0]
            if sink is not None:
                _guard("prefix_begin", sink.prefix_begin, request,
                       int(getattr(request, "num_tokens", 0)) - 1)
            out = orig(self, request, *args, **kwargs)
            if sink is not None:
                _guard("prefix_end", sink.prefix_end, out[1])
            return out
        return wrapper

    def longest_hit(func):
        sig = inspect.signature(func)

        def wrapper(klass, *args, **kwargs):
            out = func(klass, *args, **kwargs)
            sink = _sink[0]
            if sink is not None:
                def note():
                    a = sig.bind(klass, *args, **kwargs).arguments
                    sink.prefix_group(a.get("kv_cache_spec"), a.get("max_length", 0), out[1],
                                      bool(a.get("drop_eagle_block", False)))
                _guard("prefix_group", note)
            return out
        return wrapper

    _wrap(kvm.KVCacheManager, "get_computed_blocks", computed_blocks)
    for cls in vars(stm).values():
        if (isinstance(cls, type) and issubclass(cls, stm.SingleTypeKVCacheManager)
                and isinstance(cls.__dict__.get("find_longest_cache_hit"), classmethod)):
            _wrap_classmethod(cls, "find_longest_cache_hit", longest_hit)


def _observed(event: Any) -> None:
    sink = _sink[0]
    if sink is not None:
        _guard("observed_copy", sink.observed_copy, event)


def _v2_runner_hooks(cls: type, bt_cls: type) -> None:
    def execute_model(orig):
        def wrapper(self, scheduler_output, *args, **kwargs):
            sink = _sink[0]
            real = sink is not None and not kwargs.get("dummy_run", False)
            view = runner_view.view_of(self) if real else None
            if real:
                _guard("note_schedule", view.note_schedule, scheduler_output)
                _guard("begin_step", sink.begin_step, view, scheduler_output)
            out = orig(self, scheduler_output, *args, **kwargs)
            if real and out is not None:
                _guard("end_step", sink.end_step, view)
            return out
        return wrapper

    def prepare_inputs(orig):
        def wrapper(self, *args, **kwargs):
            batch = orig(self, *args, **kwargs)
            if _sink[0] is not None:
                _guard("note_batch", runner_view.view_of(self).note_batch, batch)
            return batch
        return wrapper

    def postprocess_sampled(orig):
        def wrapper(self, idx_mapping, sampled_tokens, num_sampled, *args, **kwargs):
            sink = _sink[0]
            if sink is not None:  # before: the original may not keep num_sampled as it is
                _guard("note_accepted", sink.note_accepted, runner_view.view_of(self), num_sampled)
            return orig(self, idx_mapping, sampled_tokens, num_sampled, *args, **kwargs)
        return wrapper

    def sample_tokens(orig):
        def wrapper(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            sink = _sink[0]
            if sink is not None:
                _guard("end_step", sink.end_step, runner_view.view_of(self))
            return out
        return wrapper

    def append_block_ids(orig):
        def wrapper(self, req_index, new_block_ids, overwrite, *args, **kwargs):
            out = orig(self, req_index, new_block_ids, overwrite, *args, **kwargs)
            if _sink[0] is not None:
                _guard("note_blocks", runner_view.note_blocks, self, req_index, new_block_ids,
                       overwrite)
            return out
        return wrapper

    _wrap(cls, "execute_model", execute_model)
    _wrap(cls, "prepare_inputs", prepare_inputs)
    _wrap(cls, "postprocess_sampled", postprocess_sampled)
    _wrap(cls, "sample_tokens", sample_tokens)
    _wrap(bt_cls, "append_block_ids", append_block_ids)


def _fused_hook(kind: str):
    def make(orig):
        def wrapper(self, *args, **kwargs):
            sink = _sink[0]
            if sink is not None:
                _guard("fused_launch", sink.fused_launch, kind, self, args, kwargs)
            out = orig(self, *args, **kwargs)
            if sink is not None:
                _guard("launch_done", sink.launch_done)
            return out
        return wrapper
    return make


def _refusing_v1_hook(cls: type, adapter: Any) -> None:
    """A release whose V1 runner is not covered: its first real step raises."""
    def execute_model(orig):
        def wrapper(self, *args, **kwargs):
            if _sink[0] is not None:
                refuse_runner(adapter, self)
            return orig(self, *args, **kwargs)
        return wrapper

    _wrap(cls, "execute_model", execute_model)


def install_hooks(sink: Any, fused_precopy: bool, adapter: Any = None) -> None:
    """Wrap everything the adapter covers (idempotent) and route calls to ``sink``."""
    runners = tuple(getattr(adapter, "runners", ("V1",)))
    mu = importlib.import_module(MAMBA_MODULE)
    if "V1" in runners:
        _runner_hooks(importlib.import_module(RUNNER_MODULE).GPUModelRunner)
        _copy_hooks(mu, fused_precopy)
    else:
        try:
            _refusing_v1_hook(importlib.import_module(RUNNER_MODULE).GPUModelRunner, adapter)
        except ImportError:
            pass
    if "V2" in runners:
        _v2_runner_hooks(importlib.import_module(V2_RUNNER_MODULE).GPUModelRunner,
                         importlib.import_module(V2_BLOCK_TABLE_MODULE).BlockTables)
        ctx = mu.MambaSpecDecodeGPUContext
        _wrap(ctx, "run_fused_precopy", _fused_hook("precopy"))
        _wrap(ctx, "run_fused_postprocess_align", _fused_hook("postprocess_align"))
    _worker_hooks()
    _scheduler_hooks()
    try:
        from statescope.patches import cpu_kernels

        cpu_kernels.add_copy_listener(_observed)
    except ImportError:
        pass
    _sink[0] = sink


def set_sink(sink: Any) -> None:
    _sink[0] = sink


def uninstall_hooks() -> bool:
    """Restore every wrapped attribute; True when something was restored."""
    _sink[0] = None
    try:
        from statescope.patches import cpu_kernels

        cpu_kernels.remove_copy_listener(_observed)
    except ImportError:
        pass
    restored = bool(_originals)
    for (owner, name), original in list(_originals.items()):
        setattr(owner, name, original)
    _originals.clear()
    return restored


def hooks_installed() -> bool:
    return bool(_originals)
