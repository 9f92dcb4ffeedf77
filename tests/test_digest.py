"""Device-side digests of state blocks (CPU tensors here; the same code runs on CUDA), and the
word hash that sees what the word-sum checksum misses (``statescope.capture.word_hash``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from statescope.capture import digest as digest_mod
from statescope.capture import digest_native, word_hash
from statescope.capture.digest import (Digester, Fence, gather_snapshot, host_to_device, pack,
                               stat_names, to_host_async, unpack)

torch.set_num_threads(1)


def _views(raw, num_blocks, conv_shape, ssm_shape, conv_bytes, page):
    conv = torch.as_strided(raw.view(torch.bfloat16), (num_blocks, *conv_shape),
                            (page // 2, conv_shape[1], 1))
    ssm = torch.as_strided(raw.view(torch.float32), (num_blocks, *ssm_shape),
                           (page // 4, ssm_shape[1] * ssm_shape[2], ssm_shape[2], 1), conv_bytes // 4)
    return conv, ssm


def _paged_states(num_blocks=9, conv_shape=(5, 16), ssm_shape=(2, 4, 8), pad=40, seed=0,
                  device=None):
    """A layer's conv (bf16) and ssm (fp32) as views into one padded page buffer per block."""
    g = torch.Generator().manual_seed(seed)
    conv_bytes = int(np.prod(conv_shape)) * 2
    page = conv_bytes + int(np.prod(ssm_shape)) * 4 + pad
    raw = torch.randint(0, 255, (num_blocks * page,), generator=g, dtype=torch.uint8)
    conv, ssm = _views(raw, num_blocks, conv_shape, ssm_shape, conv_bytes, page)
    conv.copy_(torch.randn(conv.shape, generator=g).to(torch.bfloat16))
    ssm.copy_(torch.randn(ssm.shape, generator=g))
    if device is not None:  # same bytes, same padded layout, on the device
        raw = raw.to(device)
        conv, ssm = _views(raw, num_blocks, conv_shape, ssm_shape, conv_bytes, page)
    return raw, conv, ssm


def _ref_checksum(block: torch.Tensor) -> int:
    words = block.contiguous().view(-1).view(torch.int16 if block.element_size() == 2 else torch.int32)
    total = int(words.to(torch.int64).sum()) % 2**32
    return total - 2**32 if total >= 2**31 else total  # int32 wrap-around, signed


def test_stats_and_checksum_match_a_reference_on_padded_views():
    _, conv, ssm = _paged_states()
    d = Digester(projections=2, seed=5)
    ids = torch.tensor([[3, 0, 7]])
    for states in ([conv], [ssm]):
        stats, checks = d.digest(states, ids)
        assert stats.shape == (1, 3, len(stat_names(2))) and checks.shape == (1, 3, 2)
        for r, b in enumerate(ids[0].tolist()):
            x = states[0][b].to(torch.float32)
            assert stats[0, r, 0].item() == pytest.approx(x.sum().item(), rel=1e-4, abs=1e-4)
            assert stats[0, r, 1].item() == pytest.approx((x * x).sum().item(), rel=1e-4)
            assert stats[0, r, 2].item() == 0 and stats[0, r, 3].item() == 0  # NaN, Inf
            assert checks[0, r, 0].item() == _ref_checksum(states[0][b])
            assert checks[0, r, 1].item() == _ref_hash(states[0][b])


def _fmix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _ref_hash(block: torch.Tensor) -> int:
    """The word hash written out in plain Python ints from its definition (word_hash docstring)."""
    cols = block.shape[-1]
    bits = 16 if block.element_size() == 2 else 32
    words = block.contiguous().view(torch.int16 if bits == 16 else torch.int32).reshape(-1, cols)
    total = 0
    for r, row in enumerate(words.tolist()):
        terms = sum(_fmix((w & (2**bits - 1)) ^ (((c + 1) * 0x9E3779B1) & 0xFFFFFFFF))
                    for c, w in enumerate(row))
        total += (_fmix(r) | 1) * terms
    total %= 2**32
    return total - 2**32 if total >= 2**31 else total


def test_hash_sees_a_doubled_state_and_a_swap_the_checksum_misses():
    """The two blind spots of the word sum (issue 20): a float32 state scaled by 2 with a
    multiple of 512 nonzero elements keeps its checksum (every exponent +1 adds 2**23), and a
    swap of two values inside a row keeps the row's checksum and sum. The hash sees both, and
    stays exact: the C kernel and the torch path agree with it bit for bit."""
    g = torch.Generator().manual_seed(3)
    ssm = torch.randn(4, 2, 16, 32, generator=g)  # 1024 elements per block
    ssm[1] = ssm[0] * 2
    d = Digester(3, 0)
    stats, exact = d.digest([ssm], torch.tensor([[0, 1]]))
    assert exact[0, 0, 0] == exact[0, 1, 0]  # the checksum's blind spot, reproduced
    assert exact[0, 0, 1] != exact[0, 1, 1]  # the hash sees it
    conv = torch.randn(3, 5, 48, generator=g).to(torch.bfloat16)
    conv[1] = conv[0]
    conv[1, 2, [7, 30]] = conv[1, 2, [30, 7]]  # swap two channels of token row 2
    rows_exact, sums = d.token_rows(d.gather([conv], torch.tensor([[0, 1]])), conv.shape[1:], 0)
    assert rows_exact[0, 0, 2, 0] == rows_exact[0, 1, 2, 0]  # row checksum unchanged ...
    torch.testing.assert_close(sums[0, 0, 2], sums[0, 1, 2])  # ... and row sum
    assert rows_exact[0, 0, 2, 1] != rows_exact[0, 1, 2, 1]  # the row hash sees the swap
    assert (rows_exact[0, 0, [0, 1, 3, 4], 1] == rows_exact[0, 1, [0, 1, 3, 4], 1]).all()
    # a row keeps its hash wherever it sits in the window (the live-row comparison shifts)
    moved = conv[0].roll(1, 0)
    assert torch.equal(word_hash.token_row_hash(moved)[1:], word_hash.token_row_hash(conv[0])[:-1])
    # whole-row permutations change the block hash (row weights), not the checksum
    assert word_hash.block_hash(moved) != word_hash.block_hash(conv[0])
    assert _ref_hash(conv[1]) == word_hash.block_hash(conv[1]).item()
    if digest_mod.native_kernel() is not None:
        got = d.digest_in_place([conv], torch.tensor([[0, 1]]), with_rows=True)
        assert torch.equal(got[2], rows_exact)
        assert torch.equal(d.digest_in_place([ssm], torch.tensor([[0, 1]]))[1], exact)


def test_checksum_is_exact_and_batch_independent_projections_are_positional():
    _, conv, ssm = _paged_states()
    d = Digester(projections=3, seed=1)
    alone, alone_sum = d.digest([ssm], torch.tensor([[4]]))
    batch, batch_sum = d.digest([ssm], torch.tensor([[1, 4, 6, 2]]))
    assert torch.equal(alone_sum[0, 0], batch_sum[0, 1])
    torch.testing.assert_close(alone[0, 0], batch[0, 1], rtol=1e-5, atol=1e-5)
    before, before_sum = d.digest([ssm], torch.tensor([[4]]))
    ssm[4, 0, 0, 0] = ssm[4, 0, 0, 0] + 1.0  # one word changes -> checksum and hash change
    after, after_sum = d.digest([ssm], torch.tensor([[4]]))
    assert (after_sum[0, 0] != before_sum[0, 0]).all()
    # a permutation keeps the (order-free) checksum but moves the projections and the hash
    ssm[5].copy_(ssm[4].flip(-1))
    perm, perm_sum = d.digest([ssm], torch.tensor([[5]]))
    assert perm_sum[0, 0, 0] == after_sum[0, 0, 0] and perm_sum[0, 0, 1] != after_sum[0, 0, 1]
    assert not torch.allclose(perm[0, 0, 4:], after[0, 0, 4:])
    # same seed, same weights; another seed, other projections
    again, _ = Digester(projections=3, seed=1).digest([ssm], torch.tensor([[4]]))
    other, _ = Digester(projections=3, seed=2).digest([ssm], torch.tensor([[4]]))
    torch.testing.assert_close(again, after)
    assert not torch.allclose(other[0, 0, 4:], after[0, 0, 4:])


def test_nan_and_inf_counts():
    states = [torch.randn(8, 2, 3, 3) for _ in range(2)]
    states[0][2, 0, 0, :2] = float("nan")
    states[0][2, 1, 1, 1] = float("inf")
    states[1][5, 0, 0, 0] = float("-inf")
    ids = torch.tensor([[2, 5, 1], [2, 5, 1]])
    stats, _ = Digester(0, 0).digest(states, ids)
    assert stats[0, 0, 2:4].tolist() == [2.0, 1.0]  # layer 0, block 2: 2 NaN, 1 Inf
    assert stats[1, 1, 2:4].tolist() == [0.0, 1.0]
    assert stats[..., 2:4].sum().item() == 4.0
    many = [torch.full((8, 4), float("nan"))]
    stats, _ = Digester(0, 0).digest(many, torch.tensor([list(range(5))]))
    assert stats[0, :, 2].tolist() == [4.0] * 5


def _require_kernel():
    import shutil

    # The README's machine has a C compiler (the environment installs one); without it these
    # tests would pass by testing nothing, so its absence fails here, naming what is missing.
    assert shutil.which("cc") is not None, "no C compiler on PATH: the in-place digest kernel cannot build"
    assert digest_mod.native_kernel() is not None  # a compiler is there: the kernel must build


def test_in_place_kernel_matches_the_torch_digest_on_padded_views():
    _require_kernel()
    _, conv, ssm = _paged_states(num_blocks=9, conv_shape=(5, 48), ssm_shape=(2, 4, 40))
    d = Digester(projections=3, seed=4)
    ids = torch.tensor([[3, 0, 7], [8, 2, 3]])
    for states, k in (([conv, conv], 3), ([ssm, ssm], 3), ([ssm, ssm], 5), ([conv, conv], 0)):
        d = Digester(projections=k, seed=4)
        stats, checks = d.digest(states, ids)
        got = d.digest_in_place(states, ids, with_rows=states[0].dim() == 3)
        assert got[0].shape == stats.shape and torch.equal(got[1], checks)  # exact, bit for bit
        torch.testing.assert_close(got[0], stats, rtol=1e-4, atol=1e-3)
        if states[0].dim() == 3:  # conv windows: per-token-row digests too
            rows = d.token_rows(d.gather(states, ids), states[0].shape[1:], 0)
            assert torch.equal(got[2], rows[0])
            torch.testing.assert_close(got[3], rows[1], rtol=1e-5, atol=1e-4)
        else:
            assert got[2] is None and got[3] is None
    # position-sensitive: a flipped block keeps its checksum, not its projections
    d = Digester(projections=3, seed=4)
    ssm[5].copy_(ssm[4].flip(-1))
    a, b = d.digest_in_place([ssm], torch.tensor([[4, 5]]))[:2]
    assert b[0, 0, 0] == b[0, 1, 0] and not torch.allclose(a[0, 0, 4:], a[0, 1, 4:])
    assert b[0, 0, 1] != b[0, 1, 1]
    ssm[4, 1, 2, 3] = float("nan")
    ssm[5, 0, 0, 0] = float("-inf")
    a, _ = d.digest_in_place([ssm], torch.tensor([[4, 5, 6]]))[:2]
    assert a[0, :, 2:4].tolist() == [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="block ids"):
        d.digest_in_place([ssm], torch.tensor([[9]]))


def test_in_place_kernel_declines_what_it_does_not_cover(monkeypatch):
    _require_kernel()
    _, conv, ssm = _paged_states()
    d = Digester(2, 0)
    ids = torch.tensor([[1, 2]])
    assert d.digest_in_place([ssm.to(torch.float16)], ids) is None  # dtype
    assert d.digest_in_place([conv.transpose(1, 2)], ids) is None  # blocks not contiguous
    monkeypatch.setattr(digest_native, "_native", [None])  # no compiler / STATESCOPE_DIGEST_NATIVE=0
    assert d.digest_in_place([ssm], ids) is None


def test_sumsq_is_optional():
    _, _, ssm = _paged_states()
    ids = torch.tensor([[3, 4]])
    full, checks = Digester(2, 0).digest([ssm], ids)
    lean, lean_checks = Digester(2, 0, sumsq=False).digest([ssm], ids)
    assert Digester(2, 0, sumsq=False).names == ("sum", "nan", "inf", "proj0", "proj1")
    assert torch.equal(checks, lean_checks)
    torch.testing.assert_close(lean, full[..., [0, 2, 3, 4, 5]])


def test_pack_unpack_round_trip():
    parts = [torch.randn(2, 3), torch.tensor([[1, -2**40]], dtype=torch.int64),
             torch.arange(5, dtype=torch.int32), torch.randn(4).to(torch.bfloat16)]
    flat, layout = pack(parts)
    assert flat.dtype == torch.uint8 and flat.numel() % 8 == 0
    assert all(off % 8 == 0 for _, _, off in layout)  # each part viewable as its dtype
    for a, b in zip(parts, unpack(flat, layout)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_chunking_changes_nothing():
    layers = [torch.randn(6, 2, 8, 8) for _ in range(5)]
    ids = torch.randint(0, 6, (5, 3))
    whole = Digester(2, 0).digest(layers, ids)
    tiny = Digester(2, 0, chunk_bytes=1)  # one layer per chunk
    assert len(tiny.gather(layers, ids)) == 5
    parts = tiny.digest(layers, ids)
    torch.testing.assert_close(whole[0], parts[0])
    assert torch.equal(whole[1], parts[1])


def test_gather_reuse_keeps_one_buffer_and_fresh_values():
    layers = [torch.randn(6, 2, 8, 8) for _ in range(3)]
    d = Digester(2, 0)
    first = d.gather(layers, torch.tensor([[1, 2]] * 3), reuse=True)
    stats_1, _ = d.reduce(first)
    second = d.gather(layers, torch.tensor([[4, 5]] * 3), reuse=True)
    assert second[0].data_ptr() == first[0].data_ptr()  # no allocation per step
    stats_2, _ = d.reduce(second)
    ref, _ = Digester(2, 0).digest(layers, torch.tensor([[4, 5]] * 3))
    torch.testing.assert_close(stats_2, ref)
    assert not torch.allclose(stats_1, stats_2)  # results were taken before the buffer was reused


def test_token_rows_per_layout():
    _, conv, _ = _paged_states()
    d = Digester(0, 0)
    ids = torch.tensor([[2, 6]])
    checks, sums = d.token_rows(d.gather([conv], ids), conv.shape[1:], 0)
    assert checks.shape == (1, 2, 5, 2)
    for r, b in enumerate((2, 6)):
        for t in range(5):
            assert checks[0, r, t, 0].item() == _ref_checksum(conv[b, t])
            assert checks[0, r, t, 1].item() == _ref_hash(conv[b, t][None])  # one row: weight 1
            assert sums[0, r, t].item() == pytest.approx(conv[b, t].float().sum().item(), abs=1e-3)
    ds = conv.transpose(1, 2)  # DS layout: (conv_dim, state_len) per block
    checks_ds, _ = d.token_rows(d.gather([ds], ids), ds.shape[1:], 1)
    assert torch.equal(checks_ds, checks)


def test_snapshot_and_host_helpers_on_cpu():
    _, conv, ssm = _paged_states()
    snap = gather_snapshot([ssm, ssm], torch.tensor([3, 7]))
    assert snap.shape == (2, *ssm.shape[1:])
    assert torch.equal(snap[0], ssm[3]) and torch.equal(snap[1], ssm[7])
    ssm[3].zero_()
    assert not torch.equal(snap[0], ssm[3])  # a copy, not a view of live state
    t = torch.arange(4)
    assert host_to_device(t, "cpu") is t and to_host_async(t) is t
    f = Fence("cpu")
    assert f.done()
    f.wait()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU host)")
def test_cuda_digest_census_and_transfers_never_synchronize():
    from statescope.capture.census_decode import postprocess_decisions

    _, conv_cpu, ssm_cpu = _paged_states()
    _, conv, ssm = _paged_states(device="cuda")
    assert ssm.stride() == ssm_cpu.stride()  # padded pages on the device too
    d = Digester(3, 0)
    d.digest([ssm], torch.tensor([[1]], device="cuda"))  # one-time weight upload, outside the check
    d.digest([conv], torch.tensor([[1]], device="cuda"))
    inputs = [torch.tensor(v, device="cuda") for v in  # the runner's device buffers, made here
              ([3, 1], [0, 1], [3, 3], [5, 13], [2, 2])]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host<->device synchronization raises
    try:
        ids = host_to_device(torch.tensor([[3, 0, 7]]), "cuda")
        stats, checks = d.digest([ssm], ids)
        chunks = d.gather([conv], ids)
        conv_stats, conv_checks = d.reduce(chunks)
        rows = d.token_rows(chunks, conv.shape[1:], 0)
        snap = gather_snapshot([ssm], ids[0, :1])
        dec = postprocess_decisions(*inputs, 8)
        flat, layout = pack([stats, checks, conv_checks, rows[0], snap, dec])
        flat_host = to_host_async(flat)  # one copy for the whole step
        fence = Fence("cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    fence.wait()
    assert fence.done() and flat_host.is_pinned()
    host = unpack(flat_host, layout)
    ref_stats, ref_checks = d.digest([ssm_cpu], torch.tensor([[3, 0, 7]]))
    assert torch.equal(host[1], ref_checks)  # exact on any device
    torch.testing.assert_close(host[0], ref_stats, rtol=1e-4, atol=1e-4)
    assert torch.equal(host[2], d.digest([conv_cpu], torch.tensor([[3, 0, 7]]))[1])
    assert torch.equal(host[4][0], ssm_cpu[3])
    assert host[5].tolist()[0][:4] == [1, 0, 0, 2] and host[5].tolist()[0][4] == 1
