"""Installing builds: one isolated, cached virtual environment per build spec, with its install log.

What it does: ``ensure_build`` creates the environment of a ``BuildSpec`` once under
``builds_dir()/<install key>`` with ``uv`` when it is found or can be pip-installed, else
``python -m venv`` + pip; installs vLLM with statescope's light dependencies in one resolve (the
release's torch pin is the resolver's to keep; the machine's pip configuration and ``PIP_*``
variables pass through, translated into ``uv`` options), then statescope itself editable without
dependencies, and checks that vLLM imports. A commit spec's wheel is fetched from vLLM's
per-commit index (``COMMIT_INDEX``) only. Every command and its output go to ``install.log``; a
build that cannot be installed raises ``BuildFailed`` with that log, and stays failed until
re-added with ``force``. An existing environment (``env:DIR`` / ``python:PATH``) installs nothing:
``ensure_build`` only checks it (``statescope.builds.existing.check_existing``). ``list_builds`` / ``remove_build`` manage the cache.

What it deliberately does not do: build vLLM from source, share an environment between specs that
install different things, run experiments, or delete environments on its own.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from statescope.builds.process import VERIFY_IMPORTS, clean_env, run_logged  # noqa: F401 (re-export)
from statescope.builds.spec import (LIGHT_DEPS, REPO, Build, BuildFailed, BuildSpec, builds_dir)
from statescope.errors import EnvironmentBroken, InputError

COMMIT_INDEX = "https://wheels.vllm.ai/{commit}"
def _commit_fetch_env() -> dict:
    env = {k: v for k, v in clean_env().items()
           if k not in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONSTRAINT")}
    return {**env, "PIP_CONFIG_FILE": os.devnull}  # pip then reads no configuration file


def pip_config() -> dict[str, list[str]]:
    """This machine's pip settings (config files and PIP_* variables), as ``pip config list`` shows."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, env=clean_env()).stdout
    conf: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep and "." in key:
            for v in value.strip().strip("'\"").split():
                conf.setdefault(key.split(".", 1)[1], [])
                if v not in conf[key.split(".", 1)[1]]:
                    conf[key.split(".", 1)[1]].append(v)
    return conf


def uv_options(conf: dict[str, list[str]]) -> tuple[list[str], dict]:
    """pip settings as ``uv pip install`` options and variables (uv reads no pip config)."""
    args = ["--index-strategy", "unsafe-best-match"]  # pip's rule: best version over all indexes
    for key, flag in (("index-url", "--index-url"), ("extra-index-url", "--extra-index-url"),
                      ("find-links", "--find-links"), ("constraint", "--constraint")):
        for v in conf.get(key, [])[:1] if key == "index-url" else conf.get(key, []):
            args += [flag, v]
    env = {}
    if conf.get("cert"):
        env["SSL_CERT_FILE"] = conf["cert"][0]
    if conf.get("default-timeout"):
        env["UV_HTTP_TIMEOUT"] = conf["default-timeout"][0]
    return args, env


def find_uv(bootstrap: bool = False) -> str | None:
    """``uv`` from $STATESCOPE_UV, PATH or the builds tool dir; ``bootstrap`` pip-installs it there."""
    tools = builds_dir() / "_tools"
    for cand in (os.environ.get("STATESCOPE_UV"), shutil.which("uv"), str(tools / "bin" / "uv")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    if bootstrap:
        tools.mkdir(parents=True, exist_ok=True)
        with open(tools / "install.log", "ab") as log, contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([sys.executable, "-m", "pip", "install", "--target", str(tools), "uv"],
                           stdout=log, stderr=subprocess.STDOUT, env=clean_env(), timeout=600)
        return find_uv(False)  # None when that failed: the caller falls back to pip
    return None


def _install(spec: BuildSpec, path: Path, installer: str, timeout_s: float) -> dict:
    venv, log_path = path / "venv", path / "install.log"
    if not (REPO / "pyproject.toml").is_file():
        raise EnvironmentBroken(f"builds install statescope from its source tree, expected at {REPO}")
    shutil.rmtree(venv, ignore_errors=True)
    uv = find_uv(bootstrap=True) if installer in ("auto", "uv") else None
    if installer == "uv" and uv is None:
        raise InputError("installer='uv': uv was not found and could not be pip-installed")
    uv_args, uv_env = uv_options(pip_config()) if uv else ([], {})
    env = clean_env(uv_env)
    py = venv / "bin" / "python"
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        log.write(f"statescope build {spec.label} (key {path.name}), installer "
                  f"{'uv ' + uv if uv else 'pip'}\n".encode())

        def step(name: str, cmd: list) -> str:
            rc, out = run_logged(cmd, log, name, env, timeout_s)
            if rc != 0:
                tail = [l for l in out.strip().splitlines() if l.strip()][-3:]
                raise BuildFailed(f"build {spec.label}: {name} failed (exit {rc}): "
                                  + " | ".join(tail), log_path)
            return out

        step("create venv", [uv, "venv", "--python", sys.executable, venv] if uv
             else [sys.executable, "-m", "venv", venv])
        requirement = spec.source
        if spec.kind == "commit":
            index = COMMIT_INDEX.format(commit=spec.source) + (f"/{spec.variant}" if spec.variant else "")
            # Only the commit's index may answer (no configured index may offer a release vllm);
            # the wheel is then installed like a local file, with the machine's pip settings.
            rc, out = run_logged([sys.executable, "-m", "pip", "download", "vllm", "--no-deps", "--pre",
                                   "--only-binary", ":all:", "--index-url", index, "-d", path / "wheel"],
                                  log, "fetch commit wheel", _commit_fetch_env(), timeout_s)
            wheels = sorted((path / "wheel").glob("*.whl"))
            if rc != 0 or not wheels:
                raise BuildFailed(f"build {spec.label}: no wheel for this commit at {index}", log_path)
            requirement = str(wheels[0])
        pip = [uv, "pip", "install", "--python", py, *uv_args] if uv else [py, "-m", "pip", "install"]
        step("install vllm", [*pip, requirement, *LIGHT_DEPS])
        step("install statescope", [*pip, "--no-deps", "-e", REPO])
        log.write(f"\nshims hook: {_ensure_shims_hook(venv)}\n".encode())
        out = step("import check", [py, "-c", VERIFY_IMPORTS])
    versions = json.loads(out.split("STATESCOPE_VERSIONS ", 1)[1].splitlines()[0])
    du = subprocess.run(["du", "-sb", str(venv)], capture_output=True, text=True).stdout.split()
    return {"installer": "uv" if uv else "pip", "install_seconds": round(time.perf_counter() - t0, 1),
            "size_bytes": int(du[0]) if du else None, "versions": versions}


def _ensure_shims_hook(venv: Path) -> Path:
    """statescope's start-up ``.pth`` hook in the build's site-packages (``statescope.patches.shims``):
    vLLM inspects model architectures in a ``python -m`` subprocess that must get the CPU import
    shims too, and builds installed before this hook existed lack it."""
    from statescope.patches.shims import install_pth

    found = sorted(venv.glob("lib/python*/site-packages"))
    if not found:
        raise EnvironmentBroken(f"no site-packages under {venv}")
    return install_pth(found[0])


@contextlib.contextmanager
def _locked(path: Path):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # one installer per environment at a time
        yield


def ensure_build(spec: BuildSpec | str, *, force: bool = False, installer: str = "auto",
                 timeout_s: float = 3600) -> Build:
    """The installed environment of ``spec``, installing it first if needed (raises BuildFailed)."""
    spec = BuildSpec.parse(spec)
    if installer not in ("auto", "uv", "pip"):
        raise InputError(f"installer={installer!r}: expected 'auto', 'uv' or 'pip'")
    if spec.existing:  # someone else's environment: check it, never install into it
        from statescope.builds.existing import check_existing

        return check_existing(spec)
    path = builds_dir() / spec.install_key()
    with _locked(path):
        meta = path / "build.json"
        info = json.loads(meta.read_text()) if meta.is_file() else {}
        build = Build(spec, path, info)
        if not force and info.get("status") == "ok" and build.python.is_file():
            _ensure_shims_hook(path / "venv")
            return build
        if not force and info.get("status") == "failed":
            raise BuildFailed(f"{info.get('error')}; cached failure, re-add with force=True to retry",
                              build.log_path)
        info = {**dataclasses.replace(spec, patches=()).to_dict(), "key": path.name,
                "created": time.time()}
        try:
            info.update(_install(spec, path, installer, timeout_s), status="ok")
        except BuildFailed as exc:
            info.update(status="failed", error=str(exc).split(" (install log:")[0])
            raise
        finally:
            meta.write_text(json.dumps(info, indent=2))
        build.info = info
        return build


def list_builds() -> list[dict]:
    """One row per environment under ``builds_dir()``."""
    rows = []
    # installed builds, and the existing environments ``build add env:…|python:…`` checked
    for meta in sorted(builds_dir().glob("*/build.json")) + sorted(builds_dir().glob("_existing/*/build.json")):
        i = json.loads(meta.read_text())
        rows.append({"spec": i.get("spec"), "key": i.get("key"), "status": i.get("status"),
                     "vllm": i.get("versions", {}).get("vllm"), "torch": i.get("versions", {}).get("torch"),
                     "installer": i.get("installer"), "install_seconds": i.get("install_seconds"),
                     "size_gb": round(i["size_bytes"] / 1e9, 2) if i.get("size_bytes") else None,
                     # an existing environment is only checked: its log is the check's
                     "log": str(meta.parent / ("check.log" if i.get("existing") else "install.log")),
                     "error": i.get("error")})
    return rows


def remove_build(spec_or_key: str | BuildSpec) -> bool:
    """Delete a build environment named by its spec, its install key or its ``spec`` as
    ``list_builds`` shows it (specs that differ only in patches share it); False when there was
    none. An existing environment (``env:`` / ``python:``) loses only statescope's record of its
    check (``_existing/<key>``), never the environment itself."""
    if isinstance(spec_or_key, str) and re.fullmatch(r"[0-9a-f]{16}", spec_or_key):
        key = spec_or_key
    else:
        listed = [r["key"] for r in list_builds() if r["spec"] == str(spec_or_key) and r["key"]]
        # an existing environment is listed by its label ("vllm 0.28.0 @ DIR"), not a spec
        key = listed[0] if listed and not isinstance(spec_or_key, BuildSpec) \
            else BuildSpec.parse(spec_or_key).install_key()
    removed = False
    for path in (builds_dir() / key, builds_dir() / "_existing" / key):
        if path.is_dir():
            shutil.rmtree(path)
            removed = True
    if removed:
        from statescope.builds.existing import forget

        forget(key)
    return removed
