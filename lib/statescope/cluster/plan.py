"""What a cluster run runs: cells, each one experiment in one build, named by what it measures.

What it does: ``CellPlan`` is one cell -- a build spec, the trigger arm's settings, a seed and the
experiment's parameters (preset, unit, control, model, geometry) -- and ``cell_id`` is a name
derived from exactly those (readable spec slug + a hash), so a resumed driver recognises a cell
it has already completed, and the sequential path run with ``run_id=cell_id`` writes the same
records. ``matrix_plan`` crosses build specs with setting axes and seeds, refusing axes that are
not fields of the trigger arm's ``EngineConfig``, settings that arm cannot take (checked once,
here, not in every cell) and cells that would be the same experiment.

What it deliberately does not do: run, schedule or store anything (``statescope.cluster.cells``,
``statescope.cluster.driver``, ``statescope.cluster.ledger``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from statescope.builds.spec import BuildSpec
from statescope.errors import InputError

CELL_PARAMS = ("preset", "unit", "control", "model", "geometry")  # what a cell's result depends on
AXIS_ALIASES = ("num_speculative_tokens",)  # handled by statescope.verdict.matrix.cell_config


@dataclass(frozen=True, eq=False)
class CellPlan:
    """One experiment in one build: ``spec`` text, trigger settings, seed, experiment parameters.
    ``tag`` (e.g. the bisection item) is part of the identity: two items never share a cell."""
    spec: str
    trigger_set: dict = field(default_factory=dict)
    seed: int = 0
    preset: str = "smoke"
    unit: str = "episode"
    control: str = "reference"
    model: str | None = None
    geometry: str | None = None
    tag: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", BuildSpec.parse(self.spec).text)  # bad text: InputError now
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise InputError(f"cell seed={self.seed!r}: expected an integer >= 0")

    @property
    def build(self) -> BuildSpec:
        return BuildSpec.parse(self.spec)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CellPlan":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown or "spec" not in d:
            raise InputError(f"cell plan {d!r}: expected the fields {sorted(names)} (unknown: {unknown})")
        return cls(**d)

    @property
    def cell_id(self) -> str:
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), default=str)
        label = self.build.label.removesuffix(".whl")
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", label)[:48].strip("-.")
        return f"{slug}-s{self.seed}-{hashlib.sha256(canon.encode()).hexdigest()[:10]}"

    @property
    def label(self) -> str:
        settings = ",".join(f"{k}={v}" for k, v in sorted(self.trigger_set.items()))
        return self.build.label + (f" [{settings}]" if settings else "") + f" seed={self.seed}"

    def cell_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``statescope.builds.run.write_cell_request`` for this cell."""
        return {"seed": self.seed, "trigger_set": dict(self.trigger_set),
                **{k: getattr(self, k) for k in CELL_PARAMS}}


def check_axes(axes: dict[str, Sequence] | None) -> dict[str, list]:
    """Setting axes of the trigger arm: {EngineConfig field: [values, ...]}, non-empty, distinct."""
    from statescope.engine.config import EngineConfig

    fields_ = {f.name for f in dataclasses.fields(EngineConfig)} | set(AXIS_ALIASES)
    out: dict[str, list] = {}
    for name, values in (axes or {}).items():
        if name not in fields_:
            raise InputError(f"matrix axis {name!r}: expected a field of the trigger arm's "
                             f"EngineConfig, one of {sorted(fields_)}")
        if not isinstance(values, (list, tuple)) or not values:
            raise InputError(f"matrix axis {name!r}: expected a non-empty list of values, got {values!r}")
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) != len(values):
            raise InputError(f"matrix axis {name!r}: expected distinct values, got {list(values)}")
        out[name] = list(values)
    return out


def check_settings(axes: dict[str, Sequence] | None) -> dict[str, list]:
    """``check_axes``, and every combination of values applied to the trigger arm (a bad value
    fails here, once, not in every cell)."""
    from statescope.engine.config import EngineConfig
    from statescope.verdict.matrix import cell_config

    axes = check_axes(axes)
    for values in itertools.product(*axes.values()):
        try:
            cell_config(EngineConfig(), dict(zip(axes, values)))
        except InputError as exc:
            raise InputError(f"trigger settings {dict(zip(axes, values))}: {exc}") from None
    return axes


def matrix_plan(specs: Sequence[BuildSpec | str], *, axes: dict[str, Sequence] | None = None,
                seeds: Sequence[int] = (0,), **params: Any) -> list[CellPlan]:
    """Every (build, settings, seed) cell, builds outermost, in the order given."""
    unknown = sorted(set(params) - set(CELL_PARAMS))
    if unknown:
        raise InputError(f"matrix parameters {unknown}: expected some of {list(CELL_PARAMS)}")
    if not specs:
        raise InputError("matrix: expected at least one build spec")
    axes = check_settings(axes)
    parsed = [BuildSpec.parse(s) for s in specs]
    plans = [CellPlan(spec.text, dict(zip(axes, values)), int(seed), **params)
             for spec in parsed for values in itertools.product(*axes.values()) for seed in seeds]
    ids = [p.cell_id for p in plans]
    if len(set(ids)) != len(ids):
        twice = sorted({p.label for p in plans if ids.count(p.cell_id) > 1})
        raise InputError(f"matrix: cells {twice} are listed twice; expected each experiment once")
    return plans
