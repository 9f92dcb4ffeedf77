"""The digest's second exact number: a position-keyed, nonlinear hash of a state block's raw words.

Why: the word-sum checksum (``statescope.capture.digest``) is linear in the words and blind to
order, so two corruptions pass it unseen — a permutation of values (a swap of two channels of a
conv row keeps every per-row checksum and row sum), and a whole float32 state scaled by 2 (each
exponent +1 adds 2**23 to the word; over a multiple of 512 nonzero elements that adds a multiple
of 2**32). A hash that mixes each word with its position before summing sees both, and stays
exact and independent of summation order (integer adds modulo 2**32), so every device, kernel and
batch size gives the same bits.

Definition (all arithmetic on unsigned 32-bit words, modulo 2**32). A block is viewed as a matrix
``[rows, cols]`` (cols = its last dimension, as the float projections view it):

- ``word``: the element's raw bits, zero-extended (float32: 32 bits; bfloat16: 16 bits);
- ``key(j) = (j + 1) * 0x9E3779B1`` and ``mix`` = MurmurHash3's 32-bit finalizer ``fmix32``;
- element term ``t[r, c] = mix(word[r, c] ^ key(c))`` (c: the channel, the position in its row);
- block hash ``H = sum over r, c of weight(r) * t[r, c]`` with ``weight(r) = mix(r) | 1`` (odd:
  a permutation of whole rows changes H unless the rows' sums of terms agree modulo ~2**31);
- token-row hash of a conv window: the sum of ``t`` over the row's channels, with no row weight,
  so a row keeps its hash when a shift moves it (the live-row comparison lines up rows at
  different offsets). In the DS layout (``(conv_dim, state_len)`` blocks) the token rows are the
  block's columns: their hash keys each element by its channel, the block row
  (``mix(word ^ key(r))``, summed over r).

Stored like the checksum: the 32-bit result read as a signed int32, kept in an int64.

What it does here: the reference implementation with torch integer ops (``block_hash``,
``token_row_hash``), which the torch gather path of ``Digester`` uses and the C and Triton kernels
(``statescope.capture.digest_native``, ``.digest_triton``) must match bit for bit.

What it deliberately does not do: resist an adversary (it is a corruption detector, not a MAC), or
run fast (the kernels do that; this path makes int32 temporaries of the blocks' size).
"""
from __future__ import annotations

import torch

GOLDEN = 0x9E3779B1
MIX1, MIX2 = 0x85EBCA6B, 0xC2B2AE35
MASK32 = 0xFFFFFFFF
DEFINITION = "fmix32(word ^ (j+1)*0x9E3779B1), row weight fmix32(r)|1; sum mod 2**32"


def _i32(value: int) -> int:
    """An unsigned 32-bit constant as the signed int32 with the same bits."""
    return value - 2**32 if value >= 2**31 else value


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finalizer on int32 tensors (the bits of uint32 values; modified in place
    and returned). int32 products wrap modulo 2**32 (two's complement), as the definition wants;
    a right shift of an int32 copies the sign bit, so each is masked to a logical shift."""
    x ^= (x >> 16) & 0xFFFF
    x *= _i32(MIX1)
    x ^= (x >> 13) & 0x7FFFF
    x *= _i32(MIX2)
    x ^= (x >> 16) & 0xFFFF
    return x


def words(block: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float32/bfloat16 tensor as int32 (bf16: the 16 bits zero-extended);
    always a fresh tensor (``fmix32`` writes into it)."""
    if block.element_size() == 4:
        return block.contiguous().view(torch.int32).clone()
    if block.element_size() == 2:
        return block.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    raise TypeError(f"word_hash: {block.dtype} has no 16- or 32-bit words")


def _as_i32(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same bits."""
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def key(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return _as_i32(((torch.arange(n, dtype=torch.int64, device=device) + 1) * GOLDEN) & MASK32)


def row_weight(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return fmix32(torch.arange(n, dtype=torch.int32, device=device)) | 1


def terms(w: torch.Tensor) -> torch.Tensor:
    """``mix(word ^ key(channel))`` for int32 words ``[..., cols]`` (channel = last axis)."""
    w ^= key(w.shape[-1], w.device)
    return fmix32(w)


def block_hash(x: torch.Tensor) -> torch.Tensor:
    """Hash of each block of ``x`` ``[..., rows, cols]`` -> int64 ``[...]`` (signed int32 values)."""
    per_row = terms(words(x)).sum(-1, dtype=torch.int32)  # int32 sums wrap: modulo 2**32
    per_row *= row_weight(x.shape[-2], x.device)
    return per_row.sum(-1, dtype=torch.int32).to(torch.int64)


def token_row_hash(x: torch.Tensor) -> torch.Tensor:
    """Hash of each token row of conv windows ``x`` ``[..., tokens, channels]`` -> ``[..., tokens]``
    (for DS blocks pass the transposed view: tokens first, channels last)."""
    return terms(words(x)).sum(-1, dtype=torch.int32).to(torch.int64)
