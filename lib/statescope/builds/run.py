"""Experiments inside builds: one cell per build, a matrix of builds, and bisection probes.

What it does: ``run_cell`` runs one trigger-vs-control experiment (``statescope.verdict.reproduce``) in the
build's own interpreter (``python -m statescope.builds run-cell REQUEST.json``; the build side is
``statescope.builds.cell``), writing the results store and ``cell.json``; this process never
imports the build's vLLM. Its three parts (``write_cell_request``, ``cell_command``,
``read_cell_result``) are public so that ``statescope.cluster.cells`` launches the same cell
inside a Ray task. ``build_matrix`` runs cells across builds (a build that fails to install
or run fails its row only; each row carries the build's source census, ``census``);
``plant_regression`` adds the PLANTED regression patch from a chosen
build on; ``build_probe`` turns cells into a bisection probe (``statescope.bisect``).

What it deliberately does not do: install builds itself (``statescope.builds.install``), decide
anything statistical (``statescope.verdict.stats``, ``statescope.bisect``), or reuse a cell's engine.
"""
from __future__ import annotations

import html
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from statescope.builds.install import clean_env, ensure_build
from statescope.builds.spec import REPO, Build, BuildFailed, BuildSpec
from statescope.errors import EnvironmentBroken, InputError
from statescope.tables import RecordsTable

MATRIX_COLUMNS = ["build", "status", "vllm", "failed", "units", "rate", "outcome", "labels", "census",
                  "detail"]


@dataclass
class CellResult:
    """One trigger-vs-control experiment run in a build's environment (counts are the trigger's)."""
    spec: str
    n_units: int
    n_failed: int
    outcome: str
    unit: str
    labels: list[str]
    vllm: str
    torch: str
    run_dir: str
    log: str
    seconds: float
    control_units: int = 0
    control_failed: int = 0
    copies: dict | None = None  # the fused-copy census (``statescope.builds.cell.CopyCensus``)
    seeds: list | None = None  # the seeds of the cell's trace
    engine_starts: int | None = None  # 2, or 1 when the control run was re-used
    control_reused: str | None = None  # the run directory of a re-used control arm
    runner: dict | None = None  # the resolved runner of each arm (``runner_version``)

    @property
    def rate(self) -> float:
        return self.n_failed / self.n_units if self.n_units else 0.0


def run_cell(spec: BuildSpec | str, *, preset: str = "smoke", seed: int = 0, unit: str = "episode",
             control: str = "reference", store_root: str | Path = "runs", run_id: str | None = None,
             trigger_set: dict | None = None, model: str | None = None, installer: str = "auto",
             geometry: str | None = None, timeout_s: float = 3600, progress=None,
             seeds: Sequence[int] | None = None, control_set: dict | None = None,
             trigger_patches: Sequence[str] = (), control_cache: str | Path | None = None) -> CellResult:
    """Run one experiment in the build's own interpreter; raises BuildFailed or EnvironmentBroken.
    ``progress`` (``statescope.progress``) advances as the cell's records are written. ``seeds``
    (instead of ``seed``): the preset once per seed, as ``reproduce --seeds``; ``trigger_set`` /
    ``control_set``: EngineConfig fields of each arm; ``trigger_patches``: runtime patches of the
    trigger arm (labelled PATCHED / AMPLIFIED, as ``reproduce --trigger-patch``); ``control_cache``:
    a folder where control runs are indexed, so a later cell of the same build, control
    configuration and trace re-uses the control instead of starting its engine again."""
    from statescope.records import new_run_id

    spec = BuildSpec.parse(spec)
    build = ensure_build(spec, installer=installer)
    run_dir = Path(store_root).resolve() / (run_id or new_run_id("build"))
    request = write_cell_request(spec, run_dir, preset=preset, seed=seed, unit=unit, control=control,
                                 trigger_set=trigger_set, model=model, geometry=geometry, seeds=seeds,
                                 control_set=control_set, trigger_patches=trigger_patches,
                                 control_cache=control_cache)
    argv, env = cell_command(build, request)
    t0 = time.perf_counter()
    with open(run_dir / "cell.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        rc = _wait_counting(proc, run_dir / "records.jsonl", timeout_s, progress)
    return read_cell_result(spec, run_dir, rc, time.perf_counter() - t0)


def write_cell_request(spec: BuildSpec, run_dir: Path, *, preset: str = "smoke", seed: int = 0,
                       unit: str = "episode", control: str = "reference",
                       trigger_set: dict | None = None, model: str | None = None,
                       geometry: str | None = None, seeds: Sequence[int] | None = None,
                       control_set: dict | None = None, trigger_patches: Sequence[str] = (),
                       control_cache: str | Path | None = None) -> Path:
    """Create ``run_dir`` and write the request the build side reads (``cell_request.json``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    request = {"spec": spec.text,
               "preset": preset, "seed": seed, "unit": unit, "control": control,
               "store_root": str(run_dir.parent), "run_id": run_dir.name, "model": model,
               "trigger_set": trigger_set or {}, "out": str(run_dir / "cell.json"),
               "geometry": geometry, "seeds": list(seeds) if seeds else None,
               "control_set": control_set or {}, "trigger_patches": list(trigger_patches),
               "control_cache": str(Path(control_cache).resolve()) if control_cache else None}
    (run_dir / "cell_request.json").write_text(json.dumps(request, indent=2))
    return run_dir / "cell_request.json"


def cell_command(build: Build, request: Path) -> tuple[list[str], dict]:
    """The build interpreter's command line and environment for one cell request."""
    # This checkout's statescope wins over the build's editable install, which may point at the
    # checkout that created it. An existing environment brings its own (env.sh's, with this
    # checkout's lib first: statescope.builds.existing.cell_environment).
    if build.env is not None:
        return ([str(build.python), "-m", "statescope.builds", "run-cell", str(request)],
                {**build.env, "VLLM_LOGGING_LEVEL": build.env.get("VLLM_LOGGING_LEVEL", "WARNING")})
    env = clean_env({"VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(REPO / "lib")})
    return [str(build.python), "-m", "statescope.builds", "run-cell", str(request)], env


def read_cell_result(spec: BuildSpec, run_dir: Path, rc: int, seconds: float) -> CellResult:
    """The ``CellResult`` a finished build process left in ``run_dir`` (EnvironmentBroken if none)."""
    out = run_dir / "cell.json"
    if rc != 0 or not out.is_file():
        lines = [l for l in (run_dir / "cell.log").read_text(errors="replace").splitlines() if l.strip()]
        raise EnvironmentBroken(f"build {spec.label}: experiment failed (exit {rc}): "
                                f"{lines[-1] if lines else 'no output'} (log: {run_dir / 'cell.log'})")
    cell = json.loads(out.read_text())
    known = set(CellResult.__dataclass_fields__)
    return CellResult(**{k: v for k, v in cell.items() if k in known}, run_dir=str(run_dir), log=str(run_dir / "cell.log"),
                      seconds=round(seconds, 1))


def _wait_counting(proc: subprocess.Popen, records: Path, timeout_s: float, progress) -> int:
    """Wait for the cell; every second, advance ``progress`` by the records written since."""
    seen, deadline = 0, time.monotonic() + timeout_s
    while True:
        try:
            rc = proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            rc = None
        if progress is not None and records.is_file():
            with records.open("rb") as fh:
                n = sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
            if n > seen:
                progress.advance(n - seen)
                seen = n
        if rc is not None:
            return rc
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            return 124


def cell_requests(preset: str) -> int:
    """Requests one cell sends (both arms) for a preset, for progress totals."""
    from statescope.workload.episodes import PRESETS

    eps, steps = PRESETS[preset][:2] if preset in PRESETS else (1, 1)
    return 2 * eps * steps


class BuildMatrix(RecordsTable):
    """One row per build: the trigger's failures, or why the build could not be measured."""

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.rows)

    def _repr_html_(self) -> str:
        marked = sorted({l for r in self.rows for l in r["labels"] if "PLANTED" in l or "EMULATED" in l})
        return "".join(f"<p style='color:#b00;font-weight:bold'>{html.escape(l)}</p>"
                       for l in marked) + super()._repr_html_()


def build_matrix(specs: Sequence[BuildSpec | str], *, progress=None,
                 **cell_kwargs: Any) -> BuildMatrix:
    """``run_cell`` for every build; a build that fails to install or run fails its row only.
    ``progress`` gets a stage line per build and counts the cells' requests."""
    from statescope.builds.census import build_brief
    from statescope.verdict.stats import clopper_pearson

    parsed = [BuildSpec.parse(s) for s in specs]  # bad spec text is the caller's error: raise now
    rows = []
    for i, spec in enumerate(parsed):
        if progress is not None:
            progress.note(f"build {i + 1}/{len(parsed)}: {spec.label}")
            cell_kwargs["progress"] = progress
        row: dict[str, Any] = {"build": spec.label, "status": "ok", "vllm": None, "failed": None,
                               "units": None, "rate": None, "outcome": None,
                               "labels": [p.label for p in spec.patches], "detail": None}
        try:
            c = run_cell(spec, **cell_kwargs)
            row.update(vllm=c.vllm, failed=c.n_failed, units=c.n_units, rate=round(c.rate, 4),
                       ci95=clopper_pearson(c.n_failed, c.n_units) if c.n_units else None,
                       outcome=c.outcome, labels=c.labels, detail=c.run_dir, seconds=c.seconds,
                       copies=c.copies)
        except BuildFailed as exc:
            row.update(status="install failed", detail=str(exc), log=str(exc.log_path))
        except EnvironmentBroken as exc:
            row.update(status="run failed", detail=str(exc))
        row["census"] = build_brief(spec)  # the build's source census (statescope.builds.census)
        rows.append(row)
    return BuildMatrix("experiments per build (trigger arm)", rows, MATRIX_COLUMNS)


def plant_regression(specs: Sequence[BuildSpec | str], from_index: int,
                     rate: float | None = None) -> list[BuildSpec]:
    """The specs with the PLANTED ``planted_regression`` patch added from ``from_index`` on."""
    parsed = [BuildSpec.parse(s) for s in specs]
    if not 0 <= from_index < len(parsed):
        raise InputError(f"plant_regression from_index={from_index}: expected 0..{len(parsed) - 1}")
    patch = "planted_regression" + (f"={rate}" if rate is not None else "")
    return [s.with_patches(patch) if i >= from_index else s for i, s in enumerate(parsed)]


def build_probe(*, setting: str | None = None, build: BuildSpec | str | None = None,
                first_seed: int = 0, seeds: Sequence[int] | None = None,
                **cell_kwargs: Any) -> Callable[[Any, int], tuple[int, int]]:
    """A bisection probe running cells (seeds first_seed, first_seed + 1, ... per item) until >= n
    units; returns (units, failed). Items are build specs, or with ``setting`` values of that
    EngineConfig field of the trigger arm, run in ``build``. ``first_seed`` > 0 keeps probes
    independent of cells already run with lower seeds (re-runs of one seed are bit-identical).
    ``seeds`` (a seed set, e.g. 0..2): each cell runs the preset once per seed of the set, the
    item's next cell the set shifted by its span (3..5), so no two cells of an item share a seed."""
    counter: dict[str, int] = {}
    span = (max(seeds) - min(seeds) + 1) if seeds else 1

    def probe(item: Any, n: int) -> tuple[int, int]:
        spec = BuildSpec.parse(build if setting else item)
        extra = dict(cell_kwargs)
        if setting:
            extra["trigger_set"] = {**(cell_kwargs.get("trigger_set") or {}), setting: item}
        key, units, failed = f"{spec.text}|{item if setting else ''}", 0, 0
        while units < n:
            counter[key] = counter.get(key, first_seed - 1) + 1
            if seeds:
                j = counter[key] - first_seed
                cell = run_cell(spec, seeds=[s + j * span for s in seeds], **extra)
            else:
                cell = run_cell(spec, seed=counter[key], **extra)
            probe.cells.append(cell)
            if cell.n_units == 0:
                raise EnvironmentBroken(f"build {spec.label}: the experiment completed no units")
            units, failed = units + cell.n_units, failed + cell.n_failed
        return units, failed

    if setting and build is None:
        raise InputError("build_probe(setting=...): expected the build to run the values in")
    probe.cells = []  # type: ignore[attr-defined]
    return probe


def build_seed_probe(*, setting: str | None = None, build: BuildSpec | str | None = None,
                     **cell_kwargs: Any) -> Callable[[Any, list], tuple[int, int]]:
    """A probe of the confirmed bisection (``statescope.bisect.confirmed``): ``probe(item, seeds)``
    runs one cell of ``item`` with that seed set (the preset once per seed) and returns (units,
    failed); items as for ``build_probe``."""
    if setting and build is None:
        raise InputError("build_seed_probe(setting=...): expected the build to run the values in")
    cell_kwargs.pop("seeds", None)  # the search chooses every probe's seeds

    def probe(item: Any, seeds: list) -> tuple[int, int]:
        spec = BuildSpec.parse(build if setting else item)
        extra = dict(cell_kwargs)
        if setting:
            extra["trigger_set"] = {**(cell_kwargs.get("trigger_set") or {}), setting: item}
        cell = run_cell(spec, seeds=list(seeds), **extra)
        probe.cells.append(cell)
        if cell.n_units == 0:
            raise EnvironmentBroken(f"build {spec.label}: the experiment completed no units")
        return cell.n_units, cell.n_failed

    probe.cells = []  # type: ignore[attr-defined]
    return probe
