"""The one-launch Triton digest (``statescope.capture.digest_triton``) against the torch path.

The kernel is run on CPU tensors under Triton's interpreter, which must be switched on before
triton is first imported, so those checks run in a subprocess (this file, run as a script); the
pytest process (where vLLM may already have imported triton) only checks where the device path
must decline. On a CUDA host the last test runs the compiled kernel under sync-debug mode.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

torch.set_num_threads(1)


def _layer(seed: int, num_blocks: int, conv_shape: tuple, ssm_shape: tuple, pad: int = 40):
    """One layer's conv (bf16) and recurrent (fp32) states as views into padded pages (the
    recurrent state at an offset in the page), like vLLM's shared page buffers."""
    g = torch.Generator().manual_seed(seed)
    conv_bytes = int(np.prod(conv_shape)) * 2
    page = conv_bytes + int(np.prod(ssm_shape)) * 4 + pad
    raw = torch.randint(0, 255, (num_blocks * page,), generator=g, dtype=torch.uint8)
    conv = torch.as_strided(raw.view(torch.bfloat16), (num_blocks, *conv_shape),
                            (page // 2, conv_shape[1], 1))
    strides = [int(np.prod(ssm_shape[i + 1:])) for i in range(len(ssm_shape))]
    ssm = torch.as_strided(raw.view(torch.float32), (num_blocks, *ssm_shape),
                           (page // 4, *strides), conv_bytes // 4)
    conv.copy_((torch.randn(conv.shape, generator=g) * 3).to(torch.bfloat16))
    ssm.copy_(torch.randn(ssm.shape, generator=g) * 3)
    return raw, conv, ssm


def _same(got: tuple, ref_stats: torch.Tensor, ref_checks: torch.Tensor) -> None:
    assert got[0].shape == ref_stats.shape and got[0].dtype == torch.float32
    assert got[1].dtype == torch.int64 and torch.equal(got[1], ref_checks)  # bit for bit
    torch.testing.assert_close(got[0], ref_stats, rtol=1e-4, atol=2e-3, equal_nan=True)


def squeeze_interpreter_scalars() -> bool:
    """Triton 3.6's interpreter turns its one-element scalars into ints with ``int(array)``,
    which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars",
    measured on the H200 image: triton 3.6 there; reproduced here with triton 3.6.0 + NumPy
    2.4.6); later releases squeeze first (3.9: ``int(data.squeeze())``). Do as they do, in this
    subprocess only: the interpreter's scalar conversion changes, the kernel does not. True when
    the interpreter needed it."""
    import inspect

    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if "squeeze()" in inspect.getsource(original):
        return False

    def patched(tensor, scope):
        original(tensor, scope)  # the scope restores in reverse order: this goes first
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
    return True


def interpreter_checks() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (see ``test_kernel_...``)."""
    import statescope  # noqa: F401  (import shims first)

    if squeeze_interpreter_scalars():
        print("interpreter: triton's scalar conversion squeezed (NumPy >= 2.4 compatibility)")
    from statescope.capture import run as capture_run
    from statescope.capture import census_decode as cd
    from statescope.capture import digest_triton as dt
    from statescope.capture.digest import Digester

    assert dt.interpreting()
    # 3 layers, separate page buffers; conv SD (state_len 5 x conv_dim 2100: two column
    # tiles, the second masked), recurrent 4 x 16 x 40 (rows 64 = two row tiles, cols 40 masked)
    layers = [_layer(s, 9, (5, 2100), (4, 16, 40)) for s in range(3)]
    conv, ssm = [la[1] for la in layers], [la[2] for la in layers]
    ids = torch.tensor([[3, 0, 7, 3], [8, 2, 3, 1], [5, 5, 0, 8]])  # duplicates, out of order
    ssm[1][2, 1, 3, 7] = float("nan")
    ssm[1][2, 3, 0, 0] = float("inf")
    ssm[2][5, 0, 0, 1] = float("-inf")
    conv[0][7, 2, 2099] = float("nan")
    conv[2][0, 4, 0] = float("inf")
    for k, sumsq in ((3, True), (4, False), (0, True)):
        d = Digester(projections=k, seed=7, sumsq=sumsq)
        for states in (conv, ssm):
            ref = d.digest(states, ids)
            got = d.digest_device(states, ids)
            _same(got, *ref)
            assert got[2] is None and got[3] is None
        cols, rows = ssm[0].shape[-1], ssm[0][0].numel() // ssm[0].shape[-1]
        u, v = d._weights_for(rows, cols, torch.device("cpu"))
        for splits in (1, 3):  # one program per block, or several (partials added after)
            got = dt.digest_blocks(ssm, ids, u[1:], v[1:], sumsq, None, splits)
            _same(got, *d.digest(ssm, ids))
    ref_stats, ref_checks = Digester(3, 7).digest(ssm, ids)
    assert (ref_checks < 0).any() and (ref_checks > 0).any()  # int32 wrap: negative sums too
    assert ref_stats[1, 1, 2:4].tolist() == [1.0, 1.0]  # the planted NaN and Inf, counted
    assert ref_stats[2, :2, 3].tolist() == [1.0, 1.0]
    d = Digester(3, 7)
    # conv token rows, SD: per block row (on CPU the default is 2 programs per block here)
    rows = d.token_rows(d.gather(conv, ids), conv[0].shape[1:], 0)
    weights = [w[1:] for w in d._weights_for(5, 2100, conv[0].device)]
    for got in (d.digest_device(conv, ids, with_rows=True, token_axis=0),
                dt.digest_blocks(conv, ids, *weights, True, 0, 1),
                dt.digest_blocks(conv, ids, *weights, True, 0, 3)):
        _same(got, *d.digest(conv, ids))
        assert got[2].shape == (3, 4, 5, 2) and torch.equal(got[2], rows[0])
        torch.testing.assert_close(got[3], rows[1], rtol=1e-4, atol=2e-3, equal_nan=True)
    # DS layout (conv_dim 600 x state_len 5 per block, contiguous): tokens are block columns
    ds = [torch.randn(9, 600, 5, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16) * 9
          for s in range(3)]
    rows = d.token_rows(d.gather(ds, ids), ds[0].shape[1:], 1)
    for splits in (None, 1, 3):  # split: per-column partials added after
        got = dt.digest_blocks(ds, ids, *[w[1:] for w in d._weights_for(600, 5, ds[0].device)],
                               True, 1, splits)
        _same(got, *d.digest(ds, ids))
        assert got[2].shape == (3, 4, 5, 2) and torch.equal(got[2], rows[0])
        torch.testing.assert_close(got[3], rows[1], rtol=1e-4, atol=2e-3)
    # where it must decline
    assert d.digest_device([c.transpose(1, 2) for c in conv], ids) is None  # not contiguous
    assert d.digest_device([c.to(torch.float16) for c in conv], ids) is None  # dtype
    assert Digester(5, 7).digest_device(ssm, ids) is None  # more projections than it has
    # the capture's wiring: both kinds and the conv token rows from the device path
    for dim_first, states in ((False, [[c, s] for c, s in zip(conv, ssm)]),
                              (True, [[c, s] for c, s in zip(ds, ssm)])):
        geoms = cd.geometry_from_states([(f"l{i}", 0, s) for i, s in enumerate(states)], dim_first)
        calls = []
        orig = d.digest_device
        d.digest_device = lambda *a, **kw: calls.append(1) or orig(*a, **kw)
        stats2, checks2, row_checks, _ = capture_run.digest_kinds(d, geoms[0], states, ids, reuse=False)
        item = {"stats": stats2, "checksum": checks2, "conv_row_checks": row_checks}
        del d.digest_device
        assert len(calls) == 2  # both kinds went through the device path
        kinds = [[s[0] for s in states], [s[1] for s in states]]
        for i, kind in enumerate(kinds):
            stats, checks = d.digest(kind, ids)
            assert torch.equal(item["checksum"][i], checks)
            torch.testing.assert_close(item["stats"][i], stats, rtol=1e-4, atol=2e-3,
                                       equal_nan=True)
        rows = d.token_rows(d.gather(kinds[0], ids), kinds[0][0].shape[1:], 1 if dim_first else 0)
        assert torch.equal(item["conv_row_checks"], rows[0])
    print("INTERPRETER CHECKS PASSED")


def test_kernel_matches_the_torch_path_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               TRITON_DEFAULT_FP_FUSION="1", STATESCOPE_DIGEST_TRITON="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "INTERPRETER CHECKS PASSED" in proc.stdout


def test_device_path_declines_on_cpu_without_the_interpreter(monkeypatch):
    from statescope.capture import digest as digest_mod
    from statescope.capture.digest import Digester

    _, conv, ssm = _layer(0, 4, (3, 16), (2, 4, 8))
    ids = torch.tensor([[1, 2]])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert Digester(3).digest_device([ssm], ids) is None  # a CPU tensor: the C / torch paths
    monkeypatch.delenv(digest_mod.ENV_TRITON, raising=False)
    monkeypatch.setattr(digest_mod, "_triton", [])
    # on by default since it was measured on the H200 (data/results/gpu/e2e_factors/), wherever Triton imports
    import importlib.util

    assert (digest_mod.triton_kernel() is not None) == (importlib.util.find_spec("triton") is not None)
    monkeypatch.setenv(digest_mod.ENV_TRITON, "0")  # the opt-out
    monkeypatch.setattr(digest_mod, "_triton", [])
    assert digest_mod.triton_kernel() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU host)")
def test_cuda_kernel_matches_and_never_synchronizes(monkeypatch):
    from statescope.capture import digest as digest_mod
    from statescope.capture.digest import Digester, host_to_device

    monkeypatch.setenv(digest_mod.ENV_TRITON, "1")  # explicit (the default)
    monkeypatch.setattr(digest_mod, "_triton", [])

    layers = [_layer(s, 9, (5, 2100), (4, 16, 40)) for s in range(3)]
    raws = [la[0].cuda() for la in layers]
    cpu = [[la[1] for la in layers], [la[2] for la in layers]]
    dev = [[torch.as_strided(r.view(c.dtype), c.shape, c.stride(), c.storage_offset())
            for r, c in zip(raws, kind)] for kind in cpu]
    ids_host = torch.tensor([[3, 0, 7, 3], [8, 2, 3, 1], [5, 5, 0, 8]])
    d = Digester(3, 7)
    warm = host_to_device(ids_host, "cuda")
    assert d.digest_device(dev[0], warm, with_rows=True) is not None  # compile, table upload
    assert d.digest_device(dev[1], warm) is not None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host<->device synchronization raises
    try:
        ids = host_to_device(ids_host, "cuda")
        got = [d.digest_device(dev[0], ids, with_rows=True), d.digest_device(dev[1], ids)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for g, states in zip(got, cpu):
        _same(tuple(t.cpu() if t is not None else None for t in g), *d.digest(states, ids_host))
    rows = d.token_rows(d.gather(cpu[0], ids_host), cpu[0][0].shape[1:], 0)
    assert torch.equal(got[0][2].cpu(), rows[0])


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    interpreter_checks()
