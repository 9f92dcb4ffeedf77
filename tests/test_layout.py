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
# LAYOUT.md's order, but for models: the GPU arms build random hybrids (gpu -> models), and the
# models wing needs only engine, patches and workload, so it sits right above engine. cluster
# (matrix and bisection cells on Ray) runs builds' cells: right above builds.
WINGS = ("workload", "patches", "capture", "engine", "models", "verdict", "diverge", "bisect",
         "builds", "cluster", "gpu", "results", "teach", "share", "cli")
BASE = {"errors", "tables", "records", "resolved", "wings", "intervals", "progress", "quiet",
        "lockfile"}  # shared by every wing
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


# --- no round names (issue 34): a name says which question it answers, never which GPU campaign
# ("round 3") it came from. A campaign round is "round" glued to a number (round3, round_3,
# e2e_round4, round-6) or an R-number constant/alias (R3_DIR, R4, ``as r3``); the other "round" of
# this project, a timed round of an overhead measurement (``timed_round``, ``rounds=``,
# ``overhead_rounds``, ``gui_12_rounds.json``), and ``round(x)`` carry no number and pass.
REPO = PKG.parents[1]
ROUND_NAME = re.compile(r"(?i)(?<![a-z])round[-_]?\d")
R_NUMBER = re.compile(r"(?:^|_)[Rr]\d+(?:_|$)")  # R3_DIR, R4, OVERHEAD_R5, r3 (as an alias)
PY_DIRS = ("lib", "tests", "notebooks", "scripts", "benchmarks")


def _py_files() -> list[Path]:
    return sorted(p for d in PY_DIRS for p in (REPO / d).rglob("*.py")
                  if "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts)


def _round_named(name: str) -> bool:
    return bool(ROUND_NAME.search(name))


def _round_file_name(stem: str) -> bool:
    """A module or test file: also "..._rounds" / "round_..." without a number (the file would be
    named for the campaigns, e.g. test_gpu_overhead_rounds.py)."""
    return _round_named(stem) or bool(re.search(r"(?:^|_)rounds?(?:_|$)", stem))


def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("path", _py_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_python_file_parses(path: Path):
    """Every other check here reads sources with ``ast``: a file that does not parse (a notebook's
    markdown left uncommented, say) must fail, never be skipped."""
    try:
        _parsed(path)
    except SyntaxError as e:
        pytest.fail(f"{path.relative_to(REPO)}:{e.lineno}: does not parse ({e.msg})")


def _round_names_in(path: Path, tree: ast.Module) -> list[str]:
    """Every round name ``tree`` defines or binds: functions, classes, parameters, variables,
    import aliases, module-level constants, dict keys and subscripted string keys."""
    where = str(path.relative_to(REPO))
    bad = []

    def flag(kind: str, name: str, node: ast.AST, strict: bool = False) -> None:
        if _round_named(name) or (strict and R_NUMBER.search(name)):
            bad.append(f"{where}:{getattr(node, 'lineno', '?')}: {kind} {name!r}")

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            flag("definition", node.name, node)
        elif isinstance(node, ast.arg):
            flag("parameter", node.arg, node)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            flag("name", node.id, node)
        elif isinstance(node, ast.alias):
            flag("module", node.name.split(".")[-1], node)
            if node.asname:
                flag("import alias", node.asname, node, strict=True)
        elif isinstance(node, ast.Dict):
            for k in node.keys:
                if isinstance(k, ast.Constant) and isinstance(k.value, str):
                    flag("dict key", k.value, k)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str):
            flag("key", node.slice.value, node)
        elif isinstance(node, ast.keyword) and node.arg:
            flag("keyword", node.arg, node)
    for node in tree.body:  # module-level constants: R3_DIR, R4 = ...
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name) and n.id.isupper():
                    flag("constant", n.id, n, strict=True)
    return bad


def test_no_round_names_in_code():
    bad = []
    for path in _py_files():
        if _round_file_name(path.stem):
            bad.append(f"{path.relative_to(REPO)}: file named after a round")
        try:
            tree = _parsed(path)
        except SyntaxError:
            continue  # test_every_python_file_parses fails on it
        bad += _round_names_in(path, tree)
    assert not bad, "names that say which round, not which question:\n" + "\n".join(bad)


def test_no_round_names_in_data_folders():
    results = REPO / "data" / "results"
    bad = [str(p.relative_to(REPO)) for p in sorted(results.rglob("*"))
           if _round_named(p.name) or R_NUMBER.search(p.stem)]
    assert not bad, f"results named after a round, not the question they answer: {bad}"


def test_no_round_names_in_script_subcommands():
    """The device scripts' code lines (subcommands, ``case`` labels, ``--tag`` stems): no round name.
    Comments may tell the history; a name may not."""
    bad = []
    for path in sorted((REPO / "scripts").glob("*.sh")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = "" if line.lstrip().startswith("#") else re.sub(r"\s#.*$", "", line)
            if _round_named(code):
                bad.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not bad, "script names after a round:\n" + "\n".join(bad)


def test_no_round_aliases_or_keys_in_notebooks():
    """The .ipynb halves of the jupytext pairs (their code cells, as text)."""
    import json

    bad = []
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            src = "".join(cell["source"]) if cell["cell_type"] == "code" else ""
            for m in re.finditer(r"\bas\s+(\w+)|\b(\w+)\s*=|[\"'](\w+)[\"']", src):
                name = next(g for g in m.groups() if g)
                if _round_named(name) or (m.group(1) and R_NUMBER.search(name)):
                    bad.append(f"{nb.name}: {m.group(0)!r}")
    assert not bad, "round names in notebook code:\n" + "\n".join(bad)


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


def _top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):  # guarded definitions
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
                elif isinstance(sub, ast.Assign):
                    names |= {n.id for t in sub.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _module_file(dotted: str) -> Path | None:
    p = PKG.parent.joinpath(*dotted.split("."))
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return p.with_suffix(".py") if p.with_suffix(".py").is_file() else None


def test_every_statescope_import_names_something_that_exists():
    """Lazy imports inside functions are not run by importing the module: check them as text."""
    repo = PKG.parents[1]
    files = [p for d in ("lib", "tests", "scripts", "benchmarks", "notebooks")
             for p in (repo / d).rglob("*.py") if "__pycache__" not in p.parts]
    faces: dict[str, set[str]] = {}
    for init in PKG.glob("*/__init__.py"):
        m = re.search(r"public_face\(__name__, \{(.*?)\}\)", init.read_text(), re.S)
        if m:
            faces[f"statescope.{init.parent.name}"] = set(re.findall(r'"(\w+)":', m.group(1)))
    broken = []
    for path in files:
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError as e:  # a file that does not parse is a failure, never a skip
            broken.append(f"{path.relative_to(repo)}:{e.lineno}: does not parse ({e.msg})")
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.startswith("statescope")):
                continue
            target = _module_file(node.module)
            where = f"{path.relative_to(repo)}:{node.lineno}"
            if target is None:
                broken.append(f"{where}: no module {node.module}")
                continue
            have = _top_level_names(target) | faces.get(node.module, set())
            for a in node.names:
                sub = _module_file(f"{node.module}.{a.name}")
                if a.name not in have and sub is None and a.name != "*":
                    broken.append(f"{where}: {node.module} has no {a.name}")
    assert not broken, "imports of names that do not exist:\n" + "\n".join(broken)


def _dotted(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_import_nodes(tree: ast.Module):
    """Every import statement that runs, lazily in a function or not; ``if TYPE_CHECKING:`` blocks
    are annotations only and are skipped."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _module_edges() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the statescope modules it imports at run time, private names imported across)."""
    paths = {_dotted(p): p for p in _modules()}
    edges: dict[str, set[str]] = {m: set() for m in paths}
    private = []
    for mod, path in paths.items():
        for node in _runtime_import_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges[mod] |= {a.name for a in node.names if a.name in paths}
                continue
            base = node.module or ""
            if node.level:
                up = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                base = ".".join(up[:len(up) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                if target not in paths or target == mod:
                    continue
                edges[mod].add(target)
                if a.name.startswith("_") and not a.name.startswith("__"):
                    private.append(f"{path.relative_to(PKG)}:{node.lineno} imports {a.name} "
                                   f"from {target}")
    return edges, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for u in graph[v]:
            if u not in index:
                visit(u)
                low[v] = min(low[v], low[u])
            elif u in stack:
                low[v] = min(low[v], index[u])
        if low[v] == index[v]:
            comp = []
            while True:
                u = stack.pop()
                comp.append(u)
                if u == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_inside_a_wing():
    """Counting lazy imports in functions too: a circle hidden in a function is still a circle."""
    edges, _ = _module_edges()
    circles = []
    for wing in WINGS:
        inside = {m for m in edges if m.startswith(f"statescope.{wing}.")}
        circles += _cycles({m: {t for t in edges[m] if t in inside} for m in inside})
    assert not circles, "import circles inside a wing:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_private_names_across_modules():
    _, private = _module_edges()
    assert not private, "private names imported from another module:\n" + "\n".join(private)


def test_the_circle_check_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
