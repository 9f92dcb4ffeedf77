"""One CUDA-graph replay per step for the capture's digests of both state kinds (accelerator path).

Why: on the H200 the step is host-bound at small models and the digest's cost there is not GPU
time (0.48 ms) but the host time of launching it — two Triton launches and ~30 small torch calls
per step. ``StepDigest`` records that work once per *bucket* of digested columns (8, 16, 32, …:
the block-index input padded to the bucket with copies of column 0) as a CUDA graph, and replays
it: per step one pinned upload of the block indices and one ``replay()``. The output is one flat
byte buffer per bucket (``flat_layout`` says where the conv/ssm statistics, exact numbers —
checksum and word hash — and conv token rows lie, for ``Cb`` columns); the caller copies it out with the step's other results and
``slice_columns`` drops the padding on the host.

Safety: a graph is built in the step the first time its bucket is needed: the body runs once
eagerly (warm-up: Triton compile, cached tables), is captured on a side stream
(``capture_error_mode="thread_local"``: the flusher thread's event queries stay legal), replayed
once and compared bit for bit with the eager result — one host synchronization per bucket for
the engine's life (the ``StepDigest`` lives on the model runner, across capture runs). Any failure
or mismatch turns graphs off for good (``status`` says why) and the eager path is used.

The default on CUDA (``STATESCOPE_DIGEST_GRAPH=0`` turns it off), measured on the H200: the five-mode
probe (``data/results/gpu/overhead_modes/``) built the graphs once per capture run, and in runs of ~165
steps their synchronizing self-checks cost more host time than the replays saved (2.5 / 6.9 ms per
step in the step's hooks vs 1.6 eager), so graphs were opt-in; built once per engine (the graph-digest
probe, ``data/results/gpu/overhead_graph_digest/``) the capture's host time per step fell from 1.54-1.64 ms
(eager) to 1.00-1.20 ms at 6.7 B, the replayed digests equal to the eager ones on all 245,952 rows
of one comparison (245,944 of another, not investigated), and the throughput ratio rose from
0.91-0.94 to 0.94-0.97 (paired medians).

``run(blocks, graphs=False)`` runs the same padded body eagerly (the default; CPU tests of the
padding, layout and slicing; the fallback).

``digest_kinds`` is the body: both state kinds of a block table digested by the best path that
applies (Triton, the C kernel, torch); ``engine_step_digest`` keeps one ``StepDigest`` per
engine (on its model runner).

What it deliberately does not do: choose blocks (``statescope.capture.run``), or copy results to
the host (``statescope.capture.digest.to_host_async``).
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch

from statescope.capture.digest import Digester, host_to_device, native_kernel, pack

log = logging.getLogger("statescope.capture.digest")
ENV_GRAPH = "STATESCOPE_DIGEST_GRAPH"  # "0": launch the digest eagerly (graphs are the default)
MIN_BUCKET, MAX_BUCKET = 8, 1024


def bucket(columns: int) -> int | None:
    """The padded column count for ``columns`` digested columns (None: too many for a graph)."""
    if columns > MAX_BUCKET:
        return None
    b = MIN_BUCKET
    while b < columns:
        b *= 2
    return b


def pad_columns(blocks: np.ndarray, width: int) -> np.ndarray:
    """``blocks`` ``[L, C]`` padded to ``[L, width]`` with copies of column 0 (valid blocks, so the
    padded reads are ordinary reads; their results are dropped)."""
    layers, cols = blocks.shape
    out = np.empty((layers, width), dtype=np.int64)
    out[:, :cols] = blocks
    out[:, cols:] = blocks[:, :1]
    return out


def slice_columns(values: Sequence[torch.Tensor], columns: int) -> list[torch.Tensor]:
    """Drop the padded columns (axis 2 of ``[2, L, Cb, …]`` stacks, axis 1 of ``[L, Cb, …]``)."""
    stats, check, rows_check, rows_sum = values
    return [stats[:, :, :columns], check[:, :, :columns],
            None if rows_check is None else rows_check[:, :columns],
            None if rows_sum is None else rows_sum[:, :columns]]


class StepDigest:
    """Digests of both kinds for a ``[L, C]`` host block table: ``run(blocks, graphs)`` ->
    ``(flat device buffer, layout, C)`` or None (the caller then takes the unpadded eager path).
    One per engine (``statescope.capture.run`` keeps it on the model runner), so a graph is built
    once per bucket for the engine's life, not once per capture run."""

    def __init__(self, body: Callable[[torch.Tensor], tuple | None], device: torch.device) -> None:
        self.body = body  # padded idx [L, Cb] (device) -> (stats2, check2, rows_check, rows_sum)
        self.device = device
        self.failed: str | None = None  # why graphs were turned off for good
        self._graphs: dict[int, tuple] = {}  # bucket -> (graph, static idx, static flat, layout)
        self._pool: Any = None

    def graphs_on(self, want: bool) -> bool:
        return want and self.device.type == "cuda" and self.failed is None

    def status(self, want: bool) -> str:
        if self.graphs_on(want):
            return "on"
        return self.failed if (want and self.failed) else "off"

    def run(self, blocks: np.ndarray, graphs: bool = False,
            extra: torch.Tensor | None = None) -> tuple | None:
        """Digest host columns ``blocks`` ``[L, C]`` then device columns ``extra`` ``[L, E]``
        (the resume columns, picked on the device: copied into the index after its upload)."""
        cols = blocks.shape[1]
        total = cols + (0 if extra is None else extra.shape[1])
        cb = bucket(total)
        if cb is None:
            return None
        host = torch.from_numpy(pad_columns(blocks, cb))
        if self.graphs_on(graphs):
            entry = self._graphs.get(cb)
            if entry is not None:  # the steady state: one upload, one replay
                graph, static_idx, flat, layout = entry
                static_idx.copy_(host.pin_memory(), non_blocking=True)
                _place(static_idx, cols, extra)
                graph.replay()
                return flat, layout, total
            entry = self._build(cb, _place(host_to_device(host, self.device), cols, extra))
            if entry is not None:
                return entry[2], entry[3], total
        out = self.body(_place(host_to_device(host, self.device), cols, extra))
        if out is None:
            return None
        flat, layout = _flat(out)
        return flat, layout, total

    def _build(self, cb: int, idx: torch.Tensor) -> tuple | None:
        try:
            eager = self.body(idx)  # warm-up: compiles, fills the layout and weight caches
            if eager is None:
                raise RuntimeError("the digest body does not apply to these states")
            ref, _ = _flat(eager)
            static_idx = idx.clone()
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    flat, layout = _flat(self.body(static_idx))
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph.replay()
            if not torch.equal(flat, ref):  # one synchronization per bucket per engine
                raise RuntimeError("the replayed digest differs from the eager one")
        except Exception as exc:  # never break the step: the eager path still works
            self.failed = f"off after failure: {type(exc).__name__}: {exc}"[:300]
            log.warning("statescope digest: CUDA graph for %d columns failed (%s); eager from now on",
                        cb, exc)
            return None
        entry = (graph, static_idx, flat, layout)
        self._graphs[cb] = entry
        return entry


def _place(idx: torch.Tensor, cols: int, extra: torch.Tensor | None) -> torch.Tensor:
    """Write the device columns ``extra`` after the ``cols`` uploaded ones (stream-ordered)."""
    if extra is not None and extra.shape[1]:
        idx[:, cols:cols + extra.shape[1]].copy_(extra)
    return idx


def _flat(values: tuple) -> tuple[torch.Tensor, list]:
    """One byte buffer of (stats2, check2, rows_check, rows_sum); missing row outputs stay out."""
    present = [v for v in values if v is not None]
    flat, layout = pack(present)
    return flat, [layout.pop(0) if v is not None else None for v in values]


def unflatten(flat: torch.Tensor, layout: list, columns: int) -> list[torch.Tensor]:
    """Host side: the four outputs of ``StepDigest.run`` for the ``columns`` real columns."""
    from statescope.capture.digest import unpack

    present = unpack(flat, [x for x in layout if x is not None])
    it = iter(present)
    return slice_columns([next(it) if x is not None else None for x in layout], columns)


# ---- the body the step digest runs, and the engine's StepDigest (used by capture.run) ----

def digest_kinds(d: Digester, geom: Any, states: list, idx: torch.Tensor, reuse: bool) -> tuple:
    """(stats ``[2, L, C, S]``, exact ``[2, L, C, 2]`` (checksum, hash), conv token-row exact
    numbers ``[L, C, rows, 2]`` and sums) for
    block table ``idx`` (on the states' device), straight from the blocks where a kernel applies:
    on a CUDA GPU one Triton launch per kind (``Digester.digest_device``, conv token rows
    included; host launch overhead is the cost there), on CPU the C kernel
    (``Digester.digest_in_place``: one pass, no gather). Where neither applies (no Triton or
    compiler, another dtype or layout), gather and reduce with torch ops — on CPU into kept
    buffers (``reuse``: no per-step allocation), the recurrent state chunk by chunk. ``geom`` is
    the first conv state's geometry. The step calls it, and the engine's ``StepDigest`` body."""
    conv_states, ssm_states = [s[0] for s in states], [s[1] for s in states]
    conv = d.digest_device(conv_states, idx, with_rows=True,
                           token_axis=1 if geom.dim_rows else 0)
    ssm = d.digest_device(ssm_states, idx) if conv is not None else None
    if conv is None or ssm is None:
        conv = d.digest_in_place(conv_states, idx, with_rows=not geom.dim_rows)
        ssm = d.digest_in_place(ssm_states, idx) if conv is not None else None
    if conv is None or ssm is None:
        chunks = d.gather(conv_states, idx, reuse=reuse)
        conv = d.reduce(chunks) + d.token_rows(chunks, geom.shape, 1 if geom.dim_rows else 0)
        ssm = d.digest(ssm_states, idx, reuse=reuse)
    elif conv[2] is None:  # DS layout: the token rows are columns of the block
        conv = conv[:2] + d.token_rows(d.gather(conv_states, idx), geom.shape, 1)
    if idx.device.type == "cpu":  # host tensors: numpy stacks without torch's dispatch
        stats = torch.from_numpy(np.stack([conv[0].numpy(), ssm[0].numpy()]))
        checks = torch.from_numpy(np.stack([conv[1].numpy(), ssm[1].numpy()]))
    else:
        stats, checks = torch.stack([conv[0], ssm[0]]), torch.stack([conv[1], ssm[1]])
    return stats, checks, conv[2], conv[3]


def engine_step_digest(runner: Any, layers: list, geom: Any, spec: Any, device: torch.device,
                        device_path: bool) -> StepDigest:
    """The engine's ``StepDigest`` for this digest configuration, kept on the model runner so its
    CUDA graphs are built once per engine (not per capture run). Its body owns its ``Digester``
    (the graphs read its weights) and reads the runner's state tensors through a weak reference."""
    cache = runner.__dict__.setdefault("_statescope_step_digests", {})
    key = (spec.projections, spec.digest_seed, tuple(n for n, _ in layers), str(device))
    sd = cache.get(key)
    if sd is None:
        ref, names = weakref.ref(runner), [n for n, _ in layers]
        digester = Digester(spec.projections, spec.digest_seed)

        def body(idx: torch.Tensor) -> tuple:
            ctx = ref().compilation_config.static_forward_context
            return digest_kinds(digester, geom, [list(ctx[n].kv_cache[:2]) for n in names], idx,
                                reuse=not device_path)

        sd = cache[key] = StepDigest(body, device)
    return sd


def digest_kernel_name(device: torch.device) -> str:
    """Which digest path this run uses (manifests of different kernels agree on checksums only)."""
    from statescope.capture.digest import triton_kernel

    if device.type == "cpu":
        return "c_in_place" if native_kernel() is not None else "torch"
    return "triton" if device.type == "cuda" and triton_kernel() is not None else "torch"
