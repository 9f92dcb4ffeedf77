"""Overlap-safe Mamba state copies: a runtime patch for the H-copy race in vLLM builds before 0.29.0.

What it does: ``install_overlap_safe_copy()`` replaces the module attribute
``vllm.v1.worker.mamba_utils.batch_memcpy`` (the runner's scalar copy path, reached through
``do_mamba_copy_block``, looks it up there at call time) with a wrapper. The wrapper reads the batch's
pointers and sizes back to the host (one small device-to-host copy per call), sends every copy whose
source and destination ranges are disjoint to the original kernel unchanged, and stages every
overlapping copy through a scratch buffer: source -> scratch, then scratch -> destination, as two
launches of the original kernel on the same stream. Neither launch has overlapping ranges, and stream
order puts every read of the first before every write of the second, so the result is a memmove.
``uninstall_overlap_safe_copy()`` restores the original; both are idempotent.

What it deliberately does not do: patch the fused post-process / pre-copy Triton kernels (their
copy decision is made on the device; intercepting it would need a sync per step or a kernel of our
own), order copies *between* entries of one batch (the original kernel runs them unordered too), or
hide its cost: the read-back is a host sync each time ``batch_memcpy`` is called.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from statescope.errors import EnvironmentBroken

MAMBA_UTILS = "vllm.v1.worker.mamba_utils"
_ORIGINAL_ATTR = "_statescope_original_batch_memcpy"

CopyKernel = Callable[[Any, Any, Any], None]


def overlapping_mask(src: Any, dst: Any, sizes: Any) -> Any:
    """Bool tensor: copy i's byte ranges [src, src+size) and [dst, dst+size) intersect (src != dst)."""
    nonempty = sizes > 0
    return nonempty & (src != dst) & (src < dst + sizes) & (dst < src + sizes)


def overlap_safe_batch_memcpy(src_ptrs: Any, dst_ptrs: Any, sizes: Any, *, kernel: CopyKernel) -> None:
    """Do the batch of raw-pointer copies with ``kernel``, staging overlapping ones through scratch.

    ``src_ptrs``/``dst_ptrs``/``sizes`` are 1-D int64 tensors (addresses and byte counts) on the
    kernel's device, as vLLM's ``batch_memcpy`` takes them. ``kernel`` must be exact for disjoint
    ranges; nothing else is assumed of it (the tests use a CPU stand-in that corrupts overlaps).
    """
    import torch

    n = int(src_ptrs.shape[0])
    if n == 0:
        return
    meta = torch.stack([src_ptrs, dst_ptrs, sizes]).to("cpu")  # the one sync
    src, dst, size = meta[0], meta[1], meta[2]
    overlap = overlapping_mask(src, dst, size)
    if not bool(overlap.any()):
        kernel(src_ptrs, dst_ptrs, sizes)
        return
    device = src_ptrs.device
    disjoint = (~overlap).nonzero().flatten()
    if disjoint.numel():
        idx = disjoint.to(device)
        kernel(src_ptrs[idx].contiguous(), dst_ptrs[idx].contiguous(), sizes[idx].contiguous())
    ov_src, ov_dst, ov_size = src[overlap], dst[overlap], size[overlap]
    # Each staged copy gets its own 256-byte-aligned slot so the kernel's accesses stay aligned.
    slot = (ov_size + 255) // 256 * 256
    offsets = torch.cumsum(slot, 0) - slot
    scratch = torch.empty(int(slot.sum()), dtype=torch.uint8, device=device)
    stage = offsets + scratch.data_ptr()
    as_dev = [t.to(device) for t in (ov_src, ov_dst, ov_size, stage)]
    kernel(as_dev[0], as_dev[3], as_dev[2])  # source -> scratch: disjoint
    kernel(as_dev[3], as_dev[1], as_dev[2])  # scratch -> destination: disjoint, ordered after
    # Freeing ``scratch`` here is safe: the caching allocator reuses it only in stream order.


def _mamba_utils() -> Any:
    try:
        import statescope  # noqa: F401  (CPU shims must precede vLLM's import)

        return importlib.import_module(MAMBA_UTILS)
    except Exception as exc:  # vLLM missing or broken: there is nothing to patch
        raise EnvironmentBroken(f"overlap_safe: cannot import {MAMBA_UTILS}: {exc}") from exc


def is_installed(module: Any | None = None) -> bool:
    """True when ``batch_memcpy`` in ``module`` (default: vLLM's mamba_utils) is the overlap-safe wrapper."""
    mod = module if module is not None else sys.modules.get(MAMBA_UTILS)
    return mod is not None and hasattr(mod, _ORIGINAL_ATTR)


def install_overlap_safe_copy(module: Any | None = None) -> bool:
    """Wrap ``module.batch_memcpy`` (default: vLLM's mamba_utils). Returns False if already installed."""
    mod = module if module is not None else _mamba_utils()
    if is_installed(mod):
        return False
    original = getattr(mod, "batch_memcpy", None)
    if original is None:
        raise EnvironmentBroken(f"overlap_safe: {getattr(mod, '__name__', mod)} has no batch_memcpy "
                                "(this vLLM build copies Mamba state differently)")

    def batch_memcpy(src_ptrs: Any, dst_ptrs: Any, sizes: Any) -> None:
        overlap_safe_batch_memcpy(src_ptrs, dst_ptrs, sizes, kernel=original)

    batch_memcpy.__doc__ = "statescope overlap-safe wrapper around vLLM's batch_memcpy"
    batch_memcpy.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(mod, _ORIGINAL_ATTR, original)
    mod.batch_memcpy = batch_memcpy
    return True


def uninstall_overlap_safe_copy(module: Any | None = None) -> bool:
    """Restore the original ``batch_memcpy``. Returns False if the wrapper was not installed."""
    mod = module if module is not None else sys.modules.get(MAMBA_UTILS)
    if not is_installed(mod):
        return False
    mod.batch_memcpy = getattr(mod, _ORIGINAL_ATTR)
    delattr(mod, _ORIGINAL_ATTR)
    return True
