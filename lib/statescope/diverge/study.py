"""The planted-fault divergence study as a few calls: workload, runs, replays, calibration, reports.

What it does: ``staggered_prompts(block_size)`` builds a workload whose decoding crosses Mamba block
boundaries (short prompts end just before the first boundary, long ones before the second) and
whose total prompt length exceeds one step's token budget, so the last prompt is still in prefill
while the others decode — the batch in which two rows have *different* accepted counts, which the
accepted-count permutation needs. ``record_study(trigger_engine, out, prompts, faults)`` records,
in ``mode="full"``, a clean run, re-batched clean runs (same requests in reverse order and in two
halves) and one run per planted fault (a ``faults.FaultSpec``, or CPU copy semantics such as
``("barrierless_tiles", 8192)`` that emulate H-copy), keeping what each fault planted.
``replay_study(clean_engine, study)`` replays every run's tokens through a clean configuration.
``calibrate_study(study)`` measures tolerances (re-batched + replay pairs; oracle pairs) and
``reports(study, name)`` gives the position-aligned first-divergence reports of one run against
its replay and against the oracle.

What it deliberately does not do: start engines (the caller owns them; one alive at a time) or
score hypotheses (``statescope.diverge.hypotheses``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statescope.diverge import noise
from statescope.diverge import replay
from statescope.capture.session import boundary_prompts, record
from statescope.workload.trace import prompt_sha
from statescope.diverge.report import DivergenceReport
from statescope.diverge.by_position import position_report
from statescope.errors import InputError
from statescope.patches.faults import FaultSpec, install_fault, uninstall_fault

CLEAN, REBATCHED = "clean", "rebatched"


def staggered_prompts(block_size: int, n_short: int = 4, n_long: int | None = None, seed: int = 0,
                      budget: int = 4096) -> list[list[int]]:
    """Token-id prompts: ``n_short`` boundary prompts (``capture_session.boundary_prompts``) and
    ``n_long`` seeded random prompts ending 8-11 tokens before the second block boundary (default:
    at least 4, and more where the block is small — a GPU resolves 48-token blocks where a CPU
    resolves 384 — until the prompts overflow one step's ``budget``, so the last one is still in
    prefill while the first ones decode). An explicit ``n_long`` that fits in one step is an error."""
    if block_size < 8 or budget < 1:
        raise InputError(f"staggered_prompts: expected block_size >= 8 and budget >= 1, got "
                         f"{block_size}, {budget}")
    rng = random.Random(seed)
    prompts = boundary_prompts(block_size, n_short)
    i = 0
    while i < (n_long or 4) or (n_long is None and sum(map(len, prompts)) <= budget):
        prompts.append([rng.randrange(3, 250) for _ in range(2 * block_size - 11 + i % 4)])
        i += 1
    if sum(map(len, prompts)) <= budget:
        raise InputError(f"staggered_prompts: {sum(map(len, prompts))} prompt tokens fit in one "
                         f"step of {budget}; add prompts so the last one is still in prefill")
    return prompts


@dataclass
class Study:
    out: Path
    prompts: list
    runs: dict = field(default_factory=dict)  # name -> (CapturedStates, records)
    planted: dict = field(default_factory=dict)  # name -> FaultSpec.planted
    faults: dict = field(default_factory=dict)  # name -> FaultSpec
    replays: dict = field(default_factory=dict)  # name -> ReplayStates
    tolerance: Any = None  # run vs replay (noise.Tolerance)
    oracle_tolerance: Any = None  # run vs oracle
    model_dir: str = ""
    oracles: dict = field(default_factory=dict)  # name -> OracleStates (cached float64 states)
    _reports: dict = field(default_factory=dict)

    def sha(self, i: int) -> str:
        return prompt_sha(self.prompts[i])

    def records(self, name: str) -> list:
        return self.runs[name][1]

    def oracle(self, name: str) -> replay.OracleStates:
        """The oracle for run ``name``'s tokens (kept: its states cost a float64 forward)."""
        if name not in self.oracles:
            tokens = replay.tokens_from_records(self.runs[name][1])
            self.oracles[name] = replay.OracleStates(self.model_dir, tokens)
        return self.oracles[name]


def _full(out: Path, name: str) -> dict:
    return {"output_dir": str(out), "run_id": name, "mode": "full"}


def record_study(engine: Any, out: str | Path, prompts: list, faults: dict[str, Any],
                 max_tokens: int = 16) -> Study:
    """Clean, re-batched and one faulty run per fault on ``engine`` (the trigger configuration)."""
    study = Study(Path(out), prompts, model_dir=str(engine.config.model))
    rec = lambda name, ps: record(engine, _full(study.out, name), ps, max_tokens=max_tokens)  # noqa: E731
    study.runs[CLEAN] = _states(*rec(CLEAN, prompts))
    half = len(prompts) // 2  # same requests, other batch compositions and order
    parts = [rec(f"{REBATCHED}-{i}", ps) for i, ps in
             enumerate((prompts[::-1], prompts[:half], prompts[half:]))]
    study.runs[REBATCHED] = [_states(*p) for p in parts]
    for name, spec in faults.items():
        if isinstance(spec, FaultSpec):
            install_fault(spec)
            try:
                study.runs[name] = _states(*rec(name, prompts))
            finally:
                uninstall_fault()
            study.faults[name], study.planted[name] = spec, list(spec.planted)
        else:
            from statescope.patches import cpu_kernels

            study.runs[name] = _with_copy_semantics(spec, lambda: _states(*rec(name, prompts)))
            # copy semantics are planted only where statescope's CPU kernels run; on a GPU the
            # real kernels copy and this run is the clean configuration again
            study.faults[name] = spec
            study.planted[name] = [{"semantics": spec[0], "tile": spec[1]}] \
                if cpu_kernels.is_installed() else []
    return study


def _with_copy_semantics(semantics: tuple[str, int], run: Any) -> Any:
    """Record under planted CPU copy semantics, e.g. ``("barrierless_tiles", 8192)`` (H-copy),
    on the accelerator's packed launch path as tests/test_capture.py does; restores memmove."""
    from statescope.capture import run as capture_run
    from statescope.patches import cpu_kernels

    cpu_kernels.set_copy_semantics(*semantics)
    capture_run.DEVICE_PATH_ON_CPU = True
    try:
        return run()
    finally:
        cpu_kernels.set_copy_semantics("memmove")
        capture_run.DEVICE_PATH_ON_CPU = False


def planted_as(study: Study, name: str) -> str | None:
    """The label run ``name`` may carry in a hypothesis table: ``name`` when its fault fired or its
    copy semantics were in force, else None (nothing was planted: what it shows is real)."""
    return name if study.planted.get(name) else None


def _states(run: Any, records: list) -> tuple:
    return replay.CapturedStates(run), records


def replay_study(engine: Any, study: Study) -> Study:
    """Replay the clean run and every faulty run through ``engine`` (a clean configuration)."""
    for name, run in study.runs.items():
        if name == REBATCHED:
            continue
        states, records = run
        study.replays[name] = replay.record_replay(engine, states, records, study.out,
                                                   run_id=f"replay-{name}")
    return study


def calibrate_study(study: Study) -> Study:
    """Tolerances: re-batched runs vs the clean run, and the clean run vs its replay (for replay
    comparisons); the clean run vs the oracle (for oracle comparisons)."""
    clean = study.runs[CLEAN][0]
    rebatch = [noise.compare_states(clean, other) for other, _ in study.runs[REBATCHED]]
    vs_replay = noise.compare_states(clean, study.replays[CLEAN])
    study.tolerance = noise.calibrate(rebatch + [vs_replay],
                                      ["clean run vs 3 re-batched clean runs",
                                       "clean run vs its clean replay"])
    study.oracle_tolerance = noise.calibrate([noise.compare_states(clean, study.oracle(CLEAN))],
                                             ["clean run vs float64 oracle"])
    return study


def reports(study: Study, name: str) -> dict[str, DivergenceReport]:
    """``{"replay": ..., "oracle": ...}`` first-divergence reports of run ``name``."""
    if name not in study._reports:
        states = study.runs[name][0]
        study._reports[name] = {
            "replay": position_report(states, study.replays[name], study.tolerance),
            "oracle": position_report(states, study.oracle(name), study.oracle_tolerance)}
    return study._reports[name]


def planted_step(study: Study, name: str, index: int = 0) -> dict:
    """The capture step (req_id, req_step) in which planted record ``index`` of ``name`` fired."""
    states = study.runs[name][0]
    rec = study.planted[name][index]
    st = states.run.steps()
    mine = st[st["req_id"] == rec["req_id"]]
    hit = mine[mine["num_computed_tokens"] == rec["num_computed_tokens"]]
    matched = "exact"
    if hit.empty and rec["num_computed_tokens"] is not None:
        if rec.get("computed_from") == "runner":
            # the runner's count before the step: the step that read the fault is the first one
            # at or after it (the scheduler's count of that step can run ahead under async)
            hit = mine[mine["num_computed_tokens"] >= rec["num_computed_tokens"]].sort_values(
                "num_computed_tokens").head(1)
            matched = "first at or after the runner's count"
        else:
            # the scheduler's count under async scheduling can run ahead of the captured one
            # (drafts counted before their rejection is known): the step that read the fault is
            # the last one at or before it. (The H200 case that prompted this, notebook 06 cell
            # 17, was a fault planted into a finished request: patches.faults._in_this_step.)
            hit = mine[mine["num_computed_tokens"] <= rec["num_computed_tokens"]].sort_values(
                "num_computed_tokens").tail(1)
            matched = "last at or before the scheduler's count"
    if hit.empty:
        raise InputError(f"planted_step: no captured step of {rec['req_id']} at "
                         f"{rec['num_computed_tokens']} computed tokens")
    return {"req_id": rec["req_id"], "req_step": int(hit["req_step"].iloc[0]),
            "prompt_sha": hit["prompt_sha"].iloc[0], "matched": matched, **rec}
