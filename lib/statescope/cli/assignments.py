"""``NAME=VALUE`` command-line assignments (``--trigger-set``, ``--control-set``, ``render -p``).

What it does: ``parse_assignments(pairs, where, allowed)`` splits each pair at its first ``=``,
reads VALUE as JSON (so ``3``, ``true``, ``{"a": 1}`` keep their types) and otherwise keeps it as a
string; a name that is not an identifier, or not one of ``allowed`` when given, is an
``InputError`` naming the option and the pair.

What it deliberately does not do: check a value against the field it sets (the consumer —
``EngineConfig``, papermill's notebook parameters — owns that).
"""
from __future__ import annotations

import json
from typing import Any, Iterable

from statescope.errors import InputError


def parse_assignments(pairs: Iterable[str] | None, where: str,
                      allowed: Iterable[str] | None = None) -> dict[str, Any]:
    """``{"name": value}`` from ``["name=value", ...]`` given on option ``where``."""
    names = sorted(allowed) if allowed is not None else None
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier() or (names is not None and key not in names):
            expected = f"NAME one of {names}" if names is not None else "NAME an identifier"
            raise InputError(f"{where} {pair!r}: expected NAME=VALUE with {expected} "
                             "(VALUE as JSON, else a string)")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out
