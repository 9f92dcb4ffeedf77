"""Issue 33: run folders from elsewhere are bounded, attributable and end in one line.

Item 1: the spool decoder allocates nothing from an unchecked number (a fuzz of 20,000 mutations
under a memory limit, in a child process: ``spool_fuzz_child.py``), and the JSON readers of
records, manifests and traces answer nesting bombs and huge integers with one ``InputError``
naming the file and line. Item 2: a store, ledger or manifest of another run id or fingerprint is
refused with one line and left as it was; a refused resume never turns ``completed`` into
``failed``. Item 4: a full disk (a real 4 MiB tmpfs) and a refused write end in one
``StoreWriteFailed`` naming the path and what was kept, no temp file stays, the manifest says
``failed``. Item 5: a second process on the same run id is refused before any engine starts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from statescope.errors import InputError
from statescope.records import (ResultsStore, StoreWriteFailed, load_lifetimes, load_manifest,
                                load_records)

HERE = Path(__file__).parent


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


def _rec(run_id: str, step: int, **extra) -> dict:
    return {"run_id": run_id, "build": "trigger", "config_hash": "h", "episode": "e0", "step": step,
            **extra}


# -- item 1 -------------------------------------------------------------------------------------
def test_spool_fuzz_gives_no_traceback_and_bounded_memory():
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(HERE / "spool_fuzz_child.py"), "20000", "1024"],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["unexpected"] == 0, "\n".join(out["examples"])
    assert out["cases"] >= 20_000 and out["refused"] > 5_000 and out["input_error"] > 100, out
    assert out["seconds"] <= 60 and time.perf_counter() - t0 < 180, out  # incl. torch's import
    # the decoder's own growth above the imports (torch and numpy alone are ~230 MiB; a parent whose
    # sys.path brought more along measured 830 MiB before any case ran)
    assert out["peak_rss_mib"] - out["baseline_rss_mib"] < 300, out
    assert "claims 4611686018427387904 bytes" in out["huge_header"], out["huge_header"]


def test_the_issue_records_are_refused_by_name():
    import struct

    from statescope.capture import spool_format as sf

    u32, u64 = struct.Struct("<I").pack, struct.Struct("<Q").pack
    for data, needle in [
        (b"K" + u32(2**32 - 1) + u32(0), "exceed what a record"),
        (b"a" + sf.encode("<f4")[1:] + bytes([2]) + u64(2**50) + u64(12 * 2**50) + u64(0), "dimension above"),
        (b"a" + sf.encode("<f4")[1:] + bytes([2]) + u64(2**39) + u64(2**39) + u64(0),
         "needs 1208925819614629174706176 bytes"),  # the product in Python ints: no overflow
        (b"I" + sf.encode("--5")[1:], "decimal digits"),
        (b"I" + sf.encode("\u00b2")[1:], "decimal digits"),
    ]:
        with pytest.raises(sf.SpoolFormatError, match=needle):
            sf.decode(data)


@pytest.mark.parametrize("line", ["[" * 100_000, '{"a": ' + "9" * 5000 + "}",
                                  json.dumps(_rec("r1", 0, episode={"a": 1}))])
def test_records_lines_that_break_json_are_one_input_error(tmp_path, line):
    run = tmp_path / "r1"
    run.mkdir()
    (run / "records.jsonl").write_text(line + "\n" + json.dumps(_rec("r1", 1)) + "\n")
    with pytest.raises(InputError, match=r"records\.jsonl:1: "):
        load_records(run)
    (run / "manifest.json").write_text("[" * 100_000)
    with pytest.raises(InputError, match=r"manifest\.json: expected a JSON object"):
        load_manifest(run)


def test_a_trace_line_with_a_huge_integer_is_one_input_error(tmp_path):
    from statescope.workload.trace import read_trace

    path = tmp_path / "t.jsonl"
    path.write_text('{"trace_version": 1, "max_tokens": ' + "9" * 5000 + "}\n")
    with pytest.raises(InputError, match=r"t\.jsonl:1: .*not valid JSON"):
        read_trace(path)
    path.write_text("[" * 100_000 + "\n")
    with pytest.raises(InputError, match=r"t\.jsonl:1: .*not valid JSON"):
        read_trace(path)


# -- item 2 -------------------------------------------------------------------------------------
def _completed_run(root: Path, run_id: str, fingerprint: str | None = None) -> Path:
    with ResultsStore(root, run_id) as store:
        store.start({"k": 1}, fingerprint=fingerprint)
        store.append(_rec(run_id, 0))
    return root / run_id


def test_records_of_another_run_are_refused_and_nothing_is_rewritten(tmp_path):
    run = _completed_run(tmp_path, "L3")
    lines = (run / "records.jsonl").read_text().splitlines()
    (run / "records.jsonl").write_text(lines[0] + "\n" + json.dumps(_rec("OTHER", 1)) + "\n")
    before = (run / "manifest.json").read_bytes()
    with pytest.raises(InputError, match=r"records\.jsonl:2: a record of run 'OTHER', not 'L3'"):
        with ResultsStore(tmp_path, "L3") as store:
            store.start({"k": 1})
    assert (run / "manifest.json").read_bytes() == before  # still 'completed', untouched


def test_a_manifest_of_another_run_or_fingerprint_is_refused(tmp_path):
    run = _completed_run(tmp_path, "L3", fingerprint="aaaa")
    manifest = json.loads((run / "manifest.json").read_text())
    with pytest.raises(InputError, match="run fingerprint aaaa"):
        ResultsStore(tmp_path, "L3").start({}, fingerprint="bbbb")
    (run / "manifest.json").write_text(json.dumps({**manifest, "run_id": "OTHER"}))
    with pytest.raises(InputError, match="belongs to run 'OTHER', not 'L3'"):
        ResultsStore(tmp_path, "L3").start({}, fingerprint="aaaa")
    (run / "manifest.json").write_text(json.dumps(manifest))
    ResultsStore(tmp_path, "L3").start({}, fingerprint="aaaa").get("status") == "running"


def test_a_corrupt_completed_store_stays_completed(tmp_path):
    run = _completed_run(tmp_path, "r1")
    with open(run / "records.jsonl", "a") as fh:
        fh.write("{corrupt\n" + json.dumps(_rec("r1", 1)) + "\n")
    with pytest.raises(InputError, match=r"records\.jsonl:2"):
        with ResultsStore(tmp_path, "r1") as store:
            store.start({"k": 1})
    assert load_manifest(run)["status"] == "completed"
    with ResultsStore(tmp_path, "r1") as store:  # a store that never started: no downgrade
        pass
    assert load_manifest(run)["status"] == "completed"


def test_a_ledger_copied_from_another_run_is_refused(tmp_path):
    from statescope.cluster.ledger import CellLedger

    ledger = CellLedger(tmp_path, "L3")
    ledger.begin("matrix", {"cells": []})
    ledger.finish("completed")
    rec = {"run_id": "OTHER", "build": "b", "config_hash": "cell-1", "episode": "cell", "step": 0,
           "status": "ok"}
    (tmp_path / "L3" / "records.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(InputError, match="a record of run 'OTHER', not 'L3'"):
        CellLedger(tmp_path, "L3").begin("matrix", {"cells": []})
    assert load_manifest(tmp_path / "L3")["status"] == "completed"
    assert load_manifest(tmp_path / "L3")["run_id"] == "L3"


def test_lifetimes_written_as_they_go_count_once_each(tmp_path):
    store = ResultsStore(tmp_path, "r1")
    for metrics in ({}, {"spec_accepted_tokens": 3}, {"spec_accepted_tokens": 7}):
        store.append_lifetime({"build": "trigger", "config_hash": "h", "lifetime": 0,
                               "metrics": metrics})
    store.append_lifetime({"build": "trigger", "config_hash": "h", "lifetime": 1, "metrics": {}})
    lives = load_lifetimes(tmp_path / "r1", "trigger", "h")
    assert [(l["lifetime"], l["metrics"]) for l in lives] == [(0, {"spec_accepted_tokens": 7}), (1, {})]


# -- item 4 -------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MiB tmpfs (the tests run as root in this project's environment)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"cannot mount a tmpfs (run as root): {proc.stderr}"
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_is_one_line_naming_the_path_and_the_run_ends_failed(small_disk):
    kept = 0
    with pytest.raises(StoreWriteFailed) as info:
        with ResultsStore(small_disk, "full") as store:
            store.start({"k": 1})
            for step in range(1000):
                store.append(_rec("full", step, pad="x" * 300_000))
                kept += 1
    msg = str(info.value)
    assert "\n" not in msg and str(small_disk / "full" / "records.jsonl") in msg, msg
    assert "No space left on device" in msg and f"kept {kept} complete record(s)" in msg, msg
    assert load_manifest(small_disk / "full")["status"] == "failed"
    assert not [p for p in (small_disk / "full").iterdir() if p.name.endswith(".tmp")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the record cut by the full disk
        assert list(load_records(small_disk / "full")["step"]) == list(range(kept))


def test_a_refused_manifest_write_leaves_no_temp_file(tmp_path, monkeypatch):
    import errno

    from statescope import records

    def denied(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", str(dst))

    monkeypatch.setattr(records.os, "replace", denied)
    with pytest.raises(StoreWriteFailed, match=r"manifest\.json: cannot write the manifest "
                                               r"\(Permission denied\); kept 0 complete"):
        ResultsStore(tmp_path, "r1").start({"k": 1})
    assert [p.name for p in (tmp_path / "r1").iterdir()] == []  # no temp manifest, 0 bytes or not


def test_the_cli_says_a_full_disk_in_one_line(small_disk, capsys, monkeypatch):
    import importlib

    cli = importlib.import_module("statescope.cli.main")  # the module (``statescope.cli.main`` is the function)

    def fill(args):
        with ResultsStore(small_disk, "cli") as store:
            store.start({})
            while True:
                store.append(_rec("cli", len(store.completed_keys()), pad="x" * 500_000))

    monkeypatch.setattr(cli, "cmd_reproduce", fill)  # the command's body: a run filling the disk
    rc = cli.main(["reproduce"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "No space left on device" in err[0], err
    assert "kept" in err[0] and str(small_disk / "cli" / "records.jsonl") in err[0], err


# -- item 5 -------------------------------------------------------------------------------------
HOLD = """
import sys, time
from statescope.records import ResultsStore
store = ResultsStore(sys.argv[1], sys.argv[2])
store.lock()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_process_on_the_same_run_id_is_refused_before_any_engine(tmp_path, capsys,
                                                                          monkeypatch):
    from statescope.cli.main import main
    from statescope.engine import offline, runners, server

    def refuse(*_a, **_k):
        raise AssertionError("an engine started although the run is locked")

    monkeypatch.setattr(offline.OfflineEngine, "__init__", refuse)
    monkeypatch.setattr(server.VllmServer, "__init__", refuse)
    monkeypatch.setattr(runners.ServerRunner, "__init__", refuse)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "runs"), "twice"],
                              stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc = main(["reproduce", "--runs", str(tmp_path / "runs"), "--run-id", "twice"])
        err = capsys.readouterr().err.strip().splitlines()
        lines = [ln for ln in err if ln.startswith("statescope ")]
        assert rc == 2 and len(lines) == 1, err
        assert f"already being run by pid {holder.pid}" in lines[0], lines
        assert not (tmp_path / "runs" / "twice" / "manifest.json").exists()
    finally:
        holder.kill()  # only the child this test started
        holder.wait()
    ResultsStore(tmp_path / "runs", "twice").lock()  # the holder is gone: its lock with it
