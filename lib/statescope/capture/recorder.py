"""The capture instrument: record GDN state digests, snapshots and the copy census inside vLLM.

Turn it on with a capture spec (``statescope.capture.spec``): set ``STATESCOPE_CAPTURE`` to the
spec's path before vLLM starts and ``statescope.plugin.register()`` calls ``install_from_env()``
in whichever process holds the model (in-process engine, multiprocess engine core or worker,
``python -m vllm.entrypoints.openai.api_server``), or call ``install(spec)`` in-process at any
time, even with an engine already running. Unset (or mode ``off``) installs nothing. A spec on a
vLLM version the hooks do not cover raises ``EnvironmentBroken`` at start, naming the version
and what is missing (``statescope.capture.adapters``).

Design: ``statescope.capture.hooks`` wraps the V1 runner's step methods and the Mamba copy
entry points; ``Recorder`` (this module) is their sink and keeps one ``RunCapture``
(``statescope.capture.run``) per model runner — one run directory each. Digests and snapshots
are taken on the state's device after each step; on a GPU a step's small results travel in one
non-blocking copy into pinned host memory. A daemon flusher thread polls the copies' events and
writes finished steps, so the step itself never synchronizes. ``flush()``/``close()``, the worker's shutdown, SIGTERM (a handler chained in front of
the process's own, installed when the first run starts) and process exit wait for the device
once and write everything. The run manifest records this under ``perturbation``.

How a run ended goes into its manifest at close (``ended``, ``statescope.capture.store`` reads it
back with ``CaptureRun.ending()``): who closed it, the engine steps captured, hook errors, and —
when the workload driver said what it planned (``note_workload``) and how it went (``close(...,
outcome=...)``: requests finished, the engine's error) — whether it ran to its end. A run whose
engine raised, that finished fewer requests than planned, or that was closed (SIGTERM, exit)
before its driver reported an outcome is ``status: incomplete``.

In the process that runs vLLM's scheduler (the engine core, or this process for the in-process
engine) the same recorder also logs every prefix-cache lookup with its per-group hit lengths
(``statescope.capture.prefix_log``), written under ``<output_dir>/scheduler/``.

What it deliberately does not do: compare runs (the divergence tools do), or change what vLLM
computes — every hook calls the original with the same arguments.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from statescope.capture.ending import run_ending
from statescope.capture.spool import IDLE_S
from statescope.capture.spec import ENV_CAPTURE, CaptureSpec
from statescope.errors import InputError

log = logging.getLogger("statescope.capture.recorder")
ENV_STRICT = "STATESCOPE_CAPTURE_STRICT"
PERTURBATION = {
    "forced_sync": False, "forced_eager": False,
    "in_step": "device ops enqueued after sample_tokens on the current stream; small index "
               "uploads and one packed result download through pinned memory; no "
               ".item()/.tolist()/synchronize",
    "sync_points": ["flush()/close()/process exit: one wait on the last step's event",
                    "CUDA-graph digest (the CUDA default; STATESCOPE_DIGEST_GRAPH=0 turns it "
                    "off): one wait per digest-column bucket, once per engine (the graph's "
                    "bit-for-bit self-check)"],
    "off_step_work": "emit 'idle' (the accelerator default): the flusher thread only appends "
                     "finished steps to the run's spool while the engine steps; table rows are "
                     "made when no step has started for 0.25 s, at defer_max_steps, or at close. "
                     "emit 'background' (CPU default): the flusher makes them as steps finish "
                     "(same GIL as the step)",
    "host_work_in_step": "Python bookkeeping per selected request; scalar-path pointer arrays "
                         "(already on the host) copied; on CPU the digest itself (a C kernel "
                         "reading each selected block once where it lies, GIL released; torch "
                         "gather + reductions where it is unavailable): the CPU has no other "
                         "stream to put it on",
}
_FUSED_ARGS = {
    "precopy": ("num_reqs", "state_idx_gpu", "src_col_gpu", "token_bias_gpu", "idx_mapping"),
    "postprocess": ("num_reqs", "num_accepted_tokens_gpu", "mamba_state_idx_gpu",
                    "num_scheduled_tokens_gpu", "num_computed_tokens_gpu", "num_draft_tokens_gpu"),
    # Model Runner V2 (vllm 0.29+): per request slot, read through idx_mapping (batch row -> slot)
    "postprocess_align": ("num_reqs", "num_accepted_tokens_gpu", "state_idx_gpu",
                          "new_num_computed_tokens_gpu", "idx_mapping"),
}


def _staged(bound: dict, names: tuple, n: int, slots: Any) -> Any:
    """Columns ``names`` of a fused launch's per-row (V1: ``[:n]``) or per-slot (V2: ``slots``)
    inputs as one int64 ``[n, k]`` device copy: stacked whole, then one row pick and one cast —
    three device ops where a pick and a cast per column made ``2k + 1`` (each a launch on the
    step's host-bound path). Columns of different dtypes or lengths are picked one by one."""
    import torch

    cols = [bound[k] for k in names]
    if len({(c.dtype, c.shape) for c in cols}) == 1:
        whole = torch.stack(cols, 1)
        picked = whole[:n] if slots is None else whole.index_select(0, slots)
        return picked.to(torch.int64)
    return torch.stack([(c[:n] if slots is None else c.index_select(0, slots)).to(torch.int64)
                        for c in cols], 1)


def v2_coverage(cache_mode: str | None) -> dict:
    """What a capture on Model Runner V2 records, piece by piece (the manifest's ``coverage``)."""
    align = cache_mode == "align"
    return {
        "digests": "running column per selected request and GDN layer, picked on the host by the "
                   "V2 pre-process rule (ceil((computed + scheduled) / block) - 1) on the "
                   "scheduler's counts; the device's own column is in the step rows "
                   "(running_col_device)" if align else
                   "block of the last computed token per selected request and GDN layer",
        "accepted": "sampled: GPUModelRunner.postprocess_sampled num_sampled per batch row; used: "
                    "the align post-process input per request slot, gathered by idx_mapping"
                    if align else "sampled: GPUModelRunner.postprocess_sampled num_sampled per "
                    "batch row; used: not observed on V2: no align post-process outside align mode",
        "copies": ("decoded from the inputs of the fused pre-copy (run_fused_precopy) and align "
                   "post-process (run_fused_postprocess_align) launches, gathered by idx_mapping; "
                   "V2 has no scalar copy path; not cross-checked against the copies done (the "
                   "GPU kernels report nothing)") if align else
                  f"not observed on V2: mamba_cache_mode is {cache_mode!r} (V2 copies states in "
                  "align mode only)",
        "prefix_hits": "scheduler hooks (KVCacheManager.get_computed_blocks, "
                       "find_longest_cache_hit): the same on both runners",
        "block_tables": "host mirror of BlockTables.append_block_ids (V2 keeps block ids on the "
                        "device only); requests admitted before the capture was installed have "
                        "no block ids",
        "pipeline_parallel": "not covered: idx_mapping rows of -1 (filtered) are read as slot 0",
    }


def _rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (in tests) or not distributed
        return 0


class Recorder:
    """Sink of the capture hooks for one spec in this process."""

    def __init__(self, spec: CaptureSpec, adapter: Any, strict: bool = False) -> None:
        self.spec, self.adapter, self.strict = spec, adapter, strict
        self.runs: dict[int, Any] = {}
        self.closed: list[Path] = []
        self.current: Any = None
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()  # re-entered by the SIGTERM handler on the main thread
        self.hits: Any = None  # PrefixHitLog, made at the first scheduler lookup
        self._flusher_error: BaseException | None = None
        self.workload: dict | None = None  # what the driver planned (``note_workload``)

    # ---- runs ----------------------------------------------------------------------------------

    def _new_run(self, runner: Any) -> Any:
        _chain_sigterm()  # the worker's own handler exists by now: ours runs first, then it
        import torch
        import vllm

        from statescope.capture.run import RunCapture
        from statescope.resolved import resolve_vllm_config

        rank = _rank()
        base = self.spec.run_id or time.strftime("run-%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        base += f"-rank{rank}" if rank else ""
        out = Path(self.spec.output_dir)
        run_dir, n = out / base, 1
        while run_dir.exists():
            n += 1
            run_dir = out / f"{base}-{n}"
        from statescope.capture.adapters import refuse_runner, runner_kind

        from statescope.lockfile import environment_record

        refuse_runner(self.adapter, runner)  # EnvironmentBroken: the resolved runner is not covered
        vc = runner.vllm_config
        runner_class = getattr(runner, "statescope_runner_class", None) or (
            f"{type(runner).__module__}.{type(runner).__name__}")
        manifest = {
            "run_id": run_dir.name, "mode": self.spec.mode, "spec": self.spec.to_dict(),
            "spec_source": self.spec.source, "vllm_version": vllm.__version__,
            "torch_version": torch.__version__,
            # the lock's sha and drift, as a results store records them (cached per process)
            "environment": environment_record(), "adapter": self.adapter.to_dict(),
            "runner_class": runner_class.rsplit(".", 1)[-1], "runner_module": runner_class,
            "runner_version": runner_kind(runner), "pid": os.getpid(), "rank": rank,
            "resolved": resolve_vllm_config(vc),
            "cudagraph_mode": str(getattr(vc.compilation_config, "cudagraph_mode", None)),
            "perturbation": dict(PERTURBATION, mode=self.spec.mode,
                                 enforce_eager=bool(vc.model_config.enforce_eager)),
        }
        if manifest["runner_version"] == "V2":
            manifest["coverage"] = v2_coverage(getattr(vc.cache_config, "mamba_cache_mode", None))
        if self.workload is not None:
            manifest["workload"] = dict(self.workload)
        run = RunCapture(self.spec, runner, run_dir, manifest)
        run.wake = self._wake
        self._start_flusher()
        return run

    def _run_for(self, runner: Any) -> Any:
        run = self.runs.get(id(runner))
        if run is not None and run.runner_ref() is runner:
            return run
        with self._lock:
            for key, old in list(self.runs.items()):
                if old.runner_ref() is None or key == id(runner):  # engine gone or id reused
                    self._close_run(key)
            if not hasattr(runner, "kv_cache_config"):
                return None  # before the KV cache exists (profiling): nothing to read yet
            run = self._new_run(runner)
            self.runs[id(runner)] = run
            return run

    def _close_run(self, key: int, status: str = "complete", closed_by: str = "close",
                   outcome: dict | None = None) -> None:
        run = self.runs.pop(key)
        ended = run_ending(self.workload, outcome, closed_by, run.engine_step, len(self.errors))
        run.writer.note(ended=ended)
        if not ended["complete"]:
            status = "incomplete"
        run.close("complete_with_errors" if self.errors and status == "complete" else status)
        self.closed.append(run.writer.run_dir)

    def note_workload(self, **planned: Any) -> None:
        """What the driving workload plans (e.g. ``requests_planned``, ``max_tokens``, ``what``):
        kept in the manifest of every open and later run as ``workload``."""
        self.workload = dict(planned)
        for run in self.runs.values():
            run.writer.note(workload=dict(planned))

    # ---- the hooks' sink -----------------------------------------------------------------------

    def begin_step(self, runner: Any, scheduler_output: Any) -> None:
        self.current = self._run_for(runner)
        if self.current is not None:
            self.current.begin_step(scheduler_output)

    def end_step(self, runner: Any) -> None:
        run, self.current = self.current, None
        if run is not None and run.runner_ref() is runner:
            run.end_step(runner)

    def note_sampled(self, runner: Any, output_token_ids: Any) -> None:
        if self.current is not None:
            self.current.note_sampled(output_token_ids)

    def note_accepted(self, runner: Any, num_sampled: Any) -> None:
        """Model Runner V2: the step's tokens kept per batch row (accepted drafts + 1; 0 for a
        prefill chunk that samples nothing), as V1's ``note_sampled`` counts them."""
        if self.current is not None and not isinstance(num_sampled, int):
            self.current.note_accepted(num_sampled)

    def scalar_meta(self, before: int, after: int, req_id: str, src: int, dst: int,
                    bias: int) -> None:
        if self.current is not None:
            self.current.scalar_meta(before, after, {"req_id": req_id, "src_col": src,
                                                     "dst_col": dst, "bias": bias})

    def scalar_launch(self, copy_bufs: Any) -> None:
        run = self.current
        if run is None or run.step is None:
            return
        n = int(copy_bufs.offset)
        data = tuple(b.np[:n].astype("int64").tolist() for b in
                     (copy_bufs.src_ptrs, copy_bufs.dst_ptrs, copy_bufs.sizes))
        run.open_launch("scalar", data, dict(run.step.scalar_owners))

    def fused_launch(self, kind: str, ctx: Any, args: tuple, kwargs: dict) -> None:
        run = self.current
        if run is None or run.step is None:
            return
        bound = dict(zip(_FUSED_ARGS[kind], args), **kwargs)
        n = int(bound["num_reqs"])
        if n == 0 or not ctx.is_initialized:
            return  # the original returns without launching
        import torch

        slots = bound.get("idx_mapping")  # V2: batch row -> request slot (V1: None, batch order)
        if slots is not None:  # the step's launches share one mapping: made once per step
            key = (id(slots), n)
            if run.step.slots_key != key:
                run.step.slots_key, run.step.slots = key, slots[:n].to(torch.int64).clamp(min=0)
            slots = run.step.slots
        if kind == "precopy":
            data = _staged(bound, ("state_idx_gpu", "src_col_gpu", "token_bias_gpu"), n, slots)
            run.open_launch(kind, data)  # a device tensor: moved to the host with the step's results
            return
        # The kernel's inputs in one copy, made before it runs (it rewrites the accepted counts
        # in place): a few device ops in the step; its decisions are derived on the host when
        # the step is emitted (census_decode.postprocess_decisions_np), not with ~20 ops here.
        if kind == "postprocess_align":
            # V2's kernel reads (accepted, running column, new computed) per slot: staged as they
            # are, and turned into V1's five inputs on the host at emit (``_Launch.v2_align``)
            run.note_used(None)
            run.open_launch("postprocess", _staged(bound, _FUSED_ARGS[kind][1:4], n, slots),
                            block_size=int(ctx.block_size), v2_align=True)
            return
        cols = [bound[k][:n] for k in _FUSED_ARGS[kind][1:]]
        same = len({c.dtype for c in cols}) == 1
        data = torch.stack(cols if same else [c.to(torch.int64) for c in cols], 1)
        run.note_used(None)  # column 0 of ``data``: taken from the launch at emit
        run.open_launch(kind, data, block_size=int(ctx.block_size))

    def launch_done(self) -> None:
        if self.current is not None:
            self.current.launch_done()

    def observed_copy(self, event: Any) -> None:
        if self.current is not None:
            self.current.observed_copy(event)

    def worker_shutdown(self) -> None:
        self.close(closed_by="worker_shutdown")

    # ---- scheduler side: prefix-cache lookups (statescope.capture.prefix_log) -----------------------

    def prefix_begin(self, request: Any, max_cache_hit_tokens: int) -> None:
        if self.hits is None:
            from statescope.capture.prefix_log import PrefixHitLog

            self.hits = PrefixHitLog(self.spec.output_dir)
            _chain_sigterm()
            self._start_flusher()
        self.hits.begin(request, max_cache_hit_tokens)

    def prefix_group(self, kv_cache_spec: Any, max_length: int, hit: int, drop: bool) -> None:
        if self.hits is not None:
            from statescope.capture.prefix_log import group_kind

            self.hits.group_lookup(group_kind(kv_cache_spec), max_length, hit, drop)

    def prefix_end(self, hit_tokens: int) -> None:
        if self.hits is not None:
            self.hits.end(hit_tokens)

    def hook_error(self, what: str, exc: BaseException) -> None:
        self.errors.append(f"{what}: {type(exc).__name__}: {exc}")
        if self.strict:
            raise exc
        if len(self.errors) <= 3:
            log.warning("statescope capture: %s failed; the run will be marked "
                        "complete_with_errors", what, exc_info=exc)
        for run in self.runs.values():
            run.writer.note(errors=self.errors[:20], error_count=len(self.errors))

    # ---- flushing ------------------------------------------------------------------------------

    def _start_flusher(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop = threading.Event()  # a closed recorder's next run gets a fresh flusher
            self._thread = threading.Thread(target=self._flush_loop, args=(self._stop,),
                                            name="statescope-capture", daemon=True)
            self._thread.start()

    def _flush_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            # a CPU step with digests to reduce wakes it; steps deferred to an idle engine are
            # looked at every IDLE_S (statescope.capture.spool)
            deferring = any(r.deferred or r.pending for r in self.runs.values() if r.spool is not None)
            self._wake.wait(IDLE_S if deferring else self.spec.flush_interval_s)
            self._wake.clear()
            if self.hits is not None:
                try:
                    self.hits.write()
                except Exception as exc:  # recorded like a run's flusher error
                    self.errors.append(f"prefix hits: {type(exc).__name__}: {exc}")
            for run in list(self.runs.values()):
                try:
                    run.drain()
                except Exception as exc:  # the flusher must keep running; the error is recorded
                    self.errors.append(f"flusher: {type(exc).__name__}: {exc}")
                    log.warning("statescope capture: flusher failed", exc_info=exc)
                    run.writer.note(errors=self.errors[:20], error_count=len(self.errors))
                    self._flusher_error = self._flusher_error or exc

    def _raise_flusher_error(self) -> None:
        """Strict mode: a flusher thread's error surfaces at the next flush/close."""
        exc, self._flusher_error = self._flusher_error, None
        if exc is not None and self.strict:
            raise exc

    def flush(self) -> list[Path]:
        """Wait for the device once, write every finished step of every open run."""
        self._raise_flusher_error()
        if self.hits is not None:
            self.hits.write()
        for run in list(self.runs.values()):
            run.drain(force=True)
        return [r.writer.run_dir for r in self.runs.values()]

    def checkpoint(self, **progress: Any) -> None:
        """Make every finished step durable now and record the workload's progress so far
        (``requests_finished``, ...) in each open run's manifest (``progress``): a run killed
        later keeps these rows, and ``capture-recover`` knows how far the workload got."""
        self.flush()
        for run in list(self.runs.values()):
            with run.drain_lock:
                run.writer.note(progress=dict(progress))
                run.writer.write_manifest()

    def close(self, closed_by: str = "close", outcome: dict | None = None) -> list[Path]:
        """Write and close every run; ``outcome``: how the workload went (``requests_finished``,
        ``engine_error``), which decides whether a run is complete."""
        from statescope.capture.signals import sigterm_deferred

        self._stop.set()
        self._wake.set()
        with sigterm_deferred(), self._lock:  # a SIGTERM waits until the runs are written
            if self.hits is not None:
                self.hits.write()
            for key in list(self.runs):
                self.runs[key].writer.note(closed_by=closed_by)
                self._close_run(key, closed_by=closed_by, outcome=outcome)
        self._raise_flusher_error()  # after the runs are written and closed
        return list(self.closed)


_recorder: list[Recorder | None] = [None]


def _as_spec(spec: CaptureSpec | dict | str | os.PathLike | None) -> CaptureSpec | None:
    if spec is None:
        return CaptureSpec.from_env()
    if isinstance(spec, CaptureSpec):
        return spec
    if isinstance(spec, dict):
        return CaptureSpec.from_dict(spec)
    if isinstance(spec, (str, os.PathLike)):
        return CaptureSpec.load(spec)
    raise InputError(f"capture spec: expected a CaptureSpec, dict or path, got {type(spec).__name__}")


def install(spec: CaptureSpec | dict | str | os.PathLike | None = None, *,
            strict: bool | None = None) -> Recorder | None:
    """Start capturing with ``spec`` (default: the env var). Idempotent for an equal spec; a new
    spec closes the previous runs first. Returns None (and installs nothing) when there is no
    spec or its mode is 'off'."""
    import vllm

    from statescope.capture.adapters import adapter_for
    from statescope.capture.hooks import install_hooks, set_sink

    spec = _as_spec(spec)
    if spec is None or not spec.enabled:
        return None
    current = _recorder[0]
    if current is not None and current.spec == spec:
        return current
    adapter = adapter_for(vllm.__version__)  # raises EnvironmentBroken: version + what is missing
    if current is not None:
        current.close()
    if strict is None:
        strict = os.environ.get(ENV_STRICT, "") == "1"
    rec = Recorder(spec, adapter, strict)
    _recorder[0] = rec
    install_hooks(rec, adapter.fused_precopy, adapter)
    set_sink(rec)
    return rec


def install_from_env() -> Recorder | None:
    """What the vLLM plugin calls: capture iff ``STATESCOPE_CAPTURE`` names a spec."""
    if not os.environ.get(ENV_CAPTURE, "").strip():
        return None
    return install(None)


def active() -> Recorder | None:
    return _recorder[0]


def flush() -> list[Path]:
    """Write everything recorded so far (waits for the device once); returns open run dirs."""
    rec = _recorder[0]
    return rec.flush() if rec is not None else []


def close(outcome: dict | None = None) -> list[Path]:
    """Finish every run of this process (later steps start new runs); returns all run dirs."""
    rec = _recorder[0]
    return rec.close(outcome=outcome) if rec is not None else []


def checkpoint(**progress: Any) -> None:
    """Flush and record the workload's progress (see ``Recorder.checkpoint``)."""
    rec = _recorder[0]
    if rec is not None:
        rec.checkpoint(**progress)


def note_workload(**planned: Any) -> None:
    """Tell the active recorder what the workload plans (see ``Recorder.note_workload``)."""
    rec = _recorder[0]
    if rec is not None:
        rec.note_workload(**planned)


def _close_on_sigterm() -> None:
    rec = _recorder[0]
    if rec is not None:
        rec.close(closed_by="SIGTERM")


def _chain_sigterm() -> None:
    from statescope.capture.signals import chain_sigterm

    chain_sigterm(_close_on_sigterm)


def uninstall(outcome: dict | None = None) -> list[Path]:
    """Close the runs (``outcome``: how the workload went) and remove every hook; returns the
    run dirs written."""
    from statescope.capture.hooks import uninstall_hooks

    from statescope.capture.signals import unchain_sigterm

    dirs = close(outcome)
    uninstall_hooks()
    unchain_sigterm()
    _recorder[0] = None
    return dirs


@atexit.register
def _at_exit() -> None:
    rec = _recorder[0]
    if rec is not None:
        try:
            rec.close(closed_by="process_exit")
        except Exception as exc:  # interpreter shutdown: report, never raise
            log.warning("statescope capture: final flush failed: %s", exc)


def _register_process_exit() -> None:
    # vLLM's engine core and workers are multiprocessing children, which leave through
    # os._exit: atexit never runs there, multiprocessing's own exit finalizers do.
    from multiprocessing import util

    util.Finalize(None, _at_exit, exitpriority=100)


_register_process_exit()
