"""Append-only, crash-tolerant results store: one JSON line per request plus a run manifest.

What it does: ``ResultsStore`` appends records to ``root/run_id/records.jsonl`` (flushed and fsync'd
per record, so a record reported written survives a SIGKILL), keeps ``manifest.json`` current by
atomic replace, and reports which record keys are already stored so an interrupted run can resume.
A torn last line left by a kill is ignored with a warning and cut off before the next append;
a corrupt line anywhere else is an ``InputError``. Loaders return pandas DataFrames.

A run folder is this run's or nothing: ``start`` refuses (before it writes anything) a manifest,
records or lifetimes of another run id or another run fingerprint (a caller's hash of what the
run is: trace, configurations, build), so a folder copied from elsewhere is never resumed as this
run. ``lock`` takes an exclusive ``flock`` on ``<run>/.run.lock`` for the run's life: a second
process on the same run id is refused before it starts anything. A store that never started
leaves an existing manifest alone (a refused resume never turns ``completed`` into ``failed``).
An OS error while writing (disk full, permission) is one ``StoreWriteFailed`` naming the path and
what is kept; temp files are removed, and the final status reaches the manifest even on a full
disk (rewritten in place when no temp file fits). Engine lifetimes may be written several times
as they go: the last line of each (build, config_hash, lifetime) is the current one.

What it deliberately does not do: compact, deduplicate or rewrite records.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import hashlib
import json
import os
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

import pandas as pd

from statescope.errors import EnvironmentBroken, InputError

KEY_FIELDS = ("run_id", "build", "config_hash", "episode", "step")
STATUSES = ("running", "completed", "failed", "interrupted")
RECORDS_FILE, MANIFEST_FILE = "records.jsonl", "manifest.json"
LIFETIMES_FILE = "lifetimes.jsonl"  # one line per engine lifetime of an arm (its counters)
LOCK_FILE = ".run.lock"  # flock'd by the one process running the run


class StoreWriteFailed(EnvironmentBroken):
    """The OS refused a write to a run folder (disk full, permission): the message names the path
    and what was kept."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process was (``terminate_as_interrupt``) so that cleanup runs and
    the manifest says ``interrupted``."""


@contextlib.contextmanager
def terminate_as_interrupt():
    """While inside: SIGTERM raises ``Terminated`` (a ``KeyboardInterrupt``) instead of ending the
    process at once; the previous handler comes back after. Main thread only (else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated(f"signal {signum} (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _json_default(obj: Any) -> Any:
    # numpy scalars/arrays and paths show up in records; anything else is a caller bug.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def config_hash(config: dict) -> str:
    """Stable 16-hex-digit sha256 of the canonical JSON of config (key order does not matter)."""
    if not isinstance(config, dict):
        raise InputError(f"config_hash config: expected a dict, got {type(config).__name__}")
    try:
        canon = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                           default=_json_default)
    except TypeError as exc:
        raise InputError(f"config_hash config: expected JSON-serialisable values ({exc})") from None
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def _key(rec: dict) -> tuple:
    return tuple(rec[k] for k in KEY_FIELDS)


def _plain_key_value(v: Any) -> bool:
    return isinstance(v, (str, int)) and not isinstance(v, bool)


def scan_records(path: Path, keys: tuple = KEY_FIELDS) -> tuple[list[dict], int]:
    """Parse a records file; returns (records, byte offset where a torn last line starts or size)."""
    data = path.read_bytes() if path.exists() else b""
    records, offset = [], 0
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for lineno, raw in enumerate(lines, start=1):
        last = lineno == len(lines)
        start, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
            missing = [k for k in keys if k not in rec]
            if missing:
                raise ValueError(f"missing key field(s) {missing}")
            odd = [k for k in keys if not _plain_key_value(rec[k])]
            if odd:
                raise ValueError(f"key field(s) {odd} not a string or integer")
        except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            if last:  # a kill mid-write leaves at most the final line torn
                warnings.warn(f"{path}:{lineno}: ignoring a torn trailing line ({len(raw)} bytes): "
                              f"{exc}", RuntimeWarning, stacklevel=3)
                return records, start
            raise InputError(f"{path}:{lineno}: expected one JSON object per line with keys "
                             f"{list(keys)}, got an unreadable line ({exc})") from None
        records.append(rec)
    return records, len(data)


def _write_json_atomic(path: Path, obj: dict, *, in_place_if_full: bool = False) -> None:
    """Write ``obj`` to ``path`` through a temp file and a rename; the temp file never stays
    behind. ``in_place_if_full``: on a full disk, rewrite ``path`` itself (its own blocks are
    freed first, so a status update fits where no second copy does)."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=_json_default).encode("utf-8")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if not (in_place_if_full and exc.errno in (errno.ENOSPC, errno.EDQUOT) and path.exists()):
            raise
        with open(path, "r+b") as fh:
            fh.truncate(0)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ResultsStore:
    """Writer for one run directory; also a context manager that sets the final manifest status."""

    def __init__(self, root: Path | str, run_id: str) -> None:
        if not isinstance(run_id, str) or not run_id or "/" in run_id or run_id in (".", ".."):
            raise InputError(f"ResultsStore run_id: expected a non-empty name without '/', got {run_id!r}")
        self.root, self.run_id = Path(root), run_id
        self.run_dir = self.root / run_id
        self.records_path = self.run_dir / RECORDS_FILE
        self.manifest_path = self.run_dir / MANIFEST_FILE
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise InputError(f"results store {self.run_dir}: a file is in the way (expected "
                             f"{self.root} and its run folder to be directories)") from None
        except PermissionError:
            raise InputError(f"results store {self.run_dir}: permission denied") from None
        self._fh = None
        self._keys: set[tuple] | None = None
        self._started = False
        self._refused = False  # start() refused the folder: its manifest is not ours to end
        self._lock_fh = None
        self.fingerprint: str | None = None  # what the run is (``start``); records carry it

    # -- one process per run ------------------------------------------------------------------
    def lock(self) -> None:
        """Hold an exclusive lock on the run folder until ``finish``; another process
        holding it is an ``InputError`` naming it (call before starting anything expensive)."""
        if self._lock_fh is not None:
            return
        path = self.run_dir / LOCK_FILE
        try:
            fh = open(path, "a+")
        except OSError as exc:
            raise StoreWriteFailed(f"{path}: cannot create the run's lock file ({exc.strerror})") from None
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise InputError(f"run {self.run_dir}: already being run by {holder}; expected one "
                             "process per run id (wait for it to end, or use another --run-id)") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} since {_now()}")
        fh.flush()
        self._lock_fh = fh

    def _unlock(self) -> None:
        if self._lock_fh is not None:
            self._lock_fh.close()  # closing the descriptor releases the flock
            self._lock_fh = None

    # -- belongs to this run --------------------------------------------------------------------
    def check_belongs(self, fingerprint: str | None = None) -> None:
        """Refuse (``InputError``, one line) a folder whose manifest, records or lifetimes are of
        another run id, or of another run fingerprint when ``fingerprint`` is given."""
        def refuse(where: str, what: str) -> None:
            raise InputError(f"{where}: {what}; expected this run's own files (a run folder "
                             "copied from elsewhere is not resumed: use a new --run-id)")

        old = load_manifest(self.run_dir) if self.manifest_path.exists() else {}
        if old.get("run_id") not in (None, self.run_id):
            refuse(str(self.manifest_path), f"belongs to run {old.get('run_id')!r}, not {self.run_id!r}")
        if fingerprint and old.get("fingerprint") not in (None, fingerprint):
            refuse(str(self.manifest_path), f"run fingerprint {old.get('fingerprint')} (another "
                                            f"trace, configuration or build), not {fingerprint}")
        for path, keys in ((self.records_path, KEY_FIELDS), (self.run_dir / LIFETIMES_FILE,
                                                              ("build", "config_hash"))):
            if not path.exists():
                continue
            for lineno, rec in enumerate(scan_records(path, keys)[0], 1):
                if rec.get("run_id") != self.run_id:
                    refuse(f"{path}:{lineno}", f"a record of run {rec.get('run_id')!r}, not "
                                               f"{self.run_id!r}")
                if fingerprint and rec.get("run_fingerprint") not in (None, fingerprint):
                    refuse(f"{path}:{lineno}", f"a record of run fingerprint "
                                               f"{rec.get('run_fingerprint')}, not {fingerprint}")

    def kept(self) -> str:
        """What the folder holds now, for an error line: its complete records."""
        n = len(self._keys) if self._keys is not None else len(scan_records(self.records_path)[0]) \
            if self.records_path.exists() else 0
        return f"kept {n} complete record(s) in {self.records_path}"

    def _write_failed(self, path: Path, what: str, exc: OSError) -> StoreWriteFailed:
        return StoreWriteFailed(f"{path}: cannot write {what} ({exc.strerror or exc}); "
                                f"{self.kept()}; resume with run id {self.run_id!r} once the "
                                "cause is fixed")

    # -- manifest -----------------------------------------------------------------------------
    def start(self, resolved_config: dict | None = None, *, vllm_version: str | None = None,
              torch_version: str | None = None, device: str | None = None,
              seeds: Any = None, extra: dict | None = None, fingerprint: str | None = None) -> dict:
        """Write the manifest with status 'running'; on resume keeps 'created' and the first
        'environment' (the resume's own goes to 'resumed_environment' if it differs) and merges 'extra'.
        Everything already in the folder is checked first (``check_belongs``): a refused or
        corrupt folder is left exactly as it was."""
        import statescope
        from statescope.lockfile import environment_record

        try:
            self.check_belongs(fingerprint)
        except InputError:
            self._refused = True
            raise
        old = load_manifest(self.run_dir) if self.manifest_path.exists() else {}
        manifest = {
            "run_id": self.run_id, "created": old.get("created", _now()), "status": "running",
            "resolved_config": dict(resolved_config or {}), "vllm_version": vllm_version,
            "torch_version": torch_version, "device": device, "seeds": seeds, "started": _now(),
            "ended": None, "statescope_version": statescope.__version__,
            # versions vs requirements.lock (drift listed); a resume keeps the environment the
            # run began in (its records came from there) and records its own beside it if it differs
            "environment": old.get("environment") or environment_record(),
            "extra": {**old.get("extra", {}), **(extra or {})},
        }
        if old:
            manifest["extra"]["resumed_from_status"] = old.get("status")
            if old.get("environment") and old["environment"] != environment_record():
                manifest["resumed_environment"] = environment_record()
        if fingerprint:
            manifest["fingerprint"] = fingerprint
        self.fingerprint = fingerprint
        try:
            _write_json_atomic(self.manifest_path, manifest)
        except OSError as exc:
            raise self._write_failed(self.manifest_path, "the manifest", exc) from None
        self._started = True
        return manifest

    def finish(self, status: str = "completed") -> dict:
        """Record the final status and end time in the manifest. A folder ``start`` refused is
        left alone, and a store that did not start this run never turns a ``completed`` manifest
        into another status (it is an earlier run's result)."""
        if status not in STATUSES[1:]:
            raise InputError(f"ResultsStore.finish status: expected one of {STATUSES[1:]}, got {status!r}")
        try:
            if self._refused:
                return {}
            manifest = load_manifest(self.run_dir) if self.manifest_path.exists() else {"run_id": self.run_id}
            if not self._started and manifest.get("status") == "completed" and status != "completed":
                return manifest
            manifest.update(status=status, ended=_now())
            try:
                _write_json_atomic(self.manifest_path, manifest, in_place_if_full=True)
            except OSError as exc:
                raise self._write_failed(self.manifest_path, f"the final status {status!r}", exc) from None
            self._started = False
            return manifest
        finally:
            self.close()
            self._unlock()

    # -- records ------------------------------------------------------------------------------
    def completed_keys(self) -> set[tuple]:
        """Keys (run_id, build, config_hash, episode, step) already stored; callers skip these."""
        if self._keys is None:
            records, _ = scan_records(self.records_path)
            self._keys = {_key(r) for r in records}
        return set(self._keys)

    def _open(self) -> None:
        records, good_end = scan_records(self.records_path)
        self._keys = {_key(r) for r in records}
        size = self.records_path.stat().st_size if self.records_path.exists() else 0
        if good_end < size:  # cut the torn line off so the next record starts on a fresh line
            os.truncate(self.records_path, good_end)
        self._fh = open(self.records_path, "ab")
        if good_end > 0:
            with open(self.records_path, "rb") as fh:
                fh.seek(good_end - 1)
                if fh.read(1) != b"\n":  # a complete last record whose newline never made it
                    self._fh.write(b"\n")
        _fsync_dir(self.run_dir)

    def append(self, record: dict) -> tuple:
        """Validate, write one JSON line, flush and fsync; returns the record's key."""
        if not isinstance(record, dict):
            raise InputError(f"ResultsStore.append record: expected a dict, got {type(record).__name__}")
        missing = [k for k in KEY_FIELDS if k not in record]
        if missing:
            raise InputError(f"ResultsStore.append record: missing key field(s) {missing}; expected "
                             f"all of {list(KEY_FIELDS)}")
        if record["run_id"] != self.run_id:
            raise InputError(f"ResultsStore.append record run_id: expected {self.run_id!r}, "
                             f"got {record['run_id']!r}")
        for k in KEY_FIELDS:
            if not isinstance(record[k], (str, int)) or isinstance(record[k], bool):
                raise InputError(f"ResultsStore.append record field {k!r}: expected str or int, "
                                 f"got {type(record[k]).__name__}")
        if self._fh is None:
            self._open()
        key = _key(record)
        if key in self._keys:
            raise InputError(f"ResultsStore.append: key {key} is already stored in "
                             f"{self.records_path}; skip keys in completed_keys() when resuming")
        try:
            line = json.dumps(record, default=_json_default, ensure_ascii=False)
        except TypeError as exc:
            raise InputError(f"ResultsStore.append record: expected JSON-serialisable values ({exc})") from None
        try:
            self._fh.write(line.encode("utf-8") + b"\n")  # one write call per record
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except OSError as exc:
            # a part of the line may be on disk: the next open cuts it off as a torn last line
            self._drop_handle()
            raise self._write_failed(self.records_path, f"record {key}", exc) from None
        self._keys.add(key)
        return key

    def _drop_handle(self) -> None:
        with contextlib.suppress(OSError):  # its buffer cannot be flushed either: drop it
            self._fh.close()
        self._fh = None

    def append_lifetime(self, entry: dict) -> None:
        """Append one engine lifetime of an arm (``build``, ``config_hash``, its counters, the
        requests it served) to ``lifetimes.jsonl``, flushed and fsync'd: the guards of a resumed
        or re-run store add up every lifetime, not only the last engine's."""
        for k in ("build", "config_hash"):
            if not isinstance(entry.get(k), str):
                raise InputError(f"ResultsStore.append_lifetime: field {k!r} must be a string")
        line = json.dumps({"run_id": self.run_id, "recorded": _now(), **entry},
                          default=_json_default, ensure_ascii=False)
        path = self.run_dir / LIFETIMES_FILE
        try:
            with open(path, "ab") as fh:
                fh.write(line.encode("utf-8") + b"\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise self._write_failed(path, "an engine lifetime", exc) from None

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:  # buffered bytes that cannot be written: nothing more to keep
                self._fh = None
            self._fh = None

    def __enter__(self) -> "ResultsStore":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        status = ("completed" if exc_type is None else
                  "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed")
        self.finish(status)


# -- loaders ----------------------------------------------------------------------------------
def load_records(run_dir: Path | str) -> pd.DataFrame:
    """All records of a run as a DataFrame (a torn last line is skipped with a warning)."""
    path = Path(run_dir) / RECORDS_FILE
    if not path.exists():
        raise InputError(f"{path}: records file not found; expected a run directory written by ResultsStore")
    records, _ = scan_records(path)
    return pd.DataFrame(records, columns=None if records else list(KEY_FIELDS))


def load_lifetimes(run_dir: Path | str, build: str | None = None,
                   config_hash: str | None = None) -> list[dict]:
    """The engine lifetimes recorded in a run (of one arm when ``build``/``config_hash`` given);
    a torn last line is skipped, a corrupt line elsewhere is an ``InputError``."""
    path = Path(run_dir) / LIFETIMES_FILE
    if not path.exists():
        return []
    rows, _ = scan_records(path, ("build", "config_hash"))
    current: dict[Any, dict] = {}  # a lifetime written as it goes: its last line is current
    for i, r in enumerate(rows):
        if (build is None or r.get("build") == build) and \
                (config_hash is None or r.get("config_hash") == config_hash):
            life = r.get("lifetime")
            current[(r["build"], r["config_hash"], life) if _plain_key_value(life) else i] = r
    return list(current.values())


def load_manifest(run_dir: Path | str) -> dict:
    path = Path(run_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: manifest not found; expected a run directory written by ResultsStore") from None
    except (ValueError, RecursionError) as exc:  # ValueError: bad JSON, UTF-8 or a huge integer
        raise InputError(f"{path}: expected a JSON object, got unreadable JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(manifest).__name__}")
    return manifest


def list_runs(root: Path | str) -> pd.DataFrame:
    """One row per run directory under root: manifest summary, record count, and any problem."""
    cols = ["run_id", "status", "created", "started", "ended", "vllm_version", "device",
            "n_records", "problem"]
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{root}: expected a results root directory")
    rows = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        if not (d / MANIFEST_FILE).exists() and not (d / RECORDS_FILE).exists():
            continue
        row: dict[str, Any] = {"run_id": d.name, "problem": None}
        try:
            m = load_manifest(d)
            row.update({c: m.get(c) for c in cols if c not in ("run_id", "n_records", "problem")})
        except InputError as exc:
            row["problem"] = str(exc)
        rec = d / RECORDS_FILE
        row["n_records"] = (sum(1 for line in rec.read_bytes().split(b"\n")[:-1] if line.strip())
                            if rec.exists() else 0)
        rows.append(row)
    return pd.DataFrame(rows, columns=cols)


def new_run_id(prefix: str = "run") -> str:
    """A fresh, sortable run id (``prefix-YYYYmmdd-HHMMSS-PID-xxxxxxxx``): the process id keeps
    two processes apart, 32 random bits two calls of one process within a second."""
    import secrets
    import time

    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(4)}"


def claim_run_id(root: Path | str, prefix: str = "run") -> str:
    """A ``new_run_id`` whose folder under ``root`` this call created (exclusively, so no other
    process or thread can be handed the same one)."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise InputError(f"results root {root}: a file is in the way, expected a directory") from None
    for _ in range(16):
        run_id = new_run_id(prefix)
        try:
            (root / run_id).mkdir()
        except FileExistsError:
            continue
        return run_id
    raise EnvironmentError(f"results root {root}: could not claim a fresh run id")


def rows_by_request(rows: Any, build: str | None = None,
                    config_hash: str | None = None) -> dict[tuple[str, int], dict]:
    """``{(episode, step): record}`` of one arm: the records whose ``build`` and ``config_hash``
    match when given (an arm is one build + one configuration hash in a store). A request stored
    twice is an ``InputError``: one arm answers each request once."""
    out: dict[tuple[str, int], dict] = {}
    for r in rows:
        if (build is not None and r.get("build") != build) or \
                (config_hash is not None and r.get("config_hash") != config_hash):
            continue
        key = (r["episode"], int(r["step"]))
        if key in out:
            raise InputError(f"records of arm {build or '?'} ({config_hash or 'any config'}): "
                             f"request {key} appears twice")
        out[key] = r
    return out
