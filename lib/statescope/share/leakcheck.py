"""The last check before anything is shared: does any file, name or printed text still say a secret?

What it does: ``leaks_in_text(text, scrubber)`` names what survived scrubbing in ``text`` — token
shapes and known secret values in every view ``statescope.share.decoded`` gives (as written,
unescaped level by level, line-joined, reversed, each base64 run decoded, the text chunks of a
PNG inside such a run), and the repository path, home directory and host names in the textual
views. ``leaks_in_bytes`` does the same for a file's bytes (and a PNG's text chunks, compressed
ones inflated). ``check_file`` / ``check_tree`` raise ``SecretLeak`` naming the file (or the
file *name*) and what was found, never the value. ``check_tree`` also checks every path name
under the folder, the folder's own name included.

What it deliberately does not do: repair anything (a render that fails the check is refused by
``statescope.share.publish``), or read pixels.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from statescope.share import decoded
from statescope.share.scrub import Scrubber, SecretLeak, shape_spans

MAX_NESTED = 2  # base64 inside base64 inside a file


def _identity(text: str, scrubber: Scrubber) -> list[str]:
    hits = []
    for path, repl in scrubber.paths:
        if path in text:
            hits.append("the repository path" if repl == "[repo]" else "the home directory path")
    hosts = scrubber.host_pattern
    if hosts is not None and hosts.search(text):
        hits.append("this machine's host name")
    return hits


def _values(text: str, scrubber: Scrubber) -> list[str]:
    """Names of the token shapes and known secret values in ``text`` (never the values)."""
    out = [name for _s, _e, name in shape_spans(text)]
    for value, name in scrubber.secret_values.items():
        if value in text:
            out.append(f"the value of ${name}" if name != "?" else
                       "the value of a credential-named environment variable")
    return out


def leaks_in_text(text: str, scrubber: Scrubber, *, textual: bool = True, depth: int = 0) -> list[str]:
    """What leaked in ``text``: sorted names, each once, with the first view that showed it."""
    levels = decoded.unescaped_levels(text)
    plain = levels[-1].text if levels else text
    found: dict[str, str] = {}

    def add(names: list[str], how: str) -> None:
        for name in names:
            found.setdefault(name, how)

    add(_values(text, scrubber), "")
    if textual:
        add(_identity(text, scrubber), "")
    for view in levels:
        add(_values(view.text, scrubber), "after unescaping")
    if textual and levels:
        add(_identity(plain, scrubber), "after unescaping")
    add(_values(decoded.joined(plain).text, scrubber), "with line wraps joined")
    add(_values(text[::-1], scrubber), "reversed")
    if depth < MAX_NESTED:
        for source in dict.fromkeys([text, plain]):
            for _span, data in decoded.base64_runs(source):
                add(leaks_in_bytes(data, scrubber, textual=False, depth=depth + 1), "in a base64 run")
    return sorted(f"{name} ({how})" if how else name for name, how in found.items())


def leaks_in_bytes(data: bytes, scrubber: Scrubber, *, textual: bool = True, depth: int = 0) -> list[str]:
    """``leaks_in_text`` for a file's content; a PNG's text chunks are inflated and checked."""
    is_png = data.startswith(decoded.PNG_MAGIC)
    hits = leaks_in_text(data.decode("utf-8", "replace"), scrubber,
                         textual=textual and not is_png, depth=depth)
    for chunk in decoded.png_texts(data):
        hits += [f"{h} (in a PNG text chunk)" for h in leaks_in_text(chunk, scrubber, depth=depth + 1)]
    return sorted(set(hits))


def leaks_in_numbers(obj: object, scrubber: Scrubber) -> list[str]:
    """What the typed arrays and number lists inside ``obj`` (a figure spec) spell as text."""
    found: set[str] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if decoded.is_typed_array(item) or isinstance(item, list):
            for text in decoded.number_texts(item):
                found |= {f"{h} (in an array of numbers)" for h in
                          _values(text, scrubber) + _values(decoded.joined(text).text, scrubber)}
        if isinstance(item, dict) and not decoded.is_typed_array(item):
            stack += list(item.values())
        elif isinstance(item, list):
            stack += [v for v in item if isinstance(v, (dict, list))]
    return sorted(found)


def check_numbers(obj: object, where: str, scrubber: Scrubber) -> None:
    """Raise ``SecretLeak`` when the numbers in ``obj`` spell a secret (see ``leaks_in_numbers``)."""
    hits = leaks_in_numbers(obj, scrubber)
    if hits:
        raise SecretLeak(f"{where}: a secret survived scrubbing ({'; '.join(hits)}); "
                         "the render was stopped, nothing from it may be shared")


def check_text(text: str, where: str, scrubber: Scrubber) -> None:
    """Raise ``SecretLeak`` when ``text`` (to be printed or written at ``where``) leaks."""
    hits = leaks_in_text(text, scrubber)
    if hits:
        raise SecretLeak(f"{where}: a secret survived scrubbing ({'; '.join(hits)}); "
                         "the render was stopped, nothing from it may be shared")


def check_file(path: str | Path, scrubber: Scrubber) -> None:
    """Raise ``SecretLeak`` naming ``path`` and the pattern when a secret is in the file."""
    path = Path(path)
    hits = leaks_in_bytes(path.read_bytes(), scrubber)
    if hits:
        raise SecretLeak(f"{path}: a secret survived scrubbing ({'; '.join(hits)}); "
                         f"the render was stopped, nothing from it may be shared")


def check_tree(root: str | Path, environ: Mapping[str, str] | None = None,
               scrubber: Scrubber | None = None) -> int:
    """``check_file`` on every file under ``root`` and a check of every name; returns files checked."""
    environ = os.environ if environ is None else environ
    scrubber = scrubber or Scrubber.for_environment(environ)
    root = Path(root)
    n = 0
    for path in [root, *sorted(root.rglob("*"))]:
        name = path.name if path == root else str(path.relative_to(root))
        hits = leaks_in_text(name, scrubber, textual=False)
        if hits:
            raise SecretLeak(f"{root}: the file name {len(name)} characters long at depth "
                             f"{name.count('/')} carries a secret ({'; '.join(hits)}); the render "
                             "was stopped, nothing from it may be shared")
        if path.is_file():
            check_file(path, scrubber)
            n += 1
    return n


def check_files(root: str | Path, paths: list[Path], scrubber: Scrubber) -> int:
    """``check_file`` on each of ``paths`` (files under ``root`` that a render wrote) and a check of
    their names and ``root``'s; other files in the folder are the user's and are not read."""
    root = Path(root)
    for path in [root, *paths]:
        name = root.name if path == root else str(path.relative_to(root))
        hits = leaks_in_text(name, scrubber, textual=False)
        if hits:
            raise SecretLeak(f"{root}: the file name {len(name)} characters long at depth "
                             f"{name.count('/')} carries a secret ({'; '.join(hits)}); the render "
                             "was stopped, nothing from it may be shared")
        if path != root and path.is_file():
            check_file(path, scrubber)
    return len(paths)
