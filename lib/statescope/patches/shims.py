"""Import shims that let the CPU build of vLLM import on a machine without a GPU.

What it does:
- PyPI's ``torchvision`` wheel is a CUDA build; beside ``torch==2.13.0+cpu`` its import dies while
  registering fake kernels for ``torchvision::nms`` / ``torchvision::qnms``, whose schemas the CPU
  torch never defined (``RuntimeError: operator torchvision::nms does not exist``). vLLM's
  Qwen3.5 model module needs ``torchvision.transforms.v2``. Declaring the two schemas with
  ``torch.library.define`` before torchvision is first imported lets it import; the ops themselves
  stay unimplemented (statescope never calls them).
- ``torchaudio`` / ``torchcodec`` fail to load beside CPU torch and are not needed: they are made
  to look absent (``sys.modules[name] = None``), so optional-import probes say "not installed"
  instead of dying in a shared library.

When: right after ``torch`` finishes importing (a meta-path hook wraps torch's loader), so nothing
is imported early and a process that never imports torch pays nothing. It must hold in *every*
process that imports vLLM — vLLM inspects model architectures in a ``python -m`` subprocess, and
``vllm serve`` runs its engine in another — so ``install_pth()`` (run by the setup script) adds a
one-line ``statescope-shims.pth`` to the environment's site-packages that installs the hook at
interpreter start-up. That file is statescope's own; no installed package is edited.

What it deliberately does not do: anything when torch is not a ``+cpu`` build or torchvision
already imports cleanly (a matching torchvision build, or a GPU machine).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

PTH_NAME = "statescope-shims.pth"
_BLOCKED_MODULES = ("torchaudio", "torchcodec")
_TORCHVISION_SCHEMAS = {
    "torchvision::nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "torchvision::qnms": "(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
}
_state = {"applied": False, "hooked": False}


def _torch_is_cpu_only() -> bool:
    import torch

    return "+cpu" in torch.__version__ and not torch.cuda.is_available()


def apply() -> bool:
    """Apply the shims now (imports torch); True when they were needed. Idempotent."""
    if _state["applied"]:
        return True
    if not _torch_is_cpu_only():
        return False
    import torch

    for qualname, schema in _TORCHVISION_SCHEMAS.items():
        # torchvision may already be mid-import (it imports torch first): define regardless.
        try:
            torch.library.define(qualname, schema)
        except RuntimeError:
            pass  # already defined by a CPU torchvision or an earlier apply()
    for name in _BLOCKED_MODULES:
        # None makes `import` raise ImportError and `find_spec` return None: "not installed".
        sys.modules.setdefault(name, None)
    _forget_cached_probes()
    _state["applied"] = True
    return True


def _forget_cached_probes() -> None:
    """transformers caches ``is_torchaudio_available()`` (lru_cache); a probe made before torch
    loaded (it needs only ``find_spec``) said "installed" and would later import the blocked
    module. Clear those caches so the next probe sees the shim."""
    utils = sys.modules.get("transformers.utils.import_utils")
    if utils is None:
        return
    for attr in dir(utils):
        if attr.startswith(("is_torchaudio", "is_torchcodec")):
            clear = getattr(getattr(utils, attr), "cache_clear", None)
            if callable(clear):
                clear()


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds ``torch`` with the normal path finder and runs ``apply()`` once it has loaded."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102
        if fullname != "torch" or _state["applied"]:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        real_exec = spec.loader.exec_module

        def exec_then_shim(module):
            real_exec(module)
            apply()

        spec.loader.exec_module = exec_then_shim
        return spec


def install() -> None:
    """Arrange for ``apply()`` to run as soon as torch is imported (now if it already is)."""
    if "torch" in sys.modules:
        apply()
    elif not _state["hooked"]:
        sys.meta_path.insert(0, _AfterTorchImport())
        _state["hooked"] = True


def install_pth(site_packages: str | Path | None = None) -> Path:
    """Write the start-up hook file into ``site_packages`` (default: this interpreter's)."""
    import sysconfig

    target = Path(site_packages or sysconfig.get_paths()["purelib"]) / PTH_NAME
    line = "import statescope.patches.shims as _s; _s.install()\n"
    if not target.exists() or target.read_text() != line:
        target.write_text(line)
    return target


if __name__ == "__main__":  # python -m statescope.patches.shims  -> installs the .pth hook
    print(install_pth())
