"""CPU stand-ins for vLLM 0.28.0's two fused align-mode Mamba state-copy Triton kernels.

What it does: the CPU build of vLLM replaces most Triton kernels but not
``precopy_mamba_align_fused_kernel`` / ``postprocess_mamba_fused_kernel`` (module attributes of
``vllm.v1.worker.mamba_utils``, launched as ``kernel[grid](...)`` by the
``MambaSpecDecodeGPUContext.run_fused_*`` methods), so prefix caching + align mode + speculative
decoding dies at the first step. ``install_cpu_kernels()`` puts a ``CpuKernel`` under each name;
``CpuKernel[grid]`` returns a callable with the Triton launch signature, so the runner's launch
code runs unchanged while the kernel semantics (copy decisions, block-table lookups, conv shift by
the accepted-token bias, recurrent copy from column ``src + bias``, SD/DS conv layouts, padded
page strides) are reimplemented here.

Addresses (the design choice): the kernels get raw state and block-table base addresses in int64
metadata tensors, as on a GPU. Rather than dereference them with ctypes (a wrong one would crash
the process), each is looked up in a registry of CPU tensors and becomes a bounds-checked byte
view of that tensor's whole storage, so padded pages and conv/recurrent states sharing one page
buffer address exactly the runner's bytes. ``install_cpu_kernels`` wraps
``MambaSpecDecodeGPUContext.initialize_from_forward_context`` (run lazily before the first fused
launch) to register the forward context's state tensors, labelled by layer, and the block tables
it binds; ``register_state_tensors`` does it by hand. Unknown addresses raise ``InputError``; the
registry holds weak references, so an engine's caches die with it.

Copy semantics (``set_copy_semantics``, or env ``STATESCOPE_COPY_SEMANTICS=name[:tile_bytes]`` read
by ``install_cpu_kernels``): ``memmove`` (default, correct) reads each whole source before writing.
``barrierless_tiles`` is a deterministic worst case of a tiled parallel copy with no barrier
between loads and stores: tiles of ``tile_bytes`` run in ascending order (the kernel's loop); in a
tile, byte lanes run from the highest address down, each loading then storing, so a lane reads
what a higher lane of its tile already stored. An in-place left shift by ``s`` bytes (same
physical block, bias > 0) is corrupted exactly when ``0 < s < min(tile_bytes, copy length)``;
copies between distinct blocks never are. 1024 models ``batch_memcpy``'s tile; 0.28.0's fused conv
copy moves 1024 u64 words (8 KiB) per iteration, so ``tile_bytes=8192`` models that kernel.
Listeners (``add_copy_listener``) get a ``CopyEvent`` per copy.

What it deliberately does not do: emulate races between requests (a launch's copies run in
(request, state) order), model the GPU's alignment head/tail bytes, touch the scalar
``batch_memcpy`` path, or accept vLLM versions other than 0.28.0 (``EnvironmentBroken`` says why).
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from statescope.errors import EnvironmentBroken, InputError

COPY_SEMANTICS = ("memmove", "barrierless_tiles")
DEFAULT_TILE_BYTES = 1024
SUPPORTED_VLLM_VERSIONS = ("0.28.0",)
ENV_SEMANTICS = "STATESCOPE_COPY_SEMANTICS"
PRECOPY = "precopy_mamba_align_fused_kernel"
POSTPROCESS = "postprocess_mamba_fused_kernel"
T = torch.Tensor  # keeps the Triton-shaped signatures readable


@dataclass(frozen=True)
class CopyEvent:
    """One state copy made by a kernel stand-in; offsets are bytes from the state's base address."""

    kernel: str  # PRECOPY or POSTPROCESS
    state_index: int  # flattened (layer, state type) index of the launch metadata
    layer_name: str | None  # from the registry; None when registered without a label
    state_kind: str  # "conv" or "ssm"
    batch_row: int
    req_slot: int
    src_col: int
    dst_col: int
    src_block: int  # physical block ids (conv: block of src_col; ssm: of src_col + bias)
    dst_block: int
    bias: int
    state_base_addr: int  # identifies the state tensor
    src_offset: int
    dst_offset: int
    nbytes: int  # bytes per row; 0 when bias >= conv width leaves nothing to copy
    rows: int  # 1, or the conv dim for the DS conv layout
    row_stride: int
    semantics: str
    tile_bytes: int

    @property
    def in_place_shift(self) -> bool:
        """The H-copy shape: a conv window shifted inside one physical block."""
        return self.state_kind == "conv" and self.src_block == self.dst_block and self.bias > 0


_semantics: list[Any] = ["memmove", DEFAULT_TILE_BYTES]
_listeners: list[Callable[[CopyEvent], None]] = []
# storage start address -> (weakref to an anchor tensor, storage byte length)
_regions: dict[int, tuple[weakref.ref, int]] = {}
# state tensor data_ptr -> (layer label, weakref to its anchor: a dead one means a stale label)
_labels: dict[int, tuple[str, weakref.ref]] = {}
_originals: dict[str, Any] = {}


def set_copy_semantics(name: str, tile_bytes: int = DEFAULT_TILE_BYTES) -> None:
    """Select how the stand-ins copy bytes: ``memmove`` or ``barrierless_tiles``."""
    if name not in COPY_SEMANTICS:
        raise InputError(f"copy semantics: expected one of {COPY_SEMANTICS}, got {name!r}")
    if isinstance(tile_bytes, bool) or not isinstance(tile_bytes, int) or tile_bytes <= 0:
        raise InputError(f"tile_bytes: expected a positive int, got {tile_bytes!r}")
    _semantics[:] = [name, tile_bytes]


def get_copy_semantics() -> tuple[str, int]:
    """The selected (semantics name, tile bytes)."""
    return _semantics[0], _semantics[1]


def add_copy_listener(fn: Callable[[CopyEvent], None]) -> None:
    """Call ``fn(event)`` after every copy; listener exceptions propagate into the engine step."""
    if fn not in _listeners:
        _listeners.append(fn)


def remove_copy_listener(fn: Callable[[CopyEvent], None]) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


def register_tensor(tensor: torch.Tensor, label: str | None = None) -> None:
    """Make the storage under ``tensor`` addressable; ``label`` names the layer of a state tensor."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise InputError(f"register_tensor: expected a CPU tensor, got {tensor!r:.80}")
    anchor = tensor if tensor._base is None else tensor._base  # views keep their base alive
    storage = tensor.untyped_storage()
    _regions[storage.data_ptr()] = (weakref.ref(anchor), storage.nbytes())
    if label is not None:
        _labels[tensor.data_ptr()] = (label, weakref.ref(anchor))


def register_state_tensors(ctx: Any, kv_cache_config: Any, forward_context: dict[str, Any],
                           block_tables: Sequence[torch.Tensor]) -> None:
    """Register a ``MambaSpecDecodeGPUContext``'s state tensors (labelled) and block tables."""
    for group_id in ctx.mamba_group_ids:
        for layer_name in kv_cache_config.kv_cache_groups[group_id].layer_names:
            for state in forward_context[layer_name].kv_cache:
                register_tensor(state, layer_name)
    for table in block_tables:
        register_tensor(table)


def clear_registry() -> None:
    _regions.clear()
    _labels.clear()


def _storage_bytes(addr: int, nbytes: int, what: str) -> tuple[torch.Tensor, int]:
    """(flat uint8 view of the storage holding [addr, addr+nbytes), offset of addr in it)."""
    for start, (ref, length) in list(_regions.items()):
        anchor = ref()
        if anchor is None:  # freed engine: forget it so a reused address is not misread
            del _regions[start]
            continue
        if start <= addr and addr + nbytes <= start + length:
            flat = torch.empty(0, dtype=torch.uint8).set_(anchor.untyped_storage())
            return flat, addr - start
    raise InputError(
        f"{what}: address {addr:#x} (+{nbytes} bytes) is not inside any registered tensor; "
        "install_cpu_kernels() before the engine's first step, or call register_state_tensors()")


def _label(addr: int) -> str | None:
    label, ref = _labels.get(addr, (None, None))
    return label if ref is not None and ref() is not None else None


def _read_i32(addr: int, what: str) -> int:
    flat, off = _storage_bytes(addr, 4, what)
    return int(flat[off:off + 4].view(torch.int32).item())


def _tiled_copy(flat: torch.Tensor, src: int, dst: int, n: int, tile: int) -> None:
    """``barrierless_tiles`` on one row: ascending tiles, lanes high-to-low inside each tile."""
    delta = src - dst
    for start in range(0, n, tile):
        m = min(tile, n - start)
        lane = torch.arange(m, dtype=torch.int64)
        if 0 < delta < m:
            # Lane j reads dst[j + delta], which lane j + delta already overwrote with the byte it
            # read, and so on until the chain leaves the tile: ceil((m - j) / delta) hops.
            read = lane + delta * torch.div(m - lane + delta - 1, delta, rounding_mode="floor")
        else:
            read = lane + delta
        flat[dst + start:dst + start + m] = flat[dst + start + read]


def _move(src_addr: int, dst_addr: int, nbytes: int, rows: int, row_stride: int,
          what: str) -> None:
    span = (rows - 1) * row_stride + nbytes
    src_flat, src_off = _storage_bytes(src_addr, span, f"{what} source")
    dst_flat, dst_off = _storage_bytes(dst_addr, span, f"{what} destination")
    name, tile = _semantics
    same_storage = src_flat.data_ptr() == dst_flat.data_ptr()
    if name == "barrierless_tiles" and same_storage:
        for r in range(rows):  # rows in order, as the DS loop runs them
            _tiled_copy(dst_flat, src_off + r * row_stride, dst_off + r * row_stride, nbytes, tile)
        return
    src = src_flat.as_strided((rows, nbytes), (row_stride, 1), src_off)
    dst = dst_flat.as_strided((rows, nbytes), (row_stride, 1), dst_off)
    dst.copy_(src.clone() if same_storage else src)  # clone: read everything before writing


_LAYOUT_ARGS = ("block_table_ptrs_ptr", "block_table_stride_req", "state_base_addrs_ptr",
                "state_block_strides_ptr", "state_elem_sizes_ptr", "state_inner_sizes_ptr",
                "state_conv_widths_ptr", "state_group_indices_ptr", "state_dim_row_count_ptr",
                "state_dim_row_stride_ptr")


@dataclass(frozen=True)
class _Layout:
    """The flattened per-state metadata of one launch, read once into Python ints."""

    block_table_ptrs: list[int]
    block_table_stride: int
    base: list[int]
    block_stride: list[int]
    elem: list[int]
    inner: list[int]
    conv_width: list[int]
    group: list[int]
    dim_rows: list[int]
    row_stride: list[int]
    dim_first: bool

    @classmethod
    def read(cls, launch_args: dict[str, Any]) -> _Layout:
        """From a kernel's arguments by name (both kernels share these parameter names)."""
        tables, stride, *state = (launch_args[n] for n in _LAYOUT_ARGS)
        return cls(tables.tolist(), int(stride), *(t.tolist() for t in state),
                   bool(launch_args["CONV_STATE_DIM_FIRST"]))


def _copy_state(kernel: str, lay: _Layout, s: int, batch_row: int, req_slot: int,
                src_col: int, dst_col: int, bias: int) -> None:
    """Copy one (layer, state type) block for one request, then report it."""
    table = lay.block_table_ptrs[lay.group[s]] + batch_row * lay.block_table_stride * 4
    base, stride, elem = lay.base[s], lay.block_stride[s], lay.elem[s]
    width = lay.conv_width[s]
    what = f"{kernel} state {s}"
    dst_block = _read_i32(table + dst_col * 4, f"{what} block table")
    rows, row_stride = 1, 0
    if width > 0:
        src_block = _read_i32(table + src_col * 4, f"{what} block table")
        if lay.dim_first:  # DS: (conv_dim, state_len) per block; shift along each dim row
            rows, row_stride = lay.dim_rows[s], lay.row_stride[s]
            token_bytes = elem
        else:  # SD: (state_len, conv_dim) per block; a token is one contiguous row
            token_bytes = lay.inner[s] * elem
        src_off = src_block * stride + bias * token_bytes
        nbytes = max(0, (width - bias) * token_bytes)
    else:  # recurrent state: the whole block of the accepted column
        src_block = _read_i32(table + (src_col + bias) * 4, f"{what} block table")
        src_off = src_block * stride
        nbytes = lay.inner[s] * elem  # natural size, not the (possibly padded) page stride
    dst_off = dst_block * stride
    if nbytes > 0:
        _move(base + src_off, base + dst_off, nbytes, rows, row_stride, what)
    if _listeners:
        event = CopyEvent(kernel, s, _label(base), "conv" if width > 0 else "ssm", batch_row,
                          req_slot, src_col, dst_col, src_block, dst_block, bias, base, src_off,
                          dst_off, nbytes, rows, row_stride, _semantics[0], _semantics[1])
        for fn in list(_listeners):
            fn(event)


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
    lay = _Layout.read(locals())
    rows, total_states = _grid_dims(grid)
    mapping = idx_mapping_ptr.tolist() if HAS_IDX_MAPPING else None
    dst_cols, src_cols, biases = (t.tolist() for t in (mamba_state_idx_ptr, src_col_ptr,
                                                       token_bias_ptr))
    for batch_row in range(min(rows, int(num_reqs))):
        req = mapping[batch_row] if mapping is not None else batch_row
        if req < 0 or src_cols[req] < 0 or src_cols[req] == dst_cols[req]:
            continue  # skipped slot, fresh state, or still inside the same block
        for s in range(total_states):
            _copy_state(PRECOPY, lay, s, batch_row, req, src_cols[req], dst_cols[req],
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
    lay = _Layout.read(locals())
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
            _copy_state(POSTPROCESS, lay, s, batch_row, req, src_col, dst_col, bias)


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
        tile_bytes = int(tile) if tile else _semantics[1]
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
    if version not in SUPPORTED_VLLM_VERSIONS:
        problems.insert(0, f"statescope.cpu_kernels supports vLLM {SUPPORTED_VLLM_VERSIONS}; "
                           "its kernel semantics were not checked against this version")
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

    _check_vllm(mamba_utils, getattr(vllm, "__version__", "unknown"))
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
                                    mamba_state_copy_funcs: Any, block_tables: Any) -> None:
            init(self, kv_cache_config, forward_context, mamba_state_copy_funcs, block_tables)
            register_state_tensors(self, kv_cache_config, forward_context, block_tables)

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
    return True


def is_installed() -> bool:
    """Whether both stand-ins currently sit in ``vllm.v1.worker.mamba_utils``."""
    module = sys.modules.get("vllm.v1.worker.mamba_utils")
    return module is not None and all(getattr(module, n, None) is k for n, k in _KERNELS.items())
