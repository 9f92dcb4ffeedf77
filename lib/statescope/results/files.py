"""The committed GPU result folders as files: where they are, how a device job's output becomes one,
and how to read their parts.

What it does: ``collect`` turns what a device job returned (parts_X.jsonl, arms_X.jsonl, the results
store's records.jsonl, the capture archive, the log) into the committed layout — records compacted to
the fields the verdict reads (``compact_record``), logs cut to their last lines. ``manifest``, ``arms``, ``parts``,
``part`` and ``records`` read a folder of that layout (any round's: ``E2E_DIR`` is only the default),
naming the file and line of anything malformed.

What it deliberately does not do: compute a table (the question modules of this wing do), run
anything on a device, or edit results by hand.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from statescope.errors import InputError


E2E_DIR = Path(__file__).resolve().parents[3] / "data" / "results" / "gpu" / "e2e"


RECORD_FIELDS = ("run_id", "build", "config_hash", "episode", "step", "text", "output_token_ids",
                 "finish_reason", "margins", "num_cached_tokens")


MODELS = ("tiny-gui", "tiny-gui-hd96")


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{i + 1}: expected one JSON object per line ({exc})") from None
    return out


def compact_record(rec: dict) -> dict:
    out = {k: rec.get(k) for k in RECORD_FIELDS}
    out["margins"] = [None if m is None else round(float(m), 5) for m in (rec.get("margins") or [])]
    out["prompt_tokens"] = len(rec.get("prompt_token_ids") or [])
    return out


def collect(returned: str | Path, dest: str | Path = E2E_DIR, log_lines: int = 400) -> list[str]:
    """Copy one job's returned files into ``dest`` (compacting records and logs); returns names."""
    src, dest = Path(returned), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for f in sorted(src.glob("*.jsonl")):
        shutil.copyfile(f, dest / f.name)
        written.append(f.name)
    for rec_file in sorted(src.glob("store/*/records.jsonl")):
        label = rec_file.parent.name.removeprefix("e2e_")
        target = dest / f"records_{label}.jsonl"
        have = read_jsonl(target)  # a later call may add arms of the same model: append, no duplicates
        keys = {tuple(r[k] for k in ("build", "config_hash", "episode", "step")) for r in have}
        rows = [c for c in map(compact_record, read_jsonl(rec_file))
                if tuple(c[k] for k in ("build", "config_hash", "episode", "step")) not in keys]
        target.write_text("".join(json.dumps(r) + "\n" for r in have + rows))
        written.append(f"records_{label}.jsonl")
    for f in sorted(src.glob("capture_*.tar.gz")):
        shutil.copyfile(f, dest / f.name)
        written.append(f.name)
    for f in sorted(src.glob("job*.log")):
        lines = f.read_text(errors="replace").splitlines()
        (dest / f.name).write_text("\n".join(lines[-log_lines:]) + "\n")
        written.append(f.name)
    return written


def manifest(d: Path = E2E_DIR) -> dict:
    """The e2e manifest (versions, GPU, driver, commands, device seconds)."""
    path = Path(d) / "manifest.json"
    if not path.is_file():
        raise InputError(f"{path}: missing (written by scripts/gpu_collect.py)")
    return json.loads(path.read_text())


def arms(d: Path = E2E_DIR) -> list[dict]:
    """Every arm's meta (all jobs), in file order."""
    return [m for f in sorted(Path(d).glob("arms_*.jsonl")) for m in read_jsonl(f)]


def parts(d: Path = E2E_DIR) -> list[dict]:
    return [dict(p, job=f.stem.split("_")[-1]) for f in sorted(Path(d).glob("parts_*.jsonl"))
            for p in read_jsonl(f)]


def part(name: str, d: Path = E2E_DIR) -> dict | None:
    """The last successful result of part ``name`` (None when it never finished)."""
    ok = [p for p in parts(d) if p["part"] == name and p["status"] == "ok"]
    return ok[-1]["result"] if ok else None


def records(label: str, d: Path = E2E_DIR) -> list[dict]:
    return read_jsonl(Path(d) / f"records_{label}.jsonl")
