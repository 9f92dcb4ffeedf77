"""The library's layout holds: wings by stage, imports only downward, names by question, small modules.

Reads the sources as text (``ast``), imports nothing of statescope. The wing order is the one in
``../shared/design/LAYOUT.md`` (bottom to top); the base modules at the top of the package may be
imported by every wing and import no wing themselves.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "lib" / "statescope"
WINGS = ("workload", "patches", "capture", "engine", "verdict", "diverge", "bisect", "builds",
         "gpu", "results", "models", "teach", "share", "cli")
BASE = {"errors", "tables", "records", "resolved", "wings"}  # shared by every wing
ENTRIES = {"__init__"}  # the package root (installs the CPU shims)
# vLLM's plugin entry point installs patches and capture in every vLLM process; the in-process
# engine calls it too: it sits between capture and engine.
PLACED = {"plugin": WINGS.index("capture") + 0.5}


def _rank(name: str) -> float | None:
    return PLACED.get(name, WINGS.index(name) if name in WINGS else None)
# argparse outside cli/: a separate process's own command line, not a statescope command
ARGPARSE_ALLOWED = {"engine/server_guard.py": "the guard is its own process (python -m ...)"}


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _wing(dotted: str) -> str | None:
    """The wing (or base/entry module name) a dotted ``statescope.X...`` path belongs to."""
    parts = dotted.split(".")
    if parts[0] != "statescope" or len(parts) < 2:
        return None
    return parts[1]


def _imports(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "statescope":
                out += [(f"statescope.{a.name}", node.lineno) for a in node.names]
            elif node.module.startswith("statescope."):
                out.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("statescope.")]
    return out


def _own_wing(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_wing_exists_and_says_what_it_is():
    for wing in WINGS:
        init = PKG / wing / "__init__.py"
        assert init.is_file(), f"wing {wing} has no __init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{wing}/__init__.py: no docstring"


def test_imports_point_down_the_wings():
    upward = []
    for path in _modules():
        me = _own_wing(path)
        for target, line in _imports(path):
            other = _wing(target)
            if other is None or other == me:
                continue
            where = f"{path.relative_to(PKG)}:{line} imports {target}"
            if me in ENTRIES or other in BASE:
                continue
            if me in BASE:
                upward.append(f"{where} (a base module imports no wing)")
            elif other in ENTRIES:
                upward.append(f"{where} (nothing imports the package root)")
            elif _rank(other) is None or _rank(me) is None:
                upward.append(f"{where} (unknown module or wing)")
            elif _rank(other) > _rank(me):
                upward.append(f"{where} ({other} sits above {me})")
    assert not upward, "imports against the wing order:\n" + "\n".join(upward)


def test_few_modules_at_the_top():
    top = sorted(p.stem for p in PKG.glob("*.py"))
    known = BASE | ENTRIES | set(PLACED)
    assert set(top) <= known, f"top-level modules outside the base set: {set(top) - known}"
    assert len(top) <= 15


def test_names_say_what_not_when():
    bad = [str(p.relative_to(PKG)) for p in _modules()
           if re.search(r"(round\d|_round|_v\d+$|20\d\d|session\d)", p.stem)]
    assert not bad, f"modules named after a round, date or version: {bad}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_module_opens_with_a_docstring_and_stays_small(path: Path):
    src = path.read_text()
    if path.name == "__init__.py" or path.name == "__main__.py" or src.strip():
        assert ast.get_docstring(ast.parse(src)), "no opening docstring (what it does and does not)"
    assert src.count("\n") < 1000, "a module of 1,000 lines or more: split it by question"


def test_command_line_code_lives_in_cli():
    offenders = []
    for path in _modules():
        rel = str(path.relative_to(PKG))
        if rel.startswith("cli/") or rel in ARGPARSE_ALLOWED:
            continue
        if re.search(r"^\s*import argparse|^\s*from argparse", path.read_text(), re.M):
            offenders.append(rel)
    assert not offenders, f"argparse outside statescope.cli: {offenders}"
