"""Existing environments as builds: a release someone else installed (a "device build profile").

What it does: ``check_existing`` is what ``ensure_build`` does for ``env:DIR`` / ``python:PATH``
specs: one ``import statescope, vllm, torch`` in the cell's environment
(``statescope.builds.environment.cell_environment``: ``env.sh`` sourced with a minimal environment
and a time limit), logged under ``builds_dir()/_existing/<key>/check.log``, its outcome in
``build.json`` beside it (``status`` ok or failed: ``build list`` shows the last check, not an
older success); a failure is ``BuildFailed`` naming the path. Checked once per process and
environment (``forget`` drops a removed environment from that memory).

What it deliberately does not do: install, upgrade or write anything into the environment (no
shims ``.pth`` either: a CPU environment without it is the caller's to fix with
``python -m statescope.patches.shims``), or activate it for the caller's own process.
"""
from __future__ import annotations

import json
from pathlib import Path

from statescope.builds.environment import (  # noqa: F401 (re-exported: the module's former face)
    ENV_SH_TIMEOUT_S, EXISTING_KINDS, SOURCE_ENV_NAMES, SOURCE_ENV_PREFIXES, cell_environment,
    interpreter, label, resolve_path, source_environment, vllm_location, vllm_version)
from statescope.builds.process import VERIFY_IMPORTS, run_logged
from statescope.builds.spec import Build, BuildFailed, BuildSpec, builds_dir
from statescope.errors import InputError


_CHECKED: dict[tuple, dict] = {}


def check_existing(spec: BuildSpec) -> Build:
    """The ``Build`` of an existing environment, after one import check (BuildFailed if it fails);
    checked once per process and environment."""
    env = cell_environment(spec)
    try:
        py = interpreter(spec, env)
    except InputError as exc:
        raise InputError(str(exc)) from None
    folder = builds_dir() / "_existing" / spec.install_key()
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / "check.log"
    key = (spec.kind, spec.source, str(py))
    if key not in _CHECKED:
        with open(log_path, "wb") as log:
            log.write(f"statescope existing environment {spec.kind}:{spec.source}, python {py}\n".encode())
            rc, out = run_logged([py, "-c", VERIFY_IMPORTS], log, "import check", env, 600)
        if rc != 0 or "STATESCOPE_VERSIONS " not in out:
            tail = [l for l in out.strip().splitlines() if l.strip()][-1:] or ["no output"]
            what = "vllm" if "vllm" in tail[0] else "statescope, vllm and torch"
            error = f"build {spec.kind}:{spec.source}: {py} cannot import {what} ({tail[0][:200]})"
            # replaces an earlier "ok": the environment changed since, and list must say so
            (folder / "build.json").write_text(json.dumps(
                {**spec.to_dict(), "key": spec.install_key(), "status": "failed", "existing": True,
                 "python": str(py), "error": error}, indent=2))
            raise BuildFailed(error, log_path)
        versions = json.loads(out.split("STATESCOPE_VERSIONS ", 1)[1].splitlines()[0])
        _CHECKED[key] = {**spec.to_dict(), "key": spec.install_key(), "status": "ok",
                         "existing": True, "python": str(py), "versions": versions}
        (folder / "build.json").write_text(json.dumps(_CHECKED[key], indent=2))
    return Build(spec, Path(spec.source), dict(_CHECKED[key]), python_path=py, env=env)


def forget(install_key: str) -> None:
    """Drop the environments of ``install_key`` from this process's checked ones (their record
    was removed: the next ``check_existing`` checks again and writes it anew)."""
    for key in [k for k, v in _CHECKED.items() if v.get("key") == install_key]:
        del _CHECKED[key]
