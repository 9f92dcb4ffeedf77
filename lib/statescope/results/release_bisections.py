"""Which release fixes it, asked live? The three `statescope bisect` runs over real releases on the
H200 (``data/results/gpu/bisect_releases/``: 0.26.0, 0.28.0, 0.29.0, 0.30.0, 0.32.0, find-fix,
confirmed search), one row per setting: the answer, each probe as ``release k/n``, and the cost.

Unlike ``statescope.results.releases.bisection_answer`` (a search REPLAYED over recorded release
cells), every probe here started real engines on the GPU; this module only reads the reports back.

What it deliberately does not do: re-run or re-decide a search (``tests/test_gpu_bisect_releases.py``
replays the confirmed search on these counts), or read a missing report as an answer: a setting
without its ``stdout.json`` is one clear ``InputError``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from statescope.errors import InputError
from statescope.results.cli_runs import RELEASES_DIR

BISECT_DIR = RELEASES_DIR.parent / "bisect_releases"
# setting folder -> what it ran (scripts/gpu_cli.sh bisect_releases names the folders)
SETTINGS = {"default": "as each release resolves it",
            "v1_forced": "Model Runner V1 forced (--both-set model_runner=v1)",
            "v1_accept_sync": "V1 forced + accept_sync on the trigger (PATCHED)"}


def report(setting: str, d: str | Path = BISECT_DIR) -> dict[str, Any]:
    """One setting's ``--json`` report."""
    path = Path(d) / setting / "stdout.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: expected a statescope bisect --json report ({e})") from None


def _release(label: str) -> str:
    return label.split()[1] if label.startswith("vllm ") else label


def live_bisections(d: str | Path = BISECT_DIR) -> list[dict[str, Any]]:
    """One row per setting: outcome, answer (a release or None), probes in order, cost."""
    rows = []
    for setting, what in SETTINGS.items():
        r = report(setting, d)
        labels = [_release(x) for x in r["labels"]]
        i = r["outcome"].get("answer_index")
        rows.append({"setting": setting, "what": what, "outcome": r["outcome"]["outcome"],
                     "answer": labels[i] if i is not None else None,
                     "probes": ", ".join(f"{labels[p['index']]} {p['k']}/{p['n']}" for p in r["probes"]),
                     "cells": r["cost"]["cells"], "engine_starts": r["cost"]["engine_starts"],
                     "wall_s": r["cost"]["wall_seconds"], "exit_status": r["outcome"]["exit_status"]})
    return rows
