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

What it does: ``plan`` (in the step) gives, per selected request, that offset (0 .. drafts) with
device ops only (the accepted counts are still on the device; no host read in the step) — the
post-process's in-place reset follows from host facts and the count (see ``plan``), the rule
``statescope.capture.census_decode.postprocess_decisions_np`` applies to the launch at emit —
and picks the block of that column per (layer, request) from the request's block row, also on
the device, for the capture to digest
as an extra column. At emit ``resolve`` turns the offsets read back into table rows.

The offset follows the count the rejection sampler produced (the state after the accepted
tokens). Under the async-scheduling race the post-process may read another count: then the next
step reads another column than this one, and the divergence shows where that read happens.

What it deliberately does not do: digest anything (``statescope.capture.run``), or cover the
pre-copy of the next step (it moves the state to a new running column without changing it).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


def plan(accepted: Any, launches: list, per_req: np.ndarray, end_tokens: np.ndarray,
         tables: list, pos: np.ndarray, cols: np.ndarray, layer_group_pos: list, block_size: int,
         draft_columns: bool, device: Any) -> tuple[Any, np.ndarray | None, Any]:
    """In the step: ``(offsets, extra_req, extra_blocks)``. ``offsets`` ``[R]`` (device, int64):
    per selected request (``per_req`` rows: batch row, drafts, ...; ``end_tokens``: computed +
    scheduled tokens at schedule time) the column its next step reads, ``accepted - 1`` clamped
    to ``0 .. drafts``, 0 where the align post-process reset the count. That reset happens
    exactly when every draft was accepted and the step's last token ends a block (``end_tokens``
    a multiple of the block size: copy source == destination), a fact known on the host.
    ``extra_req``: the selected requests that get an extra digest column (those with drafts;
    none with ``draft_columns``, which digest every column); ``extra_blocks`` ``[L, E]``
    (device): that column's block per layer. All None in a step without drafts.

    How, without reading the counts: the host builds, per request, the offset for every
    possible count (``lookup_offsets``: a count is 0 .. drafts + 1) and, per (layer, extra
    request), the block for every count; one upload, then an index and a gather per output on
    the device (counts clamped first, so a gather never reads out of bounds)."""
    from statescope.capture.digest import host_to_device

    drafts = per_req[:, 1]
    if accepted is None or not drafts.any():
        return None, None, None
    postprocess = any(ln.kind == "postprocess" for ln in launches)
    ends_block = (end_tokens % block_size == 0) if postprocess else np.zeros(len(drafts), bool)
    width = int(drafts.max()) + 2  # counts 0 .. drafts + 1
    lut = lookup_offsets(drafts, ends_block, width)  # [R, W]
    extra_req = np.zeros(0, dtype=np.int64) if draft_columns else np.flatnonzero(drafts > 0)
    reqs, e, layers = len(drafts), len(extra_req), len(layer_group_pos)
    block_lut = np.zeros((len(tables), e, width), dtype=np.int64)  # per Mamba group
    if e:  # the block at running column + offset, per group (0 past a row's end: the null block)
        p = pos[extra_req]
        at = cols[extra_req][:, None] + lut[extra_req]  # [E, W]
        for gi, (tab, nb) in enumerate(tables):
            if tab.shape[1]:
                block_lut[gi] = np.where(at < nb[p][:, None],
                                         tab[p[:, None], np.minimum(at, tab.shape[1] - 1)], 0)
    block_lut = block_lut[layer_group_pos]  # [L, E, W]
    host = np.concatenate([per_req[:, 0], lut.ravel(), per_req[extra_req, 0], block_lut.ravel()])
    dev = host_to_device(torch.from_numpy(host.astype(np.int64)), device)
    counts = accepted.index_select(0, dev[:reqs]).to(torch.int64).clamp_(0, width - 1)
    off = dev[reqs:reqs + reqs * width].view(reqs, width).gather(1, counts.view(-1, 1)).view(-1)
    if not e:
        return off, None, None
    at = reqs + reqs * width
    counts_e = accepted.index_select(0, dev[at:at + e]).to(torch.int64).clamp_(0, width - 1)
    blocks = dev[at + e:].view(layers, e, width).gather(2, counts_e.view(1, -1, 1)
                                                       .expand(layers, -1, 1)).view(layers, e)
    return off, extra_req, blocks


def lookup_offsets(drafts: np.ndarray, ends_block: np.ndarray, width: int) -> np.ndarray:
    """``[R, width]``: the resume offset of each request for each accepted count 0 .. width - 1:
    ``count - 1`` clamped to ``0 .. drafts``, 0 for ``count == drafts + 1`` where the step ends a
    block (the post-process's in-place reset)."""
    counts = np.arange(width)[None, :]
    off = np.clip(counts - 1, 0, drafts[:, None])
    reset = ends_block[:, None] & (drafts[:, None] > 0) & (counts == drafts[:, None] + 1)
    return np.where(reset, 0, off).astype(np.int64)


def resolve(offsets: np.ndarray, extra_req: np.ndarray, metas: list, layer_group_pos: list
            ) -> tuple[np.ndarray, np.ndarray]:
    """At emit: the digest rows ``[E, 2]`` (request, column offset) and block ids ``[L, E]`` of
    the extra resume columns, from the offsets read back and each request's block rows."""
    off = offsets[extra_req]
    rows = np.stack([extra_req, off], 1).astype(np.int64)
    blocks = np.array([[metas[r]["mamba_block_ids"][g][metas[r]["running_col"] + o]
                        for r, o in zip(extra_req.tolist(), off.tolist())]
                       for g in layer_group_pos], dtype=np.int64).reshape(len(layer_group_pos), -1)
    return rows, blocks
