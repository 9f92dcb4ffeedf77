"""The build-side half of ``statescope.builds.run.run_cell``: runs inside the build's environment.

What it does: ``run_cell_here(REQUEST.json)`` applies the spec's runtime patches to the trigger arm,
runs the trigger-vs-control experiment on the build's vLLM, and writes ``cell.json`` (counts,
outcome, labels, versions, and ``copies``: a census of the fused align-mode copies the CPU kernel
stand-ins made -- how many, how many were in-place conv shifts inside one block (the H-copy
shape), and how many of those the applied semantics corrupted -- with the kernel profile used).

What it deliberately does not do: install anything, or run in the notebook's own process.
"""
from __future__ import annotations

import json
from pathlib import Path

from statescope.builds.spec import BuildSpec


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

    from statescope.verdict.matrix import cell_config
    from statescope.patches.registry import apply_patches
    from statescope.verdict.reproduce import reproduce, standard_arms
    from statescope.workload.episodes import preset_trace

    spec = BuildSpec.parse(req["spec"])
    trigger, control = standard_arms(req["control"])
    common = {"model": req["model"]} if req.get("model") else {}
    trigger.config = cell_config(trigger.config.replace(**common), req["trigger_set"])
    control.config = control.config.replace(**common)
    labels = apply_patches(list(spec.patches), trigger, seed=req["seed"])
    from statescope.patches import cpu_kernels
    from statescope.engine import offline as engine

    engine_gate_widened = _widen_engine_gate(engine, vllm.__version__)
    census = CopyCensus()
    cpu_kernels.add_copy_listener(census)  # engines run in this process: the listener sees them
    result = reproduce(trigger, control, preset_trace(req["preset"], seed=req["seed"],
                                                    geometry=req.get("geometry")),
                       store_root=req["store_root"], run_id=req["run_id"], unit=req["unit"])
    v = result.verdict
    cell = {"spec": spec.label, "n_units": v.trigger.n_units, "n_failed": v.trigger.n_failed_units,
            "outcome": v.outcome, "unit": v.unit, "labels": labels + trigger.labels,
            "vllm": vllm.__version__, "torch": torch.__version__,
            "control_units": v.control.n_units, "control_failed": v.control.n_failed_units,
            "copies": {**census.summary(), "engine_gate_widened": engine_gate_widened}}
    Path(req["out"]).write_text(json.dumps(cell, indent=2))
    print(json.dumps(cell))
    return 0
