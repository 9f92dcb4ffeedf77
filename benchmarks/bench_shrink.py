"""What a shrink costs: engine runs, engine starts and seconds, real or simulated.

Usage:
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_shrink.py --simulate [--keep-failing 3] [--compare]
  engine-slot .venv/bin/python benchmarks/bench_shrink.py -- SHRINK ARGS...   (a real shrink)
  .venv/bin/python benchmarks/bench_shrink.py --logs [LOG ...]   (what committed shrinks cost)

``--simulate`` drives the real search (``statescope.verdict.shrink._Search``: the same phases and
ddmin) with a stand-in candidate runner whose predicate has the issue-30 shape: 96 episodes of 6
steps, and the failure needs one request (episode A, its 4th step) with a partner in the batch
(episode B's first steps: a prefill row) and max_num_seqs >= 2. A candidate that passes costs one
engine run (the first clean trigger run stops it); one that fails costs K trigger runs + 1
control. No engine starts; the count is exact for that predicate. The real mode runs
``statescope shrink ARGS --json`` in-process and reports the same counts from its result.
``--logs`` adds up the candidate logs of shrinks that ran (default: the H200 chain from 288
requests to 3, ``data/results/gpu/minimal_reproducer_0.26.0``): candidates, engine runs and engine
seconds per log and phase, each candidate counted once (a resumed shrink's log holds the earlier
one's). The cost goal (issue 30): <= 40 engine runs (and <= 12 GPU-minutes on the H200) for a
96-episode failing run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter


def simulate(keep_failing: int, strict: bool = False, episodes: int = 96, steps: int = 6,
             order: tuple = (), batched_control: bool = True) -> dict:
    from statescope.verdict.reproduce import standard_arms
    from statescope.verdict.shrink import _Search
    from statescope.verdict.shrink_run import Workload
    from statescope.workload.trace import TraceStep, episodes_of

    trace = [TraceStep(f"ep{e:03d}", s, None, f"ep{e:03d} turn {s} " + "word " * 40, 24)
             for e in range(episodes) for s in range(steps)]
    culprit, partner = "ep061", "ep017"

    def fails(work: Workload) -> bool:
        turns = {(s.episode, s.user.split(" ")[2]) for s in work.trace}
        return ((culprit, "3") in turns and (partner, "0") in turns
                and work.overrides.get("max_num_seqs", 32) >= 2)

    def answer_keys(work: Workload) -> set:
        """The control answers a run of ``work`` leaves: every episode and each of its prefixes."""
        keys = set()
        for steps in episodes_of(work.trace).values():
            turns = tuple(s.user for s in steps)
            keys |= {turns[:j] for j in range(1, len(turns) + 1)}
        return keys

    def needed_keys(work: Workload) -> set:
        return {tuple(s.user for s in steps) for steps in episodes_of(work.trace).values()}

    class StandIn:
        def __init__(self) -> None:
            self.trigger, self.control = standard_arms("no_async")
            self.done: dict = {}
            self.engine_runs = 0
            self.engine_starts = 0  # one engine kept while runs ask for its configuration
            self.control_runs = 0
            self.request_runs = 0  # requests x runs: what a run's time grows with
            self.serial_request_runs = 0
            self.answered: set = set()
            self.engine = None

        def key(self, work: Workload, strict: bool = True) -> str:
            return work.key() + ("strict" if strict else "quick")

        def _run(self, arm: str, work: Workload, n_requests: int) -> None:
            config = (arm, tuple(sorted(work.overrides.items())))
            if config != self.engine:
                self.engine_starts += 1
                self.engine = config
            self.engine_runs += 1
            self.control_runs += arm == "control"
            self.request_runs += n_requests
            self.serial_request_runs += n_requests * (work.overrides.get("max_num_seqs", 32) == 1)

        def prefetch_control(self, works: list) -> int:
            if not batched_control:  # as before: each candidate's control answered on its own
                return 0
            todo = [w for w in works if self.key(w, False) not in self.done
                    and needed_keys(w) - self.answered]
            if not todo:
                return 0
            self._run("control", todo[0], sum(w.n_requests() for w in todo))
            for w in todo:
                self.answered |= answer_keys(w)
            return 1

        def evaluate(self, work, phase, removed, trial_no, *, strict=True):
            failed = fails(work)
            before = self.engine_runs
            if strict:
                self._run("control", work, work.n_requests())
            elif needed_keys(work) - self.answered:
                self._run("control", work, work.n_requests())
                self.answered |= answer_keys(work)
            for _ in range(keep_failing if failed and strict else 1):
                self._run("trigger", work, work.n_requests())
            rows = [{"episode": s.episode, "step": s.step,
                     "wave": s.step if batched_control else None,  # lock-step: step k, wave k
                     "symptoms": ["planted"] if failed and (s.episode, s.user.split(" ")[2])
                     == (culprit, "3") else []} for s in work.trace]
            entry = {"key": self.key(work, strict), "phase": phase, "failed": failed,
                     "trigger_failures": [[["ep061", 3]]] if failed else [[]],
                     "engine_runs": self.engine_runs - before,
                     "n_requests": work.n_requests(),
                     "trigger_run": {"rows": rows,
                                     "resolved": {"max_num_batched_tokens": 2048,
                                                  "block_size": 64}}}
            self.done[entry["key"]] = entry
            return entry

    runner = StandIn()
    start = Workload(trace, [f"ep{e:03d}" for e in range(episodes)], {})
    search = _Search(runner, start, strict)
    t0 = time.perf_counter()
    search.test(start, "confirm", {})
    search.accept(start)
    from statescope.verdict.shrink import PHASES

    for phase in order or PHASES:  # the default order, as statescope shrink runs it
        if phase == "batch":
            search.batch({"max_num_batched_tokens": 2048, "block_size": 64})
        else:
            getattr(search, phase)()
    if not strict:  # the result verified: K trigger runs + the control
        search.trials.append(runner.evaluate(search.current, "verify", {}, 0, strict=True))
    per_phase = Counter(t["phase"] for t in search.trials)
    runs = Counter()
    for t in search.trials:
        runs[t["phase"]] += t["engine_runs"]
    return {"mode": "simulated (strict)" if strict else "simulated (quick, verified)",
            "keep_failing": keep_failing, "requests": len(trace),
            "minimal_requests": search.current.n_requests(),
            "minimal_episodes": search.current.order, "trials": len(search.trials),
            "trials_per_phase": dict(per_phase), "engine_runs_per_phase": dict(runs),
            "engine_runs": runner.engine_runs, "engine_starts": runner.engine_starts,
            "control_runs": runner.control_runs, "batched_control": batched_control,
            "request_runs": runner.request_runs,
            "serial_request_runs": runner.serial_request_runs,
            "phases": list(order or PHASES), "conditions": search.conditions,
            "search_s": round(time.perf_counter() - t0, 3)}


def real(shrink_args: list[str]) -> dict:
    import contextlib
    import io

    from statescope.cli.main import main as cli

    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        code = cli(["shrink", *shrink_args, "--json"])
    doc = json.loads(buf.getvalue())
    per_phase, runs = Counter(), Counter()
    for t in doc["trials"]:
        per_phase[t["phase"]] += 1
        runs[t["phase"]] += t["engine_runs"]
    return {"mode": "real", "exit": code, "reproduced": doc["reproduced"],
            "requests": doc["original"].get("n_requests"),
            "minimal_requests": (doc.get("minimal") or {}).get("n_requests"),
            "trials": len(doc["trials"]), "trials_per_phase": dict(per_phase),
            "engine_runs_per_phase": dict(runs), "engine_runs": doc["engine_runs"],
            "engine_starts": doc["engine_starts"], "seconds": round(time.perf_counter() - t0, 1),
            "conditions": doc["conditions"]}


H200_LOGS = [f"data/results/gpu/minimal_reproducer_0.26.0/{p}" for p in (
    "batch_phase/candidates.jsonl.gz",            # 288 -> 198 (episodes), steps (clean), batch -> 2
    "at_two_seqs/shrink/candidates.jsonl")]       # at a batch of two: 198 -> 3 (episodes, steps)


def from_logs(paths: list[str]) -> dict:
    """Candidates, engine runs and engine seconds of committed shrink candidate logs."""
    import gzip

    seen, per_phase, runs, secs = set(), Counter(), Counter(), Counter()
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as fh:
            for line in fh:
                if not line.strip():
                    continue
                c = json.loads(line)
                if c["key"] in seen:
                    continue
                seen.add(c["key"])
                per_phase[c["phase"]] += 1
                runs[c["phase"]] += int(c.get("engine_runs") or 0)
                secs[c["phase"]] += float(c.get("seconds") or 0.0)
    minutes = sum(secs.values()) / 60
    return {"mode": "logs", "logs": paths, "candidates": len(seen),
            "candidates_per_phase": dict(per_phase), "engine_runs_per_phase": dict(runs),
            "engine_minutes_per_phase": {k: round(v / 60, 1) for k, v in secs.items()},
            "engine_runs": sum(runs.values()), "engine_minutes": round(minutes, 1),
            "gpu_minutes_goal": f"{'met' if minutes <= 12 else 'MISSED'} ({minutes:.1f} engine "
                                "minutes, goal <= 12; starts and transfers not counted)"}


def main() -> None:
    argv = sys.argv[1:]
    shrink_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--keep-failing", type=int, default=3)
    ap.add_argument("--strict", action="store_true", help="simulate: K runs + control per candidate")
    ap.add_argument("--phases", default="", help="simulate: the phase order (default: shrink's)")
    ap.add_argument("--compare", action="store_true",
                    help="simulate: also without the batched control answers and the wave cut "
                         "(the search before 2026-12-06), ratios printed")
    ap.add_argument("--logs", nargs="*", default=None, help="candidate logs (default: the H200 chain)")
    ap.add_argument("--json")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.logs is not None:
        out = from_logs(args.logs or H200_LOGS)
    else:
        out = simulate(args.keep_failing, args.strict,
                       order=tuple(p for p in args.phases.split(",") if p)) if args.simulate or not shrink_args else real(shrink_args)
    if args.compare and args.simulate:
        old = simulate(args.keep_failing, args.strict, batched_control=False,
                       order=tuple(p for p in args.phases.split(",") if p))
        out["before"] = {k: old[k] for k in ("engine_runs", "engine_starts", "control_runs",
                                              "trials", "request_runs")}
        out["ratios_before_over_now"] = {k: round(old[k] / max(out[k], 1), 2)
                                         for k in ("engine_runs", "engine_starts", "control_runs")}
    for k, v in out.items():
        print(f"{k:>22}: {v}")
    print(f"{'cost goal':>22}: {'met' if out['engine_runs'] <= 40 else 'MISSED'} "
          f"({out['engine_runs']} engine runs, goal <= 40)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
