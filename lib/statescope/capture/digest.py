"""Per-block state digests and snapshots computed on the state's own device, without host sync.

What it does: ``Digester`` reduces one block per (layer, request) of a list of same-shaped
per-layer state tensors (conv windows or recurrent states, possibly ``as_strided`` views into
padded page buffers) to a short row of numbers. What each one detects:

- ``checksum`` (exact): the block's raw words (int16 for bf16, int32 for float32) summed modulo
  2**32. Identical bytes give a bit-identical checksum on any device, batch size or summation
  order; any single changed word changes it. Blind to a permutation of the words, and to a
  whole float32 state scaled by 2 when it has a multiple of 512 nonzero elements (each exponent
  +1 adds 2**23 to its word).
- ``hash`` (exact): the words mixed with their position before they are summed
  (``statescope.capture.word_hash``): as exact and order-free as the checksum, and it sees the
  permutations and the scaling the checksum misses. The two travel together as the last axis
  (``EXACT``) of the "exact" tensors below.
- ``proj0..`` (``projections`` of them): random bilinear forms ``u_j @ X @ v_j`` of the block
  viewed as a matrix X (seeded Gaussian u_j, v_j per block shape). Position-sensitive: a
  shifted, transposed or permuted state changes them; compared with a small relative tolerance.
- ``sum`` and ``sumsq`` (float): magnitude — a blow-up shows in the sum of squares. ``sumsq`` is
  optional (``Digester(sumsq=False)``) for a device where its extra pass costs.
- ``nan`` / ``inf`` (exact counts): garbage. A non-finite sum flags a block; on a GPU they are
  always counted (a host branch would synchronize), on a CPU only in flagged blocks.

How: on a CPU, ``digest_in_place`` reads every selected block once, where it lies, with a small C
kernel (``statescope.capture.digest_native``: compiled on first use into the temp directory;
ctypes, GIL released): all the numbers in one pass, no gather. On a CUDA GPU, ``digest_device`` does the same with one Triton launch per
state kind (``statescope.capture.digest_triton``; host launch overhead, not memory traffic, is the cost
there). Elsewhere (no Triton, no C compiler, or another dtype/layout) ``digest`` gathers the
blocks with ``index_select`` a chunk at a time and reduces each chunk with device ops that
enqueue behind the step's own kernels: one batched matmul ``U @ X`` (sum and projections), one
integer sum (checksum), the hash's integer ops, one norm (sumsq). All paths use the same weights; checksums agree bit
for bit, floats up to rounding (so one run uses one path).
The Triton path is the default on CUDA since it was measured on the H200 (vLLM 0.26.0, beside the factor
check in ``data/results/gpu/e2e_factors/``): checksums bit-identical to the torch path, no synchronization,
0.48 ms of device and 0.76 ms of host time per step for 18 layers x 32 requests (torch: 10.6 and
5.4 ms). ``STATESCOPE_DIGEST_TRITON=0`` turns it off (the torch path then runs).

``gather_snapshot`` copies one request's blocks (all layers) for a full snapshot. ``pack`` joins a
step's small result tensors into one byte buffer so that ``to_host_async`` moves them with one
``non_blocking`` copy into pinned host memory; ``unpack`` splits them again. ``Fence`` records an
event to query later. On CPU the transfers are no-ops (results are already fresh host tensors).
``host_to_device`` uploads small index tensors through pinned memory (a pageable upload would
synchronize the stream).

What it deliberately does not do: decide which blocks to digest (``statescope.capture.recorder``), read
back results (the recorder does, once ``Fence.done()``), or call ``.item()``/``.tolist()`` on
an accelerator.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from statescope.capture import word_hash
from statescope.capture.block_layout import block_contiguous
from statescope.capture.digest_native import ENV_NATIVE, native_kernel  # noqa: F401 (re-export)

log = logging.getLogger("statescope.capture.digest")
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# source bytes gathered and reduced at once: on a CPU the chunk stays in L2 between the gather
# and the passes. On an accelerator larger chunks would mean fewer launches (the real cost there),
# but the chunk is a transient allocation inside vLLM's step, where the KV cache has taken what
# memory profiling left: 16 MB is what was measured safe on the H200; the Triton path avoids both.
CHUNK_BYTES = {"cpu": 2**20, "other": 16 * 2**20}
ENV_TRITON = "STATESCOPE_DIGEST_TRITON"  # "0": skip the one-launch Triton digest (on by default)
EXACT = ("checksum", "hash")  # the last axis of every "exact" tensor, in this order


def stat_names(projections: int, sumsq: bool = True) -> tuple[str, ...]:
    """Float statistic columns, in order: sum, [sumsq], nan, inf, proj0..proj{K-1}."""
    return ("sum",) + (("sumsq",) if sumsq else ()) + ("nan", "inf") + tuple(
        f"proj{k}" for k in range(projections))


class Digester:
    """Digests of state blocks; weights are cached per (block shape, device)."""

    def __init__(self, projections: int = 3, seed: int = 0, chunk_bytes: int | None = None,
                 sumsq: bool = True) -> None:
        self.projections = projections
        self.seed = seed
        self.chunk_bytes = chunk_bytes
        self.sumsq = sumsq
        self._weights: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return stat_names(self.projections, self.sumsq)

    def _weights_for(self, rows: int, cols: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(U ``[1+K, rows]``, V ``[1+K, cols]``): statistic j of a block viewed as a matrix X
        ``[rows, cols]`` is ``U[j] @ X @ V[j]``. Row 0 of both is ones (the plain sum); rows
        1..K are seeded Gaussian vectors, so each projection is a random bilinear form."""
        key = (rows, cols, str(device))
        if key not in self._weights:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + rows * cols)
            u = torch.cat([torch.ones(1, rows), torch.randn(self.projections, rows, generator=gen)])
            v = torch.cat([torch.ones(1, cols), torch.randn(self.projections, cols, generator=gen)])
            self._weights[key] = (host_to_device(u, device), host_to_device(v, device))
        return self._weights[key]

    def iter_chunks(self, states: Sequence[torch.Tensor], block_ids: torch.Tensor,
                    reuse: bool = False) -> Iterator[torch.Tensor]:
        """Gather one block per (layer, request), a chunk of layers at a time: ``states`` are L
        tensors ``[num_blocks, *shape]`` of one kind, ``block_ids`` ``[L, R]`` int64 on their
        device -> chunks ``[Lc, R, *shape]`` of about ``chunk_bytes``. ``reuse``: write into
        buffers kept from the previous call (no per-step allocation, which costs more than the
        copy on a CPU); the caller must be done with a chunk before the next call."""
        first = states[0]
        per_block = first[0].numel() * first.element_size()
        reqs = block_ids.shape[1]
        chunk = self.chunk_bytes or CHUNK_BYTES["cpu" if first.device.type == "cpu" else "other"]
        layers_per_chunk = max(1, chunk // max(1, per_block * max(1, reqs)))
        for start in range(0, len(states), layers_per_chunk):
            part = states[start:start + layers_per_chunk]
            shape = (len(part), reqs) + tuple(first.shape[1:])
            key = (shape, first.dtype, str(first.device), start)
            out = self._buffers.get(key) if reuse else None
            if out is None:
                out = torch.empty(shape, dtype=first.dtype, device=first.device)
                if reuse:
                    self._buffers[key] = out
            for i, s in enumerate(part):  # one copy, straight into place
                torch.index_select(s, 0, block_ids[start + i], out=out[i])
            yield out

    def gather(self, states: Sequence[torch.Tensor], block_ids: torch.Tensor,
               reuse: bool = False) -> list[torch.Tensor]:  # for callers that need them again
        return list(self.iter_chunks(states, block_ids, reuse))

    def reduce(self, chunks: Iterable[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(stats ``[L, R, len(names)]`` float32, exact ``[L, R, 2]`` int64: checksum and hash)
        on the chunks' device; a generator from ``iter_chunks`` has each chunk reduced while
        still in cache."""
        return self._finish([self._passes(c) for c in chunks])

    def digest(self, states: Sequence[torch.Tensor], block_ids: torch.Tensor,
               reuse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather and reduce chunk by chunk: ``reduce(iter_chunks(states, block_ids, reuse))``."""
        return self.reduce(self.iter_chunks(states, block_ids, reuse))

    def digest_in_place(self, states: Sequence[torch.Tensor], block_ids: torch.Tensor,
                        with_rows: bool = False) -> tuple | None:
        """CPU: ``(stats, exact, row_exact, row_sums)`` read from the blocks where they lie, in
        one pass, by the C kernel: what ``digest`` gives (exact numbers bit-identical, floats up
        to rounding) plus, ``with_rows``, per matrix row of a block what ``token_rows`` gives
        (conv windows, SD layout; else None). None where it does not apply: not on a CPU, no
        kernel, not float32/bfloat16, or blocks not contiguous."""
        first = states[0]
        fn = native_kernel() if first.device.type == "cpu" else None
        if fn is None or first.dtype not in (torch.float32, torch.bfloat16) or first.dim() < 2 \
                or not all(s.dtype == first.dtype and s.shape[1:] == first.shape[1:]
                           and block_contiguous(s) for s in states):
            return None
        ids = np.ascontiguousarray(block_ids.numpy(), dtype=np.int64)
        layers, reqs = ids.shape
        if ids.size and (ids.min() < 0 or (ids.max(1) >= [s.shape[0] for s in states]).any()):
            raise ValueError(f"digest: block ids outside 0..{first.shape[0] - 1}")
        cols = first.shape[-1]
        rows = math.prod(first.shape[1:]) // cols
        u, v = self._weights_for(rows, cols, first.device)
        k = self.projections
        bases = np.array([s.data_ptr() for s in states], dtype=np.int64)
        strides = np.array([s.stride(0) * s.element_size() for s in states], dtype=np.int64)
        raw = np.empty((layers, reqs, 2 + k), np.float32)
        exact = np.empty((layers, reqs, 2), np.int64)  # written as two planes, then interleaved
        check, hashed = np.empty((layers, reqs), np.int64), np.empty((layers, reqs), np.int64)
        row_checks = np.empty((layers, reqs, rows), np.int64) if with_rows else None
        row_hashes = np.empty((layers, reqs, rows), np.int64) if with_rows else None
        row_sums = np.empty((layers, reqs, rows), np.float32) if with_rows else None
        ptr = (lambda a: a.ctypes.data if a is not None else None)
        if fn(bases.ctypes.data, strides.ctypes.data, ids.ctypes.data, layers, reqs, rows, cols,
              first.element_size(), k, u[1:].data_ptr(), v[1:].data_ptr(), raw.ctypes.data,
              check.ctypes.data, hashed.ctypes.data, ptr(row_checks), ptr(row_hashes),
              ptr(row_sums)):
            return None  # out of memory in the kernel: the caller falls back
        exact[..., 0], exact[..., 1] = check, hashed
        counts = np.zeros((layers, reqs, 2), np.float32)
        if not np.isfinite(raw[..., :2]).all():  # some block holds a NaN/Inf (or overflowed)
            for li, r in zip(*np.nonzero(~np.isfinite(raw[..., :2]).all(-1))):
                block = states[li][int(ids[li, r])]
                counts[li, r] = [torch.isnan(block).sum().item(), torch.isinf(block).sum().item()]
        stats = np.concatenate([raw[..., :1]] + ([raw[..., 1:2]] if self.sumsq else [])
                               + [counts, raw[..., 2:]], -1)
        rows_out = (torch.from_numpy(np.stack([row_checks, row_hashes], -1)),
                    torch.from_numpy(row_sums)) if with_rows else (None, None)
        return (torch.from_numpy(stats), torch.from_numpy(exact)) + rows_out

    def digest_device(self, states: Sequence[torch.Tensor], block_ids: torch.Tensor,
                      with_rows: bool = False, token_axis: int = 0) -> tuple | None:
        """Accelerator: ``(stats, exact, row_exact, row_sums)`` like ``digest_in_place``, all
        blocks of the kind in one Triton launch (``statescope.capture.digest_triton``), read where
        they lie; ``with_rows``: what ``token_rows`` gives along ``token_axis`` (0: SD conv
        windows, 1: DS). Exact numbers bit-identical to ``digest``, floats up to rounding.
        Nothing is read back to the host. None where it does not apply: not a CUDA tensor (a
        CPU one only under Triton's interpreter), Triton not importable or its kernel failed
        once, not float32/bfloat16, blocks not contiguous, too many projections."""
        first = states[0]
        if first.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            return None
        kernel = triton_kernel()
        if kernel is None or first.dim() < 2:
            return None
        cols = first.shape[-1]
        u, v = self._weights_for(math.prod(first.shape[1:]) // cols, cols, first.device)
        try:
            return kernel.digest_blocks(states, block_ids, u[1:], v[1:], self.sumsq,
                                        token_axis if with_rows else None)
        except Exception as exc:  # e.g. a compile failure on this GPU: the torch path still works
            log.warning("statescope digest: Triton kernel failed (%s); using torch", exc)
            _triton[:] = [None]
            return None

    @staticmethod
    def token_rows(chunks: Sequence[torch.Tensor], block_shape: Sequence[int], token_axis: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token-row (exact ``[L, R, state_len, 2]``: checksum and hash; float sum
        ``[L, R, state_len]``) of gathered conv windows. A window's rows are not all live
        (prefill writes only the first ``kernel - 1``; after a step the live rows start at
        ``accepted - 1``), so comparisons pick live rows."""
        sums, exact = [], []
        for c in chunks:
            w = c.view(c.shape[0], c.shape[1], *block_shape)
            if token_axis == 1:  # DS layout: (conv_dim, state_len) per block
                w = w.transpose(-1, -2).contiguous()
            check = w.view(_INT_VIEW[w.element_size()]).sum(-1, dtype=torch.int32).to(torch.int64)
            exact.append(torch.stack([check, word_hash.token_row_hash(w)], -1))
            sums.append(w.to(torch.float32).sum(-1))
        if len(chunks) == 1:
            return exact[0], sums[0]
        return torch.cat(exact), torch.cat(sums)

    def _passes(self, g: torch.Tensor) -> tuple:
        """The passes over one chunk ``[Lc, R, *shape]``: one batched matmul (sum and the
        bilinear projections), one integer sum (checksum), the hash (integer ops on the words),
        and the norm if ``sumsq``."""
        lc, reqs = g.shape[:2]
        cols = g.shape[-1] if g.dim() > 2 else 1
        x = g if g.dtype == torch.float32 else g.to(torch.float32)
        x = x.reshape(lc, reqs, -1, cols)  # a view: the chunk is contiguous
        u, v = self._weights_for(x.shape[2], cols, g.device)
        # U @ X reads the block once ([1+K, cols] per block), the V side is a few numbers
        sum_proj = torch.linalg.vecdot(torch.matmul(u, x), v)  # [Lc, R, 1 + K]
        flat = g.reshape(lc, reqs, -1)
        # int32 accumulation wraps: an exact sum modulo 2**32, independent of reduction order
        checksum = flat.view(_INT_VIEW[g.element_size()]).sum(-1, dtype=torch.int32)
        hashed = word_hash.block_hash(g.reshape(lc, reqs, -1, cols))
        exact = torch.stack([checksum.to(torch.int64), hashed], -1)
        norm = torch.linalg.vector_norm(x, 2, (-2, -1)) if self.sumsq else None
        return sum_proj, exact, norm, x

    @staticmethod
    def _finish(parts: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Assemble the columns. NaN/Inf are counted with device ops on an accelerator (a host
        branch on the sums would synchronize); on a CPU only in a chunk whose sum or sum of
        squares is not finite (which a NaN/Inf makes it, as does an overflow)."""
        stats, exact = [], []
        for sum_proj, ex, norm, x in parts:
            cols = [sum_proj[..., :1]] + ([norm.square().unsqueeze(-1)] if norm is not None else [])
            if x.device.type == "cpu" and bool(torch.isfinite(torch.cat(cols, -1)).all()):
                cols.append(sum_proj.new_zeros(sum_proj.shape[:-1] + (2,)))
            else:
                counts = [torch.isnan(x).sum((-2, -1)), torch.isinf(x).sum((-2, -1))]
                cols.append(torch.stack(counts, -1).to(sum_proj.dtype))
            stats.append(torch.cat(cols + [sum_proj[..., 1:]], -1))
            exact.append(ex)
        if len(parts) == 1:
            return stats[0], exact[0]
        return torch.cat(stats), torch.cat(exact)


_triton: list = []  # [the statescope.capture.digest_triton module, or None where it cannot be used]


def triton_kernel() -> Any:
    """``statescope.capture.digest_triton`` where Triton imports, unless ``STATESCOPE_DIGEST_TRITON=0``;
    else None, and None after the kernel failed once."""
    if not _triton:
        mod = None
        if os.environ.get(ENV_TRITON, "1") != "0":
            try:
                from statescope.capture import digest_triton as mod
            except Exception as exc:  # no triton, or a broken install
                log.info("statescope digest: Triton unavailable (%s); using torch", exc)
                mod = None
        _triton.append(mod)
    return _triton[0]


def gather_snapshot(states: Sequence[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """One request's blocks, one per layer: ``block_ids`` ``[L]`` on the device -> ``[L, *shape]``."""
    return torch.cat([s.index_select(0, block_ids[i:i + 1]) for i, s in enumerate(states)])


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Upload a host tensor without synchronizing the stream (pinned + non_blocking)."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def pack(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[tuple]]:
    """One flat uint8 tensor holding ``tensors`` back to back (each at an 8-byte aligned offset,
    so it can be viewed back as its dtype), and the layout to undo it."""
    parts, layout, offset = [], [], 0
    for t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8)
        layout.append((t.dtype, tuple(t.shape), offset))
        parts.append(raw)
        pad = -raw.numel() % 8
        if pad:
            parts.append(raw.new_zeros(pad))
        offset += raw.numel() + pad
    return torch.cat(parts), layout


def unpack(flat: torch.Tensor, layout: Sequence[tuple]) -> list[torch.Tensor]:
    return [flat[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for dtype, shape, off in layout]


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """Start a device->host copy into pinned memory; valid once a later ``Fence`` is done."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class Fence:
    """Marks "everything enqueued so far"; ``done()`` polls without blocking, ``wait()`` blocks."""

    def __init__(self, device: torch.device | str) -> None:
        self.event = None
        if torch.device(device).type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
