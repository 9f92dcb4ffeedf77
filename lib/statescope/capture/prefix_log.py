"""Scheduler-side prefix-cache hit log: per request, how long a hit each KV-cache group found.

What it does: in the process that runs vLLM's scheduler (the engine core; the same process as the
model in the in-process engine), ``statescope.capture.hooks`` wraps
``KVCacheManager.get_computed_blocks`` and each single-type manager's
``find_longest_cache_hit``. ``PrefixHitLog`` collects, for each lookup, one row:

- ``req_id``, ``num_prompt_tokens``, ``num_block_hashes`` (no hashes = nothing to look up),
  ``max_cache_hit_tokens`` (vLLM caps it at prompt length - 1);
- ``attention_hit_tokens`` / ``mamba_hit_tokens``: the first (standalone) lookup of the full
  attention and the Mamba groups, each at the full candidate length — the length that group
  alone could serve;
- ``hit_tokens``: the hit the coordinator reconciled across groups (what the request got);
- ``lookups``: every group lookup in order, as ``kind:max_length->hit`` (``+drop`` when the
  EAGLE/MTP last-block drop applied), which shows where the fixed-point iteration cut the hit.

Rows are written as parquet parts under ``<output_dir>/scheduler/`` (``hits-<pid>-<n>.parquet``),
not inside a run directory: the scheduler may live in another process than the model runner.
``CaptureRun.prefix_hits()`` reads them back for the run's own request ids.

What it deliberately does not do: change the lookup (every wrapper returns vLLM's result) or
explain a zero hit by itself (the rows are the evidence; the notebook reads them).
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

SUBDIR = "scheduler"


class PrefixHitLog:
    """Buffer of lookup rows for one process, written in parquet parts."""

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.dir = Path(output_dir) / SUBDIR
        self.rows: list[dict] = []
        self.current: dict | None = None
        self.parts = 0
        self.lock = threading.RLock()

    def begin(self, request: Any, max_cache_hit_tokens: int) -> None:
        self.current = {
            "req_id": str(getattr(request, "request_id", "")), "pid": os.getpid(),
            "time": time.time(), "num_prompt_tokens": int(getattr(request, "num_prompt_tokens", 0)),
            "num_block_hashes": len(getattr(request, "block_hashes", []) or []),
            "max_cache_hit_tokens": int(max_cache_hit_tokens), "attention_hit_tokens": None,
            "mamba_hit_tokens": None, "hit_tokens": None, "lookups": []}

    def group_lookup(self, kind: str, max_length: int, hit: int, drop: bool) -> None:
        cur = self.current
        if cur is None:
            return
        key = f"{kind}_hit_tokens"
        if key in cur and cur[key] is None:
            cur[key] = int(hit)
        cur["lookups"].append(f"{kind}:{int(max_length)}->{int(hit)}" + ("+drop" if drop else ""))

    def end(self, hit_tokens: int) -> None:
        cur, self.current = self.current, None
        if cur is not None:
            cur["hit_tokens"] = int(hit_tokens)
            with self.lock:
                self.rows.append(cur)

    def write(self) -> Path | None:
        """Write buffered rows as one part; returns its path (None when nothing was buffered)."""
        with self.lock:
            rows, self.rows = self.rows, []
            if not rows:
                return None
            import pyarrow as pa
            import pyarrow.parquet as pq

            self.dir.mkdir(parents=True, exist_ok=True)
            self.parts += 1
            path = self.dir / f"hits-{os.getpid()}-{self.parts:05d}.parquet"
            tmp = path.with_suffix(".tmp")
            pq.write_table(pa.Table.from_pylist(rows), tmp)
            os.replace(tmp, path)  # readers never see a half-written part
            return path


def group_kind(spec: Any) -> str:
    """'mamba', 'attention' (full attention) or the spec's class name in lower case."""
    name = type(spec).__name__
    if name == "MambaSpec":
        return "mamba"
    if name == "FullAttentionSpec":
        return "attention"
    return name.lower()


def read_hits(output_dir: str | os.PathLike, req_ids: Any = None) -> Any:
    """All rows under ``<output_dir>/scheduler/`` (a pandas frame), optionally only ``req_ids``."""
    import pandas as pd

    parts = sorted((Path(output_dir) / SUBDIR).glob("hits-*.parquet"))
    if not parts:
        return pd.DataFrame()
    df = pd.concat([pd.read_parquet(p) for p in parts], ignore_index=True)
    if req_ids is not None:
        df = df[df["req_id"].isin(set(req_ids))].reset_index(drop=True)
    return df
