"""``shrink``: the smallest workload that still corrupts — in every one of K re-runs of the trigger
arm — and stays clean in the control arm.

What it does: from a failing workload (a trace, or a ``reproduce`` run folder: its trace and arms),
it confirms the failure, then removes what the failure does not need, phase by phase, each
candidate a real engine run (``statescope.verdict.shrink_run``): delta debugging
(``statescope.verdict.ddmin``) over episodes, then over the steps left (each episode renumbered),
then the batch — ``max_num_seqs`` (ascending powers of two below the number of episodes: the
first that still fails), the token budget ``max_num_batched_tokens`` (halved while it still
fails), the arrival order (reversed) — then prompt length (each text user turn halved while it
still fails). It returns the minimal workload as a trace plus its overrides, every trial (what was
removed, fail/pass, seconds, engine runs) and the conditions the failure needs (the removals that
made it pass). ``result.json`` and ``minimal.jsonl`` are written into the run folder; the
candidate log there makes a re-run resume.

What it deliberately does not do: explain the failure (``capture``/``continuity``/``diverge`` read
the minimal trace), write the standalone reproducer (``statescope.share.repro_script``), or count a
near-tie flip as a failure (``shrink_run.SYMPTOMS``).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from statescope.errors import InputError
from statescope.verdict.ddmin import ddmin
from statescope.verdict.reproduce import Arm
from statescope.verdict.shrink_run import (CandidateRunner, Workload, renumbered,
                                           workload_from_trace)
from statescope.workload.trace import TraceStep, episodes_of, write_trace

PHASES = ("episodes", "steps", "batch", "prompt")
RESULT_FILE = "result.json"
MINIMAL_TRACE = "minimal.jsonl"


@dataclass
class ShrinkResult:
    reproduced: bool
    minimal: Workload | None
    trials: list[dict]
    conditions: list[str]
    engine_runs: int
    engine_starts: int
    seconds: float
    run_dir: Path
    original: dict = field(default_factory=dict)
    final_entry: dict | None = None

    def to_dict(self) -> dict:
        brief = [{k: t.get(k) for k in ("phase", "trial", "removed", "n_requests", "episodes",
                                        "overrides", "failed", "seconds", "engine_runs",
                                        "trigger_failures", "control_failures")}
                 for t in self.trials]
        out = {"reproduced": self.reproduced, "original": self.original, "trials": brief,
               "conditions": self.conditions, "engine_runs": self.engine_runs,
               "engine_starts": self.engine_starts, "seconds": round(self.seconds, 3),
               "run_dir": str(self.run_dir)}
        if self.minimal is not None:
            out["minimal"] = {"episodes": self.minimal.order, "n_requests": self.minimal.n_requests(),
                              "overrides": self.minimal.overrides,
                              "trace": str(self.run_dir / MINIMAL_TRACE),
                              "failing_requests": (self.final_entry or {}).get("trigger_failures",
                                                                               [[]])[-1]}
        return out

    def report_lines(self) -> list[str]:
        lines = []
        for t in self.trials:
            lines.append(f"  [{t['phase']:<8}] #{t['trial']:<3} removed {json.dumps(t['removed'])[:70]:<70} "
                         f"{'FAIL' if t['failed'] else 'pass'} {t['seconds']:7.1f} s")
        if not self.reproduced:
            return lines + ["the failure did not reproduce in every re-run: nothing to shrink"]
        m = self.minimal
        lines.append(f"minimal: {m.n_requests()} request(s) in episode(s) {m.order}, overrides "
                     f"{m.overrides or 'none'} (from {self.original.get('n_requests')} requests)")
        lines += [f"  needs: {c}" for c in self.conditions]
        lines.append(f"{len(self.trials)} trials, {self.engine_runs} engine runs, "
                     f"{self.engine_starts} engine starts, {self.seconds:.0f} s")
        return lines


class _Search:
    """The phases over one CandidateRunner; ``self.current`` is the failing workload so far."""

    def __init__(self, runner: CandidateRunner, current: Workload) -> None:
        self.runner, self.current = runner, current
        self.trials: list[dict] = []
        self.conditions: list[str] = []
        self.last_failing: dict | None = None

    def test(self, work: Workload, phase: str, removed: Any) -> bool:
        entry = self.runner.evaluate(work, phase, removed, len(self.trials) + 1)
        self.trials.append(entry)
        return bool(entry["failed"])

    def accept(self, work: Workload) -> None:
        self.current = work
        self.last_failing = self.runner.done[self.runner.key(work)]  # its failing runs

    def episodes(self) -> None:
        cur = self.current

        def fails(kept: list[str]) -> bool:
            work = Workload([s for s in cur.trace if s.episode in kept],
                            [e for e in cur.order if e in kept], cur.overrides)
            return self.test(work, "episodes", {"episodes": [e for e in cur.order if e not in kept]})

        res = ddmin(cur.order, fails)
        self.accept(Workload([s for s in cur.trace if s.episode in res.minimal],
                             [e for e in cur.order if e in res.minimal], cur.overrides))
        for item, _trial in res.needed():
            self.conditions.append(f"episode {item}: without it the failure is gone")

    def steps(self) -> None:
        cur = self.current
        items = [(s.episode, s.step) for s in cur.trace]
        by_item = {(s.episode, s.step): s for s in cur.trace}

        def work_of(kept: list[tuple]) -> Workload:
            keep = set(kept)
            steps = renumbered([by_item[i] for i in items if i in keep])
            eps = {s.episode for s in steps}
            return Workload(steps, [e for e in cur.order if e in eps], cur.overrides)

        def fails(kept: list[tuple]) -> bool:
            return self.test(work_of(kept), "steps",
                             {"steps": [list(i) for i in items if i not in set(kept)]})

        res = ddmin(items, fails)
        self.accept(work_of(res.minimal))
        kept = [f"{e} step {s}" for e, s in res.minimal]
        self.conditions.append(f"steps {kept} (original numbering), each needed"
                               if res.needed() else f"steps {kept} (original numbering)")
        for (ep, step), _trial in res.needed():
            if step > 0 and (ep, step - 1) not in res.minimal:
                self.conditions.append(f"{ep} step {step} needs no earlier step of its episode")

    def batch(self, resolved: dict) -> None:
        cur = self.current
        n_eps = len(cur.order)
        seqs = cur.overrides.get("max_num_seqs", self.runner.trigger.config.max_num_seqs)
        tries = [v for v in (1, 2, 4, 8, 16) if v < min(n_eps, seqs)]
        found = None
        for value in tries:
            work = dataclasses.replace(cur, overrides={**cur.overrides, "max_num_seqs": value})
            if self.test(work, "batch", {"max_num_seqs": f"{seqs} -> {value}"}):
                found = value
                self.accept(work)
                break
        if tries and found == 1:
            self.conditions.append("no batch partner: max_num_seqs=1 still fails")
        elif tries:
            need = found or min(n_eps, seqs)
            passed = [v for v in tries if v < need]
            self.conditions.append(f"a batch of >= {need} running requests (max_num_seqs="
                                   f"{', '.join(map(str, passed))} passes)")
        self._token_budget(resolved)
        cur = self.current
        if len(cur.order) > 1:
            work = dataclasses.replace(cur, order=list(reversed(cur.order)))
            if self.test(work, "batch", {"arrival_order": "reversed"}):
                self.conditions.append("arrival order does not matter (reversed still fails)")
            else:
                self.conditions.append(f"arrival order {cur.order} (reversed passes)")

    def _token_budget(self, resolved: dict, max_halvings: int = 2) -> None:
        budget = self.current.overrides.get("max_num_batched_tokens") or \
            resolved.get("max_num_batched_tokens")
        floor = int(resolved.get("mamba_block_size") or resolved.get("block_size") or 16)
        if not budget:
            self.conditions.append("token budget not tried (the engine did not report it)")
            return
        for _ in range(max_halvings):
            value = int(budget) // 2
            if value < floor:
                return
            work = dataclasses.replace(self.current, overrides={**self.current.overrides,
                                                                "max_num_batched_tokens": value})
            if not self.test(work, "batch", {"max_num_batched_tokens": f"{budget} -> {value}"}):
                self.conditions.append(f"a token budget of {budget} (max_num_batched_tokens="
                                       f"{value} passes)")
                return
            self.accept(work)
            budget = value

    def prompt(self, max_halvings: int = 2) -> None:
        for index in range(len(self.current.trace)):
            for _ in range(max_halvings):
                step = self.current.trace[index]
                if not isinstance(step.user, str) or len(step.user.split()) < 2 or step.messages:
                    break
                words = step.user.split(" ")
                shorter = " ".join(words[:max(1, len(words) // 2)])
                trace = list(self.current.trace)
                trace[index] = dataclasses.replace(step, user=shorter)
                work = dataclasses.replace(self.current, trace=trace)
                where = f"{step.episode} step {step.step}"
                if not self.test(work, "prompt", {"user_words": f"{where}: {len(words)} -> "
                                                                 f"{len(shorter.split(' '))}"}):
                    self.conditions.append(f"the user turn of {where} at {len(words)} words "
                                           "(half of it passes)")
                    break
                self.accept(work)


def shrink(trace: list[TraceStep], trigger: Arm, control: Arm, run_dir: str | Path, *,
           keep_failing: int = 3, phases: tuple = PHASES,
           say: Callable[[str], None] | None = None) -> ShrinkResult:
    """Shrink ``trace`` (whose trigger arm corrupted) to its minimal failing workload."""
    import time

    bad = [p for p in phases if p not in PHASES]
    if bad:
        raise InputError(f"shrink phases {bad}: expected some of {PHASES}")
    if not trace:
        raise InputError("shrink: the trace is empty")
    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    runner = CandidateRunner(trigger, control, run_dir, keep_failing, say)
    start = workload_from_trace(trace)
    search = _Search(runner, start)
    original = {"n_requests": len(trace), "episodes": len(episodes_of(trace))}
    try:
        if not search.test(start, "confirm", {}):
            return _finish(search, False, runner, t0, run_dir, original)
        search.accept(start)
        resolved = (search.last_failing or {}).get("trigger_run", {}).get("resolved", {})
        original["resolved"] = resolved
        for phase in phases:
            if phase == "batch":
                search.batch(resolved)
            else:
                getattr(search, phase)()
    finally:
        runner.close()
    return _finish(search, True, runner, t0, run_dir, original)


def _finish(search: _Search, reproduced: bool, runner: CandidateRunner, t0: float,
            run_dir: Path, original: dict) -> ShrinkResult:
    import time

    minimal = search.current if reproduced else None
    result = ShrinkResult(reproduced, minimal, search.trials, search.conditions,
                          runner.engine_runs, runner.pool.starts, time.perf_counter() - t0,
                          run_dir, original, search.last_failing if reproduced else None)
    if minimal is not None:
        write_trace(minimal.trace, run_dir / MINIMAL_TRACE)
    doc = result.to_dict()
    if minimal is not None and search.last_failing is not None:
        doc["final_key"] = search.last_failing["key"]
    fault = runner.trigger.fault
    if fault is not None:  # the exported script needs it, labelled PLANTED
        doc["planted"] = json.dumps({k: v for k, v in json.loads(fault.to_env()).items()
                                     if k != "out"})
    (run_dir / RESULT_FILE).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return result


def load_shrink(run_dir: str | Path) -> tuple[dict, dict]:
    """(result.json, the log entry of the minimal failing candidate) of a finished shrink."""
    from statescope.verdict.shrink_run import LOG_FILE

    run_dir = Path(run_dir)
    path = run_dir / RESULT_FILE
    if not path.is_file():
        raise InputError(f"{run_dir}: expected a shrink run folder holding {RESULT_FILE} "
                         "(statescope shrink writes it)")
    doc = json.loads(path.read_text())
    if not doc.get("reproduced") or not doc.get("final_key"):
        raise InputError(f"{path}: the shrink found no failing workload (reproduced="
                         f"{doc.get('reproduced')}): nothing to export")
    for line in (run_dir / LOG_FILE).read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            if entry.get("key") == doc["final_key"]:
                return doc, entry
    raise InputError(f"{run_dir / LOG_FILE}: no candidate {doc['final_key']} (the minimal "
                     "workload's runs): was the log replaced?")
