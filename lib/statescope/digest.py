"""Per-block state digests and snapshots computed on the state's own device, without host sync.

What it does: ``Digester.digest(states, block_ids)`` gathers one block per (layer, request) from a
list of same-shaped per-layer state tensors (conv windows or recurrent states, possibly
``as_strided`` views into padded page buffers) and reduces each to a short row of statistics,
all with device ops that enqueue behind the step's own kernels:

- float32 statistics (``stat_names``): sum, sum of squares, NaN count, Inf count and
  ``projections`` fixed random projections (seeded, one weight vector per state shape: these are
  position-sensitive, so a shifted or permuted window changes them);
- an exact ``checksum``: the sum of the block's raw words (int16 words for bf16, int32 for
  float32) modulo 2**32 (int32 accumulation wraps). Modular addition is associative, so identical
  bytes give a bit-identical checksum on any device and batch size, and any single changed word
  changes it. It ignores order; the projections (compared with a small relative tolerance)
  do not.

NaN/Inf counts are exact. On a GPU they are always counted (a branch would synchronize); on
CPU only when a row's sums say it holds any, and the small results are assembled with numpy.
``gather(..., reuse=True)`` writes into buffers kept between steps (for a caller that reduces in
the step, as the CPU capture does).
The reductions are chosen to read the gathered bytes few times — one matmul (sum and
projections), one norm, one integer sum — because on a CPU with a tiny model the digest competes
with the model's own step (an abs max, two more passes, was dropped for that reason: the sum of
squares already shows a blow-up, the NaN/Inf counts garbage).

``gather_snapshot`` copies one request's blocks (all layers) for a full snapshot. ``pack`` joins a
step's small result tensors into one byte buffer so that ``to_host_async`` moves them with one
``non_blocking`` copy into pinned host memory; ``unpack`` splits them again. ``Fence`` records an
event to query later. On CPU the transfers are no-ops (results are already fresh host tensors).
``host_to_device`` uploads small index tensors through pinned memory (a pageable upload would
synchronize the stream).

What it deliberately does not do: decide which blocks to digest (``statescope.capture``), read
back results (the recorder does, once ``Fence.done()``), or call ``.item()``/``.tolist()``.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

BASE_STATS = ("sum", "sumsq", "nan", "inf")  # no abs max: two more passes, little to add
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK_BYTES = 16 * 2**20  # source bytes gathered at once; temporaries are up to 8x this


def stat_names(projections: int) -> tuple[str, ...]:
    return BASE_STATS + tuple(f"proj{k}" for k in range(projections))


class Digester:
    """Digests of gathered state blocks; weights are cached per (state shape, device)."""

    def __init__(self, projections: int = 3, seed: int = 0, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.projections = projections
        self.seed = seed
        self.chunk_bytes = chunk_bytes
        self._weights: dict[tuple, torch.Tensor] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return stat_names(self.projections)

    def _weights_for(self, numel: int, device: torch.device) -> torch.Tensor:
        key = (numel, str(device))
        if key not in self._weights:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + numel)
            # column 0 of ones gives the plain sum from the same matmul as the projections
            w = torch.cat([torch.ones(numel, 1),
                           torch.randn(numel, self.projections, generator=gen)], 1)
            self._weights[key] = host_to_device(w, device)
        return self._weights[key]

    def gather(self, states: Sequence[torch.Tensor], block_ids: torch.Tensor,
               reuse: bool = False) -> list[torch.Tensor]:
        """Copy one block per (layer, request): ``states`` are L tensors ``[num_blocks, *shape]``
        of one kind, ``block_ids`` is ``[L, R]`` int64 on their device. Returns chunks
        ``[Lc, R, numel]`` of at most ``chunk_bytes`` each (the only in-step work on CPU).
        ``reuse``: write into buffers kept from the previous call of the same shape (no
        allocation per step: megabytes freed and faulted in again every step cost more than the
        copy on a CPU); the caller must be done with the previous chunks."""
        first = states[0]
        per_block = first[0].numel() * first.element_size()
        reqs = block_ids.shape[1]
        layers_per_chunk = max(1, self.chunk_bytes // max(1, per_block * max(1, reqs)))
        chunks = []
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
            chunks.append(out.view(len(part), reqs, -1))
        return chunks

    def reduce(self, chunks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(stats ``[L, R, len(names)]`` float32, checksum ``[L, R]`` int64) on the chunks' device."""
        if len(chunks) == 1:
            return self._reduce(chunks[0])
        stats, sums = zip(*(self._reduce(c) for c in chunks))
        return torch.cat(stats), torch.cat(sums)

    def digest(self, states: Sequence[torch.Tensor], block_ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``reduce(gather(states, block_ids))``."""
        return self.reduce(self.gather(states, block_ids))

    @staticmethod
    def token_rows(chunks: Sequence[torch.Tensor], block_shape: Sequence[int], token_axis: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token-row (checksum, float sum) of gathered conv windows: ``[L, R, state_len]``
        each. A window's rows are not all live (prefill writes only the first ``kernel - 1``;
        after a step the live rows start at ``accepted - 1``), so comparisons pick live rows."""
        sums, checks = [], []
        for c in chunks:
            w = c.view(c.shape[0], c.shape[1], *block_shape)
            if token_axis == 1:  # DS layout: (conv_dim, state_len) per block
                w = w.transpose(-1, -2).contiguous()
            checks.append(w.view(_INT_VIEW[w.element_size()]).sum(-1, dtype=torch.int32))
            sums.append(w.to(torch.float32).sum(-1))
        return torch.cat(checks).to(torch.int64), torch.cat(sums)

    def _reduce(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Three passes over the gathered bytes: one matmul (sum + projections), one norm, one
        integer sum. On a GPU the small results are assembled with device ops (a host branch
        would synchronize); on CPU with numpy (a torch op costs ~10 us of dispatch, more than
        these few hundred numbers), and NaN/Inf are counted only in the rows whose sums say
        they hold any. Both give the same numbers."""
        x = g if g.dtype == torch.float32 else g.to(torch.float32)
        sum_proj = x @ self._weights_for(g.shape[-1], g.device)  # [Lc, R, 1 + K]
        norm = torch.linalg.vector_norm(x, 2, -1)
        # int32 accumulation wraps: an exact sum modulo 2**32, independent of reduction order
        checksum = g.view(_INT_VIEW[g.element_size()]).sum(-1, dtype=torch.int32)
        if g.device.type == "cpu":
            return self._finish_on_host(x, sum_proj, norm, checksum)
        nan, inf = torch.isnan(x).sum(-1).to(norm.dtype), torch.isinf(x).sum(-1).to(norm.dtype)
        stats = torch.cat([sum_proj[..., :1], torch.stack([norm.square(), nan, inf], -1),
                           sum_proj[..., 1:]], -1)
        return stats, checksum.to(torch.int64)

    @staticmethod
    def _finish_on_host(x: torch.Tensor, sum_proj: torch.Tensor, norm: torch.Tensor,
                        checksum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sp = sum_proj.numpy()
        sumsq = np.square(norm.numpy())
        if np.isfinite(sp[..., 0] + sumsq).all():  # not finite iff a row holds a NaN or an Inf
            nan = inf = np.zeros_like(sumsq)
        else:
            nan = torch.isnan(x).sum(-1).to(torch.float32).numpy()
            inf = torch.isinf(x).sum(-1).to(torch.float32).numpy()
        stats = np.concatenate([sp[..., :1], np.stack([sumsq, nan, inf], -1), sp[..., 1:]], -1)
        return torch.from_numpy(stats), torch.from_numpy(checksum.numpy().astype(np.int64))


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
