"""Position-aligned state differences, and tolerances measured from clean runs.

bf16 arithmetic makes a state depend on the batch it was computed in (identical configurations are
bit-identical; different batchings, prefill vs decode kernels, and float64 are not). So "diverged"
must mean "beyond the difference clean runs show", not "not bit-identical".

What it does:

* ``compare_states(run, reference)`` lines a ``replay.CapturedStates`` run up with any reference
  source (another run, a replay, the oracle) by (request, token position, kind) and gives one row
  per (request step, GDN layer, kind): the largest absolute difference, per conv row (row 0 =
  leading/oldest of the live window) and per recurrent head, the reference's scale, NaN/Inf.
* ``calibrate(frames)`` turns comparisons of *clean* pairs (re-batched runs, a clean run vs its
  replay or vs the oracle) into a ``Tolerance`` per (layer, kind):
  ``tol = max(margin * measured, floor_rel[kind] * scale)``; the floor keeps a bit-identical
  calibration from making every last-bit difference a divergence.
* ``in_units(frame, tolerance)`` adds ``units`` (difference / tolerance), ``rows_out`` and
  ``heads_out`` (which conv rows / heads exceed it).

What it deliberately does not do: pick the clean runs (the caller records them) or say where a run
diverges first (``statescope.diverge.by_position``).
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import pandas as pd
import torch

from statescope.errors import InputError

MARGIN = 2.0
FLOOR_REL = {"conv": 2.0 ** -8, "ssm": 2.0 ** -16}  # bf16 conv inputs; float32 recurrent state


def _diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b|, with a NaN/Inf on one side only counted as infinitely far."""
    d = (a - b).abs()
    both = (torch.isnan(a) & torch.isnan(b)) | (torch.isinf(a) & torch.isinf(b) & (a == b))
    return torch.where(both, torch.zeros_like(d), torch.nan_to_num(d, nan=math.inf))


def compare_states(run: Any, reference: Any, points: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (request step, layer, kind) where both sides have a state at that position."""
    pts = run.points() if points is None else points
    reference.prepare(pts)
    rows = []
    for p in pts.itertuples():
        ref = reference.at(p.prompt_sha, p.position, p.kind)
        if ref is None:
            continue
        mine = run.get(p.req_id, p.req_step, p.kind)
        for layer, a in mine.items():
            b = ref.get(layer)
            if b is None:
                continue
            if a.shape != b.shape:
                raise InputError(f"compare_states: {layer} {p.kind} shapes differ "
                                 f"({tuple(a.shape)} vs {tuple(b.shape)}): not the same model?")
            d = _diff(a, b.to(a.dtype))
            parts = d.amax(dim=tuple(range(1, d.ndim))) if d.ndim > 1 else d
            rows.append({"prompt_sha": p.prompt_sha, "req_id": p.req_id, "req_step": p.req_step,
                         "engine_step": getattr(p, "engine_step", None), "position": p.position,
                         "layer": layer, "kind": p.kind, "max_abs": float(d.max()),
                         "parts": [float(x) for x in parts],
                         "scale": float(torch.nan_to_num(b.abs(), nan=0.0).max()),
                         "nan_or_inf": bool((~torch.isfinite(a)).any())})
    return pd.DataFrame(rows)


@dataclass
class Tolerance:
    """Per (layer, kind) tolerance with what it was measured from."""

    table: pd.DataFrame  # layer, kind, measured, scale, floor, tol, pairs
    sources: list[str] = field(default_factory=list)
    margin: float = MARGIN

    def tol(self, layer: str, kind: str) -> float:
        hit = self.table[(self.table.layer == layer) & (self.table.kind == kind)]
        if hit.empty:
            raise InputError(f"tolerance: no calibration for {layer} {kind}")
        return float(hit["tol"].iloc[0])

    def to_dict(self) -> dict:
        return {"margin": self.margin, "sources": self.sources,
                "layers": self.table.to_dict(orient="records")}

    def _repr_html_(self) -> str:
        return (f"<p><b>Noise tolerance</b> (margin {self.margin}× the largest clean difference, "
                f"floor {FLOOR_REL}× scale) from: {html.escape('; '.join(self.sources))}</p>"
                + self.table.to_html(index=False, float_format=lambda x: f"{x:.3g}"))


def calibrate(frames: Sequence[pd.DataFrame], sources: Sequence[str] = (),
              margin: float = MARGIN, floor_rel: dict | None = None) -> Tolerance:
    """A ``Tolerance`` from ``compare_states`` frames of clean pairs."""
    frames = [f for f in frames if f is not None and not f.empty]
    if not frames:
        raise InputError("calibrate: no clean comparisons (did the clean runs capture snapshots?)")
    floor_rel = dict(FLOOR_REL, **(floor_rel or {}))
    allf = pd.concat(frames, ignore_index=True)
    if allf["nan_or_inf"].any() or not allf["max_abs"].map(math.isfinite).all():
        raise InputError("calibrate: a clean comparison has NaN/Inf: not a clean pair")
    g = allf.groupby(["layer", "kind"]).agg(measured=("max_abs", "max"), scale=("scale", "median"),
                                           points=("max_abs", "size")).reset_index()
    g["floor"] = [floor_rel[k] * s for k, s in zip(g["kind"], g["scale"])]
    g["tol"] = [max(margin * m, f) for m, f in zip(g["measured"], g["floor"])]
    return Tolerance(g, list(sources), margin)


def combine(*tolerances: Tolerance) -> Tolerance:
    """The largest tolerance of several calibrations, per (layer, kind)."""
    t = pd.concat([x.table for x in tolerances], ignore_index=True)
    g = t.groupby(["layer", "kind"]).agg(measured=("measured", "max"), scale=("scale", "max"),
                                         points=("points", "sum"), floor=("floor", "max"),
                                         tol=("tol", "max")).reset_index()
    return Tolerance(g, [s for x in tolerances for s in x.sources], tolerances[0].margin)


def in_units(frame: pd.DataFrame, tolerance: Tolerance) -> pd.DataFrame:
    """Add ``tol``, ``units``, ``rows_out``/``heads_out`` (parts beyond tolerance) and ``out``."""
    if frame.empty:
        return frame.assign(tol=[], units=[], parts_out=[], out=[])
    tols = [tolerance.tol(l, k) for l, k in zip(frame["layer"], frame["kind"])]
    f = frame.assign(tol=tols)
    f["units"] = [m / t if t > 0 else (math.inf if m > 0 else 0.0) for m, t in zip(f.max_abs, tols)]
    f["parts_out"] = [[i for i, v in enumerate(parts) if v > t] for parts, t in zip(f.parts, tols)]
    f["out"] = f["units"] > 1.0
    return f
