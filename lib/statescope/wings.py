"""A wing's public face: names handed on lazily from the wing's modules.

What it does: ``public_face(wing, {"Name": "module", ...})`` returns the ``__getattr__``, ``__dir__``
and ``__all__`` a wing's ``__init__.py`` installs, so ``from statescope.diverge import
hypothesis_table`` works and imports ``statescope.diverge.hypotheses`` only when the name is first
used (importing a wing stays cheap — no torch, no vLLM — and wings cannot form import cycles through
their faces). An unknown name raises ``AttributeError``, so ``from statescope.diverge import
replay`` still finds the submodule.

What it deliberately does not do: re-export everything; a face lists what notebooks and other
wings use, the rest stays reachable by its module path.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def public_face(wing: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]],
                                                          list[str]]:
    """``(__getattr__, __dir__, __all__)`` for wing ``wing`` handing on ``names`` (name -> module)."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {wing!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{wing}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__, sorted(names)
