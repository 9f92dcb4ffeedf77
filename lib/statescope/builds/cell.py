"""The build-side half of ``statescope.builds.run.run_cell``: runs inside the build's environment.

What it does: ``run_cell_here(REQUEST.json)`` applies the spec's runtime patches and the request's
``trigger_patches`` to the trigger arm of the request's ``statescope.verdict.experiment.Experiment``
(the process-wide ones -- ``accept_sync``,
``amplify_accept_race``, ``overlap_safe_copy`` -- as the arm's own patches, which
``statescope.verdict.reproduce`` installs for the trigger's engine only and labels PATCHED /
AMPLIFIED), the request's ``trigger_set`` / ``control_set`` to each arm, runs the trigger-vs-control
experiment on the build's vLLM over the preset (once per seed of ``seeds`` when given), and writes
``cell.json`` (counts, outcome, labels, versions, seeds, the resolved runner of each arm, engine
starts, and ``copies``: a census of the fused align-mode copies the CPU kernel stand-ins made --
how many, how many were in-place conv shifts inside one block (the H-copy shape), and how many of
those the applied semantics corrupted -- with the kernel profile used). With a ``control_cache``
folder, a control arm already run for the same environment, vLLM version, control configuration
and trace is re-used (one engine start instead of two), and a fresh one is indexed there.

What it deliberately does not do: install anything, or run in the notebook's own process.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from statescope.builds.spec import BuildSpec

# patches reproduce() installs per arm (statescope.verdict.reproduce._open_runner)
ARM_PATCHES = ("accept_sync", "amplify_accept_race", "overlap_safe_copy")


class CopyCensus:
    """A ``statescope.patches.cpu_kernels`` copy listener that counts copies by what they could do."""

    def __init__(self) -> None:
        self.counts = {"copies": 0, "conv_copies": 0, "in_place_shifts": 0, "corrupting_shifts": 0}
        self.semantics: set[str] = set()

    def __call__(self, event) -> None:
        c = self.counts
        c["copies"] += 1
        c["conv_copies"] += event.state_kind == "conv"
        self.semantics.add(f"{event.semantics}:{event.tile_bytes}")
        if event.in_place_shift:
            c["in_place_shifts"] += 1
            shift = event.src_offset - event.dst_offset  # bytes, inside one block
            # barrier-less tiles corrupt exactly the shifts shorter than a tile and the copy
            c["corrupting_shifts"] += (event.semantics == "barrierless_tiles"
                                       and 0 < shift < min(event.tile_bytes, event.nbytes))

    def summary(self) -> dict:
        from statescope.patches import cpu_kernels

        return {**self.counts, "semantics_applied": sorted(self.semantics),
                "stand_ins_installed": cpu_kernels.is_installed(),
                "kernel_profile": cpu_kernels.installed_release()}


class ControlCache:
    """Control runs indexed by what they answered: the environment (interpreter and vLLM version),
    the control arm's configuration and labels, and the trace; one small JSON file per key,
    written once the cell that ran the control has finished."""

    def __init__(self, folder: str | None, spec: BuildSpec, control, trace) -> None:
        import hashlib
        import sys

        import vllm

        from statescope.workload.trace import trace_sha

        self.folder = Path(folder) if folder else None
        what = {"env": dataclasses.replace(spec, patches=()).text, "python": sys.executable,
                "vllm": vllm.__version__, "control": control.config.to_dict(),
                "labels": control.labels, "name": control.name, "trace": trace_sha(trace)}
        self.key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]
        self.name = control.name

    @property
    def path(self) -> Path | None:
        return self.folder / f"{self.key}.json" if self.folder else None

    def lookup(self):
        """The indexed control ``ArmRun``, or None (no cache, no entry, or its records are gone)."""
        from statescope.errors import InputError
        from statescope.verdict.reproduce import load_arm_run

        if self.path is None or not self.path.is_file():
            return None
        try:
            return load_arm_run(json.loads(self.path.read_text())["run_dir"], self.name)
        except (InputError, KeyError, ValueError, OSError):
            return None

    def index(self, run_dir) -> None:
        if self.path is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"run_dir": str(run_dir), "arm": self.name}))
        os.replace(tmp, self.path)  # atomic: a cell running beside this one reads all or nothing


def _widen_engine_gate(engine, version: str) -> bool:
    """Let ``statescope.engine.offline`` start a release that ``statescope.patches.cpu_kernels_releases`` checked
    but the engine's version gate does not list yet (0.29.0); True when it had to. Build cells
    only: the gate itself belongs to ``statescope.engine.offline``."""
    from statescope.patches.cpu_kernels_releases import RELEASES

    if version.startswith(engine.SUPPORTED_VLLM) or version not in RELEASES:
        return False
    engine.SUPPORTED_VLLM = (*engine.SUPPORTED_VLLM, version)
    return True


def run_cell_here(request_path: str) -> int:
    """The build-side half of ``run_cell`` (runs inside the build's environment)."""
    req = json.loads(Path(request_path).read_text())
    import torch
    import vllm

    from statescope.patches.registry import apply_patches
    from statescope.verdict.experiment import Experiment
    from statescope.verdict.reproduce import reproduce
    from statescope.workload.episodes import preset_trace, seeds_trace

    spec = BuildSpec.parse(req["spec"])
    # the experiment reproduce would build from the same options (one override rule)
    trigger, control = Experiment.from_request(req).arms()
    # reproduce() uninstalls every process-wide patch before each arm's engine and installs the
    # arm's own: those must be the trigger arm's patches, or they would be gone by its start
    own = [p for p in spec.patches if p.name in ARM_PATCHES]
    labels = apply_patches([p for p in spec.patches if p.name not in ARM_PATCHES], trigger,
                           seed=req["seed"])
    trigger.patches = tuple(str(p) for p in own) + trigger.patches
    from statescope.patches import cpu_kernels
    from statescope.engine import offline as engine

    engine_gate_widened = _widen_engine_gate(engine, vllm.__version__)
    census = CopyCensus()
    cpu_kernels.add_copy_listener(census)  # engines run in this process: the listener sees them
    seeds = req.get("seeds")
    trace = (seeds_trace(req["preset"], seeds, geometry=req.get("geometry")) if seeds else
             preset_trace(req["preset"], seed=req["seed"], geometry=req.get("geometry")))
    cache = ControlCache(req.get("control_cache"), spec, control, trace)
    control_run = cache.lookup()
    result = reproduce(trigger, control, trace, store_root=req["store_root"], run_id=req["run_id"],
                       unit=req["unit"], control_run=control_run)
    if control_run is None:
        cache.index(result.run_dir)
    v = result.verdict
    cell = {"spec": spec.label, "n_units": v.trigger.n_units, "n_failed": v.trigger.n_failed_units,
            "outcome": v.outcome, "unit": v.unit, "labels": labels + trigger.labels,
            "vllm": vllm.__version__, "torch": torch.__version__,
            "control_units": v.control.n_units, "control_failed": v.control.n_failed_units,
            "copies": {**census.summary(), "engine_gate_widened": engine_gate_widened},
            "seeds": seeds or [req["seed"]], "engine_starts": 1 if control_run is not None else 2,
            "control_reused": str(control_run.run_dir) if control_run is not None else None,
            "runner": {"trigger": result.trigger.resolved.get("runner_version"),
                       "control": result.control.resolved.get("runner_version")}}
    Path(req["out"]).write_text(json.dumps(cell, indent=2))
    print(json.dumps(cell))
    return 0
