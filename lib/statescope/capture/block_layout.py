"""Whether a paged state tensor's blocks are each one contiguous run of memory.

What it does: ``block_contiguous(s)`` reads the strides of ``s[1:]`` (a block's shape) and says
whether each block ``s[i]`` can be read as one flat run: what the fused digest paths (the torch
reduction in ``statescope.capture.digest`` and the Triton kernel in ``digest_triton``) need before
they treat a block as contiguous bytes.

What it deliberately does not do: look at the tensor's data or at the first dimension's stride
(blocks may sit anywhere in the pool).
"""
from __future__ import annotations

import math

import torch


def block_contiguous(s: torch.Tensor) -> bool:
    """Whether each block ``s[i]`` is one contiguous run of memory (from the strides alone)."""
    shape, strides = s.shape[1:], s.stride()[1:]
    return all(n == 1 or st == math.prod(shape[i + 1:])
               for i, (n, st) in enumerate(zip(shape, strides)))
