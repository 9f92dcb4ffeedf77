"""One trigger-vs-control experiment, built one way by every command.

Why: the trigger arm used to be assembled in four places (``reproduce``, a build's cell,
``capture``, the GPU arms) and ``shrink`` applied its ``--*-set`` pairs by a fifth rule (a plain
field replace: prefix caching off kept ``mamba_cache_mode='align'``). An ``Experiment`` is now the
one description of what a verdict compares, and ``arms()`` the one way to turn it into engines.

What it does: ``Experiment`` holds the named control (``standard_arms``' ``no_prefix_cache`` /
``no_mtp`` / ``no_async`` / ``reference``, or ``same``: the trigger's own configuration without its
fault or patches), the model, the engine overrides of both arms / the trigger / the control (typed
field changes; the trigger's and the control's own win over both's), the trigger's runtime
patches, a planted fault, emulated copy semantics, the batch (``max_num_seqs`` of both arms:
``reproduce --concurrency`` on the in-process runner) and, for a run read back, its arms' own
recorded configurations as the base. ``arms()`` builds the two ``Arm`` by the one override rule
(``EngineConfig.with_overrides``), errors naming the flag the override came from; ``check()``
also resolves the model directory and the patch names, before anything is installed or started.
``to_request()`` / ``from_request()`` carry it through a build's ``REQUEST.json`` (matrix,
bisect and the Ray cells), in the fields a cell request has always had.

What it deliberately does not do: choose the workload or the design (``statescope.verdict.design``),
run anything, or apply device settings (the device profile does, at every engine start:
``statescope.patches.device_profiles``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from statescope.engine.config import EngineConfig, model_path
from statescope.errors import InputError
from statescope.verdict.reproduce import STANDARD_CONTROLS

CONTROLS = (*STANDARD_CONTROLS, "same")


@dataclass(frozen=True)
class Experiment:
    control: str = "no_prefix_cache"
    model: str | None = None
    both_set: Mapping[str, Any] = field(default_factory=dict)
    trigger_set: Mapping[str, Any] = field(default_factory=dict)
    control_set: Mapping[str, Any] = field(default_factory=dict)
    trigger_patches: tuple[str, ...] = ()
    fault: Any = None               # a statescope.patches.faults.FaultSpec: PLANTED
    copy_semantics: str | None = None
    batch: int | None = None        # max_num_seqs of both arms; None: the configs' own
    # a run read back (shrink RUN): the arms' recorded EngineConfig fields and the control's name
    base_trigger: Mapping[str, Any] | None = None
    base_control: Mapping[str, Any] | None = None
    control_name: str | None = None
    # the flags the overrides came from, for errors: (both, trigger, control)
    flags: tuple[str, str, str] = ("--both-set", "--trigger-set", "--control-set")

    def __post_init__(self) -> None:
        if self.control not in CONTROLS:
            raise InputError(f"control={self.control!r}: expected one of {sorted(CONTROLS)}")
        b = self.batch
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise InputError(f"concurrency={b!r}: expected an integer >= 1")
        for name in ("both_set", "trigger_set", "control_set"):
            if not isinstance(getattr(self, name), Mapping):
                raise InputError(f"Experiment.{name}: expected a mapping of engine settings, got "
                                 f"{type(getattr(self, name)).__name__}")
        object.__setattr__(self, "trigger_patches", tuple(self.trigger_patches or ()))

    def replace(self, **changes: Any) -> "Experiment":
        return dataclasses.replace(self, **changes)

    def _overrides(self, own: Mapping[str, Any], flag: str) -> tuple[dict, str]:
        both, _, _ = self.flags
        where = f"{flag}/{both}" if self.both_set else flag
        out = {**({"model": self.model} if self.model else {}), **self.both_set, **own}
        if self.batch is not None:
            given = out.get("max_num_seqs")
            if given is not None and given != self.batch:
                raise InputError(f"--concurrency {self.batch} and {where} max_num_seqs={given}: "
                                 "on the offline runner --concurrency is max_num_seqs; give one")
            out["max_num_seqs"] = self.batch
        return out, where

    def arms(self):
        """(trigger, control) ``Arm`` of this experiment."""
        from statescope.verdict.reproduce import Arm, standard_arms

        trigger, control = standard_arms("reference" if self.control == "same" else self.control)
        _, t_flag, c_flag = self.flags
        if self.base_trigger is not None:
            trigger.config = _config_of(self.base_trigger, "trigger")
        if self.base_control is not None:
            control = Arm(self.control_name or control.name, _config_of(self.base_control, "control"))
        changes, where = self._overrides(self.trigger_set, t_flag)
        trigger.config = trigger.config.with_overrides(changes, where=where)
        if self.control == "same":  # the trigger's engine without its fault or patches
            control = Arm("same", trigger.config)
        else:
            changes, where = self._overrides(self.control_set, c_flag)
            control.config = control.config.with_overrides(changes, where=where)
        trigger.patches = self.trigger_patches
        trigger.fault = self.fault
        trigger.copy_semantics = self.copy_semantics
        return trigger, control

    def check(self) -> "Experiment":
        """Everything an engine start would only refuse later: the arms, the model directory and
        each patch name. Returns the experiment with the model as an absolute directory."""
        from statescope.patches.registry import parse_patch

        for name in self.trigger_patches:
            parse_patch(name)
        out = self
        if self.model:
            path = model_path(self.model)
            if not path.exists():
                raise InputError(f"--model {self.model!r}: no such model directory (or name under "
                                 "data/models)")
            out = self.replace(model=str(path.resolve()))
        out.arms()
        return out

    def to_request(self) -> dict[str, Any]:
        """The cell request's experiment fields (``statescope.builds.run.run_cell``'s keywords)."""
        if self.fault is not None or self.copy_semantics or self.control == "same" \
                or self.base_trigger is not None or self.batch is not None:
            raise InputError("a build's cell runs the standard arms with settings and patches "
                             "only (no planted fault, emulated copies, 'same' control, recorded "
                             "base or --concurrency)")
        out: dict[str, Any] = {"trigger_set": {**self.both_set, **self.trigger_set},
                               "control_set": {**self.both_set, **self.control_set},
                               "trigger_patches": tuple(self.trigger_patches)}
        if self.model:
            out["model"] = self.model
        return out

    @classmethod
    def from_request(cls, req: Mapping[str, Any]) -> "Experiment":
        """The experiment a cell's ``REQUEST.json`` describes (``to_request`` plus its control)."""
        return cls(control=req["control"], model=req.get("model") or None,
                   trigger_set=dict(req.get("trigger_set") or {}),
                   control_set=dict(req.get("control_set") or {}),
                   trigger_patches=tuple(req.get("trigger_patches") or ()),
                   flags=("cell settings", "cell settings", "cell settings"))


def _config_of(fields: Mapping[str, Any], which: str) -> EngineConfig:
    try:
        return EngineConfig(**fields)
    except TypeError as exc:
        raise InputError(f"manifest.json: field 'resolved_config.{which}': expected the "
                         f"EngineConfig of a reproduce arm ({exc})") from None
