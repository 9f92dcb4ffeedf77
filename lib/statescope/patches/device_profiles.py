"""Device profiles: the environment-specific engine settings, declared once and applied everywhere.

What it does: a ``DeviceProfile`` names what a machine needs beyond the experiment's own knobs —
environment variables set before vLLM starts, entries merged into ``additional_config``, and
in-process compatibility patches. ``choose_profile(name)`` picks one: the ``--profile`` argument,
else ``STATESCOPE_PROFILE``, else auto-detected (no CUDA device: ``cpu``; CUDA without the
``flashinfer`` package: ``cuda-triton``; CUDA with it: ``cuda``), and says which way it was chosen.
``profiled(config, profile)`` returns the ``EngineConfig`` with the profile's settings merged (the
experiment's own values win on a clash) and applies its environment and patches in this process;
every engine start (in-process, ``vllm serve``, a build's cell) goes through it, and the resolved
configuration and run manifests record ``profile.to_dict()``.

The profiles:

- ``cpu``: nothing beyond statescope's CPU kernels (the plugin installs them).
- ``cuda``: vLLM's defaults.
- ``cuda-triton``: a CUDA machine without FlashInfer (the project's H200): vLLM's own samplers
  (``VLLM_USE_FLASHINFER_SAMPLER=0``) and the Triton GDN prefill
  (``additional_config={"gdn_prefill_backend": "triton"}``).

All CUDA profiles also turn off the packed recurrent decode kernel
(``VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0``: on vLLM 0.26.0 it rejected the tiny models'
non-contiguous inputs, "`a`/`b` must be contiguous in the last dim") and every profile applies the
Qwen3.5-text registration when the installed vLLM lacks it (``statescope.patches.qwen35_mtp_compat``:
vLLM 0.26.0 ships the class but does not register it; a no-op on 0.28.0 and later).

What it deliberately does not do: change an experiment's knobs (prefix caching, MTP, async
scheduling, eager) or override an environment variable the user set.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from statescope.errors import InputError

ENV_PROFILE = "STATESCOPE_PROFILE"
ENV_GPU_SHARE = "STATESCOPE_GPU_MEMORY_UTILIZATION"
_CUDA_ENV = {"VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE": "0"}


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    env: dict = field(default_factory=dict)
    additional_config: dict = field(default_factory=dict)
    patches: tuple = ("qwen35_text",)
    chosen_by: str = ""  # "--profile", "STATESCOPE_PROFILE" or "auto: <why>"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.env.items()]
        parts += [f"additional_config.{k}={v}" for k, v in self.additional_config.items()]
        return f"{self.name} ({self.chosen_by}): " + (", ".join(parts) or "no extra settings")


PROFILES = {
    "cpu": DeviceProfile("cpu"),
    "cuda": DeviceProfile("cuda", env=dict(_CUDA_ENV)),
    "cuda-triton": DeviceProfile("cuda-triton",
                                 env=dict(_CUDA_ENV, VLLM_USE_FLASHINFER_SAMPLER="0"),
                                 additional_config={"gdn_prefill_backend": "triton"}),
}


def _detect() -> tuple[str, str]:
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        return "cpu", "auto: no CUDA device"
    if importlib.util.find_spec("flashinfer") is None:
        return "cuda-triton", "auto: CUDA device, no flashinfer package"
    return "cuda", "auto: CUDA device with flashinfer"


def choose_profile(name: str | None = None) -> DeviceProfile:
    """The profile named by ``name``, else by ``STATESCOPE_PROFILE``, else auto-detected."""
    chosen_by = "--profile"
    if not name:
        name = os.environ.get(ENV_PROFILE) or None
        chosen_by = os.environ.get("STATESCOPE_PROFILE_CHOSEN_BY") or ENV_PROFILE
    if not name or name == "auto":
        name, chosen_by = _detect()
    if name not in PROFILES:
        raise InputError(f"device profile {name!r} ({chosen_by}): expected one of "
                         f"{sorted(PROFILES)} or 'auto'")
    return dataclasses.replace(PROFILES[name], chosen_by=chosen_by)


def profile_env(profile: DeviceProfile) -> dict[str, str]:
    """The variables to give a process started for this profile (the user's own values kept)."""
    env = {k: os.environ.get(k, v) for k, v in profile.env.items()}
    env[ENV_PROFILE] = profile.name
    return env


def apply_in_process(profile: DeviceProfile) -> list[str]:
    """Set the profile's environment (unless set) and apply its patches here; what changed."""
    for k, v in profile_env(profile).items():
        os.environ.setdefault(k, v)
    done: list[str] = []
    if "qwen35_text" in profile.patches:
        from statescope.patches.qwen35_mtp_compat import enable_qwen35_text

        done += enable_qwen35_text()
    return done


def merged_extra(extra: dict, profile: DeviceProfile) -> dict:
    """``extra`` with the profile's ``additional_config`` merged under the experiment's own."""
    if not profile.additional_config:
        return dict(extra)
    out = dict(extra)
    out["additional_config"] = {**profile.additional_config, **(extra.get("additional_config") or {})}
    return out


def profiled(config: Any, profile: DeviceProfile | None = None) -> Any:
    """``config`` (an ``EngineConfig``) with the profile's engine settings merged, and the GPU
    share ``STATESCOPE_GPU_MEMORY_UTILIZATION`` where the config leaves it open (several engines
    side by side on one GPU: vLLM refuses to start one whose share exceeds the free memory)."""
    profile = profile or choose_profile()
    changes: dict[str, Any] = {"extra": merged_extra(config.extra, profile)}
    share = os.environ.get(ENV_GPU_SHARE)
    if share and config.gpu_memory_utilization is None and profile.name != "cpu":
        try:
            changes["gpu_memory_utilization"] = float(share)
        except ValueError:
            raise InputError(f"{ENV_GPU_SHARE}={share!r}: expected a fraction in (0, 1]") from None
    return config.replace(**changes)


def in_process_record(profile: DeviceProfile, applied: list[str]) -> dict[str, Any]:
    """What the resolved configuration records about the profile."""
    return dict(profile.to_dict(), applied=list(applied))
