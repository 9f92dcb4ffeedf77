"""CPU tests of the H-copy race probe (statescope.gpu.racecheck) and the overlap-safe copy patch.

No GPU here: the copy "kernels" are CPU stand-ins that move bytes between raw addresses in a fixed,
hostile order, so an overlapping copy through them is corrupted the way an unordered GPU copy can be.
The committed H200 results (data/results/gpu/racecheck/*.json) are checked for shape and content.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from statescope.patches import overlap_safe
from statescope.gpu import racecheck
from statescope.errors import EnvironmentBroken, InputError
from statescope.verdict.stats import clopper_pearson

torch.set_num_threads(1)
RESULTS = Path(__file__).resolve().parents[1] / "data" / "results" / "gpu" / "racecheck"


def _bytes_at(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


def descending_copy(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor) -> None:
    """Byte by byte from the top down: exact for disjoint ranges, corrupts left shifts (src > dst)."""
    for s, d, n in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
        if n:
            lo, hi = min(s, d), max(s, d) + n
            mem = _bytes_at(lo, hi - lo)
            for j in range(n - 1, -1, -1):
                mem[d - lo + j] = mem[s - lo + j]


def ascending_copy(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor) -> None:
    """Byte by byte from the bottom up: corrupts right shifts (dst > src)."""
    for s, d, n in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
        if n:
            lo, hi = min(s, d), max(s, d) + n
            mem = _bytes_at(lo, hi - lo)
            for j in range(n):
                mem[d - lo + j] = mem[s - lo + j]


def _batch(buf: torch.Tensor, copies: list[tuple[int, int, int]]) -> tuple[torch.Tensor, ...]:
    base = buf.data_ptr()
    return (torch.tensor([base + s for s, _, _ in copies], dtype=torch.int64),
            torch.tensor([base + d for _, d, _ in copies], dtype=torch.int64),
            torch.tensor([n for _, _, n in copies], dtype=torch.int64))


def _memmove_reference(buf: torch.Tensor, copies: list[tuple[int, int, int]]) -> torch.Tensor:
    want = buf.clone()
    for s, d, n in copies:
        want[d:d + n] = want[s:s + n].clone()
    return want


# --- shift-class arithmetic -------------------------------------------------------------------

def test_tiny_model_rows_are_1024_bytes() -> None:
    classes = racecheck.preset_shift_classes("tiny", tp=1)
    assert [c.row_bytes for c in classes] == [1024, 1024]
    assert [c.shift_bytes for c in classes] == [1024, 2048]
    # state_len = 4 - 1 + 2 = 5 rows; a bias-b shift copies the 5 - b rows after the bias
    assert [c.copy_bytes for c in classes] == [4 * 1024, 3 * 1024]
    assert {c.window_bytes for c in classes} == {5 * 1024}
    assert not any(c.below_tile() for c in classes)  # 1 KiB shift == the 1 KiB tile: no race


@pytest.mark.parametrize("tp, row", [(1, 20480), (2, 10240), (4, 5120)])
def test_qwen35_27b_one_token_shift_per_tp(tp: int, row: int) -> None:
    b1, b2 = racecheck.preset_shift_classes("qwen35-27b", tp=tp)
    assert (b1.shift_bytes, b2.shift_bytes) == (row, 2 * row)
    assert (b1.copy_bytes, b2.copy_bytes) == (4 * row, 3 * row)
    assert b1.bias_tokens == 1 and b1.tp == tp
    assert not b1.below_tile(racecheck.BATCH_MEMCPY_TILE_BYTES)
    # 0.28.0's fused conv copy moves 8 KiB per iteration: only TP=4's 5 KiB shift is below it
    assert b1.below_tile(racecheck.FUSED_CONV_TILE_BYTES["0.28.0"]) == (tp == 4)


def test_generic_geometry_and_bad_input() -> None:
    (c,) = racecheck.shift_classes(conv_dim=288, dtype_bytes=2, conv_kernel=4, num_spec_tokens=1)
    assert (c.shift_bytes, c.copy_bytes, c.below_tile()) == (576, 3 * 576, True)
    with pytest.raises(InputError, match="tp"):
        racecheck.shift_classes(10240, 2, 4, 2, tp=3)
    with pytest.raises(InputError, match="conv_dim"):
        racecheck.shift_classes(0, 2, 4, 2)
    with pytest.raises(InputError, match="--preset"):
        racecheck.preset_shift_classes("llama")


def test_sweep_marks_shifts_below_the_tile() -> None:
    sweep = racecheck.sweep_shift_classes()
    assert [c.shift_bytes for c in sweep] == list(racecheck.SWEEP_SHIFT_BYTES)
    assert [c.shift_bytes for c in sweep if c.below_tile()] == [2, 64, 128, 256, 576, 768, 1000]


# --- table ------------------------------------------------------------------------------------

def test_results_frame_format() -> None:
    rows = [racecheck.ProbeResult("batch_memcpy", "sweep 64B", 64, 4096, 1000, 37, patched=False),
            racecheck.ProbeResult("batch_memcpy", "sweep 64B", 64, 4096, 1000, 0, patched=True),
            racecheck.ProbeResult("postprocess_mamba_fused_kernel", "f", 2048, 3072, 10, 0, False)]
    df = racecheck.results_frame(rows)
    assert list(df.columns) == racecheck.TABLE_COLUMNS
    assert df["rate"].tolist() == [0.037, 0.0, 0.0]
    assert (df.loc[0, "ci_lo"], df.loc[0, "ci_hi"]) == pytest.approx(clopper_pearson(37, 1000))
    assert df["below_tile"].tolist() == [True, True, False]
    assert df["patched"].tolist() == [False, True, False]


# --- CLI without CUDA -------------------------------------------------------------------------

def test_cli_fails_cleanly_without_cuda() -> None:
    from statescope.cli import gpu as gpu_cli

    assert not torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="statescope")
    gpu_cli.add_racecheck_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["racecheck", "--preset", "qwen35-27b", "--tp", "2", "--copies", "10", "--json"])
    assert args.func is gpu_cli.racecheck_command and args.tp == 2
    with pytest.raises(EnvironmentBroken) as exc:
        args.func(args)
    msg = str(exc.value)
    assert "CUDA" in msg and "\n" not in msg
    with pytest.raises(InputError, match="--preset"):
        args.func(parser.parse_args(["racecheck", "--preset", "nope"]))


# --- kernels from another build's source ------------------------------------------------------

def test_load_kernel_source_compiles_only_the_triton_kernels(tmp_path: Path) -> None:
    import importlib.util

    vllm_dir = Path(importlib.util.find_spec("vllm").origin).parent  # locates, does not import vLLM
    mod = racecheck.load_kernel_source(str(vllm_dir / "v1" / "worker" / "mamba_utils.py"))
    assert {"postprocess_mamba_fused_kernel", "batch_memcpy_kernel"} <= set(vars(mod))
    assert not hasattr(mod, "batch_memcpy")  # plain Python of vLLM is left out
    assert hasattr(mod.postprocess_mamba_fused_kernel, "run")  # a Triton JITFunction
    with pytest.raises(InputError, match="expected a vLLM mamba_utils.py"):
        racecheck.load_kernel_source(str(tmp_path / "missing.py"))
    (tmp_path / "plain.py").write_text("X = 1\ndef f():\n    return X\n")
    with pytest.raises(InputError, match="postprocess_mamba_fused_kernel"):
        racecheck.load_kernel_source(str(tmp_path / "plain.py"))


# --- the overlap-safe wrapper -----------------------------------------------------------------

COPIES = [(64, 0, 300),      # left shift by 64 inside one range (the H-copy pattern)
          (1000, 1003, 200),  # right shift by 3
          (2000, 3000, 500),  # disjoint
          (3600, 3600, 50),   # src == dst: a no-op, not an overlap
          (3700, 3800, 0)]    # empty


@pytest.mark.parametrize("kernel", [descending_copy, ascending_copy])
def test_stand_in_kernels_corrupt_overlaps(kernel) -> None:
    """Guard for the next test: unwrapped, each stand-in gets some overlapping copy wrong."""
    buf = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    want = _memmove_reference(buf, COPIES)
    kernel(*_batch(buf, COPIES))
    assert not torch.equal(buf, want)
    assert torch.equal(buf[3000:3500], want[3000:3500])  # the disjoint copy is right


@pytest.mark.parametrize("kernel", [descending_copy, ascending_copy])
def test_overlap_safe_wrapper_is_exact(kernel) -> None:
    buf = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    want = _memmove_reference(buf, COPIES)
    calls: list[int] = []

    def counting(src, dst, sizes):
        calls.append(int(src.shape[0]))
        kernel(src, dst, sizes)

    overlap_safe.overlap_safe_batch_memcpy(*_batch(buf, COPIES), kernel=counting)
    assert torch.equal(buf, want)
    assert calls == [3, 2, 2]  # disjoint/no-op/empty in one launch; two overlaps staged in two


def test_overlapping_mask() -> None:
    src, dst, sizes = (torch.tensor(v) for v in ([64, 1000, 2000, 3600, 3700], [0, 1003, 3000, 3600, 3800],
                                                 [300, 200, 500, 50, 0]))
    assert overlap_safe.overlapping_mask(src, dst, sizes).tolist() == [True, True, False, False, False]


def _fake_mamba_utils(kernel) -> types.ModuleType:
    mod = types.ModuleType("fake_mamba_utils")
    mod.batch_memcpy = kernel
    return mod


def test_install_is_idempotent_and_uninstalls() -> None:
    mod = _fake_mamba_utils(descending_copy)
    assert overlap_safe.install_overlap_safe_copy(mod) is True
    wrapped = mod.batch_memcpy
    assert overlap_safe.install_overlap_safe_copy(mod) is False and mod.batch_memcpy is wrapped
    assert overlap_safe.is_installed(mod) and wrapped.__wrapped__ is descending_copy
    assert overlap_safe.uninstall_overlap_safe_copy(mod) is True
    assert mod.batch_memcpy is descending_copy and not overlap_safe.is_installed(mod)
    assert overlap_safe.uninstall_overlap_safe_copy(mod) is False
    with pytest.raises(EnvironmentBroken, match="batch_memcpy"):
        overlap_safe.install_overlap_safe_copy(types.ModuleType("no_copy"))


def test_probe_counts_corruption_and_patch_removes_it() -> None:
    """The probe, driven through a racy CPU stand-in: every copy corrupted unpatched, none patched."""
    mod = _fake_mamba_utils(descending_copy)
    raw = racecheck.probe_batch_memcpy(64, 256, 12, "cpu", module=mod, name="stand-in 64B")
    assert (raw.corrupted, raw.n, raw.patched) == (12, 12, False)
    exact = racecheck.probe_batch_memcpy(300, 256, 12, "cpu", module=mod)  # shift >= size: disjoint
    assert exact.corrupted == 0
    overlap_safe.install_overlap_safe_copy(mod)
    try:
        fixed = racecheck.probe_batch_memcpy(64, 256, 12, "cpu", module=mod, max_chunk_bytes=4096)
    finally:
        overlap_safe.uninstall_overlap_safe_copy(mod)
    assert (fixed.corrupted, fixed.n, fixed.patched) == (0, 12, True)


# --- the committed H200 results ---------------------------------------------------------------

# both kernels at 10^5 copies; batch_memcpy at 10^6 (+ fused 0.26.0/0.28.0); fused shifts alone at 10^6
RESULT_FILES = ["both_kernels_100k", "batch_memcpy_1m", "fused_shifts_1m"]


def _committed(stem: str) -> dict:
    path = RESULTS / f"{stem}.json"
    assert path.is_file(), f"{path} missing: the GPU run's results must be committed"
    return json.loads(path.read_text())


@pytest.mark.parametrize("stem", RESULT_FILES)
def test_committed_gpu_results_parse(stem: str) -> None:
    import pandas as pd

    doc = _committed(stem)
    env = doc["environment"]
    assert env["vllm"] == "0.26.0" and "H200" in env["gpu"] and env["torch"].startswith("2.11")
    assert doc["errors"] == [] and doc["rows"]
    for row in doc["rows"]:
        assert set(racecheck.TABLE_COLUMNS) <= set(row)
        assert 0 <= row["corrupted"] <= row["n"] and row["ci_lo"] <= row["rate"] <= row["ci_hi"]
        assert row["rate"] == pytest.approx(row["corrupted"] / row["n"])
    csv = pd.read_csv(RESULTS / f"{stem}.csv")
    assert list(csv.columns) == racecheck.TABLE_COLUMNS and len(csv) == len(doc["rows"])
    assert csv["corrupted"].tolist() == [r["corrupted"] for r in doc["rows"]]


@pytest.mark.parametrize("stem", ["both_kernels_100k", "batch_memcpy_1m"])
def test_committed_results_show_race_unpatched_and_none_patched(stem: str) -> None:
    rows = [r for r in _committed(stem)["rows"] if r["kernel"] == "batch_memcpy"]
    unpatched = {r["shift_class"]: r for r in rows if not r["patched"]}
    patched = {r["shift_class"]: r for r in rows if r["patched"]}
    racy = [name for name, r in unpatched.items() if r["corrupted"] > 0]
    assert racy, "no shift class raced unpatched"
    assert all(name in patched and patched[name]["corrupted"] == 0 for name in racy)
    assert all(r["corrupted"] == 0 for r in patched.values())
    # batch_memcpy raced only for shifts below its 1 KiB tile
    assert all(unpatched[name]["below_tile"] for name in racy)


def test_committed_results_back_the_model_verdict() -> None:
    """docs/gpu.md's claim: no tiny-model or Qwen3.5-27B shift was corrupted by any probed kernel."""
    rows = [r for stem in RESULT_FILES for r in _committed(stem)["rows"]
            if "tiny" in r["shift_class"] or "qwen35-27b" in r["shift_class"]]
    kernels = {r["kernel"] for r in rows}
    assert {"batch_memcpy", "postprocess_mamba_fused_kernel", "postprocess_mamba_fused_kernel@0.28.0"} <= kernels
    assert sum(r["n"] for r in rows) > 10_000_000
    assert [r for r in rows if r["corrupted"]] == []
    fused = _committed("fused_shifts_1m")
    assert fused["fused_source"]["vllm"] == "0.28.0" and len(fused["fused_source"]["sha256"]) == 64
