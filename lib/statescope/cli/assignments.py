"""``NAME=VALUE`` command-line assignments (``--trigger-set``, ``--control-set``, ``render -p``,
``bisect --settings``), parsed strictly against the consumer's field types.

What it does: ``parse_assignments(pairs, where, fields)`` splits each pair at its first ``=`` and
reads VALUE as JSON (so ``3``, ``true``, ``{"a": 1}`` keep their types), else as a string.
``fields`` maps each allowed name to its type: a ``FieldType`` or a type written the way a
dataclass annotation is (``"bool"``, ``"int | None"``, ``"str"``, ``"dict"``). A value must *be*
of that type — ``yes`` or ``true`` for an int field, ``2.0`` for an int, ``"3"`` for a number are
errors, never casts; a string field takes the text as written. A name not in ``fields``, or not
an identifier, is an error naming the option, the pair and what was expected.
``parse_value(raw, kind, where)`` is the same for one value (``bisect --settings AXIS=V1,V2``);
``dataclass_fields(cls)`` gives a dataclass's field types (``EngineConfig``'s, for the engine
overrides); ``literal_kind(value)`` the type of a notebook parameter's default.

What it deliberately does not do: check ranges or cross-field rules (the consumer — ``EngineConfig``,
a notebook — owns those), or guess a type for a value that has none.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from statescope.errors import InputError

_NAMES = {"bool": bool, "int": int, "float": float, "str": str, "dict": dict, "list": list,
          "None": type(None), "Any": object, "object": object}


@dataclass(frozen=True)
class FieldType:
    """The types one field accepts (``object`` accepts anything)."""

    types: tuple[type, ...]

    @classmethod
    def of(cls, spec: "FieldType | str | type | tuple") -> "FieldType":
        if isinstance(spec, FieldType):
            return spec
        if isinstance(spec, type):
            return cls((spec,))
        if isinstance(spec, tuple):
            return cls(tuple(spec))
        parts = [p.strip() for p in str(spec).replace("Optional[", "").rstrip("]").split("|")]
        return cls(tuple(_NAMES.get(p.split("[")[0], object) for p in parts))

    def describe(self) -> str:
        names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                 dict: "a JSON object", list: "a JSON array", type(None): "null", object: "any value"}
        return " or ".join(names[t] for t in self.types)

    def accepts(self, value: Any) -> bool:
        for t in self.types:
            if t is object or (t is type(None) and value is None):
                return True
            if t is bool and isinstance(value, bool):
                return True
            if t is int and isinstance(value, int) and not isinstance(value, bool):
                return True
            if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                return True
            if t in (str, dict, list) and isinstance(value, t):
                return True
        return False


def dataclass_fields(cls: type) -> dict[str, FieldType]:
    """``{field name: FieldType}`` of a dataclass, from its annotations."""
    return {f.name: FieldType.of(f.type) for f in dataclasses.fields(cls)}


def literal_kind(default: Any) -> FieldType:
    """What a notebook parameter with this default may be set to (a None default takes anything)."""
    if default is None:
        return FieldType((object,))
    if isinstance(default, bool):
        return FieldType((bool,))
    if isinstance(default, float):
        return FieldType((float,))
    for t in (int, str, dict, list):
        if isinstance(default, t):
            return FieldType((t,))
    return FieldType((object,))


def parse_value(raw: str, kind: FieldType | str | type, where: str) -> Any:
    """``raw`` as a value of ``kind``; ``InputError`` naming ``where`` when it is not one."""
    kind = FieldType.of(kind)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    if not kind.accepts(value) and str in kind.types and not (value is None and type(None) in kind.types):
        value = raw  # a string field takes the text as written ("2024" names a file, not a year)
    if not kind.accepts(value):
        raise InputError(f"{where}: expected {kind.describe()}, got {raw!r} (values are read as "
                         "JSON and never converted)")
    return value


def parse_assignments(pairs: Iterable[str] | None, where: str,
                      fields: Mapping[str, Any] | Iterable[str] | None = None) -> dict[str, Any]:
    """``{"name": value}`` from ``["name=value", ...]`` given on option ``where``; ``fields``: the
    allowed names with their types (a bare list of names allows any value)."""
    if fields is not None and not isinstance(fields, Mapping):
        fields = {name: FieldType((object,)) for name in fields}
    names = sorted(fields) if fields is not None else None
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier() or (names is not None and key not in names):
            expected = f"NAME one of {names}" if names is not None else "NAME an identifier"
            raise InputError(f"{where} {pair!r}: expected NAME=VALUE with {expected} "
                             "(VALUE as JSON, else a string)")
        if key in out:
            raise InputError(f"{where} {pair!r}: {key!r} is set twice")
        kind = fields[key] if fields is not None else FieldType((object,))
        out[key] = parse_value(raw, kind, f"{where} {pair!r}: field {key!r}")
    return out
