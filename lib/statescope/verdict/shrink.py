"""``shrink``: the smallest workload that still corrupts — in every one of K re-runs of the trigger
arm — and stays clean in the control arm.

What it does: from a failing workload (a trace, or a ``reproduce`` run folder: its trace and arms),
it confirms the failure, then removes what the failure does not need, phase by phase, each
candidate a real engine run (``statescope.verdict.shrink_run``): first the batch is narrowed
(``max_num_seqs`` 2, 4, 8, 16: the first that still fails; at a small batch the later phases need
far fewer candidates), then delta debugging
(``statescope.verdict.ddmin``) over episodes, then over the steps left (first every step after
the last wave holding a failed request is dropped, in one test; then ddmin, each episode
renumbered, the control's answers to a whole ddmin round fetched in one run) — partners first: the failing requests' own episodes/steps are kept while ddmin searches the
others, then reduced themselves —
then the batch — ``max_num_seqs`` (ascending powers of two from 1 below the current batch and the
number of episodes: the first that still fails, so "no partner needed" is tried on the small workload), the token budget ``max_num_batched_tokens`` (halved while it still
fails), the arrival order (reversed) — then prompt length (each text user turn halved while it
still fails; the control answers every first halving in one run). A candidate fails as ``reproduce`` counts a failure — the same labelling function
(``statescope.verdict.detect.label_requests``, through ``shrink_run.label_run``): a degenerate
answer (empty, runs of ``!``/punctuation, a repetition loop, an invalid action when the control
speaks the GUI-agent language) or a confident flip from the control arm's answer to the same
request; a near-tie flip is not a failure. The control's answers are the shrink's own control
runs: of the candidate itself when strict, else kept per episode and re-run only for episodes a
candidate changed (``shrink_run``'s docstring says why that is sound). By default a candidate is
judged by one trigger run (these failures are deterministic per workload) and the result is
verified with K trigger runs and the control — a result that does not hold is searched again with
K runs + control per candidate (``strict``). It
returns the minimal workload as a trace plus its overrides, every trial (what was
removed, fail/pass, seconds, engine runs) and the conditions the failure needs (the removals that
made it pass). ``result.json`` and ``minimal.jsonl`` are written into the run folder; the
candidate log there makes a re-run resume.

What it deliberately does not do: explain the failure (``capture``/``continuity``/``diverge`` read
the minimal trace), write the standalone reproducer (``statescope.share.repro_script``), or judge a
request by any rule but ``reproduce``'s.
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

# "narrow" first: at the smallest failing batch the episodes and steps phases converge in far
# fewer candidates (the H200 chain: the steps phase at a batch of 32 spent ~100 clean candidates;
# at a batch of two, 198 -> 3 requests took 36), and one request at a time (the slowest run of a
# large workload) is only tried by "batch", once the workload is small
PHASES = ("narrow", "episodes", "steps", "batch", "prompt")
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
    labelling: dict = field(default_factory=dict)  # the rule candidates were judged by

    def to_dict(self) -> dict:
        brief = [{k: t.get(k) for k in ("phase", "trial", "removed", "n_requests", "episodes",
                                        "overrides", "failed", "seconds", "engine_runs",
                                        "trigger_failures", "control_failures")}
                 for t in self.trials]
        out = {"reproduced": self.reproduced, "original": self.original, "trials": brief,
               "conditions": self.conditions, "engine_runs": self.engine_runs,
               "engine_starts": self.engine_starts, "seconds": round(self.seconds, 3),
               "run_dir": str(self.run_dir), "labelling": self.labelling}
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
        graded = self.labelling.get("action_syntax")
        lines.append("judged as reproduce labels requests (degenerate, or a confident flip from the "
                     f"control; action syntax {'graded' if graded else 'not graded'})")
        lines.append(f"{len(self.trials)} trials, {self.engine_runs} engine runs, "
                     f"{self.engine_starts} engine starts, {self.seconds:.0f} s")
        return lines


def _listed(items: list) -> list:
    return [list(i) if isinstance(i, tuple) else i for i in items]


class _Search:
    """The phases over one CandidateRunner; ``self.current`` is the failing workload so far."""

    def __init__(self, runner: CandidateRunner, current: Workload, strict: bool = False) -> None:
        self.runner, self.current, self.strict = runner, current, strict
        self.trials: list[dict] = []
        self.conditions: list[str] = []
        self.last_failing: dict | None = None

    def test(self, work: Workload, phase: str, removed: Any) -> bool:
        entry = self.runner.evaluate(work, phase, removed, len(self.trials) + 1,
                                     strict=self.strict)
        self.trials.append(entry)
        return bool(entry["failed"])

    def accept(self, work: Workload) -> None:
        self.current = work
        self.last_failing = self.runner.done[self.runner.key(work, self.strict)]  # its runs

    def failing_now(self) -> list[tuple]:
        """(episode, step) of the requests that failed in the current workload's last run."""
        runs = (self.last_failing or {}).get("trigger_failures") or [[]]
        return [tuple(f) for f in runs[-1]]

    def _reduce(self, items: list, fixed: list, make: Callable[[set], Workload], phase: str,
                name: str) -> tuple[list, list]:
        """ddmin over ``items``: first over those not in ``fixed`` (the failing requests' own
        items: almost surely needed, so the search spends its tests on the partners) with
        ``fixed`` kept — after one test of ``fixed`` alone — then over ``fixed`` with the partners
        found. Returns (the minimum in ``items`` order, the needed items)."""
        fixed = [i for i in items if i in set(fixed)]
        free = [i for i in items if i not in set(fixed)]

        def tester(base: list, pool: list) -> Callable[[list], bool]:
            def fails(kept: list) -> bool:
                gone = [i for i in pool if i not in set(kept)]
                return self.test(make(set(kept) | set(base)), phase, {name: _listed(gone)})
            return fails

        def preparer(base: list) -> Callable[[list[list]], None] | None:
            if self.strict:  # a strict candidate's control runs that very candidate
                return None
            return lambda cands: self.runner.prefetch_control(
                [make(set(kept) | set(base)) for kept in cands])

        needed: list = []
        alone_fails = bool(fixed and free and tester(fixed, free)([]))
        if alone_fails:
            free = []  # the failing requests alone still fail: no partner needed
        elif free:
            res = ddmin(free, tester(fixed, free), preparer(fixed))
            free, needed = res.minimal, [i for i, _ in res.needed()]
            if fixed and len(free) == 1:
                needed = list(free)  # the failing requests alone passed: their partner is needed
        if len(fixed) > 1:  # the failing requests themselves, with the partners found
            res = ddmin(fixed, tester(free, fixed), preparer(free))
            fixed = res.minimal
            needed += [i for i, _ in res.needed()]
        if not fixed:  # nothing failed in the last run's view (e.g. from an older log): plain ddmin
            res = ddmin(items, tester([], items), preparer([]))
            return res.minimal, [i for i, _ in res.needed()]
        keep = set(fixed) | set(free)
        return [i for i in items if i in keep], [i for i in items if i in set(needed)]

    def episodes(self) -> None:
        cur = self.current

        def make(kept: set) -> Workload:
            return Workload([s for s in cur.trace if s.episode in kept],
                            [e for e in cur.order if e in kept], cur.overrides)

        failing = list(dict.fromkeys(e for e, _ in self.failing_now()))
        minimal, needed = self._reduce(list(cur.order), failing, make, "episodes", "episodes")
        self.accept(make(set(minimal)))
        for item in needed:
            role = "fails" if item in failing else "partner"
            self.conditions.append(f"episode {item} ({role}): without it the failure is gone")

    def _cut_after_failing_wave(self) -> None:
        """Drop every step submitted after the last wave holding a failed request: a later wave
        starts once that one has finished, so it cannot have made it fail (one test; each
        episode keeps a prefix of its steps, whose control answers are already known)."""
        rows = ((self.last_failing or {}).get("trigger_run") or {}).get("rows") or []
        waves = [int(r["wave"]) for r in rows if r.get("symptoms") and r.get("wave") is not None]
        if not waves:
            return
        last = max(waves)
        kept = {(r["episode"], int(r["step"])) for r in rows if int(r["wave"]) <= last}
        cur = self.current
        if len(kept) >= len(cur.trace):
            return
        steps = [s for s in cur.trace if (s.episode, s.step) in kept]
        eps = {s.episode for s in steps}
        work = Workload(steps, [e for e in cur.order if e in eps], cur.overrides)
        gone = len(cur.trace) - len(steps)
        if self.test(work, "steps", {"after_wave": last, "requests": gone}):
            self.accept(work)
            self.conditions.append(f"nothing after wave {last} (the last with a failed request): "
                                   f"{gone} later request(s) dropped")

    def steps(self) -> None:
        self._cut_after_failing_wave()
        cur = self.current
        items = [(s.episode, s.step) for s in cur.trace]
        by_item = {(s.episode, s.step): s for s in cur.trace}

        def make(kept: set) -> Workload:
            steps = renumbered([by_item[i] for i in items if i in kept])
            eps = {s.episode for s in steps}
            return Workload(steps, [e for e in cur.order if e in eps], cur.overrides)

        minimal, needed = self._reduce(items, self.failing_now(), make, "steps", "steps")
        self.accept(make(set(minimal)))
        kept = [f"{e} step {s}" for e, s in minimal]
        self.conditions.append(f"steps {kept} (numbered as before this phase)")
        for ep, step in needed:
            if step > 0 and (ep, step - 1) not in minimal:
                self.conditions.append(f"{ep} step {step} needs no earlier step of its episode")

    def narrow(self) -> None:
        """The fewest running requests (``max_num_seqs`` 2, 4, 8, 16: the first that fails) that
        still fail, before any other phase; one request at a time waits for ``batch``."""
        cur = self.current
        seqs = cur.overrides.get("max_num_seqs", self.runner.trigger.config.max_num_seqs)
        for value in [v for v in (2, 4, 8, 16) if v < min(len(cur.order), seqs)]:
            work = dataclasses.replace(cur, overrides={**cur.overrides, "max_num_seqs": value})
            if self.test(work, "narrow", {"max_num_seqs": f"{seqs} -> {value}"}):
                self.accept(work)
                return

    def batch(self, resolved: dict) -> None:
        cur = self.current
        n_eps = len(cur.order)
        seqs = cur.overrides.get("max_num_seqs", self.runner.trigger.config.max_num_seqs)
        tries = [v for v in (1, 2, 4, 8, 16) if v < min(n_eps, seqs)]
        if n_eps < seqs:
            tries.append(n_eps)  # the least that still runs every episode at once
        found = None
        for value in tries:
            work = dataclasses.replace(cur, overrides={**cur.overrides, "max_num_seqs": value})
            if self.test(work, "batch", {"max_num_seqs": f"{seqs} -> {value}"}):
                found = value
                self.accept(work)
                break
        if tries and found == 1:
            self.conditions.append("no batch partner: max_num_seqs=1 still fails")
        elif tries and n_eps > 1:
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

    def _halved(self, index: int) -> tuple[Workload, int, int] | None:
        """The current workload with step ``index``'s text user turn halved (None: nothing to
        halve), with the word counts before and after."""
        step = self.current.trace[index]
        if not isinstance(step.user, str) or len(step.user.split()) < 2 or step.messages:
            return None
        words = step.user.split(" ")
        shorter = " ".join(words[:max(1, len(words) // 2)])
        trace = list(self.current.trace)
        trace[index] = dataclasses.replace(step, user=shorter)
        return dataclasses.replace(self.current, trace=trace), len(words), len(shorter.split(" "))

    def prompt(self, max_halvings: int = 2) -> None:
        if not self.strict:  # every first halving's control answers in one run, not one each
            firsts = [h[0] for i in range(len(self.current.trace)) if (h := self._halved(i))]
            self.runner.prefetch_control(firsts)
        for index in range(len(self.current.trace)):
            for _ in range(max_halvings):
                halved = self._halved(index)
                if halved is None:
                    break
                step = self.current.trace[index]
                work, n_words, n_short = halved
                where = f"{step.episode} step {step.step}"
                if not self.test(work, "prompt", {"user_words": f"{where}: {n_words} -> "
                                                                 f"{n_short}"}):
                    self.conditions.append(f"the user turn of {where} at {n_words} words "
                                           "(half of it passes)")
                    break
                self.accept(work)


def shrink(trace: list[TraceStep], trigger: Arm, control: Arm, run_dir: str | Path, *,
           keep_failing: int = 3, phases: tuple = PHASES, strict: bool = False,
           say: Callable[[str], None] | None = None,
           action_syntax: bool | None = None) -> ShrinkResult:
    """Shrink ``trace`` (whose trigger arm corrupted) to its minimal failing workload.

    Default (quick): a candidate fails when one trigger run has a request ``reproduce`` would
    count as failed, against the control's answers (the failures this tool is for are
    deterministic per workload); the result is then verified — the control and K trigger runs of
    it — and a result that does not hold is searched again strictly. ``strict=True``: every
    candidate gets the control and the K re-runs. ``action_syntax``: as ``reproduce``'s."""
    import time

    bad = [p for p in phases if p not in PHASES]
    if bad:
        raise InputError(f"shrink phases {bad}: expected some of {PHASES}")
    if not trace:
        raise InputError("shrink: the trace is empty")
    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    runner = CandidateRunner(trigger, control, run_dir, keep_failing, say, action_syntax)
    start = workload_from_trace(trace)
    original = {"n_requests": len(trace), "episodes": len(episodes_of(trace))}

    def search_in(strict_mode: bool) -> tuple[_Search, bool]:
        search = _Search(runner, start, strict_mode)
        if not search.test(start, "confirm", {}):
            return search, False
        search.accept(start)
        resolved = (search.last_failing or {}).get("trigger_run", {}).get("resolved", {})
        original["resolved"] = resolved
        for phase in phases:
            if phase == "batch":
                search.batch(resolved)
            else:
                getattr(search, phase)()
        return search, True

    try:
        search, found = search_in(strict)
        if found and not strict:
            # the quick search's result must fail in every one of K runs, with a clean control
            entry = runner.evaluate(search.current, "verify", {}, len(search.trials) + 1,
                                    strict=True)
            search.trials.append(entry)
            if entry["failed"]:
                search.last_failing = entry
            else:
                runner.say("the quick result did not fail in every re-run with a clean control: "
                           "searching again with K re-runs and the control per candidate")
                earlier = search.trials
                search, found = search_in(True)
                search.trials = earlier + search.trials
    finally:
        runner.close()
    return _finish(search, found, runner, t0, run_dir, original)


def _finish(search: _Search, reproduced: bool, runner: CandidateRunner, t0: float,
            run_dir: Path, original: dict) -> ShrinkResult:
    import time

    minimal = search.current if reproduced else None
    result = ShrinkResult(reproduced, minimal, search.trials, search.conditions,
                          runner.engine_runs, runner.pool.starts, time.perf_counter() - t0,
                          run_dir, original, search.last_failing if reproduced else None,
                          runner.labelling())
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
