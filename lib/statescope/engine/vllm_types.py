"""Engine settings checked against the installed vLLM's OWN types, before any engine starts.

Why: ``EngineConfig`` checks its own fields and ``statescope.engine.overrides`` restates a few of
vLLM's closed sets, but ``EngineConfig.extra`` (any further vLLM engine argument) went to vLLM
unchecked: an unknown key or ``max_num_batched_tokens=-5`` was only refused while the engine
started (seconds to minutes in, after the control arm may have run), in vLLM's words.

What it does: ``check_with_vllm(config, server=False)`` takes the engine arguments an
``EngineConfig`` maps to (``engine_kwargs()``, the profile's merged in by the caller) and
refuses, with one ``InputError`` naming the setting (``extra['...']`` where it came from
``extra``), the value and what was expected:
  - a name that is no argument of what will receive it: ``vllm.LLM`` (its own parameters plus
    ``dataclasses.fields(EngineArgs)``) for the offline engine; ``AsyncEngineArgs`` plus the
    server's ``FrontendArgs`` (and ``make_arg_parser``'s few own flags) for ``vllm serve``;
  - a value its annotation does not admit (pydantic ``TypeAdapter`` on the annotation, string
    annotations resolved one field at a time with ``typing.get_type_hints``; lax, as vLLM's own
    pydantic configs validate);
  - a value outside the bounds vLLM's pydantic config dataclasses put on the field of the same
    name (``SchedulerConfig.max_num_batched_tokens``: ``Field(ge=1)``), read from their
    ``__pydantic_fields__`` metadata: no config object is built, so nothing runs (measured with
    the field tables built and vLLM already imported: well under 0.1 s).
``engine_arg_names(server)`` is the accepted name set.

What it deliberately does not do: build vLLM's configs (``EngineArgs.create_engine_config`` reads
the model, loads plugins and probes the platform: cross-field rules such as
``max_num_batched_tokens >= max_num_seqs`` stay vLLM's, reported verbatim at engine start by
``statescope.engine.offline.start_error``), validate nested config objects field by field (a
config-class value is checked to be a mapping or an instance: validating it would run its
``__post_init__``), or check a server that runs under another interpreter (another vLLM).
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import inspect
import sys
import types
import typing
from typing import Any, Literal, Mapping, Union

from statescope.errors import InputError

# make_arg_parser's own flags (vllm/entrypoints/openai/cli_args.py), beside FrontendArgs and
# AsyncEngineArgs
_SERVER_OWN = ("model_tag", "headless", "api_server_count", "config", "grpc")
# a config class whose fields describe something else than the flat engine argument of the same
# name: SpeculativeConfig.max_model_len is the draft's (ge=1), passed whole as speculative_config
_NOT_FLATTENED = ("SpeculativeConfig",)
_UNRESOLVED = object()  # an annotation that could not be resolved: its field is not type-checked


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One argument vLLM accepts: where it is declared, its annotation (or ``_UNRESOLVED``) and
    the bounds vLLM's config dataclasses put on the field of the same name."""

    name: str
    owner: str
    annotation: Any
    bounds: tuple = ()
    bound_owners: tuple[str, ...] = ()


def _resolve(name: str, annotation: Any, module: str) -> Any:
    """One annotation, resolved on its own: ``typing.get_type_hints`` of the whole EngineArgs
    fails on a single unresolvable name (0.28.0's ``QuantizationConfigArgs``, imported only under
    TYPE_CHECKING), which would leave every field unchecked."""
    if not isinstance(annotation, str):
        return annotation
    holder = type("_Holder", (), {"__annotations__": {name: annotation}, "__module__": module})
    try:
        return typing.get_type_hints(holder, globalns=vars(sys.modules[module]))[name]
    except Exception:  # NameError for a TYPE_CHECKING-only import: skip that one field
        return _UNRESOLVED


def _bounds() -> dict[str, list[tuple[str, Any]]]:
    """{field name: [(config class, annotated_types bound)]} from vLLM's pydantic configs."""
    import annotated_types
    import vllm.config

    out: dict[str, list[tuple[str, Any]]] = {}
    for cls_name, cls in vars(vllm.config).items():
        fields = getattr(cls, "__pydantic_fields__", None) if isinstance(cls, type) else None
        if not fields or cls_name in _NOT_FLATTENED:
            continue
        for name, info in fields.items():
            for m in info.metadata:
                if isinstance(m, (annotated_types.Ge, annotated_types.Gt, annotated_types.Le,
                                  annotated_types.Lt, annotated_types.MultipleOf)):
                    out.setdefault(name, []).append((cls_name, m))
    return out


@functools.lru_cache(maxsize=2)
def _specs(server: bool) -> dict[str, ArgSpec]:
    # the callers (OfflineEngine, VllmServer) have imported vLLM through engine.offline.import_vllm
    # (shims first, version gate): importing offline here would close a circle inside the wing
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    raw: dict[str, tuple[str, Any]] = {}

    def add_dataclass(cls: type) -> None:
        for f in dataclasses.fields(cls):
            raw.setdefault(f.name, (f"{cls.__name__}.{f.name}",
                                    _resolve(f.name, f.type, cls.__module__)))

    if server:
        from vllm.entrypoints.openai.cli_args import FrontendArgs

        add_dataclass(AsyncEngineArgs)
        add_dataclass(FrontendArgs)
        for name in _SERVER_OWN:
            raw.setdefault(name, (f"vllm serve --{name.replace('_', '-')}", _UNRESOLVED))
    else:
        from vllm import LLM

        # LLM's own parameters come first: it converts them (compilation_config=3) before
        # EngineArgs sees them, so their annotation is the one a caller must meet
        for p in list(inspect.signature(LLM.__init__).parameters.values())[1:]:
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
                raw[p.name] = (f"LLM({p.name}=...)",
                               _resolve(p.name, p.annotation, LLM.__module__)
                               if p.annotation is not p.empty else _UNRESOLVED)
        add_dataclass(EngineArgs)
    bounds = _bounds()
    return {name: ArgSpec(name, owner, ann, tuple(b for _, b in bounds.get(name, ())),
                          tuple(c for c, _ in bounds.get(name, ())))
            for name, (owner, ann) in raw.items()}


def engine_arg_names(server: bool = False) -> frozenset[str]:
    """The argument names the offline engine (``vllm.LLM``) or ``vllm serve`` accepts."""
    return frozenset(_specs(server))


def _is_config_class(t: Any) -> bool:
    return isinstance(t, type) and hasattr(t, "__pydantic_fields__")


def _shallow(t: Any) -> Any:
    """``t`` with each vLLM config class as 'a mapping or an instance' (validating a mapping
    into the class would run its ``__post_init__``) and each enum also by member name (vLLM's
    command line passes ``--attention-backend FLASH_ATTN``)."""
    from pydantic import InstanceOf

    if typing.get_origin(t) in (Union, types.UnionType):
        return Union[tuple(_shallow(a) for a in typing.get_args(t))]
    if _is_config_class(t):
        return Union[dict[str, Any], InstanceOf[t]]
    if isinstance(t, type) and issubclass(t, enum.Enum) and len(t):
        return Union[t, Literal[tuple(m.name for m in t)]]
    return t


@functools.lru_cache(maxsize=512)
def _adapter(name: str, server: bool) -> Any:
    """The TypeAdapter of one argument, or None where pydantic cannot build one (an arbitrary
    class such as ``torch.dtype`` with no schema even with arbitrary types allowed)."""
    from pydantic import ConfigDict, TypeAdapter

    t = _shallow(_specs(server)[name].annotation)
    for kw in ({"config": ConfigDict(arbitrary_types_allowed=True)}, {}):
        try:
            return TypeAdapter(t, **kw)
        except Exception:  # PydanticSchemaGenerationError / PydanticUserError: try the other
            continue
    return None


def _expected(spec: ArgSpec) -> str:
    text = getattr(spec.annotation, "__name__", None) or str(spec.annotation)
    return text.replace("typing.", "")


def _bound_text(bound: Any) -> str:
    for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"),
                       ("multiple_of", "a multiple of")):
        if hasattr(bound, attr):
            return f"{sign} {getattr(bound, attr)}"
    return repr(bound)


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


def check_kwargs(kwargs: Mapping[str, Any], *, server: bool = False,
                 label: Mapping[str, str] | None = None, where: str = "engine settings") -> None:
    """Refuse (``InputError``) an argument ``vllm.LLM`` / ``vllm serve`` does not take, or a
    value its vLLM annotation or config bounds refuse. ``label`` names an argument as the user
    spelled it (``extra['block_size']``)."""
    from pydantic import TypeAdapter, ValidationError

    specs = _specs(server)
    label = label or {}
    target = "vllm serve" if server else "vllm.LLM (the offline engine)"
    for name, value in kwargs.items():
        shown = label.get(name, name)
        spec = specs.get(name)
        if spec is None:
            close = difflib.get_close_matches(name, list(specs), n=3)
            raise InputError(
                f"{where}: {shown}={value!r}: {name!r} is not an engine argument of vLLM "
                f"{_vllm_version()} ({target}): expected one of its {len(specs)} arguments"
                + (f"; did you mean {' or '.join(close)}?" if close else ""))
        if spec.annotation is _UNRESOLVED:
            continue  # a name vLLM takes but whose type it hides from us (see _resolve)
        adapter = _adapter(name, server)
        if adapter is not None:
            try:
                adapter.validate_python(value)
            except ValidationError as exc:
                first = exc.errors()[0]["msg"] if exc.errors() else str(exc)
                first = first if len(first) <= 200 else first[:200] + "..."  # an enum's paths
                raise InputError(f"{where}: {shown}={value!r}: expected {_expected(spec)} "
                                 f"(vLLM {_vllm_version()} {spec.owner}): {first}") from None
        if spec.bounds and isinstance(value, (int, float)) and not isinstance(value, bool):
            for bound, owner in zip(spec.bounds, spec.bound_owners):
                try:  # the config dataclass's own constraint object, applied by pydantic
                    TypeAdapter(typing.Annotated[type(value), bound]).validate_python(value)
                except ValidationError:
                    raise InputError(f"{where}: {shown}={value!r}: expected {_bound_text(bound)} "
                                     f"(vLLM {_vllm_version()} {owner}.{name})") from None


def check_with_vllm(config: Any, *, server: bool = False, where: str = "engine settings") -> None:
    """Check the engine arguments ``config`` (an ``EngineConfig``, the device profile already
    merged) maps to against the installed vLLM, before any engine or server starts."""
    kwargs = config.engine_kwargs()
    fields = {f.name for f in dataclasses.fields(config)}
    label = {k: (f"extra[{k!r}]" if k in config.extra else
                 f"EngineConfig.{k}" if k in fields else k) for k in kwargs}
    check_kwargs(kwargs, server=server, label=label, where=where)
