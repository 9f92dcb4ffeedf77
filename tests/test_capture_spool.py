"""Deferred emission (``statescope.capture.spool``): the spool is an append-only log a killed
process leaves readable, and a run recovered from it has the rows a cleanly closed run has."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from statescope.capture import recorder as capture
from statescope.capture import run as capture_run
from statescope.capture import spool as capture_spool
from statescope.capture.session import record
from statescope.capture.store import CaptureRun
from statescope.errors import InputError


def test_spool_round_trip_torn_tail_and_truncate(tmp_path):
    sp = capture_spool.Spool(tmp_path)
    items = [{"engine_step": i, "fence": object(), "t": torch.arange(4, dtype=torch.int32) + i,
              "bf": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "metas": [{"req_id": str(i)}]}
             for i in range(3)]
    ends = [sp.append(it) for it in items]
    back = list(capture_spool.read_spool(tmp_path))
    assert [off for off, _ in back] == ends
    for (_, got), want in zip(back, items):
        assert "fence" not in got and got["engine_step"] == want["engine_step"]
        assert torch.equal(got["t"], want["t"]) and got["bf"].dtype == torch.bfloat16
        assert torch.equal(got["bf"], want["bf"]) and got["metas"] == want["metas"]
    assert [it["engine_step"] for _, it in capture_spool.read_spool(tmp_path, ends[0])] == [1, 2]
    with open(sp.path, "ab") as f:  # a process killed mid-write leaves a torn record: ignored
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00partial")
    assert len(list(capture_spool.read_spool(tmp_path))) == 3
    sp.truncate()
    assert sp.offset == 0 and list(capture_spool.read_spool(tmp_path)) == []
    sp.append(items[0])
    assert len(list(capture_spool.read_spool(tmp_path))) == 1
    sp.close()


def test_device_tensors_are_not_read_when_spooled(tmp_path):
    """A launch's device inputs stay behind (emit takes them from the packed host copy): spooling
    must never read device memory (a read would synchronize the step)."""
    sp = capture_spool.Spool(tmp_path)
    sp.append({"engine_step": 1, "data": torch.empty(4, device="meta"), "host": torch.ones(2)})
    (_, item), = capture_spool.read_spool(tmp_path)
    assert item["data"] is None and torch.equal(item["host"], torch.ones(2))
    sp.close()


def test_unreadable_record_names_the_file_and_byte(tmp_path):
    (tmp_path / capture_spool.SPOOL).write_bytes(b"\x03\x00\x00\x00\x00\x00\x00\x00xyz")
    with pytest.raises(InputError, match=r"spool.bin: step record at byte 0"):
        list(capture_spool.read_spool(tmp_path))


@pytest.fixture
def trigger(engine_pool, monkeypatch):
    from statescope.engine.config import EngineConfig

    monkeypatch.setenv("STATESCOPE_CAPTURE_STRICT", "1")
    engine = engine_pool.get(EngineConfig())
    yield engine
    capture.uninstall()


@pytest.mark.engine
def test_killed_run_recovers_the_rows_of_a_clean_close(trigger, tmp_path, monkeypatch):
    """A run with ``emit: idle`` spools its steps; the directory as a kill would leave it (steps
    spooled, none emitted) is recovered into the same rows as the run closed cleanly."""
    from statescope.capture.session import boundary_prompts

    monkeypatch.setattr(capture_run, "IDLE_S", 1e9)  # the engine never counts as idle here
    prompts = boundary_prompts(trigger.resolved()["mamba_block_size"], 6)
    spec = {"output_dir": str(tmp_path / "runs"), "run_id": "deferred", "emit": "idle",
            "flush_interval_s": 3600}
    trigger.reset_prefix_cache()
    rec = capture.install(spec)
    try:
        trigger.generate(prompts, max_tokens=12, ignore_eos=True)
        run = next(iter(rec.runs.values()))
        assert run.drain() > 0 and run.deferred  # spooled, not emitted
        crashed = shutil.copytree(run.writer.run_dir, tmp_path / "crashed")
    finally:
        dirs = capture.uninstall()
    clean = CaptureRun(dirs[-1])
    assert clean.manifest["emit"] == "idle" and clean.manifest["status"] == "complete"
    assert not (clean.path / capture_spool.SPOOL).exists()  # emitted, so removed
    assert CaptureRun(crashed).manifest["status"] == "running" and len(CaptureRun(crashed).steps()) == 0
    rep = capture_spool.recover(crashed)
    # every request of this run finished before the "kill": recovered as complete, and says so
    assert rep["steps_emitted"] > 0 and rep["status"] == "complete"
    assert rep["ended"]["closed_by"] == "capture-recover"
    got = CaptureRun(crashed)
    for table in ("steps", "digests", "copies"):
        a, b = (getattr(r, table)() for r in (clean, got))
        cols = [c for c in a.columns if c != "observed"]  # the CPU cross-check needs the live kernels
        key = [c for c in ("engine_step", "req_id", "layer", "kind", "launch", "src_addr") if c in a]
        assert len(a) == len(b) > 0, table
        pa_, pb = (x[cols].sort_values(key).reset_index(drop=True) for x in (a, b))
        assert pa_.astype(str).equals(pb.astype(str)), table
    assert capture_spool.recover(crashed)["steps_emitted"] == 0  # idempotent
    # killed after a part's tables were written but before the manifest recorded it: the spool
    # still holds those steps; recovery must not add them twice
    torn = shutil.copytree(crashed, tmp_path / "torn")
    man = json.loads((torn / "manifest.json").read_text())
    man.update(spool_emitted=0, status="running")
    (torn / "manifest.json").write_text(json.dumps(man))
    assert capture_spool.recover(torn)["steps_emitted"] == 0
    assert len(CaptureRun(torn).steps()) == len(clean.steps())


@pytest.mark.engine
def test_idle_emission_writes_while_the_engine_waits(trigger, tmp_path):
    """Default threshold: once the engine stops stepping, the flusher emits without a flush."""
    import time

    from statescope.capture.session import boundary_prompts

    prompts = boundary_prompts(trigger.resolved()["mamba_block_size"], 4)
    trigger.reset_prefix_cache()
    rec = capture.install({"output_dir": str(tmp_path), "run_id": "idle", "emit": "idle",
                           "flush_interval_s": 0.05})
    try:
        trigger.generate(prompts, max_tokens=8, ignore_eos=True)
        run = next(iter(rec.runs.values()))
        deadline = time.monotonic() + 10
        # the flusher writes the tables, then restarts the spool: wait for both (on a loaded
        # machine the test could look between the two)
        while time.monotonic() < deadline and (len(CaptureRun(run.writer.run_dir).steps()) == 0
                                               or run.writer.manifest["spool_emitted"] != 0):
            time.sleep(0.1)
        assert len(CaptureRun(run.writer.run_dir).steps()) > 0
        assert run.writer.manifest["spool_emitted"] == 0  # emitted, then the spool restarted
    finally:
        capture.uninstall()


def test_row_checksum_columns_are_variable_size_lists(tmp_path):
    """conv rows carry per-token row checksums, ssm rows none (null): written as variable-size
    lists, which every pyarrow reads back (null fixed-size lists failed on the H200's pyarrow)."""
    import numpy as np
    import pyarrow.parquet as pq

    from statescope.capture.store import CaptureWriter

    w = CaptureWriter(tmp_path, {"run_id": "x"}, 10**9)
    w.add_columns("digests", {"kind": np.array(["conv"] * 3, dtype=object),
                              "row_checksums": np.arange(15).reshape(3, 5)})
    w.add_columns("digests", {"kind": np.array(["ssm"] * 2, dtype=object)})
    w.close()
    part, = (tmp_path / "tables").glob("digests-*.parquet")
    assert str(pq.read_schema(part).field("row_checksums").type).startswith("list<")
    rows = CaptureRun(tmp_path).digests()["row_checksums"].tolist()
    assert [list(r) for r in rows[:3]] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    assert rows[3] is None and rows[4] is None


def test_a_live_run_never_shows_a_half_written_part(tmp_path, monkeypatch):
    """Readers of a live run list ``tables/*.parquet`` and ``shards/*.safetensors`` (a test waiting
    for the flusher opened a part mid-write once: 'Parquet magic bytes not found'): every part is
    written under a temporary name and renamed into place."""
    import pyarrow.parquet as pq
    import safetensors.torch

    from statescope.capture.store import CaptureWriter

    seen = []
    real_write, real_save = pq.write_table, safetensors.torch.save_file

    def write_table(table, where, *a, **kw):  # what a reader listing the folder would see now
        seen.append((str(where), sorted(p.name for p in (tmp_path / "tables").glob("*.parquet"))))
        return real_write(table, where, *a, **kw)

    def save_file(tensors, where, *a, **kw):
        seen.append((str(where), sorted(p.name for p in (tmp_path / "shards").glob("*.safetensors"))))
        return real_save(tensors, where, *a, **kw)

    monkeypatch.setattr(pq, "write_table", write_table)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    w = CaptureWriter(tmp_path, {"run_id": "x"}, 10**9)
    w.add_rows("steps", [{"req_id": "a", "req_step": 0}])
    w.add_tensor(torch.ones(4))
    w.write()
    assert len(seen) == 2 and all(where.endswith(".tmp") for where, _ in seen), seen
    assert all(listed == [] for _, listed in seen), seen  # nothing listed while being written
    assert [p.name for p in (tmp_path / "tables").glob("*")] == ["steps-00001.parquet"]
    assert [p.name for p in (tmp_path / "shards").glob("*")] == ["shard-00001.safetensors"]
    assert len(CaptureRun(tmp_path).steps()) == 1
