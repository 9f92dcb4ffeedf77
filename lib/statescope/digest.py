"""Per-block state digests and snapshots computed on the state's own device, without host sync.

What it does: ``Digester.digest(states, block_ids)`` gathers one block per (layer, request) from a
list of same-shaped per-layer state tensors (conv windows or recurrent states, possibly
``as_strided`` views into padded page buffers) and reduces each to a short row of statistics,
all with device ops that enqueue behind the step's own kernels:

- float32 statistics (``stat_names``): sum, sum of squares, abs max, NaN count, Inf count and
  ``projections`` fixed random projections (seeded, one weight vector per state shape: these are
  position-sensitive, so a shifted or permuted window changes them);
- an exact ``checksum``: the sum of the block's raw words (int16 words for bf16, int32 for
  float32) modulo 2**32 (int32 accumulation wraps). Modular addition is associative, so identical
  bytes give a bit-identical checksum on any device and batch size, and any single changed word
  changes it. It ignores order; the projections (compared with a small relative tolerance)
  do not.

NaN/Inf counts are exact. On a GPU they are always counted (a branch would synchronize); on
CPU only when a row's sums say it holds any.
The reductions are chosen to read the gathered bytes few times (one matmul gives sum and
projections; norms need no temporaries), because on a CPU with a tiny model the digest competes
with the model's own step.

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

import torch

BASE_STATS = ("sum", "sumsq", "absmax", "nan", "inf")
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

    def gather(self, states: Sequence[torch.Tensor], block_ids: torch.Tensor) -> list[torch.Tensor]:
        """Copy one block per (layer, request): ``states`` are L tensors ``[num_blocks, *shape]``
        of one kind, ``block_ids`` is ``[L, R]`` int64 on their device. Returns chunks
        ``[Lc, R, numel]`` of at most ``chunk_bytes`` each (the only in-step work on CPU)."""
        first = states[0]
        per_block = first[0].numel() * first.element_size()
        reqs = block_ids.shape[1]
        layers_per_chunk = max(1, self.chunk_bytes // max(1, per_block * max(1, reqs)))
        chunks = []
        for start in range(0, len(states), layers_per_chunk):
            part = states[start:start + layers_per_chunk]
            out = torch.empty((len(part), reqs) + tuple(first.shape[1:]), dtype=first.dtype,
                              device=first.device)
            for i, s in enumerate(part):  # one copy, straight into place
                torch.index_select(s, 0, block_ids[start + i], out=out[i])
            chunks.append(out.view(len(part), reqs, -1))
        return chunks

    def reduce(self, chunks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(stats ``[L, R, len(names)]`` float32, checksum ``[L, R]`` int64) on the chunks' device."""
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
        """Few passes over the gathered bytes: one matmul (sum + projections), norm, min, max, one
        integer sum; NaN/Inf are counted only in the rows whose sums say they have any."""
        lc, reqs, n = g.shape
        x = g if g.dtype == torch.float32 else g.to(torch.float32)
        sum_proj = x @ self._weights_for(n, g.device)  # [Lc, R, 1 + K]
        sumsq = torch.linalg.vector_norm(x, 2, -1).square()
        absmax = torch.maximum(x.amax(-1), x.amin(-1).neg())
        probe = sum_proj[..., 0] + sumsq  # not finite iff the row holds a NaN or an Inf
        if g.device.type == "cpu":  # a host branch costs nothing here: count only if needed
            if bool(torch.isfinite(probe).all()):
                nan = inf = torch.zeros_like(probe)
            else:
                nan, inf = torch.isnan(x).sum(-1).to(probe.dtype), torch.isinf(x).sum(-1).to(probe.dtype)
        else:  # on a GPU a branch would synchronize; counting everything is cheap there
            nan, inf = torch.isnan(x).sum(-1).to(probe.dtype), torch.isinf(x).sum(-1).to(probe.dtype)
        stats = torch.cat([sum_proj[..., :1], torch.stack([sumsq, absmax, nan, inf], -1),
                           sum_proj[..., 1:]], -1)
        # int32 accumulation wraps: an exact sum modulo 2**32, independent of reduction order
        checksum = g.view(_INT_VIEW[g.element_size()]).sum(-1, dtype=torch.int32)
        return stats, checksum.to(torch.int64)


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
