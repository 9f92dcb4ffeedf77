"""The one override rule for an ``EngineConfig`` (``EngineConfig.with_overrides``).

Why: the same override used to mean different things by command (``num_speculative_tokens=0``
refused by ``reproduce`` and accepted by ``bisect``; turning prefix caching off cleared
``mamba_cache_mode`` in a matrix cell but kept ``align`` in ``reproduce``). Every command now
resolves its overrides here.

What it does: ``resolve_overrides(config, overrides, where)`` (called by
``EngineConfig.with_overrides``; ``typed_overrides`` is its first half, without the coupled
rules) takes ``{name: value}`` where a name is
a field of ``EngineConfig`` or vLLM's spelling of it (``enable-prefix-caching``,
``--enable-prefix-caching``, ``no-async-scheduling`` / ``--no-enable-prefix-caching`` = the field
false, ``speculative_config`` / ``speculative-config`` a JSON object ``{"method",
"num_speculative_tokens"}`` or null) and a value either already typed or the text of a command
line (``false``, ``False``, ``null``, ``None``, ``3``, JSON); checks each value against the
field's type and, where vLLM has a closed set, against vLLM's choices (``dtype``,
``mamba_ssm_cache_dtype``, ``mamba_cache_mode``); then applies the coupled rules the same way for
every command: prefix caching off clears ``mamba_cache_mode`` (unless the same overrides set it),
``num_speculative_tokens=0`` or ``speculative_method=None`` turns speculation off (method None,
count 0), a count > 0 without a method is MTP. ``extra`` (further vLLM engine arguments) is
merged into the config's own. Errors are one ``InputError`` naming ``where``, the name and what
was expected, raised before any engine starts.

What it deliberately does not do: import vLLM (its choices are restated here from vLLM 0.28.0's
``ModelDType``, ``MambaDType`` and ``MambaCacheMode``), or resolve a model name (the caller does,
with ``statescope.engine.config.model_path``).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from statescope.errors import InputError

# vLLM's own closed sets (vllm/config/model.py ModelDType, vllm/config/cache.py MambaDType and
# MambaCacheMode, 0.28.0)
VLLM_CHOICES = {
    "dtype": ("auto", "half", "float16", "bfloat16", "float", "float32"),
    "mamba_ssm_cache_dtype": ("auto", "float32", "float16", "bfloat16"),
    "mamba_cache_mode": ("none", "align", "all", None),
    "speculative_method": ("mtp", None),
    "model_runner": ("v1", "v2", None),
}

_BOOL_TEXT = {"true": True, "false": False}
_NONE_TEXT = ("null", "none")


def _field_types(cls: type) -> dict[str, tuple[type, ...]]:
    names = {"bool": bool, "int": int, "float": float, "str": str, "dict": dict, "None": type(None)}
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = tuple(names.get(p.strip(), object) for p in str(f.type).split("|"))
    return out


def _accepts(types: tuple[type, ...], value: Any) -> bool:
    for t in types:
        if t is object or (t is type(None) and value is None):
            return True
        if t is bool and isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t in (str, dict) and isinstance(value, t):
            return True
    return False


def _describe(types: tuple[type, ...]) -> str:
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             dict: "a JSON object", type(None): "null", object: "any value"}
    return " or ".join(words[t] for t in types)


def _from_text(raw: str, types: tuple[type, ...]) -> Any:
    """A command line's text as a value of one of ``types`` (never a loose cast: 'yes' stays
    text, '2.0' stays a float)."""
    low = raw.strip().lower()
    if type(None) in types and low in _NONE_TEXT:
        return None
    if bool in types and low in _BOOL_TEXT:
        return _BOOL_TEXT[low]
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    if str in types and not _accepts(types, value):
        return raw  # a string field takes the text as written
    return value


def _name(key: str, fields: Mapping[str, tuple], where: str) -> tuple[str, bool]:
    """(field name, negated) for a field name or vLLM's flag spelling of it."""
    name = str(key).strip().lstrip("-").replace("-", "_")
    if name in fields or name == "speculative_config":
        return name, False
    if name.startswith("no_") and name[3:] in fields and bool in fields[name[3:]]:
        return name[3:], True
    raise InputError(f"{where}: {key!r} is not an engine setting statescope knows: expected NAME "
                     f"one of {sorted(fields) + ['speculative_config']} (or vLLM's spelling, e.g. "
                     "enable-prefix-caching, no-async-scheduling); other vLLM engine arguments "
                     "go in extra={...}")


def _speculative(value: Any, where: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip().lower() not in _NONE_TEXT else None
        except json.JSONDecodeError:
            raise InputError(f"{where}: speculative_config: expected a JSON object "
                             f"{{\"method\": ..., \"num_speculative_tokens\": N}} or null, got "
                             f"{value!r}") from None
    if value is None:
        return {"speculative_method": None, "num_speculative_tokens": 0}
    if not isinstance(value, dict) or set(value) - {"method", "num_speculative_tokens"}:
        raise InputError(f"{where}: speculative_config: expected an object with 'method' and "
                         f"'num_speculative_tokens' only (statescope runs MTP), got {value!r}")
    return {"speculative_method": value.get("method", "mtp"),
            "num_speculative_tokens": value.get("num_speculative_tokens", 1)}


def typed_overrides(config: Any, overrides: Mapping[str, Any], where: str = "overrides") -> dict:
    """``overrides`` by field name, each value typed and checked (``speculative_config`` as its two
    fields), before the coupled rules: what a command hands on to a build's cell."""
    if not isinstance(overrides, Mapping):
        raise InputError(f"{where}: expected a mapping of engine settings, got {type(overrides)}")
    fields = _field_types(type(config))
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        name, negated = _name(key, fields, where)
        if name == "speculative_config":
            for k, v in _speculative(value, f"{where} {key}").items():
                changes[k] = v
            continue
        types = fields[name]
        if negated:  # --no-async-scheduling: the flag itself (True / None / "true") means False
            flag = _from_text(value, (bool, type(None))) if isinstance(value, str) else value
            if flag not in (True, None):
                raise InputError(f"{where}: {key!r}={value!r}: a --no-... flag takes no value "
                                 "other than true")
            value = False
        elif isinstance(value, str) and value not in VLLM_CHOICES.get(name, ()):
            value = _from_text(value, types)  # (mamba_cache_mode 'none' is vLLM's mode, not null)
        if not _accepts(types, value):
            raise InputError(f"{where}: {key}={value!r}: expected {_describe(types)} "
                             f"(EngineConfig.{name})")
        if name in VLLM_CHOICES and value not in VLLM_CHOICES[name]:
            raise InputError(f"{where}: {key}={value!r}: expected one of "
                             f"{[c for c in VLLM_CHOICES[name] if c is not None]}"
                             + (" or null" if None in VLLM_CHOICES[name] else "")
                             + " (vLLM's choices)")
        if name in changes and changes[name] != value:
            raise InputError(f"{where}: {name} is set twice, to {changes[name]!r} and {value!r}")
        changes[name] = value
    return changes


def resolve_overrides(config: Any, overrides: Mapping[str, Any], where: str = "overrides") -> dict:
    """The field changes ``overrides`` make to ``config``: typed, checked and coupled."""
    changes = typed_overrides(config, overrides, where)
    if "extra" in changes:
        changes["extra"] = {**config.extra, **changes["extra"]}
    if changes.get("enable_prefix_caching") is False and "mamba_cache_mode" not in changes:
        changes["mamba_cache_mode"] = None  # no cached recurrent state without prefix caching
    if changes.get("num_speculative_tokens") == 0 or (
            "speculative_method" in changes and changes["speculative_method"] is None):
        changes["speculative_method"], changes["num_speculative_tokens"] = None, 0
    elif changes.get("num_speculative_tokens") and "speculative_method" not in changes \
            and config.speculative_method is None:
        changes["speculative_method"] = "mtp"
    return changes


