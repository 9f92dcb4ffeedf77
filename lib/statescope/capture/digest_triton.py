"""All (layer, request) state blocks of one kind digested in one Triton launch, read where they lie.

What it does: ``digest_blocks`` gives what ``Digester`` gives on its torch path for L per-layer
state tensors of one kind (separate tensors, same block shape, float32 or bfloat16, each block
one contiguous run; any ``stride(0)``, so ``as_strided`` views into padded pages are fine) and
block ids ``[L, R]``: stats ``[L, R, len(names)]`` float32 in ``Digester.names`` order (sum,
[sumsq], nan, inf, proj0..proj{K-1}), the exact numbers ``[L, R, 2]`` int64 bit-identical to the
torch and C paths — the checksum (raw int16/int32 words summed with int32 wraparound, then
sign-extended) and the word hash (``statescope.capture.word_hash``) — and on request per token
row (exact ``[..., 2]``, float sum) as ``Digester.token_rows`` gives them: token axis 0 (SD conv
windows: rows of the block) or 1 (DS: its columns).

Per launch (grid: L*R blocks x splits): program (pair, split) finds its block through a device
table of per-layer base addresses and byte strides (``data_ptr`` values; the address is cast to
a pointer in the kernel) and the block id ``ids[layer, req]``, then walks its share of the
block's ``[BLOCK_R, BLOCK_C]`` tiles in one flat loop (loads software-pipelined, ``STAGES``)
into elementwise float32/int32/uint32 accumulators, reduced once at the end: one read of each
byte, no gather, no temporaries. The hash's element terms are integer multiplies and shifts on
the loaded words (uint32 arithmetic wraps modulo 2**32, as the definition wants). A block is split over several programs only when there are too few
blocks to fill the GPU (fewer than ~4 per SM: not at 18 layers x 32 requests on an H200); the
partials are then added by a few torch ops (deterministic: no atomics). Block ids and the
table live on the device: the host never reads a device value, and checks/uploads the table
once per set of state tensors.

What it deliberately does not do: other dtypes, non-contiguous blocks, more than
``MAX_PROJECTIONS`` projections, or more than ``MAX_TOKEN_ROWS`` token rows (``None``: the
caller falls back to the torch path); bounds-check block ids (that would need a host read).
On a CPU it runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
first imported), which is how the tests check it.
"""
from __future__ import annotations

import math
import weakref
from typing import Sequence

import torch
import triton
import triton.language as tl

from statescope.capture.block_layout import block_contiguous

MAX_PROJECTIONS = 4
MAX_TOKEN_ROWS = 1024  # token rows (conv window length) kept whole in one tile
STAGES = 3  # loads in flight per program (software pipelining of the tile loop)
TILE = 2048  # elements per tile: 8 per thread with 8 warps, ~10 live accumulators each
HASH = True  # False: leave the word hash out (it then reads 0): benchmarks/bench_digest_gpu.py


@triton.jit
def _fmix32(x):
    """MurmurHash3's 32-bit finalizer on uint32 values (the word hash's mixer)."""
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit(do_not_specialize=["reqs", "tiles_per_split", "splits"])
def _digest_kernel(table, ids, u, v, stats, check, hsh, tok_check, tok_hash, tok_sum,
                   layers, reqs, rows, cols, row_tiles, col_tiles, tiles_per_split, splits,
                   BF16: tl.constexpr, K: tl.constexpr, SUMSQ: tl.constexpr, NSTAT: tl.constexpr,
                   TOKENS: tl.constexpr, ALIGNED: tl.constexpr, STAGES: tl.constexpr,
                   HASH: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pair = tl.program_id(0)  # layer * reqs + request
    split = tl.program_id(1)
    layer = pair // reqs
    # table: [bases (L), strides in bytes (L)]; int64 address arithmetic, one cast to a pointer
    addr = tl.load(table + layer) + tl.load(ids + pair) * tl.load(table + layers + layer)
    if BF16:
        base = addr.to(tl.pointer_type(tl.int16))
    else:
        base = addr.to(tl.pointer_type(tl.int32))
    if ALIGNED:  # host checked: 16-byte aligned bases and strides allow vector loads
        base = tl.multiple_of(base, 16)
    r_off = tl.arange(0, BLOCK_R)
    c_off = tl.arange(0, BLOCK_C)
    fzero = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    izero = tl.zeros([BLOCK_R, BLOCK_C], tl.int32)
    s0, sq, p0, p1, p2, p3 = fzero, fzero, fzero, fzero, fzero, fzero
    ck, nan, inf = izero, izero, izero
    hacc = tl.zeros([BLOCK_R, BLOCK_C], tl.uint32)  # hash terms (row-weighted unless TOKENS == 1)
    tacc = tl.zeros([BLOCK_R, BLOCK_C], tl.uint32)  # DS token rows: terms keyed by the block row
    t_start = split * tiles_per_split
    t_end = tl.minimum(row_tiles * col_tiles, t_start + tiles_per_split)
    # one flat loop over this program's tiles (innermost, so the compiler can pipeline loads)
    for t in tl.range(t_start, t_end, num_stages=STAGES):
        r = (t // col_tiles) * BLOCK_R + r_off
        c = (t % col_tiles) * BLOCK_C + c_off
        r_ok = r < rows
        c_ok = c < cols
        m = r_ok[:, None] & c_ok[None, :]
        w = tl.load(base + (r[:, None] * cols + c[None, :]), mask=m, other=0).to(tl.int32)
        if BF16:  # int16 words sign-extended (as torch's int32 sum of them); float = high half
            bits = w << 16
        else:
            bits = w
        x = bits.to(tl.float32, bitcast=True)
        mag = bits & 0x7FFFFFFF  # exponent all ones: Inf (mantissa 0) or NaN
        nan += (mag > 0x7F800000).to(tl.int32)
        inf += (mag == 0x7F800000).to(tl.int32)
        ck += w  # int32 adds wrap: the sum modulo 2**32 whatever the order
        if HASH:  # the word hash: raw bits zero-extended, mixed with the channel's key
            if BF16:
                wu = (w & 0xFFFF).to(tl.uint32, bitcast=True)
            else:
                wu = w.to(tl.uint32, bitcast=True)
            key_c = (c + 1).to(tl.uint32) * 0x9E3779B1
            term = tl.where(m, _fmix32(wu ^ key_c[None, :]), 0)  # masked lanes add nothing
            if TOKENS == 1:  # one row tile holds every row: the row weight is applied at the end
                hacc += term
            else:
                hacc += term * (_fmix32(r.to(tl.uint32)) | 1)[:, None]
            if TOKENS == 2:  # DS token rows are block columns; their channel is the block row
                key_r = (r + 1).to(tl.uint32) * 0x9E3779B1
                tacc += tl.where(m, _fmix32(wu ^ key_r[:, None]), 0)
        s0 += x
        sq += x * x
        # projection j: sum of u_j[r] v_j[c] x[r, c]
        if K > 0:
            p0 += x * (tl.load(u + r, mask=r_ok, other=0.0)[:, None]
                       * tl.load(v + c, mask=c_ok, other=0.0)[None, :])
        if K > 1:
            p1 += x * (tl.load(u + rows + r, mask=r_ok, other=0.0)[:, None]
                       * tl.load(v + cols + c, mask=c_ok, other=0.0)[None, :])
        if K > 2:
            p2 += x * (tl.load(u + 2 * rows + r, mask=r_ok, other=0.0)[:, None]
                       * tl.load(v + 2 * cols + c, mask=c_ok, other=0.0)[None, :])
        if K > 3:
            p3 += x * (tl.load(u + 3 * rows + r, mask=r_ok, other=0.0)[:, None]
                       * tl.load(v + 3 * cols + c, mask=c_ok, other=0.0)[None, :])
    part = pair * splits + split
    out = stats + part * NSTAT
    tl.store(out, tl.sum(tl.sum(s0, 1), 0))
    if SUMSQ:
        tl.store(out + 1, tl.sum(tl.sum(sq, 1), 0))
    tl.store(out + 1 + SUMSQ, tl.sum(tl.sum(nan, 1), 0).to(tl.float32))
    tl.store(out + 2 + SUMSQ, tl.sum(tl.sum(inf, 1), 0).to(tl.float32))
    if K > 0:
        tl.store(out + 3 + SUMSQ, tl.sum(tl.sum(p0, 1), 0))
    if K > 1:
        tl.store(out + 4 + SUMSQ, tl.sum(tl.sum(p1, 1), 0))
    if K > 2:
        tl.store(out + 5 + SUMSQ, tl.sum(tl.sum(p2, 1), 0))
    if K > 3:
        tl.store(out + 6 + SUMSQ, tl.sum(tl.sum(p3, 1), 0))
    # the last step in int64, then wrapped: the same bits, and no int32 overflow in the interpreter
    total = tl.sum(tl.sum(ck, 1).to(tl.int64), 0).to(tl.int32)
    tl.store(check + part, total.to(tl.int64))
    # hash sums in int64 (zero-extended terms), wrapped to 32 bits at the end
    if TOKENS == 1:
        row_h = tl.sum(hacc.to(tl.int64), 1) & 0xFFFFFFFF
        weighted = row_h.to(tl.uint32) * (_fmix32(r_off.to(tl.uint32)) | 1)
        h_total = tl.sum(weighted.to(tl.int64), 0)
    else:
        h_total = tl.sum(tl.sum(hacc.to(tl.int64), 1), 0)
    tl.store(hsh + part, (h_total & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)
             .to(tl.int64))
    # token rows: the block's rows (one row tile holds them all) or columns (one column tile)
    if TOKENS == 1:
        tl.store(tok_check + part * rows + r_off, tl.sum(ck, 1).to(tl.int32).to(tl.int64),
                 mask=r_off < rows)
        tl.store(tok_hash + part * rows + r_off,
                 row_h.to(tl.uint32).to(tl.int32, bitcast=True).to(tl.int64), mask=r_off < rows)
        tl.store(tok_sum + part * rows + r_off, tl.sum(s0, 1), mask=r_off < rows)
    if TOKENS == 2:
        tl.store(tok_check + part * cols + c_off, tl.sum(ck, 0).to(tl.int32).to(tl.int64),
                 mask=c_off < cols)
        col_h = tl.sum(tacc.to(tl.int64), 0) & 0xFFFFFFFF
        tl.store(tok_hash + part * cols + c_off,
                 col_h.to(tl.uint32).to(tl.int32, bitcast=True).to(tl.int64), mask=c_off < cols)
        tl.store(tok_sum + part * cols + c_off, tl.sum(s0, 0), mask=c_off < cols)


def interpreting() -> bool:
    """Whether the kernel runs under Triton's CPU interpreter (decided when triton was imported)."""
    return type(_digest_kernel).__name__ == "InterpretedFunction"


_layouts: dict[tuple, tuple] = {}
_sm_counts: dict[str, int] = {}


def _layout(states: Sequence[torch.Tensor]) -> tuple | None:
    """(device int64 table ``[2, L]`` of base addresses and strides in bytes, whether all are
    16-byte aligned) for these tensors, or None when the kernel cannot read them. Checked and
    uploaded (pinned, no stream synchronization) once per set of tensor objects: vLLM's state
    tensors are the same objects every step and never move. Weak references: the cache never
    keeps a state alive, and a recycled ``id`` is never taken for the old tensor."""
    key = tuple(map(id, states))
    hit = _layouts.get(key)
    if hit is not None and all(ref() is t for ref, t in zip(hit[0], states)):
        return hit[1]
    first = states[0]
    value = None
    if first.dim() >= 2 and first.dtype in (torch.float32, torch.bfloat16) and all(
            t.dtype == first.dtype and t.shape[1:] == first.shape[1:] and t.device == first.device
            and block_contiguous(t) for t in states):
        addrs = [(t.data_ptr(), t.stride(0) * t.element_size()) for t in states]
        host = torch.tensor([[p for p, _ in addrs], [b for _, b in addrs]], dtype=torch.int64)
        table = host if first.device.type == "cpu" else \
            host.pin_memory().to(first.device, non_blocking=True)
        value = (table, all(p % 16 == 0 and b % 16 == 0 for p, b in addrs))
    if len(_layouts) > 64:  # sets seen by tests and re-created engines: keep it small
        _layouts.clear()
    _layouts[key] = ([weakref.ref(t) for t in states], value)
    return value


def _sm_count(device: torch.device) -> int:
    if str(device) not in _sm_counts:
        _sm_counts[str(device)] = (torch.cuda.get_device_properties(device).multi_processor_count
                                   if device.type == "cuda" else 4)
    return _sm_counts[str(device)]


def digest_blocks(states: Sequence[torch.Tensor], block_ids: torch.Tensor, u: torch.Tensor,
                  v: torch.Tensor, sumsq: bool, token_axis: int | None = None,
                  splits: int | None = None) -> tuple | None:
    """``(stats, exact, token_exact, token_sums)`` of block ``block_ids[l, r]`` of each
    ``states[l]`` (exact: checksum and hash on the last axis); ``u`` ``[K, rows]`` and ``v`` ``[K, cols]`` float32 projection weights (the
    block viewed as ``[rows, cols]``, cols = last dim); ``token_axis`` 0/1 adds per-token
    ``[L, R, n]`` outputs (else None). ``splits`` forces programs per block (tests). None where
    it does not apply (see the module docstring)."""
    first = states[0]
    k = u.shape[0]
    if (first.device.type != "cuda" and not interpreting()) or k > MAX_PROJECTIONS \
            or block_ids.dim() != 2 or block_ids.shape[0] != len(states):
        return None
    layout = _layout(states)
    if layout is None:
        return None
    table, aligned = layout
    layers, reqs = block_ids.shape
    cols = first.shape[-1]
    rows = math.prod(first.shape[1:]) // cols
    tokens = 0 if token_axis is None else token_axis + 1
    n_tok = rows if tokens == 1 else cols
    if layers * reqs == 0 or (tokens and n_tok > MAX_TOKEN_ROWS):
        return None
    # tile shape: the token axis whole (its sums then come from the accumulators), else wide rows
    if tokens == 1:
        block_r = triton.next_power_of_2(rows)
        block_c = min(triton.next_power_of_2(cols), max(1, TILE // block_r))
    else:
        block_c = min(triton.next_power_of_2(cols), TILE if tokens == 0 else MAX_TOKEN_ROWS)
        block_r = min(triton.next_power_of_2(rows), max(1, TILE // block_c))
    row_tiles, col_tiles = -(-rows // block_r), -(-cols // block_c)
    tiles, pairs = row_tiles * col_tiles, layers * reqs
    if splits is None:  # enough programs to fill every SM a few times over
        splits = -(-4 * _sm_count(first.device) // pairs)
    tiles_per_split = -(-tiles // max(1, min(splits, tiles)))
    splits = -(-tiles // tiles_per_split)
    nstat = 3 + int(sumsq) + k
    dev = first.device
    stats = torch.empty((layers, reqs, splits, nstat), dtype=torch.float32, device=dev)
    check = torch.empty((layers, reqs, splits), dtype=torch.int64, device=dev)
    hsh = torch.empty((layers, reqs, splits), dtype=torch.int64, device=dev)
    if tokens:
        tok_check = torch.empty((layers, reqs, splits, n_tok), dtype=torch.int64, device=dev)
        tok_hash = torch.empty((layers, reqs, splits, n_tok), dtype=torch.int64, device=dev)
        tok_sum = torch.empty((layers, reqs, splits, n_tok), dtype=torch.float32, device=dev)
    else:  # never written (TOKENS == 0): any pointers of these dtypes
        tok_check, tok_hash, tok_sum = check, hsh, stats
    ids = block_ids if block_ids.dtype == torch.int64 else block_ids.to(torch.int64)
    weights = (u.contiguous(), v.contiguous()) if k else (stats, stats)  # unused when K == 0
    _digest_kernel[(pairs, splits)](
        table, ids.contiguous(), *weights, stats, check, hsh, tok_check, tok_hash, tok_sum,
        layers, reqs, rows, cols, row_tiles, col_tiles, tiles_per_split, splits,
        BF16=first.dtype == torch.bfloat16, K=k, SUMSQ=int(sumsq), NSTAT=nstat, TOKENS=tokens,
        ALIGNED=aligned, STAGES=STAGES, HASH=HASH, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=8 if block_r * block_c >= TILE else 4)
    if splits == 1:
        out = (stats.view(layers, reqs, nstat),
               torch.stack([check.view(layers, reqs), hsh.view(layers, reqs)], -1))
        toks = (torch.stack([tok_check.view(layers, reqs, n_tok),
                             tok_hash.view(layers, reqs, n_tok)], -1),
                tok_sum.view(layers, reqs, n_tok)) if tokens else (None, None)
        return out + toks
    # partial sums per split: add them (int64 sums, then wrapped back to int32 as one pass does;
    # both exact numbers are sums modulo 2**32, so their partials add the same way)
    out = (stats.sum(2), torch.stack([_wrap(check.sum(2)), _wrap(hsh.sum(2))], -1))
    if not tokens:
        return out + (None, None)
    return out + (torch.stack([_wrap(tok_check.sum(2)), _wrap(tok_hash.sum(2))], -1),
                  tok_sum.sum(2))


def _wrap(x: torch.Tensor) -> torch.Tensor:
    """int64 sums of int32 partials, read back modulo 2**32 as signed int32 (kept in int64)."""
    return x.to(torch.int32).to(torch.int64)
