"""Engine runs of shrink candidates: a workload through the trigger (and control) arm, labelled.

What it does: runs a candidate workload (a trace subset, an episode order, engine overrides such
as ``max_num_seqs``/``max_num_batched_tokens``; agent_loop episodes) through in-process vLLM
engines of the real build, in lock-step waves (the next step of every unfinished episode is
submitted together, in episode order: what ``statescope.engine.runners.run_waves`` does for the
offline runner), and labels every answer with the rule ``reproduce`` counts failures by — one
function for both, ``statescope.verdict.detect.label_requests`` (``label_run``): degenerate output
(empty, immediate end, runs of ``!``/token 0 or of punctuation, a repetition loop, an invalid
action when action syntax is graded) or a confident flip from the control arm's answer to the same
request (the first differing step of an episode, at a control margin above ``near_tie``). A row's
``symptoms`` are the reasons it failed (``detect.failure_reasons``).

The control's answers, which a confident flip needs: strict (K re-runs and the control), the
control runs this very candidate first, as ``reproduce`` runs both arms on one trace; the trigger
runs follow, labelled against it, stopping at the first clean one; a control with a failed request
of its own makes the candidate pass without a trigger run. Quick (one trigger run; the search's
default, its result then checked strictly): the control's answers come from
``control_answers.jsonl``, one entry per episode keyed by the control's configuration and the
episode's steps (``trace_sha``); an episode not answered yet is run through the control first (one
engine run for all of them). An agent_loop episode's answers are a function of its steps for the
arm that does not corrupt — the same assumption ``reproduce`` makes when it compares two arms that
batch differently — so removing episodes, changing the batch or the arrival order reuses them,
and only the episodes a steps- or prompt-candidate changed are run again. A reproduce run's
stored control records are not used: they may come from another runner (a server) and another
engine lifetime, while a control run here takes one engine run with the trigger's own runner.

Action syntax is graded as ``reproduce`` decides it (``reproduce.choose_action_validator``: only
when the control speaks the GUI-agent language), decided once, from the control's answers to the
first candidate evaluated (the confirm run of the whole workload), kept in ``labelling.json`` and
applied to every candidate: a one-request candidate cannot say whether the model speaks the
language. The rule's name (``LABELLING``) is part of every candidate's key, so a log written
under another rule (the symptom-only shrink before it) is not read as this one's answers.

One engine stays alive and is reused (prefix cache reset) while consecutive runs ask for the same
configuration; a control with another configuration costs an engine start each way — so the
search asks for the control's answers to a whole ddmin round of candidates first
(``prefetch_control``: one control run), then runs the round's trigger runs on one engine. Every
evaluated candidate is one line of ``candidates.jsonl`` in the run folder, keyed by what it ran; a
re-run with the same folder answers from it without starting an engine.

What it deliberately does not do: decide which candidate to try (``statescope.verdict.shrink``),
count units or test significance (a candidate fails when every one of its trigger runs has a
failed request), or run servers (the offline runner only).
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
from statescope.records import config_hash, rows_by_request
from statescope.verdict.detect import failure_reasons, label_requests
from statescope.verdict.reproduce import (Arm, padder_for, choose_action_validator,
                                          prepare_offline_arm, trace_next_step)
from statescope.workload.trace import TraceStep, episodes_of, trace_sha

# the labelling every candidate is judged by; part of its key (a log of another rule is not reused)
LABELLING = "reproduce: detect.label_requests, action syntax by choose_action_validator"
LOG_FILE = "candidates.jsonl"
CONTROL_FILE = "control_answers.jsonl"
LABELLING_FILE = "labelling.json"
# what a control answer keeps for labelling (the margins decide near-tie vs confident flips)
CONTROL_KEYS = ("episode", "step", "text", "output_token_ids", "finish_reason", "margins")


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

    def only(self, episodes: set) -> "Workload":
        """The same workload with only ``episodes`` (order and overrides kept)."""
        return Workload([s for s in self.trace if s.episode in episodes],
                        [e for e in self.order if e in episodes], self.overrides)


def label_run(run: dict, control_rows: list[dict] | None, validator) -> list[dict]:
    """Label ``run``'s rows as ``reproduce`` labels an arm (``detect.label_requests`` against
    ``control_rows``, matched by episode and step; None: no comparison, as a control's own labels
    are made) and set each row's ``symptoms`` to the reasons it failed (empty: it did not)."""
    control = rows_by_request(control_rows) if control_rows is not None else None
    labels = label_requests(run["rows"], control, action_validator=validator)
    why = {(l["episode"], l["step"]): failure_reasons(l) for l in labels}
    for row in run["rows"]:
        row["symptoms"] = why[(row["episode"], int(row["step"]))]
    return labels


class ControlAnswers:
    """The control arm's answers per episode (the quick search's reference), keyed by the control's
    configuration and the episode's steps, kept in ``control_answers.jsonl`` (resumable). An
    episode's answers also answer each of its prefixes (its first j steps): in lock-step waves a
    step's prompt is built from its own episode's earlier steps and answers only."""

    def __init__(self, path: Path, control: Arm) -> None:
        self.path, self.control_key = Path(path), control.key()
        self.by_key: dict[str, list[dict]] = {}
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                self._keep(entry["key"], list(entry["rows"]), list(entry.get("prefixes", [])))
            except (json.JSONDecodeError, KeyError, TypeError):
                if n < len(lines):  # only a killed run's last line may be cut
                    raise InputError(f"{self.path}:{n}: expected a JSON object with 'key' and "
                                     "'rows' (a shrink's control answers)") from None

    def _keep(self, key: str, rows: list[dict], prefixes: list[str]) -> None:
        self.by_key[key] = rows
        for j, pkey in enumerate(prefixes, 1):  # prefixes[j-1]: the episode's first j steps
            self.by_key.setdefault(pkey, rows[:j])

    def key_of(self, steps: list[TraceStep]) -> str:
        """The key of one episode's ``steps`` for this control."""
        return config_hash({"control": self.control_key, "steps": trace_sha(steps)})

    def missing(self, work: Workload) -> list[str]:
        """The episodes of ``work`` the control has not answered yet, in arrival order."""
        eps = episodes_of(work.trace)
        return [e for e in work.order if self.key_of(eps[e]) not in self.by_key]

    def add_episode(self, steps: list[TraceStep], rows: list[dict]) -> None:
        """Keep the control's answers (``rows``, in step order) to one episode's ``steps``."""
        key = self.key_of(steps)
        mine = [{k: r.get(k) for k in CONTROL_KEYS} for r in rows]
        prefixes = ([self.key_of(steps[:j]) for j in range(1, len(steps))]
                    if len(mine) == len(steps) else [])
        self._keep(key, mine, prefixes)
        with self.path.open("a") as fh:
            fh.write(json.dumps({"key": key, "episode": steps[0].episode, "rows": mine,
                                 "prefixes": prefixes}, default=str) + "\n")
            fh.flush()

    def add(self, work: Workload, rows: list[dict]) -> None:
        """Keep the control's answers to every episode of ``work`` (``rows``: its run's rows)."""
        for episode, steps in episodes_of(work.trace).items():
            self.add_episode(steps, [r for r in rows if r["episode"] == episode])

    def rows(self, work: Workload) -> list[dict]:
        """The control's answers to every request of ``work`` (each episode answered before)."""
        eps = episodes_of(work.trace)
        return [r for e in work.order for r in self.by_key[self.key_of(eps[e])]]


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
    """One run of ``work`` through ``arm``: rows in wave order (with wave numbers; unlabelled:
    ``label_run`` labels them), seconds, the engine arguments and environment it ran with."""
    from statescope.engine.offline import import_vllm

    config = arm.config.with_overrides(work.overrides, where="shrink candidate")  # the one rule
    import_vllm()  # vLLM whole, after statescope's import shims, before any patch reaches in
    prepare_offline_arm(arm, out)
    t0 = time.perf_counter()
    runner = pool.get(config)
    padder = padder_for(work.trace, runner)
    next_step = trace_next_step(work.trace, padder)
    history: dict[str, list[dict]] = {ep: [] for ep in work.order}
    max_tokens = max(s.max_tokens for s in work.trace)
    rows, wave_no = [], 0
    while wave := [r for ep in work.order if (r := next_step(ep, history[ep])) is not None]:
        records = runner.generate([r.prompt for r in wave], max_tokens=max_tokens)
        for req, rec in zip(wave, records):
            row = {"episode": req.episode, "step": req.step, "wave": wave_no, **rec.to_dict()}
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
    """[episode, step] of every request of a labelled run that failed."""
    return [[r["episode"], int(r["step"])] for r in run["rows"] if r["symptoms"]]


class CandidateRunner:
    """Evaluates candidates for one (trigger, control) pair, K re-runs each, logged and resumable.
    ``action_syntax``: as ``reproduce``'s (None: graded when the control speaks the language)."""

    def __init__(self, trigger: Arm, control: Arm, run_dir: Path, keep_failing: int = 3,
                 say: Callable[[str], None] | None = None,
                 action_syntax: bool | None = None) -> None:
        if isinstance(keep_failing, bool) or not isinstance(keep_failing, int) or keep_failing < 1:
            raise InputError(f"--keep-failing {keep_failing!r}: expected an integer >= 1")
        if action_syntax not in (None, True, False):
            raise InputError(f"action_syntax={action_syntax!r}: expected None, True or False")
        self.trigger, self.control, self.k = trigger, control, keep_failing
        self.action_syntax = action_syntax
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.run_dir / LOG_FILE
        self.say = say or (lambda text: print(f"shrink: {text}", file=sys.stderr, flush=True))
        self.pool = EnginePool()
        self.engine_runs = 0
        self.done = self._load()
        self.answers = ControlAnswers(self.run_dir / CONTROL_FILE, control)
        self.graded = self._load_labelling()  # action syntax graded? None: not decided yet

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

    def _load_labelling(self) -> bool | None:
        if self.action_syntax is not None:
            return self.action_syntax
        path = self.run_dir / LABELLING_FILE
        if not path.is_file():
            return None
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise InputError(f"{path}: expected the JSON a shrink writes (its labelling)") from None
        if doc.get("rule") != LABELLING or doc.get("control") != self.control.key():
            return None  # decided for another rule or control: decide again
        return bool(doc["action_syntax"])

    def labelling(self) -> dict:
        """The rule the candidates are judged by, for the result and the exported script."""
        return {"rule": LABELLING, "action_syntax": self.graded,
                "asked": "auto" if self.action_syntax is None else self.action_syntax}

    def validator(self, control_rows: list[dict], work: Workload):
        """The action validator of every candidate: ``reproduce``'s choice, made once from the
        control's answers to the first candidate evaluated (the whole workload's confirm)."""
        if self.graded is None:
            texts = [r["text"] for r in control_rows]
            self.graded = choose_action_validator(texts, self.action_syntax) is not None
            doc = {**self.labelling(), "control": self.control.key(),
                   "decided_from": {"trace_sha": trace_sha(work.trace), "n_requests": len(texts)}}
            (self.run_dir / LABELLING_FILE).write_text(json.dumps(doc, indent=2) + "\n")
            self.say(f"action syntax {'graded' if self.graded else 'not graded'} (the control's "
                     f"answers to {len(texts)} request(s), reproduce's rule)")
        return choose_action_validator([], self.graded)

    def key(self, work: Workload, strict: bool = True) -> str:
        return config_hash({"work": work.key(), "trigger": self.trigger.key(),
                            "control": self.control.key(), "k": self.k if strict else "quick",
                            "labelling": LABELLING, "action_syntax": self.action_syntax})

    def control_rows(self, work: Workload) -> list[dict]:
        """The control's answers to ``work`` for the quick search: from ``control_answers.jsonl``,
        the episodes not answered yet run through the control first (one engine run)."""
        missing = set(self.answers.missing(work))
        if missing:
            sub = work.only(missing)
            run = run_workload(self.control, sub, self.pool, self.run_dir / "control")
            self.engine_runs += 1
            self.answers.add(sub, run["rows"])
        return self.answers.rows(work)

    def prefetch_control(self, works: list[Workload]) -> int:
        """The control's answers to every episode of ``works`` (candidates not evaluated yet) not
        answered yet, in one engine run per (overrides, max_tokens) instead of one control run
        (and an engine start each way) per candidate. The episodes are renamed apart (``#n``) in
        that run — a name is not part of any prompt — and kept under their own steps' keys.
        Returns the number of engine runs made."""
        groups: dict[str, dict] = {}
        for work in works:
            if self.key(work, strict=False) in self.done:
                continue
            eps = episodes_of(work.trace)
            gkey = config_hash({"overrides": work.overrides,
                                "max_tokens": max(s.max_tokens for s in work.trace)})
            group = groups.setdefault(gkey, {"overrides": work.overrides, "episodes": {}})
            for ep in self.answers.missing(work):
                group["episodes"].setdefault(self.answers.key_of(eps[ep]), eps[ep])
        runs = 0
        for group in groups.values():
            if not group["episodes"]:
                continue
            trace, names = [], {}
            for n, steps in enumerate(group["episodes"].values()):
                name = f"{steps[0].episode}#{n}"
                names[name] = steps
                trace += [dataclasses.replace(s, episode=name) for s in steps]
            run = run_workload(self.control, Workload(trace, list(names), group["overrides"]),
                               self.pool, self.run_dir / "control")
            self.engine_runs += 1
            runs += 1
            for name, steps in names.items():
                self.answers.add_episode(steps, [dict(r, episode=steps[0].episode)
                                                 for r in run["rows"] if r["episode"] == name])
            self.say(f"control answers for {len(names)} episode variant(s) of {len(works)} "
                     f"candidate(s) in one engine run, {run['seconds']:.1f} s")
        return runs

    def evaluate(self, work: Workload, phase: str, removed: Any, trial_no: int, *,
                 strict: bool = True) -> dict:
        """The candidate's log entry (from the log when it was run before). Strict: ``failed``
        when the control (run on this candidate first) has no failed request and each of K
        trigger runs has one; quick: when one trigger run has one, against the control's kept
        answers. Failed as ``reproduce`` labels requests (``label_run``)."""
        key = self.key(work, strict)
        k = self.k if strict else 1
        if key in self.done:
            entry = self.done[key]
            self.say(f"[{phase}] #{trial_no} removed {_brief(removed)}: "
                     f"{'FAIL' if entry['failed'] else 'pass'} (from the log)")
            return entry
        t0 = time.perf_counter()
        runs_before = self.engine_runs
        reps, control = [], None
        if strict:  # the control's own run of this candidate, as reproduce runs both arms
            control = run_workload(self.control, work, self.pool, self.run_dir / "control")
            self.engine_runs += 1
            control_rows = control["rows"]
        else:
            control_rows = self.control_rows(work)
        validator = self.validator(control_rows, work)
        if control is not None:
            label_run(control, None, validator)
        control_clean = control is None or not failed_requests(control)
        for _ in range(k if control_clean else 0):
            run = run_workload(self.trigger, work, self.pool, self.run_dir / "trigger")
            self.engine_runs += 1
            label_run(run, control_rows, validator)
            reps.append(run)
            if not failed_requests(run):
                break
        all_failed = len(reps) == k and all(failed_requests(r) for r in reps)
        failed = all_failed and control_clean
        entry = {"key": key, "strict": strict, "phase": phase, "trial": trial_no, "removed": removed,
                 "episodes": list(work.order), "n_requests": work.n_requests(),
                 "overrides": work.overrides, "trace_sha": trace_sha(work.trace),
                 "failed": failed, "engine_runs": self.engine_runs - runs_before,
                 "trigger_failures": [failed_requests(r) for r in reps],
                 "control_failures": failed_requests(control) if control else None,
                 "labelling": self.labelling(),
                 "seconds": round(time.perf_counter() - t0, 3)}
        if failed:  # strict: what export-repro needs (the requests as sent, the answers, the
            # engine, the control's margins); quick: what the search reads (which requests
            # failed, the resolved engine)
            entry["trigger_run"] = _kept(reps[-1], full=strict)
            entry["control_run"] = (_kept(control, full=True, extra=("margins",))
                                    if control else None)
        with self.log_path.open("a") as fh:
            fh.write(json.dumps(entry, default=str) + "\n")
            fh.flush()
        self.done[key] = entry
        why = ("" if failed else " (control not clean)" if not control_clean else
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


def _kept(run: dict, full: bool, extra: tuple = ()) -> dict:
    """A run as the log keeps it: rows without logprobs (full; ``extra``: more row keys, e.g. the
    control's margins) or without prompts and answers (a quick candidate's: 576 prompts per
    failing candidate would make the log hundreds of MB)."""
    keys = (ROW_KEYS + tuple(extra)) if full else ("episode", "step", "wave", "symptoms")
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
