"""The parameters a notebook declares: its cell tagged ``parameters`` (papermill's convention).

What it does: ``declared_parameters(nb)`` reads that cell's top-level assignments (``name = 1``,
``name: int = 1``) with ``ast`` and returns ``{name: default}`` — the default as a Python literal
where it is one (``ast.literal_eval``), else ``None`` (any value accepted); ``{}`` when the
notebook has no parameters cell. ``statescope render`` checks ``-p NAME=VALUE`` against it before
a kernel starts: an unknown name is an error (papermill would inject it where nothing reads it),
and a value must have its default's type (``statescope.cli.assignments.literal_kind``).

What it deliberately does not do: execute the cell, or inject anything (papermill does that).
"""
from __future__ import annotations

import ast
from typing import Any

from statescope.errors import InputError


def declared_parameters(nb: Any, where: str = "notebook") -> dict[str, Any]:
    """``{name: default or None}`` of the cell tagged ``parameters``; {} when there is none."""
    for cell in nb.cells:
        if cell.get("cell_type") != "code" or "parameters" not in cell.get("metadata", {}).get("tags", []):
            continue
        source = "".join(cell.source) if isinstance(cell.source, list) else cell.source
        try:
            tree = ast.parse(source)
        except SyntaxError as exc:
            raise InputError(f"{where}: its parameters cell is not valid Python ({exc.msg}, "
                             f"line {exc.lineno})") from None
        out: dict[str, Any] = {}
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
            for target in targets:
                if isinstance(target, ast.Name):
                    try:
                        out[target.id] = ast.literal_eval(node.value)
                    except (ValueError, SyntaxError, TypeError):
                        out[target.id] = None
        return out
    return {}
