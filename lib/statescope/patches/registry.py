"""Runtime patches a build may carry: names, labels, and how each is applied to an experiment arm.

What it does: ``PATCHES`` names the statescope runtime patches a ``statescope.builds.BuildSpec``
can list. ``parse_patch`` reads ``NAME`` or ``planted_regression=RATE`` (the share of planted
requests);
``apply_patches`` applies them inside the build's own process, before the engine starts:

- ``overlap_safe_copy``: ``statescope.patches.overlap_safe`` wraps vLLM's ``batch_memcpy`` (process-wide
  while the trigger arm's engine runs; it only changes overlapping copies, which are the H-copy race);
- ``accept_sync``: ``statescope.patches.accept_sync`` wraps the GPU runner's ``_update_states`` so the host
  accepted counts keep the previous step's row order until vLLM remaps them (process-wide; it only
  acts under async scheduling, which is the H-accept race);
- ``cpu_kernels:memmove`` / ``cpu_kernels:barrierless_tiles``: the trigger arm's CPU fused-copy
  semantics (``statescope.patches.cpu_kernels``, 1024-byte tiles; barrier-less tiles EMULATE the GPU race);
- ``cpu_kernels:release_gpu_order``: EMULATED -- the fused copies follow the build's own GPU
  ordering of in-block conv shifts (0.28.0: barrier-less tiles of the fused kernel's size;
  0.29.0 on: ordered, memmove-safe; ``statescope.patches.cpu_kernels_releases``), so a bisection over
  real releases can see the upstream fix that CPU memmove copies never need;
- ``planted_regression``: a planted fault (NaN conv state, ``statescope.patches.faults``) in a share of the
  trigger arm's requests, used to plant a regression "from a chosen build on" and always labelled
  PLANTED;
- ``planted_per_prompt[=RATE]``: the same fault in the trigger requests whose prompt (token ids)
  hashes below RATE: deterministic per workload seed, wherever the seed sits in a cell's trace
  (the failure pattern measured on the H200), for testing bisections' seed choice.

Every patch applies to the trigger arm only (``statescope.verdict.reproduce`` installs the
process-wide ones -- ``overlap_safe_copy``, ``accept_sync``, ``amplify_accept_race`` -- for the
trigger's engine and removes them before the next arm's; a build cell passes a build spec's ones
as the trigger arm's own, ``statescope.builds.cell``): the control is the reference configuration
and must stay a clean baseline. What it deliberately does not do: change installed
files (every patch is a runtime wrapper) or run anything.
"""
from __future__ import annotations

from dataclasses import dataclass

from statescope.errors import InputError

PATCHES = {
    "overlap_safe_copy": "overlap-safe batch_memcpy (runtime patch for the H-copy race)",
    "accept_sync": "ordered accepted counts (runtime patch for the H-accept race)",
    "amplify_accept_race": "AMPLIFIED: the accepted-count copy forced to land before the row moves",
    "cpu_kernels:memmove": "CPU fused copy kernels, memmove semantics (correct)",
    "cpu_kernels:barrierless_tiles": "EMULATED H-copy race: CPU fused copies as barrier-less tiles",
    "cpu_kernels:release_gpu_order": "EMULATED: CPU fused copies ordered as this release's GPU kernel",
    "planted_regression": "PLANTED REGRESSION: NaN conv state planted in a share of trigger requests",
    "planted_per_prompt": "PLANTED REGRESSION: NaN conv state planted in the trigger requests of "
                          "some prompts (deterministic per workload seed)",
}
PLANTED_PATCHES = ("planted_regression", "planted_per_prompt")
PLANTED_RATE = 0.3  # default share of trigger requests that get the planted fault


@dataclass(frozen=True)
class Patch:
    name: str
    option: str | None = None

    def __str__(self) -> str:
        return self.name if self.option is None else f"{self.name}={self.option}"

    @property
    def label(self) -> str:
        """How results of a build with this patch are labelled (never mistaken for a real run)."""
        return PATCHES[self.name] + (f" ({self.option})" if self.option else "")


def parse_patch(text: str) -> Patch:
    """``NAME`` (one of ``PATCHES``) or ``planted_regression=RATE``."""
    name, sep, option = str(text).strip().partition("=")
    if name not in PATCHES:
        raise InputError(f"build patch {text!r}: expected one of {sorted(PATCHES)} "
                         "(optionally NAME=OPTION)")
    if sep and name in PLANTED_PATCHES:
        try:
            if not 0 < float(option) <= 1:
                raise ValueError
        except ValueError:
            raise InputError(f"build patch {text!r}: expected {name}=RATE with "
                             "0 < RATE <= 1") from None
    elif sep and name == "amplify_accept_race":
        from statescope.patches.accept_race_amplifier import MODES

        if option not in MODES:
            raise InputError(f"build patch {text!r}: expected amplify_accept_race[=MODE] with MODE "
                             f"one of {MODES}")
    elif sep:
        raise InputError(f"build patch {text!r}: {name} takes no option")
    return Patch(name, option if sep else None)


def apply_patches(patches: list[Patch], trigger, *, seed: int = 0) -> list[str]:
    """Apply ``patches`` for one experiment in this process; returns their labels.

    ``trigger`` is a ``statescope.verdict.reproduce.Arm`` (changed in place: fault / copy semantics)."""
    from statescope.patches.faults import FaultSpec

    for p in patches:
        if p.name == "overlap_safe_copy":
            from statescope.patches.overlap_safe import install_overlap_safe_copy

            install_overlap_safe_copy()
        elif p.name == "accept_sync":
            from statescope.patches.accept_sync import install_accept_sync

            install_accept_sync()
        elif p.name == "amplify_accept_race":
            from statescope.patches import accept_race_amplifier

            accept_race_amplifier.install(p.option or "early")
        elif p.name.startswith("cpu_kernels:"):
            trigger.copy_semantics = p.name.split(":", 1)[1]
        elif p.name in PLANTED_PATCHES:
            rate = float(p.option) if p.option else PLANTED_RATE
            per_prompt = p.name == "planted_per_prompt"  # one fault hash for every cell
            trigger.fault = FaultSpec(kind="nan_conv", rate=rate, at_output_token=2, layers=[0],
                                      seed=0 if per_prompt else seed, by_prompt=per_prompt)
    return [p.label for p in patches]
