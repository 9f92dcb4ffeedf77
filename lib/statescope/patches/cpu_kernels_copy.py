"""The byte-moving half of statescope's CPU fused-copy stand-ins: registry, copy semantics, listeners.

What it does: the stand-ins (``statescope.patches.cpu_kernels``) get raw state and block-table addresses,
as a GPU kernel does. Rather than dereference them with ctypes (a wrong one would crash the
process), each is looked up in a registry of CPU tensors (``register_tensor``,
``register_state_tensors``; weak references, so an engine's caches die with it) and becomes a
bounds-checked byte view of that tensor's whole storage, so padded pages and conv/recurrent states
sharing one page buffer address exactly the runner's bytes; unknown addresses raise ``InputError``.
``copy_state`` makes one (layer, state type) copy for one request and reports a ``CopyEvent`` to
every listener (``add_copy_listener``: the capture plugin's API).

Copy semantics (``set_copy_semantics``): ``memmove`` (default, correct) reads each whole source
before writing. ``barrierless_tiles`` is a deterministic worst case of a tiled parallel copy with
no barrier between loads and stores: tiles of ``tile_bytes`` in ascending order; in a tile, byte
lanes from the highest address down, each loading then storing, so a lane reads what a higher lane
of its tile already stored. An in-place left shift by ``s`` bytes is corrupted exactly when
``0 < s < min(tile_bytes, copy length)``; copies between distinct blocks never are.
``release_gpu_order`` EMULATES the running release's own GPU ordering of in-block conv shifts
(``statescope.patches.cpu_kernels_releases``): barrier-less 0.28.0 tiles, memmove for 0.29.0 on.
Events carry the semantics actually applied to that copy.

What it deliberately does not do: emulate races between requests (a launch's copies run in
(request, state) order), model the GPU's alignment head/tail bytes, or launch anything.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from statescope.patches.cpu_kernels_releases import DEFAULT_RELEASE, KernelRelease, gpu_order_semantics
from statescope.errors import InputError

COPY_SEMANTICS = ("memmove", "barrierless_tiles", "release_gpu_order")
DEFAULT_TILE_BYTES = 1024
PRECOPY = "precopy_mamba_align_fused_kernel"
POSTPROCESS = "postprocess_mamba_fused_kernel"


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


active_semantics: list[Any] = ["memmove", DEFAULT_TILE_BYTES]
copy_listeners: list[Callable[[CopyEvent], None]] = []
# storage start address -> (weakref to an anchor tensor, storage byte length)
registered_regions: dict[int, tuple[weakref.ref, int]] = {}
# state tensor data_ptr -> (layer label, weakref to its anchor: a dead one means a stale label)
region_labels: dict[int, tuple[str, weakref.ref]] = {}
# the release whose kernels are installed: its GPU ordering and block-table row
active_release: list[KernelRelease] = [DEFAULT_RELEASE]


def set_copy_semantics(name: str, tile_bytes: int = DEFAULT_TILE_BYTES) -> None:
    """Select how the stand-ins copy bytes (``COPY_SEMANTICS``); ``name`` may be ``name:tile_bytes``."""
    if isinstance(name, str) and ":" in name:
        name, _, tile = name.partition(":")
        try:
            tile_bytes = int(tile)
        except ValueError:
            raise InputError(f"copy semantics {name}:{tile}: expected name[:tile_bytes]") from None
    if name not in COPY_SEMANTICS:
        raise InputError(f"copy semantics: expected one of {COPY_SEMANTICS}, got {name!r}")
    if isinstance(tile_bytes, bool) or not isinstance(tile_bytes, int) or tile_bytes <= 0:
        raise InputError(f"tile_bytes: expected a positive int, got {tile_bytes!r}")
    active_semantics[:] = [name, tile_bytes]

def get_copy_semantics() -> tuple[str, int]:
    """The selected (semantics name, tile bytes)."""
    return active_semantics[0], active_semantics[1]


def add_copy_listener(fn: Callable[[CopyEvent], None]) -> None:
    """Call ``fn(event)`` after every copy; listener exceptions propagate into the engine step."""
    if fn not in copy_listeners:
        copy_listeners.append(fn)


def remove_copy_listener(fn: Callable[[CopyEvent], None]) -> None:
    if fn in copy_listeners:
        copy_listeners.remove(fn)


def register_tensor(tensor: torch.Tensor, label: str | None = None) -> None:
    """Make the storage under ``tensor`` addressable; ``label`` names the layer of a state tensor."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise InputError(f"register_tensor: expected a CPU tensor, got {tensor!r:.80}")
    anchor = tensor if tensor._base is None else tensor._base  # views keep their base alive
    storage = tensor.untyped_storage()
    registered_regions[storage.data_ptr()] = (weakref.ref(anchor), storage.nbytes())
    if label is not None:
        region_labels[tensor.data_ptr()] = (label, weakref.ref(anchor))


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
    registered_regions.clear()
    region_labels.clear()


def _storage_bytes(addr: int, nbytes: int, what: str) -> tuple[torch.Tensor, int]:
    """(flat uint8 view of the storage holding [addr, addr+nbytes), offset of addr in it)."""
    for start, (ref, length) in list(registered_regions.items()):
        anchor = ref()
        if anchor is None:  # freed engine: forget it so a reused address is not misread
            del registered_regions[start]
            continue
        if start <= addr and addr + nbytes <= start + length:
            flat = torch.empty(0, dtype=torch.uint8).set_(anchor.untyped_storage())
            return flat, addr - start
    raise InputError(
        f"{what}: address {addr:#x} (+{nbytes} bytes) is not inside any registered tensor; "
        "install_cpu_kernels() before the engine's first step, or call register_state_tensors()")


def _label(addr: int) -> str | None:
    label, ref = region_labels.get(addr, (None, None))
    return label if ref is not None and ref() is not None else None


def _read_i32(addr: int, what: str) -> int:
    flat, off = _storage_bytes(addr, 4, what)
    return int(flat[off:off + 4].view(torch.int32).item())


def tiled_copy(flat: torch.Tensor, src: int, dst: int, n: int, tile: int) -> None:
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
          what: str, semantics: tuple[str, int]) -> None:
    span = (rows - 1) * row_stride + nbytes
    src_flat, src_off = _storage_bytes(src_addr, span, f"{what} source")
    dst_flat, dst_off = _storage_bytes(dst_addr, span, f"{what} destination")
    name, tile = semantics
    same_storage = src_flat.data_ptr() == dst_flat.data_ptr()
    if name == "barrierless_tiles" and same_storage:
        for r in range(rows):  # rows in order, as the DS loop runs them
            tiled_copy(dst_flat, src_off + r * row_stride, dst_off + r * row_stride, nbytes, tile)
        return
    src = src_flat.as_strided((rows, nbytes), (row_stride, 1), src_off)
    dst = dst_flat.as_strided((rows, nbytes), (row_stride, 1), dst_off)
    dst.copy_(src.clone() if same_storage else src)  # clone: read everything before writing


_LAYOUT_ARGS = ("block_table_ptrs_ptr", "block_table_stride_req", "state_base_addrs_ptr",
                "state_block_strides_ptr", "state_elem_sizes_ptr", "state_inner_sizes_ptr",
                "state_conv_widths_ptr", "state_group_indices_ptr", "state_dim_row_count_ptr",
                "state_dim_row_stride_ptr")


@dataclass(frozen=True)
class CopyLayout:
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
    copy_block_size: int

    @classmethod
    def read(cls, launch_args: dict[str, Any]) -> CopyLayout:
        """From a kernel's arguments by name (both kernels share these parameter names)."""
        tables, stride, *state = (launch_args[n] for n in _LAYOUT_ARGS)
        return cls(tables.tolist(), int(stride), *(t.tolist() for t in state),
                   bool(launch_args["CONV_STATE_DIM_FIRST"]), int(launch_args["COPY_BLOCK_SIZE"]))


def _effective_semantics(is_conv: bool, lay: CopyLayout) -> tuple[str, int]:
    """The (semantics, tile bytes) one copy runs with: ``release_gpu_order`` resolves per release
    for conv states; recurrent copies never overlap their source, so memmove is exact for them."""
    name, tile = active_semantics
    if name != "release_gpu_order":
        return name, tile
    if not is_conv:
        return "memmove", tile
    return gpu_order_semantics(active_release[0], lay.dim_first, lay.copy_block_size)


def copy_state(kernel: str, lay: CopyLayout, s: int, batch_row: int, req_slot: int,
                src_col: int, dst_col: int, bias: int) -> None:
    """Copy one (layer, state type) block for one request, then report it."""
    row = req_slot if active_release[0].block_table_row == "req" else batch_row
    table = lay.block_table_ptrs[lay.group[s]] + row * lay.block_table_stride * 4
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
    semantics = _effective_semantics(width > 0, lay)
    if nbytes > 0:
        _move(base + src_off, base + dst_off, nbytes, rows, row_stride, what, semantics)
    if copy_listeners:
        event = CopyEvent(kernel, s, _label(base), "conv" if width > 0 else "ssm", batch_row,
                          req_slot, src_col, dst_col, src_block, dst_block, bias, base, src_off,
                          dst_off, nbytes, rows, row_stride, *semantics)
        for fn in list(copy_listeners):
            fn(event)
