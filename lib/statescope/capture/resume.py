"""The column a request's next step resumes from: worked out in the step, on the state's device.

Why: with speculative decoding a decode step writes the recurrent state after each of its
``1 + drafts`` tokens into consecutive columns of the request's Mamba block row, from the
running column on (vLLM 0.28.0, align mode). The next step reads its initial recurrent state
from the column ``accepted - 1`` after the running one — unless the align-mode post-process
moved it: when the step ends exactly on a block boundary inside the running block (the
in-place case, copy source == destination), the kernel copies that state to the running
column and resets the count to 1. The conv window lives in the running column only; its live
rows start at the same offset (``conv_live_offset``). Digesting only the running column sees a
corruption of the resume slot one step late, when the next step has read it.

What it does: ``resume_offsets`` gives, per selected request, that offset (0 .. drafts) with
device ops only (the accepted counts are still on the device; no host read in the step); the
post-process's in-place reset is decided from the launch's staged inputs exactly as
``statescope.capture.census_decode.postprocess_decisions_np`` decides it at emit.
``resume_blocks`` picks the block of that column per (layer, request) from the candidate table
(``statescope.capture.facts.column_candidates``), also on the device, for the capture to digest
as an extra column. At emit ``resolve`` turns the offsets read back into table facts.

The offset follows the count the rejection sampler produced (the state after the accepted
tokens); the reset follows the count the post-process kernel read (where the copy really put
it). Under the async-scheduling race the two can differ: then the next step reads another
column than this one, and the divergence shows where that read happens.

What it deliberately does not do: digest anything (``statescope.capture.run``), or cover the
pre-copy of the next step (it moves the state to a new running column without changing it).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


def in_place_reset(staged: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per row of the post-process launch's staged inputs ``[n, 5]`` (accepted, running column,
    scheduled, computed, drafts): whether the kernel reset the count to 1 (source == dest)."""
    d = staged.to(torch.int64)
    acc, col, sched, comp, drafts = d.unbind(1)
    running = comp + sched - drafts
    aligned = torch.div(running + acc - 1, block_size, rounding_mode="floor") * block_size
    return (aligned >= running) & (col == torch.div(aligned, block_size, rounding_mode="floor") - 1)


def resume_offsets(accepted: torch.Tensor, rows: torch.Tensor, drafts: torch.Tensor,
                   staged: torch.Tensor | None = None, block_size: int | None = None
                   ) -> torch.Tensor:
    """Offsets ``[R]`` int64 (on the counts' device) of the column the next step reads, for batch
    ``rows`` with ``drafts`` scheduled drafts each: ``accepted - 1`` clamped to ``0 .. drafts``,
    0 where the post-process reset the count (``staged``: its inputs, all batch rows)."""
    acc = accepted.index_select(0, rows).to(torch.int64)
    off = torch.minimum((acc - 1).clamp(min=0), drafts)
    if staged is not None and block_size:
        reset = in_place_reset(staged.index_select(0, rows), block_size)
        off = torch.where(reset, torch.zeros_like(off), off)
    return off


def resume_blocks(candidates: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Block ids ``[L, R]`` of column ``offsets[r]`` of ``candidates`` ``[L, R, D + 1]``."""
    layers = candidates.shape[0]
    at = offsets.view(1, -1, 1).expand(layers, -1, 1)
    return candidates.gather(2, at).squeeze(2)


def resolve(offsets: np.ndarray, extra_req: np.ndarray, candidates: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """At emit: the digest rows ``[E, 2]`` (request, column offset) and block ids ``[L, E]`` of
    the extra resume columns, from the offsets read back (``offsets`` per selected request;
    ``extra_req``: which request each extra column belongs to; ``candidates`` ``[L, E, D + 1]``)."""
    off = offsets[extra_req]
    rows = np.stack([extra_req, off], 1).astype(np.int64)
    blocks = np.take_along_axis(candidates, off[None, :, None], 2)[..., 0]
    return rows, blocks


def staged_postprocess(launches: list) -> tuple[Any, int | None]:
    """The last post-process launch's staged inputs and block size (``(None, None)`` if none)."""
    for launch in reversed(launches):
        if launch.kind == "postprocess" and launch.block_size is not None:
            return launch.data, int(launch.block_size)
    return None, None
