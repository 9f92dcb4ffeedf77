"""The capture's one-buffer step digest (``statescope.capture.digest_graph``): buckets, padding, slicing, and
the padded path end to end on the CPU engine (eager: CUDA graphs themselves need a GPU; their
bit-for-bit self-check runs on the device, see docs/history/gpu-campaigns.md, round 4)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from statescope.capture import recorder as capture
from statescope.capture import run as capture_run
from statescope.capture import digest_graph as dg
from statescope.diverge.digest_diff import digest_diff
from statescope.capture.session import boundary_prompts, record


def test_buckets_and_padding():
    assert [dg.bucket(c) for c in (1, 8, 9, 32, 33, 1024)] == [8, 8, 16, 32, 64, 1024]
    assert dg.bucket(1025) is None
    blocks = np.array([[5, 6, 7], [9, 10, 11]])
    padded = dg.pad_columns(blocks, 8)
    assert padded.shape == (2, 8) and (padded[:, :3] == blocks).all() and (padded[:, 3:] == [[5], [9]]).all()


def test_flat_round_trip_drops_padding_and_missing_rows():
    stats = torch.randn(2, 3, 8, 5)
    check = torch.randint(0, 2**31, (2, 3, 8), dtype=torch.int64)
    rows_c = torch.randint(0, 99, (3, 8, 4), dtype=torch.int64)
    flat, layout = dg._flat((stats, check, rows_c, None))
    got = dg.unflatten(flat, layout, 6)
    assert torch.equal(got[0], stats[:, :, :6]) and torch.equal(got[1], check[:, :, :6])
    assert torch.equal(got[2], rows_c[:, :6]) and got[3] is None


def test_step_digest_eager_without_a_gpu_and_graphs_off_on_cpu():
    calls = []

    def body(idx):
        calls.append(idx.shape)
        return (idx.to(torch.float32)[None, :, :, None].repeat(2, 1, 1, 2), idx[None].repeat(2, 1, 1),
                None, None)

    sd = dg.StepDigest(body, torch.device("cpu"))
    assert sd.status(True) == sd.status(False) == "off"  # graphs only on CUDA, and only when asked for
    flat, layout, cols = sd.run(np.array([[3, 4, 5]]))
    assert calls == [(1, 8)] and cols == 3
    stats, check, _, _ = dg.unflatten(flat, layout, cols)
    assert check.tolist() == [[[3, 4, 5]], [[3, 4, 5]]] and stats.shape == (2, 1, 3, 2)
    assert sd.run(np.zeros((1, 2000), dtype=np.int64)) is None  # too wide: the caller's path


@pytest.mark.engine
def test_padded_step_digest_gives_the_same_rows(engine_pool, tmp_path, monkeypatch):
    from statescope.capture.store import CaptureRun
    from statescope.engine.config import EngineConfig

    engine = engine_pool.get(EngineConfig())
    prompts = boundary_prompts(engine.resolved()["mamba_block_size"], 5)
    b, c = [], []
    try:
        a, _ = record(engine, {"output_dir": str(tmp_path), "run_id": "plain"}, prompts, max_tokens=10)
        monkeypatch.setattr(capture_run, "DEVICE_PATH_ON_CPU", True)
        monkeypatch.setattr(capture_run, "STEP_DIGEST_ON_CPU", True)
        seen = []
        for name in ("padded", "again"):
            engine.reset_prefix_cache()
            rec = capture.install({"output_dir": str(tmp_path), "run_id": name})
            engine.generate(prompts, max_tokens=10, ignore_eos=True)
            seen.append(next(iter(rec.runs.values())).step_digest)
            (b if name == "padded" else c).append(capture.uninstall()[-1])
        b, c = CaptureRun(b[0]), CaptureRun(c[0])
    finally:
        capture.uninstall()
    # graphs are CUDA-only: on the CPU the padded path runs eagerly; on a GPU (gpu_cli.sh
    # cuda_checks) the same step digest is a graph replay
    graphs = "on" if b.manifest["state_device"].startswith("cuda") else "off"
    assert b.manifest["emit"] == "idle" and b.manifest["digest_graph"] == graphs
    assert c.manifest["digest_graph"] == graphs and seen[0] is seen[1]  # one per engine, across runs
    # by request step: the row count below is per step (one schedule, so steps line up); the
    # default (by token position) compares the running columns too, all the same as well
    diff = digest_diff(a, b, pairing="step")
    assert digest_diff(a, b)["same"].all()
    da, db = a.digests(), b.digests()
    compared = da[((da.kind == "conv") & (da.column_offset == 0)) | ((da.kind == "ssm") & da.resume)]
    assert len(diff) == len(compared) > 0 and diff["same"].all() and diff.attrs["columns"] == "resume"
    # every row, resume columns picked on the device included (recurrent state: bit for bit;
    # whole conv windows hold dead rows whose bytes depend on the block's history)
    both = da.merge(db, on=["prompt_sha", "req_step", "layer", "kind", "column_offset"])
    assert len(both) == len(da) == len(db) and (da.column_offset > 0).any()
    ssm = both[both.kind == "ssm"]
    assert (ssm.checksum_x == ssm.checksum_y).all() and (ssm.hash_x == ssm.hash_y).all()
    assert (both.resume_x == both.resume_y).all()
    # the block of a resume column picked on the device is the one the request's table names
    steps = b.steps().set_index(["req_id", "req_step"])
    group_pos = b.manifest["mamba_groups"].index(b.manifest["states"][0]["group"])
    extra = db[(db.column_offset > 0) & (db.layer_index == 0)]
    assert len(extra)
    for row in extra.itertuples():
        st = steps.loc[(row.req_id, row.req_step)]
        assert row.column_offset == st["resume_col_offset"]
        assert row.block_id == list(st["mamba_block_ids"][group_pos])[st["running_col"] + row.column_offset]
    key = ["prompt_sha", "req_step", "layer"]
    ra, rb = (r.digests().query("kind == 'conv'").sort_values(key)["row_checksums"] for r in (a, b))
    live = a.manifest["conv_window"]  # rows after the live window hold whatever the block held before
    assert [list(x[:live]) for x in ra] == [list(x[:live]) for x in rb]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device)")
def test_graph_replay_equals_eager_launches_on_cuda():
    """On the GPU: every bucket's replay gives exactly the eager digests, padded columns dropped,
    and reads the states live (a changed state changes the replayed digest)."""
    from statescope.capture.digest import Digester


    gen = torch.Generator(device="cuda").manual_seed(0)
    layers, nblocks = 4, 64
    conv = [torch.randn(nblocks, 5, 384, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(layers)]
    ssm = [torch.randn(nblocks, 1, 128, 128, device="cuda", generator=gen) for _ in range(layers)]
    d = Digester(3, 0)

    def body(idx):
        c = d.digest_device(conv, idx, with_rows=True, token_axis=0)
        s = d.digest_device(ssm, idx)
        return torch.stack([c[0], s[0]]), torch.stack([c[1], s[1]]), c[2], c[3]

    sd = dg.StepDigest(body, torch.device("cuda"))
    rng = np.random.default_rng(0)
    for step, cols in enumerate((3, 8, 5, 20, 3)):
        if step == 4:
            conv[1].add_(1.0)  # the graph must read the state as it is now
        blocks = rng.integers(0, nblocks, (layers, cols))
        flat, layout, c = sd.run(blocks, graphs=True)
        got = dg.unflatten(flat.cpu(), layout, c)
        ref = body(torch.from_numpy(blocks).cuda())
        for g, r in zip(got, ref):
            assert torch.equal(g, r.cpu()), (step, cols)
    assert sd.status(True) == "on" and sd.status(False) == "off" and sorted(sd._graphs) == [8, 32]
