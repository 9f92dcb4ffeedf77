"""Turn what a Mamba state-copy launch was given into one row per copy (layer, kind, blocks, bytes).

What it does: ``StateGeometry`` describes one (layer, state kind) tensor the way vLLM's copy paths
see it (base address, bytes per block, element size, conv width, inner size, DS rows); it is read
once per engine from the forward context (``geometry_from_states``). Three decoders reproduce, in
plain Python on host values, the addresses each path copies:

- ``decode_fused_precopy``: per batch row (dst column, src column, bias); copies when the source
  column is valid and differs from the destination;
- ``decode_fused_postprocess``: per batch row (running column, aligned column, bias, flag) as
  computed on the device by ``postprocess_decisions`` (a torch mirror of the kernel's decision,
  so the GPU path needs no host sync in the step);
- ``decode_scalar``: the raw (src, dst, size) pointer triples of ``batch_memcpy``, mapped back to
  (layer, kind, block) by address.

Conv copies shift by ``bias`` tokens (``state[src, bias:] -> state[dst, :width - bias]``);
recurrent copies take the block of column ``src + bias``. Rows carry absolute addresses so
``statescope.capture.census`` can test overlaps, including conv and recurrent states sharing one page.

What it deliberately does not do: run any copy, or classify (``statescope.capture.census``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import torch


@dataclass(frozen=True)
class StateGeometry:
    index: int  # flattened (layer, state type) index, the order vLLM's fused metadata uses
    layer: str
    kind: str  # "conv" or "ssm"
    group: int  # Mamba KV-cache group id
    base_addr: int
    block_stride: int  # bytes between blocks (the padded page size when states share a page)
    elem: int
    conv_width: int  # tokens in the conv window; 0 for the recurrent state
    inner: int  # conv (SD): elements per token row; ssm: elements per block
    dim_rows: int  # DS conv: channel rows per block, else 0
    row_stride: int  # DS conv: bytes between channel rows, else 0
    num_blocks: int
    shape: tuple  # per-block shape

    @property
    def natural_bytes(self) -> int:
        """Bytes of one block's state (excluding page padding)."""
        n = 1
        for d in self.shape:
            n *= d
        return n * self.elem

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def geometry_from_states(layers: Sequence[tuple[str, int, Sequence[torch.Tensor]]],
                         dim_first: bool = False) -> list[StateGeometry]:
    """``layers``: (layer name, group id, [conv_state, ssm_state]) in vLLM's group/layer order."""
    out = []
    for layer, group, states in layers:
        for t, kind in zip(states, ("conv", "ssm")):
            es = t.element_size()
            conv = kind == "conv"
            if conv and dim_first:  # (blocks, conv_dim, state_len)
                width, inner, rows, rstride = t.shape[2], 1, t.shape[1], t.stride(1) * es
            elif conv:  # (blocks, state_len, conv_dim)
                width, inner, rows, rstride = t.shape[1], t.stride(1), 0, 0
            else:
                width, inner, rows, rstride = 0, t[0].numel(), 0, 0
            out.append(StateGeometry(len(out), layer, kind, group, t.data_ptr(), t.stride(0) * es,
                                     es, width, inner, rows, rstride, t.shape[0],
                                     tuple(t.shape[1:])))
    return out


def _state_copy(g: StateGeometry, table: Sequence[int], src_col: int, dst_col: int,
                bias: int) -> dict:
    """The bytes one (layer, kind) copy moves for one request, as vLLM's copy kernels do."""
    dst_block = table[dst_col]
    rows, row_stride = 1, 0
    if g.conv_width > 0:
        src_block = table[src_col]
        if g.dim_rows:
            rows, row_stride, token = g.dim_rows, g.row_stride, g.elem
        else:
            token = g.inner * g.elem
        src_off = src_block * g.block_stride + bias * token
        nbytes = max(0, (g.conv_width - bias) * token)
    else:
        src_block = table[src_col + bias]
        src_off = src_block * g.block_stride
        nbytes = g.inner * g.elem
    return dict(layer=g.layer, state_index=g.index, state_kind=g.kind, buffer=g.base_addr,
                src_col=src_col, dst_col=dst_col, bias=bias, src_block=src_block,
                dst_block=dst_block, src_addr=g.base_addr + src_off,
                dst_addr=g.base_addr + dst_block * g.block_stride, nbytes=nbytes, rows=rows,
                row_stride=row_stride)


def _expand(geoms: Sequence[StateGeometry], decisions: Sequence[tuple[int, int, int, int]],
            req_ids: Sequence[str], block_ids: Mapping[str, Sequence[Sequence[int]]],
            kernel: str) -> list[dict]:
    rows = []
    for batch_row, (copy, src_col, dst_col, bias) in enumerate(decisions):
        if not copy or batch_row >= len(req_ids):
            continue
        req = req_ids[batch_row]
        for g in geoms:
            r = _state_copy(g, block_ids[req][g.group], src_col, dst_col, bias)
            r.update(path="fused", kernel=kernel, batch_row=batch_row, req_id=req)
            rows.append(r)
    return rows


def decode_fused_precopy(geoms: Sequence[StateGeometry], dst_cols: Sequence[int],
                         src_cols: Sequence[int], biases: Sequence[int], req_ids: Sequence[str],
                         block_ids: Mapping[str, Sequence[Sequence[int]]]) -> list[dict]:
    """Rows for one fused pre-copy launch (V1 batch order: row i is ``req_ids[i]``)."""
    decisions = [(s >= 0 and s != d, s, d, b) for d, s, b in zip(dst_cols, src_cols, biases)]
    return _expand(geoms, decisions, req_ids, block_ids, "precopy")


def postprocess_decisions(num_accepted: torch.Tensor, running_cols: torch.Tensor,
                          num_scheduled: torch.Tensor, num_computed: torch.Tensor,
                          num_drafts: torch.Tensor, block_size: int) -> torch.Tensor:
    """Device-side mirror of the fused post-process decision: ``[num_reqs, 5]`` int64 of
    (copy?, src column, dst column, bias, reset?) — reset: the kernel sets the request's accepted
    count to 1 (src == dst). Enqueued before the kernel; never read in the step. Host tensors
    are decided with numpy (same arithmetic, a fraction of torch's per-op dispatch cost)."""
    inputs = (num_accepted, running_cols, num_scheduled, num_computed, num_drafts)
    if all(t.device.type == "cpu" for t in inputs):
        import numpy as np

        return torch.from_numpy(postprocess_decisions_np(np.stack([t.numpy() for t in inputs], 1),
                                                         block_size))
    acc, cols, sched, comp, drafts = (t.to(torch.int64) for t in inputs)
    running = comp + sched - drafts  # tokens covered by the running state
    new = running + acc - 1
    aligned = torch.div(new, block_size, rounding_mode="floor") * block_size
    bias = aligned - running
    dst = torch.div(aligned, block_size, rounding_mode="floor") - 1
    crossed = aligned >= running
    copy = crossed & ~((cols == dst) & (bias == 0))
    reset = crossed & (cols == dst)
    return torch.stack([copy.to(torch.int64), cols, dst, bias, reset.to(torch.int64)], -1)


def postprocess_decisions_np(raw: "np.ndarray", block_size: int) -> "np.ndarray":
    """``postprocess_decisions`` on the host: ``raw`` ``[num_reqs, 5]`` holds the kernel's inputs
    (accepted, running column, scheduled, computed, drafts) as the capture staged them in the step;
    returns the ``[num_reqs, 5]`` int64 decisions."""
    import numpy as np

    acc, cols, sched, comp, drafts = np.asarray(raw, dtype=np.int64).T
    running = comp + sched - drafts
    aligned = (running + acc - 1) // block_size * block_size
    dst = aligned // block_size - 1
    crossed = aligned >= running
    bias = aligned - running
    copy = crossed & ~((cols == dst) & (bias == 0))
    reset = crossed & (cols == dst)
    return np.stack([copy.astype(np.int64), cols, dst, bias, reset.astype(np.int64)], -1)


def v2_align_as_v1_inputs(raw: "np.ndarray") -> "np.ndarray":
    """Model Runner V2's align post-process inputs ``[num_reqs, 3]`` (accepted, running column, new
    computed tokens) as V1's five (``postprocess_decisions_np``), so one decode serves both: the
    running state covers ``new - accepted + 1`` tokens, given as "scheduled" with computed = drafts
    = 0."""
    import numpy as np

    acc, cols, new = np.asarray(raw, dtype=np.int64).T
    zero = np.zeros_like(acc)
    return np.stack([acc, cols, new - acc + 1, zero, zero], -1)


def decode_fused_postprocess(geoms: Sequence[StateGeometry], decisions: Sequence[Sequence[int]],
                             req_ids: Sequence[str],
                             block_ids: Mapping[str, Sequence[Sequence[int]]]) -> list[dict]:
    """Rows for one fused post-process launch from ``postprocess_decisions`` read back."""
    return _expand(geoms, [tuple(int(x) for x in d[:4]) for d in decisions], req_ids, block_ids,
                   "postprocess")


def _locate(geoms: Sequence[StateGeometry], addr: int) -> tuple[StateGeometry, int, int] | None:
    for g in geoms:
        off = addr - g.base_addr
        if 0 <= off < g.num_blocks * g.block_stride:
            block, within = divmod(off, g.block_stride)
            if within < g.natural_bytes:
                return g, block, within
    return None


def decode_scalar(geoms: Sequence[StateGeometry], src_ptrs: Sequence[int],
                  dst_ptrs: Sequence[int], sizes: Sequence[int],
                  owners: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Rows for one ``batch_memcpy`` launch; ``owners[i]`` = (req_id, src_col, dst_col, bias) of
    the ``collect_mamba_copy_meta`` call that queued entry i (or {} if unknown)."""
    rows = []
    for i, (src, dst, size) in enumerate(zip(src_ptrs, dst_ptrs, sizes)):
        found_dst, found_src = _locate(geoms, int(dst)), _locate(geoms, int(src))
        g = found_dst[0] if found_dst else None
        owner = owners[i] if i < len(owners) else {}
        rows.append(dict(
            path="scalar", kernel="batch_memcpy", batch_row=owner.get("batch_row", -1),
            req_id=owner.get("req_id"), layer=g.layer if g else None,
            state_index=g.index if g else -1, state_kind=g.kind if g else "unknown",
            buffer=g.base_addr if g else 0, src_col=owner.get("src_col", -1),
            dst_col=owner.get("dst_col", -1), bias=owner.get("bias", -1),
            src_block=found_src[1] if found_src else -1, dst_block=found_dst[1] if found_dst else -1,
            src_addr=int(src), dst_addr=int(dst), nbytes=int(size), rows=1, row_stride=0))
    return rows
