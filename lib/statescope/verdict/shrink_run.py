"""One shrink candidate, run for real: does this workload corrupt in every one of K re-runs of the
trigger arm and stay clean in the control arm?

What it does: ``CandidateRunner.evaluate`` runs a candidate workload (a trace, an episode order and
engine overrides) through in-process vLLM engines of the real build, in lock-step waves (the next
step of every unfinished episode is submitted together, in episode order: what
``statescope.engine.runners.run_waves`` does for the offline runner), and labels each output with
the degenerate symptoms of this bug family (``SYMPTOMS``: empty, runs of ``!``/token 0 or of
punctuation; ``statescope.verdict.detect.classify_output``). Strict: the trigger runs first and
stops at the first clean re-run; only a candidate that failed K times runs the control. Quick:
one trigger run, no control (the search's default; its result is then checked strictly). One engine stays
alive and is reused (prefix cache reset) while consecutive runs ask for the same configuration.
Every evaluated candidate is one line of ``candidates.jsonl`` in the run folder, keyed by what it
ran; a re-run with the same folder answers from it without starting an engine.

What it deliberately does not do: decide which candidate to try (``statescope.verdict.shrink``),
compare against the control token by token (a near-tie flip is not a symptom: the shrink keeps
only failures a maintainer can see), or run servers (the offline runner only).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from statescope.errors import InputError
from statescope.records import config_hash
from statescope.verdict.reproduce import Arm, _padder_for, prepare_offline_arm, trace_next_step
from statescope.workload.trace import TraceStep, episodes_of, trace_sha

SYMPTOMS = ("empty", "immediate_eos", "bang_run", "punct_run")
LOG_FILE = "candidates.jsonl"


@dataclass
class Workload:
    """A candidate: the trace's steps, the order episodes arrive in, and engine overrides."""

    trace: list[TraceStep]
    order: list[str]
    overrides: dict = field(default_factory=dict)  # EngineConfig fields (max_num_seqs, ...)

    def key(self) -> str:
        return config_hash({"trace": trace_sha(self.trace), "order": self.order,
                            "overrides": self.overrides})

    def n_requests(self) -> int:
        return len(self.trace)


def symptoms_of(row: dict) -> list[str]:
    from statescope.verdict.detect import classify_output

    deg = classify_output(row["text"], list(row["output_token_ids"]), row["finish_reason"])
    return [r for r in deg.reasons if r in SYMPTOMS]


class EnginePool:
    """At most one live in-process engine, kept while runs ask for its configuration."""

    def __init__(self) -> None:
        self.config = None
        self.runner = None
        self.starts = 0

    def get(self, config):
        from statescope.engine.runners import OfflineRunner

        if self.runner is not None and self.config == config:
            self.runner.reset_prefix_cache()  # no cached state survives from the last candidate
            return self.runner
        self.close()
        self.runner, self.config = OfflineRunner(config), config
        self.starts += 1
        return self.runner

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        self.runner, self.config = None, None


def run_workload(arm: Arm, work: Workload, pool: EnginePool, out: Path) -> dict:
    """One run of ``work`` through ``arm``: rows in wave order (with wave numbers), seconds, the
    engine arguments and environment it ran with."""
    from statescope.engine.offline import import_vllm

    config = arm.config.replace(**work.overrides)
    import_vllm()  # vLLM whole, after statescope's import shims, before any patch reaches in
    prepare_offline_arm(arm, out)
    t0 = time.perf_counter()
    runner = pool.get(config)
    padder = _padder_for(work.trace, runner)
    next_step = trace_next_step(work.trace, padder)
    history: dict[str, list[dict]] = {ep: [] for ep in work.order}
    max_tokens = max(s.max_tokens for s in work.trace)
    rows, wave_no = [], 0
    while wave := [r for ep in work.order if (r := next_step(ep, history[ep])) is not None]:
        records = runner.generate([r.prompt for r in wave], max_tokens=max_tokens)
        for req, rec in zip(wave, records):
            row = {"episode": req.episode, "step": req.step, "wave": wave_no, **rec.to_dict()}
            row["symptoms"] = symptoms_of(row)
            history[req.episode].append(row)
            rows.append(row)
        wave_no += 1
    engine = runner.engine
    from statescope.patches.device_profiles import profile_env

    return {"rows": rows, "seconds": round(time.perf_counter() - t0, 3),
            "engine_args": engine.engine_args,
            # in-process, as OfflineEngine runs it; the profile's variables; the runner choice
            "engine_env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **profile_env(engine.profile),
                           **config.engine_env()},
            "max_tokens": max_tokens, "resolved": _resolved_brief(runner)}


def _resolved_brief(runner) -> dict:
    try:
        r = runner.resolved()
    except Exception as exc:  # information only: a build without a field must not stop a shrink
        return {"error": str(exc)}
    keys = ("vllm_version", "device", "model_runner", "runner_version", "async_scheduling", "max_num_seqs",
            "max_num_batched_tokens", "block_size", "mamba_block_size", "mamba_cache_mode",
            "enable_prefix_caching", "num_speculative_tokens")
    return {k: r.get(k) for k in keys if k in r}


def failed_requests(run: dict) -> list[list]:
    return [[r["episode"], int(r["step"])] for r in run["rows"] if r["symptoms"]]


class CandidateRunner:
    """Evaluates candidates for one (trigger, control) pair, K re-runs each, logged and resumable."""

    def __init__(self, trigger: Arm, control: Arm, run_dir: Path, keep_failing: int = 3,
                 say: Callable[[str], None] | None = None) -> None:
        if isinstance(keep_failing, bool) or not isinstance(keep_failing, int) or keep_failing < 1:
            raise InputError(f"--keep-failing {keep_failing!r}: expected an integer >= 1")
        self.trigger, self.control, self.k = trigger, control, keep_failing
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.run_dir / LOG_FILE
        self.say = say or (lambda text: print(f"shrink: {text}", file=sys.stderr, flush=True))
        self.pool = EnginePool()
        self.engine_runs = 0
        self.done = self._load()

    def _load(self) -> dict[str, dict]:
        done: dict[str, dict] = {}
        if self.log_path.is_file():
            for n, line in enumerate(self.log_path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                    done[entry["key"]] = entry
                except (json.JSONDecodeError, KeyError, TypeError):
                    # a line cut by a killed run is its last one: the candidate is simply re-run
                    if n < len(self.log_path.read_text().splitlines()):
                        raise InputError(f"{self.log_path}:{n}: expected a JSON object with a "
                                         "'key' (a shrink candidate log line)") from None
        return done

    def key(self, work: Workload, strict: bool = True) -> str:
        return config_hash({"work": work.key(), "trigger": self.trigger.key(),
                            "control": self.control.key(), "k": self.k if strict else "quick"})

    def evaluate(self, work: Workload, phase: str, removed: Any, trial_no: int, *,
                 strict: bool = True) -> dict:
        """The candidate's log entry (from the log when it was run before). Strict: ``failed``
        when all K trigger runs showed a symptom and the control showed none; quick: when one
        trigger run did (no control)."""
        key = self.key(work, strict)
        k = self.k if strict else 1
        if key in self.done:
            entry = self.done[key]
            self.say(f"[{phase}] #{trial_no} removed {_brief(removed)}: "
                     f"{'FAIL' if entry['failed'] else 'pass'} (from the log)")
            return entry
        t0 = time.perf_counter()
        reps, control = [], None
        for _ in range(k):
            run = run_workload(self.trigger, work, self.pool, self.run_dir / "trigger")
            self.engine_runs += 1
            reps.append(run)
            if not failed_requests(run):
                break
        all_failed = len(reps) == k and all(failed_requests(r) for r in reps)
        if all_failed and strict:
            control = run_workload(self.control, work, self.pool, self.run_dir / "control")
            self.engine_runs += 1
        failed = all_failed and (not strict or not failed_requests(control))
        entry = {"key": key, "strict": strict, "phase": phase, "trial": trial_no, "removed": removed,
                 "episodes": list(work.order), "n_requests": work.n_requests(),
                 "overrides": work.overrides, "trace_sha": trace_sha(work.trace),
                 "failed": failed, "engine_runs": len(reps) + (control is not None),
                 "trigger_failures": [failed_requests(r) for r in reps],
                 "control_failures": failed_requests(control) if control else None,
                 "seconds": round(time.perf_counter() - t0, 3)}
        if failed:  # strict: what export-repro needs (the requests as sent, the answers, the
            # engine); quick: what the search reads (which requests failed, the resolved engine)
            entry["trigger_run"] = _kept(reps[-1], full=strict)
            entry["control_run"] = _kept(control, full=True) if control else None
        with self.log_path.open("a") as fh:
            fh.write(json.dumps(entry, default=str) + "\n")
            fh.flush()
        self.done[key] = entry
        why = ("" if failed else " (control not clean)" if all_failed else
               f" (clean in trigger run {len(reps)} of {k})")
        self.say(f"[{phase}] #{trial_no} removed {_brief(removed)}: {work.n_requests()} requests, "
                 f"{'FAIL' if failed else 'pass'}{why}, {entry['seconds']:.1f} s, "
                 f"{entry['engine_runs']} engine run(s)")
        return entry

    def close(self) -> None:
        self.pool.close()


ROW_KEYS = ("episode", "step", "wave", "prompt_token_ids", "output_token_ids", "text",
            "finish_reason", "num_cached_tokens", "spec_draft_tokens", "spec_accepted_tokens",
            "symptoms")


def _kept(run: dict, full: bool) -> dict:
    """A run as the log keeps it: rows without logprobs (full) or without prompts and answers
    (a quick candidate's: 576 prompts per failing candidate would make the log hundreds of MB)."""
    keys = ROW_KEYS if full else ("episode", "step", "wave", "symptoms")
    return dict(run, rows=[{k: r.get(k) for k in keys} for r in run["rows"]])


def _brief(removed: Any) -> str:
    text = json.dumps(removed, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def workload_from_trace(trace: list[TraceStep]) -> Workload:
    return Workload(list(trace), list(episodes_of(trace)), {})


def renumbered(steps: list[TraceStep]) -> list[TraceStep]:
    """``steps`` (a subset of a trace, in order) with each episode's steps numbered 0..n-1 again."""
    counts: dict[str, int] = {}
    out = []
    for s in steps:
        out.append(dataclasses.replace(s, step=counts.get(s.episode, 0)))
        counts[s.episode] = counts.get(s.episode, 0) + 1
    return out
