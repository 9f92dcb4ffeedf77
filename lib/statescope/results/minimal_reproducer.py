"""What does the minimal reproducer do on real GPUs? The committed plain-vLLM script runs of
``data/results/gpu/minimal_reproducer_0.26.0/`` and ``data/results/gpu/minimal/`` (``statescope shrink`` → ``export-repro`` on the
H200, then ``python repro.py`` as a maintainer runs it), read back from their logs.

``script_runs`` gives one row per run: the folder (which shrink result exported the script), the
setting it ran under (as exported, async off, V2, V1 forced on another release), the vLLM version
and runner the script printed on its ``resolved:`` line (when it has one), ``k/n corrupted``, the
exit status and the corrupted requests. ``shrink_conditions`` gives the conditions the shrink
found (which removals made the failure vanish).

What it deliberately does not do: re-judge anything (the script's own labels are read as
printed), or count a run whose log has no ``k/n corrupted`` line (a crash) as clean: it is
reported with ``corrupted: None``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from statescope.errors import InputError

ROOT = Path(__file__).resolve().parents[3] / "data" / "results" / "gpu" / "minimal_reproducer_0.26.0"
# log file -> the setting it ran under (scripts/gpu_cli.sh shrink_chain and localise name them)
SETTINGS = {"as_exported": "as exported", "async_off": "--set async_scheduling=false",
            "v2": "VLLM_USE_V2_MODEL_RUNNER=1", "v1": "VLLM_USE_V2_MODEL_RUNNER=0",
            "default": "the release's default", "accept_sync": "--patch accept_sync (PATCHED)"}
# the release each folder's script ran on (0.26.0 scripts, unchanged, on 0.32.0 in on_0.32.0*/)
FOLDERS = {"repro": ("0.26.0", "episodes shrunk, max_num_seqs=32"),
           "batch_phase/repro": ("0.26.0", "batch shrunk: max_num_seqs=2, max_num_batched_tokens=4096"),
           "on_0.32.0": ("0.32.0", "the max_num_seqs=32 script, unchanged"),
           "at_two_seqs/repro": ("0.26.0", "batch of two, episodes and steps shrunk: 3 requests"),
           "on_0.32.0_v1_forced/repro": ("0.32.0", "the 3-request script, unchanged")}
# data/results/gpu/minimal/: the 2026-12-06 run on 0.32.0 (Model Runner V1 forced, an H100): the
# shrink of the 96-episode failing run at its defaults, its exported script, and the committed
# 3-request script beside it (both run as exported, async off, V2, --patch accept_sync)
MINIMAL_ROOT = ROOT.parent / "minimal"
MINIMAL_FOLDERS = {"repro": ("0.32.0", "shrunk from 96 episodes at the defaults, V1: 5 requests"),
                   "three_request_script": ("0.32.0", "the 0.26.0 3-request script, V1 forced")}
_COUNT = re.compile(r"^(\d+)/(\d+) corrupted$")
_RC = re.compile(r"^rc=(\d+)$")
_RESOLVED = re.compile(r"^resolved: vllm (\S+), model runner (\S+) \((V\d)\), async scheduling (\w+)")


def _read_log(path: Path) -> dict:
    out: dict = {"corrupted": None, "requests": None, "rc": None, "vllm": None, "runner": None,
                 "async_scheduling": None, "corrupted_requests": []}
    for line in path.read_text(errors="replace").splitlines():
        if m := _COUNT.match(line):
            out["corrupted"], out["requests"] = int(m[1]), int(m[2])
        elif m := _RC.match(line):
            out["rc"] = int(m[1])
        elif m := _RESOLVED.match(line):
            out.update(vllm=m[1], runner=m[3], async_scheduling=m[4] == "True")
        elif line.startswith("CORRUPTED "):
            out["corrupted_requests"].append(line.split(":")[0][len("CORRUPTED "):])
    return out


def script_runs(root: str | Path = ROOT, folders: dict | None = None) -> list[dict]:
    """One row per committed run of an exported ``repro.py`` (``folders``: folder -> (release,
    what the script is); default ``MINIMAL_FOLDERS`` under ``MINIMAL_ROOT``, else ``FOLDERS``)."""
    root = Path(root)
    if folders is None:
        folders = MINIMAL_FOLDERS if root == MINIMAL_ROOT else FOLDERS
    rows = []
    for folder, (release, what) in folders.items():
        logs = sorted((root / folder).glob("*.log"))
        for log in logs:
            stem = log.stem.rsplit("_", 1)[0] if log.stem[-1].isdigit() else log.stem
            if stem not in SETTINGS:
                continue  # not a script run (e.g. a reproduce log beside them)
            rows.append({"folder": folder, "release": release, "script": what,
                         "setting": SETTINGS[stem], "log": log.name, **_read_log(log)})
    if not rows:
        raise InputError(f"{root}: no script logs (expected {', '.join(folders)} with *.log)")
    return rows


def shrink_conditions(folder: str = "batch_phase", root: str | Path = ROOT) -> list[str]:
    """The conditions a committed shrink found (``result.json``'s ``conditions``)."""
    path = Path(root) / folder / "result.json"
    try:
        return list(json.loads(path.read_text())["conditions"])
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"{path}: expected a shrink result.json with 'conditions' ({e})") from None
