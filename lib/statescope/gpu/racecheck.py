"""Kernel race probe for H-copy: can vLLM's Mamba-state copy kernels corrupt an in-place left shift?

What it does:
- ``shift_classes`` turns a model's conv geometry into the in-place shifts the runner can ask for
  (SD layout, rows = tokens): a bias of b accepted tokens moves the window left by
  ``b * conv_dim/tp * dtype_bytes`` bytes and copies ``(state_len - b)`` rows, with
  ``state_len = conv_kernel - 1 + num_spec_tokens``. Presets hold the reported Qwen3.5-27B geometry
  and the project's tiny model; ``sweep_shift_classes`` gives arbitrary byte shifts.
- ``probe_batch_memcpy`` drives vLLM's own ``batch_memcpy`` (looked up on the module at call time,
  so ``statescope.patches.overlap_safe`` is probed when installed) with many left-overlapping copies
  (src = dst + shift, random bytes) and counts copies that differ from a memmove of a snapshot.
- ``probe_fused_postprocess`` drives ``postprocess_mamba_fused_kernel`` with decision inputs that
  make every request shift its conv window inside its own block (src == dest, bias > 0).
- ``load_kernel_source`` compiles just the Triton kernels of another build's ``mamba_utils.py`` (how
  0.28.0's fused kernel was probed on a machine where only 0.26.0 installs).
- ``racecheck_table`` / ``results_frame`` tabulate counts with Clopper-Pearson intervals;
  ``add_racecheck_subcommand`` / ``racecheck_command`` are the ``statescope racecheck`` CLI.

What it deliberately does not do: probe anything on CPU (the CPU build copies with memmove, so there
is no race to find there: without CUDA it raises EnvironmentBroken), or claim the race happens in a
model run - it measures what the kernels do with the byte ranges a geometry can produce.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from statescope.errors import EnvironmentBroken, InputError

# Bytes one loop iteration of each kernel moves in vLLM 0.26.0 (batch_memcpy: BLOCK_SIZE=1024 u8;
# fused SD conv copy: COPY_BLOCK_SIZE=1024 u8). 0.28.0's fused conv copy moves 1024 u64 = 8192 B.
BATCH_MEMCPY_TILE_BYTES = 1024
FUSED_CONV_TILE_BYTES = {"0.26.0": 1024, "0.28.0": 8192}
SWEEP_SHIFT_BYTES = (2, 64, 128, 256, 576, 768, 1000, 1024, 2048)
SWEEP_COPY_BYTES = 4096
TABLE_COLUMNS = ["kernel", "shift_class", "shift_bytes", "copy_bytes", "below_tile", "n",
                 "corrupted", "rate", "ci_lo", "ci_hi", "patched"]


@dataclass(frozen=True)
class ConvGeometry:
    """A GDN layer's conv state geometry (full, before tensor parallelism)."""

    name: str
    conv_dim: int
    dtype_bytes: int
    conv_kernel: int
    num_spec_tokens: int


PRESETS: dict[str, ConvGeometry] = {
    # The report's model: conv dim 10240, bf16, kernel 4, MTP with 2 speculative tokens.
    "qwen35-27b": ConvGeometry("qwen35-27b", 10240, 2, 4, 2),
    # The project's tiny model (docs/tiny-model.md): 512 channels, bf16 -> 1024-byte rows.
    "tiny": ConvGeometry("tiny", 512, 2, 4, 2),
}


@dataclass(frozen=True)
class ShiftClass:
    """One in-place left shift: the copy moves ``copy_bytes`` from ``dst + shift_bytes`` to ``dst``."""

    name: str
    shift_bytes: int
    copy_bytes: int
    bias_tokens: int | None = None
    tp: int | None = None
    row_bytes: int | None = None
    window_bytes: int | None = None

    def below_tile(self, tile_bytes: int = BATCH_MEMCPY_TILE_BYTES) -> bool:
        """Can the shift race? Only when it is smaller than what one kernel iteration moves."""
        return self.shift_bytes < tile_bytes


def positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{what}: expected a positive integer, got {value!r}")
    return value


def shift_classes(conv_dim: int, dtype_bytes: int, conv_kernel: int, num_spec_tokens: int,
                  tp: int = 1, name: str = "model") -> list[ShiftClass]:
    """The in-place shifts (bias 1..num_spec_tokens) of one geometry at tensor-parallel degree ``tp``."""
    for value, what in ((conv_dim, "conv_dim"), (dtype_bytes, "dtype_bytes"),
                        (conv_kernel, "conv_kernel"), (num_spec_tokens, "num_spec_tokens"), (tp, "tp")):
        positive_int(value, what)
    if conv_dim % tp:
        raise InputError(f"tp: expected a divisor of conv_dim={conv_dim}, got {tp}")
    row = conv_dim // tp * dtype_bytes
    state_len = conv_kernel - 1 + num_spec_tokens
    return [ShiftClass(name=f"{name} tp{tp} bias{b}", shift_bytes=b * row, copy_bytes=(state_len - b) * row,
                       bias_tokens=b, tp=tp, row_bytes=row, window_bytes=state_len * row)
            for b in range(1, num_spec_tokens + 1)]


def preset_shift_classes(preset: str, tp: int = 1) -> list[ShiftClass]:
    """``shift_classes`` for a named preset (``tiny`` or ``qwen35-27b``)."""
    if preset not in PRESETS:
        raise InputError(f"--preset: expected one of {sorted(PRESETS)} or 'sweep', got {preset!r}")
    g = PRESETS[preset]
    return shift_classes(g.conv_dim, g.dtype_bytes, g.conv_kernel, g.num_spec_tokens, tp=tp, name=g.name)


def sweep_shift_classes(shifts: tuple[int, ...] = SWEEP_SHIFT_BYTES,
                        copy_bytes: int = SWEEP_COPY_BYTES) -> list[ShiftClass]:
    """Arbitrary byte shifts with a fixed copy size, to map where the kernel races."""
    positive_int(copy_bytes, "copy_bytes")
    return [ShiftClass(name=f"sweep {positive_int(s, 'shift')}B", shift_bytes=s, copy_bytes=copy_bytes)
            for s in shifts]


@dataclass
class ProbeResult:
    """Counts from one probe: ``corrupted`` of ``n`` copies differed from the memmove reference."""

    kernel: str
    shift_class: str
    shift_bytes: int
    copy_bytes: int
    n: int
    corrupted: int
    patched: bool
    tile_bytes: int = BATCH_MEMCPY_TILE_BYTES
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def require_cuda() -> Any:
    """Import torch and vLLM's mamba_utils on a CUDA machine, else raise EnvironmentBroken."""
    import statescope  # noqa: F401  (CPU shims before vLLM)
    import torch

    if not torch.cuda.is_available():
        raise EnvironmentBroken("racecheck needs a CUDA GPU: the CPU build copies Mamba state with "
                                "memmove, so there is no kernel race to probe here")
    try:
        from vllm.v1.worker import mamba_utils
    except Exception as exc:
        raise EnvironmentBroken(f"racecheck: cannot import vllm.v1.worker.mamba_utils: {exc}") from exc
    return mamba_utils


def load_kernel_source(path: str) -> Any:
    """A module holding only the Triton kernels (and constants) of some vLLM build's mamba_utils.py.

    For probing a build that cannot be imported where the GPU is (vLLM 0.28.0 pins a torch the
    device image lacks): its kernels are pure Triton, so they compile on their own. Nothing of vLLM
    is imported; the file is compiled under its own path so Triton can read the kernels' source.
    """
    import ast
    import types
    from pathlib import Path

    import torch
    import triton
    import triton.language as tl

    file = Path(path)
    if not file.is_file():
        raise InputError(f"{path}: expected a vLLM mamba_utils.py file")
    tree = ast.parse(file.read_text())
    keep = [n for n in tree.body
            if (isinstance(n, ast.FunctionDef) and any("triton.jit" in ast.unparse(d) for d in n.decorator_list))
            or (isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant))]
    if not any(getattr(n, "name", "") == "postprocess_mamba_fused_kernel" for n in keep):
        raise InputError(f"{path}: expected a postprocess_mamba_fused_kernel Triton kernel in it")
    mod = types.ModuleType(f"statescope_kernels_{file.stem}")
    mod.__file__ = str(file.resolve())
    mod.__dict__.update(triton=triton, tl=tl, torch=torch)
    exec(compile(ast.Module(body=keep, type_ignores=[]), mod.__file__, "exec"), mod.__dict__)
    return mod


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def slot_bytes(shift_bytes: int, copy_bytes: int) -> int:
    # Each copy owns a 1024-aligned slot, as a state block starts on an aligned address.
    return (shift_bytes + copy_bytes + 1023) // 1024 * 1024


def _count_bad(buf: Any, snap: Any, n: int, slot: int, shift: int, copy: int) -> int:
    """Copies whose slot differs from memmove(dst=slot start, src=slot start+shift, copy) of ``snap``."""
    got, want = buf.view(n, slot), snap.view(n, slot).clone()
    want[:, :copy] = snap.view(n, slot)[:, shift:shift + copy]  # clone source: a true memmove
    return int((got != want).any(dim=1).sum())


def probe_batch_memcpy(shift_bytes: int, copy_bytes: int, n_copies: int, device: Any = "cuda", *,
                       name: str = "", seed: int = 0, max_chunk_bytes: int = 2 << 30,
                       module: Any | None = None) -> ProbeResult:
    """Left-overlapping copies (src = dst + shift) through ``mamba_utils.batch_memcpy``; count corrupted.

    ``module`` stands in for ``vllm.v1.worker.mamba_utils`` (tests pass a CPU stand-in); by default
    the real one is imported, which needs CUDA.
    """
    import time

    import torch

    mamba_utils = module if module is not None else require_cuda()
    from statescope.patches.overlap_safe import is_installed

    for value, what in ((shift_bytes, "shift_bytes"), (copy_bytes, "copy_bytes"), (n_copies, "n_copies")):
        positive_int(value, what)
    slot = slot_bytes(shift_bytes, copy_bytes)
    per_launch = max(1, min(n_copies, max_chunk_bytes // slot))
    gen = torch.Generator(device=device).manual_seed(seed)
    bad, done, t0 = 0, 0, time.perf_counter()
    while done < n_copies:
        k = min(per_launch, n_copies - done)
        buf = torch.randint(0, 256, (k * slot,), dtype=torch.uint8, device=device, generator=gen)
        snap = buf.clone()
        dst = buf.data_ptr() + torch.arange(k, dtype=torch.int64, device=device) * slot
        sizes = torch.full((k,), copy_bytes, dtype=torch.int64, device=device)
        mamba_utils.batch_memcpy(dst + shift_bytes, dst, sizes)
        _sync(device)
        bad += _count_bad(buf, snap, k, slot, shift_bytes, copy_bytes)
        done += k
        del buf, snap
    return ProbeResult("batch_memcpy", name or f"{shift_bytes}B", shift_bytes, copy_bytes, n_copies, bad,
                       patched=is_installed(mamba_utils), seconds=time.perf_counter() - t0)


def _fused_launch(kernel: Any, k: int, row_bytes: int, dtype_bytes: int, state_len: int, bias: int,
                  block_size: int, device: Any, gen: Any) -> int:
    """One launch of ``k`` requests, each shifting its own block in place; returns corrupted blocks."""
    import torch

    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    block = state_len * row_bytes
    state = torch.randint(0, 256, ((k + 1) * block,), dtype=torch.uint8, device=device, generator=gen)
    snap = state.clone()
    table = torch.zeros((k, 4), **i32)
    table[:, 0] = torch.arange(1, k + 1, **i32)  # request i owns block i+1 (block 0 is null)
    # Decision inputs that give aligned == block_size, dest column 0 == running column 0, bias b:
    # running = computed + scheduled - drafts = block_size - b; new = running + accepted - 1.
    drafts = bias  # every draft accepted plus the bonus token: accepted = bias + 1
    full = lambda v: torch.full((k,), v, **i32)  # noqa: E731
    accepted, state_idx = full(bias + 1), full(0)
    scheduled, drafted, computed = full(1 + drafts), full(drafts), full(block_size - bias - 1)
    accepted_out = accepted.clone()
    kernel[(k, 1)](
        accepted, state_idx, scheduled, computed, drafted,
        torch.tensor([table.data_ptr()], **i64), table.stride(0),
        torch.tensor([state.data_ptr()], **i64), torch.tensor([block], **i64),
        torch.tensor([dtype_bytes], **i32), torch.tensor([row_bytes // dtype_bytes], **i64),
        torch.tensor([state_len], **i32), torch.tensor([0], **i32),
        torch.tensor([0], **i32), torch.tensor([0], **i64),
        accepted_out, None, k, block_size=block_size, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=False)
    _sync(device)
    if not bool((accepted_out == 1).all()):
        raise EnvironmentBroken("fused probe: the kernel did not take the src == dest path "
                                "(its decision logic differs from the one this probe was written for)")
    if not bool((state[:block] == snap[:block]).all()):
        raise EnvironmentBroken("fused probe: the null block was written")
    return _count_bad(state[block:], snap[block:], k, block, bias * row_bytes, (state_len - bias) * row_bytes)


def probe_fused_postprocess(row_bytes: int, dtype_bytes: int, state_len: int, bias: int, n_reqs: int,
                            device: Any = "cuda", *, name: str = "", seed: int = 0,
                            block_size: int = 16, tile_bytes: int = FUSED_CONV_TILE_BYTES["0.26.0"],
                            module: Any | None = None, kernel_name: str = "postprocess_mamba_fused_kernel",
                            max_chunk_bytes: int = 2 << 30) -> ProbeResult:
    """In-place conv shifts (src == dest block, bias > 0) through ``postprocess_mamba_fused_kernel``.

    Only the conv state is described to the kernel (one state, SD layout), so each request's program
    copies ``state[b, bias:] -> state[b, :state_len - bias]`` inside its own block ``b``.
    """
    import time

    import torch

    mamba_utils = module if module is not None else require_cuda()
    for value, what in ((row_bytes, "row_bytes"), (state_len, "state_len"), (bias, "bias"), (n_reqs, "n_reqs")):
        positive_int(value, what)
    if bias >= state_len or row_bytes % dtype_bytes:
        raise InputError(f"fused probe: expected bias < state_len={state_len} and row_bytes a multiple "
                         f"of dtype_bytes, got bias={bias}, row_bytes={row_bytes}")
    kernel = mamba_utils.postprocess_mamba_fused_kernel
    per_launch = max(1, min(n_reqs, max_chunk_bytes // (state_len * row_bytes)))
    gen = torch.Generator(device=device).manual_seed(seed)
    bad, done, t0 = 0, 0, time.perf_counter()
    while done < n_reqs:
        k = min(per_launch, n_reqs - done)
        bad += _fused_launch(kernel, k, row_bytes, dtype_bytes, state_len, bias, block_size, device, gen)
        done += k
    shift, copy = bias * row_bytes, (state_len - bias) * row_bytes
    return ProbeResult(kernel_name, name or f"fused {shift}B", shift, copy, n_reqs, bad,
                       patched=False, tile_bytes=tile_bytes, seconds=time.perf_counter() - t0)


def results_frame(results: list[ProbeResult], conf: float = 0.95) -> Any:
    """A DataFrame of probe results (``TABLE_COLUMNS``), rates with Clopper-Pearson intervals."""
    import pandas as pd

    from statescope.verdict.stats import clopper_pearson

    rows = []
    for r in results:
        lo, hi = clopper_pearson(r.corrupted, r.n, conf)
        rows.append({"kernel": r.kernel, "shift_class": r.shift_class, "shift_bytes": r.shift_bytes,
                     "copy_bytes": r.copy_bytes, "below_tile": r.shift_bytes < r.tile_bytes, "n": r.n,
                     "corrupted": r.corrupted, "rate": r.corrupted / r.n, "ci_lo": lo, "ci_hi": hi,
                     "patched": r.patched})
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def racecheck_table(classes: list[ShiftClass], n_copies: int, device: Any = "cuda",
                    patched_modes: tuple[bool, ...] = (False, True)) -> Any:
    """Probe every class through batch_memcpy, unpatched and/or with the overlap-safe wrapper."""
    from statescope.patches.overlap_safe import install_overlap_safe_copy, uninstall_overlap_safe_copy

    mamba_utils = require_cuda()
    results = []
    try:
        for patched in patched_modes:
            (install_overlap_safe_copy if patched else uninstall_overlap_safe_copy)(mamba_utils)
            results += [probe_batch_memcpy(c.shift_bytes, c.copy_bytes, n_copies, device, name=c.name)
                        for c in classes]
    finally:
        uninstall_overlap_safe_copy(mamba_utils)
    return results_frame(results)


