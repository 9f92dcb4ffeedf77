"""On-disk format of a capture run: parquet index tables, content-addressed safetensors shards, manifest.

Layout of ``<output_dir>/<run_id>/``::

    manifest.json                  mode, spec, vLLM version, resolved config, perturbation, sizes
    tables/<name>-<part>.parquet   steps | digests | copies | snapshots (appended in parts)
    shards/shard-<n>.safetensors   full snapshots, keyed by sha256 of the tensor bytes

Columns a reader may rely on (other tools read these names; keep them):

- ``steps`` (one row per selected request per engine step): ``engine_step``, ``req_id``,
  ``req_step`` (the request's own step counter), ``prompt_sha``, ``num_computed_tokens`` (at
  schedule time), ``num_scheduled_tokens``, ``num_drafts`` (draft tokens scheduled),
  ``running_col``, ``running_blocks`` / ``mamba_block_ids`` (per Mamba group), ``block_size``,
  ``is_new``, ``prefix_hit_tokens`` (runner side: computed tokens of a newly scheduled request),
  ``conv_live_offset`` (first live conv row for the next read), ``resume_col_offset`` (the
  column after the running one whose recurrent state the next step reads), and the accepted
  counts:

  - ``num_accepted_sampled``: what the rejection sampler produced for the request in this step
    (tokens of the row that are not -1: accepted drafts + 1); ``accepted`` is the same value
    (its older name);
  - ``num_accepted_used``: the count the state update was given for the request in this step —
    the ``num_accepted_tokens`` entry of the request's batch row that the align-mode
    post-process copy launch read (taken just before the launch). Null when the step launched no
    post-process (no speculative decoding or no align mode). The two differ only when the
    count reached the state update through a stale or permuted buffer (the async-scheduling
    hypothesis).
- ``digests`` (one row per request, layer, state kind and digested column): ``column_offset``
  (0 = the running column; 1..drafts = the columns after it: the draft columns, spec
  ``draft_columns``, or the resume column), ``resume`` (the row holds the state the request's next
  step reads; ``resume_col_offset`` in ``steps``), ``block_id``, ``checksum`` and ``hash`` (exact:
  ``statescope.capture.word_hash``; older runs lack ``hash``), the float statistics named in the
  manifest's ``digest_stats``, and for conv windows ``row_checksums`` / ``row_hashes`` /
  ``row_sums`` per token row.
- the manifest's ``ended``: how the run ended (``statescope.capture.ending``;
  ``CaptureRun.ending()``).
- prefix-cache lookups of the scheduler: ``CaptureRun.prefix_hits()``
  (``statescope.capture.prefix_log``, stored next to the runs under ``scheduler/``).

What it does: ``CaptureWriter`` buffers rows and tensors and writes them in parts (tensor bytes are
deduplicated by sha256, so an unchanged block costs nothing twice) with the manifest replaced
atomically each time; ``CaptureRun`` loads a run back as pandas frames and tensors;
``find_runs`` lists runs under a directory. ``gdn_geometry`` / ``snapshot_bytes`` /
``estimate_capture_bytes`` size a run before it starts, from a Hugging Face config.

What it deliberately does not do: decide what is recorded (``statescope.capture.recorder``), lock against
concurrent writers (one writer per run directory), or compact parts.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from statescope.errors import InputError

FORMAT = "statescope-capture/1"
TABLES = ("steps", "digests", "copies", "snapshots")
MANIFEST = "manifest.json"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def tensor_sha256(t: Any) -> str:
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(flat.tobytes()).hexdigest()


class CaptureWriter:
    """Buffered writer for one run directory; call ``write()`` to persist what is buffered."""

    def __init__(self, run_dir: str | os.PathLike, manifest: Mapping[str, Any], max_bytes: int) -> None:
        self.run_dir = Path(run_dir)
        (self.run_dir / "tables").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "shards").mkdir(exist_ok=True)
        self.max_bytes = max_bytes
        self.manifest = dict(manifest, format=FORMAT, created=_now(), status="running",
                             truncated=False, snapshots_skipped=0)
        self._rows: dict[str, list[dict]] = {t: [] for t in TABLES}
        self._tables: dict[str, list[Any]] = {t: [] for t in TABLES}
        self._columns: dict[str, list[dict]] = {t: [] for t in TABLES}
        self._tensors: dict[str, Any] = {}
        self._known: dict[str, str] = {}  # sha -> shard file name
        self._parts = 0
        self._shards = 0
        self.bytes_written = 0
        self.tensor_bytes = 0
        self._pending_bytes = 0
        self.write()

    @classmethod
    def reopen(cls, run_dir: str | os.PathLike) -> "CaptureWriter":
        """A writer that appends parts to an existing run (``capture_spool.recover``): the next
        part and shard numbers follow those on disk, the manifest keeps its fields."""
        self = cls.__new__(cls)
        self.run_dir = Path(run_dir)
        self.manifest = read_manifest(self.run_dir / MANIFEST)
        self.max_bytes = int(self.manifest.get("spec", {}).get("max_bytes") or 2**62)
        self._rows = {t: [] for t in TABLES}
        self._tables = {t: [] for t in TABLES}
        self._columns = {t: [] for t in TABLES}
        self._tensors, self._known = {}, {}
        parts = [int(f.stem.rsplit("-", 1)[1]) for f in (self.run_dir / "tables").glob("*-*.parquet")]
        self._parts = max(parts, default=0)
        self._shards = len(list((self.run_dir / "shards").glob("shard-*.safetensors")))
        sizes = self.manifest.get("sizes") or {}
        self.bytes_written = int(sizes.get("bytes_total") or 0)
        self.tensor_bytes = int(sizes.get("tensor_bytes") or 0)
        self._pending_bytes = 0
        return self

    def add_rows(self, table: str, rows: list[dict]) -> None:
        if table not in self._rows:
            raise InputError(f"capture table {table!r}: expected one of {TABLES}")
        self._rows[table].extend(rows)

    def add_table(self, table: str, data: Any) -> None:
        """Buffer a ``pyarrow.Table`` (columnar rows: no per-row Python objects)."""
        if table not in self._rows:
            raise InputError(f"capture table {table!r}: expected one of {TABLES}")
        self._tables[table].append(data)

    def add_columns(self, table: str, columns: Mapping[str, Any]) -> None:
        """Buffer rows given as equal-length numpy arrays (2-D arrays become fixed-size lists);
        buffers with the same columns are joined into one table at ``write()``."""
        if table not in self._rows:
            raise InputError(f"capture table {table!r}: expected one of {TABLES}")
        self._columns[table].append(dict(columns))

    def _joined_columns(self, table: str) -> list[Any]:
        import numpy as np
        import pyarrow as pa

        by_schema: dict[tuple, list[dict]] = {}
        for cols in self._columns[table]:
            by_schema.setdefault(tuple(cols), []).append(cols)
        out = []
        for names, parts in by_schema.items():
            arrays = []
            for name in names:
                a = np.concatenate([p[name] for p in parts])
                if a.ndim == 2:  # variable-size lists: a table that also holds rows without
                    # this column gets nulls there, and pyarrow before the GH-35692 fix (2026-07)
                    # cannot read null fixed-size lists back from parquet (the H200's could not)
                    offsets = np.arange(0, a.size + 1, max(a.shape[1], 1), dtype=np.int32)[:a.shape[0] + 1]
                    arrays.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(a.reshape(-1))))
                else:
                    arrays.append(pa.array(a))
            out.append(pa.table(arrays, names=list(names)))
        self._columns[table] = []
        return out

    def has_room(self, nbytes: int) -> bool:
        return self.bytes_written + self._pending_bytes + nbytes <= self.max_bytes

    def add_tensor(self, t: Any) -> tuple[str, str]:
        """Buffer ``t`` (host tensor) under its sha256; returns (sha, shard file it lives in)."""
        sha = tensor_sha256(t)
        if sha in self._known:
            return sha, self._known[sha]
        if sha not in self._tensors:
            self._tensors[sha] = t.detach().contiguous().clone()
            self._pending_bytes += t.numel() * t.element_size()
        return sha, f"shard-{self._shards + 1:05d}.safetensors"

    def note(self, **fields: Any) -> None:
        """Update manifest fields (written with the next ``write()``)."""
        self.manifest.update(fields)

    def write(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._tensors:
            from safetensors.torch import save_file

            self._shards += 1
            name = f"shard-{self._shards:05d}.safetensors"
            tmp = self.run_dir / "shards" / f"{name}.tmp"
            save_file(self._tensors, str(tmp))
            os.replace(tmp, self.run_dir / "shards" / name)  # readers never see a half-written shard
            self.bytes_written += (self.run_dir / "shards" / name).stat().st_size
            for sha in self._tensors:
                self._known[sha] = name
            self.tensor_bytes += self._pending_bytes
            self._tensors, self._pending_bytes = {}, 0
        wrote = False
        for table, rows in self._rows.items():
            parts = (self._tables[table] + self._joined_columns(table)
                     + ([pa.Table.from_pylist(rows)] if rows else []))
            if parts:
                wrote = True
                path = self.run_dir / "tables" / f"{table}-{self._parts + 1:05d}.parquet"
                tmp = path.with_suffix(".parquet.tmp")
                pq.write_table(pa.concat_tables(parts, promote_options="default"), tmp)
                # a reader of a live run (diverge, a test waiting for the flusher) lists *.parquet:
                # it must never open a part still being written
                os.replace(tmp, path)
                self.bytes_written += path.stat().st_size
                self._rows[table], self._tables[table] = [], []
        self._parts += wrote
        self.manifest["updated"] = _now()
        self.manifest["sizes"] = {"bytes_total": self.bytes_written, "tensor_bytes": self.tensor_bytes,
                                  "tensors": len(self._known), "parts": self._parts}
        self._write_manifest()

    def close(self, status: str = "complete") -> None:
        self.manifest["status"] = status
        self.manifest["closed"] = _now()
        self.write()

    def write_manifest(self) -> None:
        """Replace the manifest now (atomically), without writing buffered rows."""
        self._write_manifest()

    def _write_manifest(self) -> None:
        tmp = self.run_dir / (MANIFEST + ".tmp")
        try:
            tmp.write_text(json.dumps(self.manifest, indent=2, default=str))
            os.replace(tmp, self.run_dir / MANIFEST)
        except OSError:  # disk full or denied: no half-written temp manifest stays behind
            tmp.unlink(missing_ok=True)
            raise


def read_manifest(path: Path) -> dict:
    """A run's manifest; ``InputError`` naming the file when it is not a readable JSON object."""
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(f"capture run manifest {path}: expected a JSON object as a capture run "
                         f"writes it, got an unreadable file ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict):
        raise InputError(f"capture run manifest {path}: expected a JSON object, got "
                         f"{type(manifest).__name__}")
    return manifest


def update_manifest(run_dir: str | os.PathLike, **fields: Any) -> dict:
    """Add ``fields`` to a closed run's manifest (atomically); returns the new manifest. For
    what is known only after close (the capture command's ``exercised`` counts)."""
    path = Path(run_dir) / MANIFEST
    manifest = dict(read_manifest(path), **fields)
    tmp = path.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, default=str))
    os.replace(tmp, path)
    return manifest


class CaptureRun:
    """A capture run on disk, read back."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        mf = self.path / MANIFEST
        if not mf.is_file():
            raise InputError(f"capture run {self.path}: no {MANIFEST} (not a capture run directory)")
        self.manifest = read_manifest(mf)
        if self.manifest.get("format") != FORMAT:
            raise InputError(f"capture run {mf}: format {self.manifest.get('format')!r}, "
                             f"expected {FORMAT!r}")

    def table(self, name: str) -> pd.DataFrame:
        if name not in TABLES:
            raise InputError(f"capture table {name!r}: expected one of {TABLES}")
        parts = sorted((self.path / "tables").glob(f"{name}-*.parquet"))
        if not parts:
            return pd.DataFrame()
        return pd.concat([pd.read_parquet(p) for p in parts], ignore_index=True)

    def steps(self) -> pd.DataFrame:
        return self.table("steps")

    def digests(self) -> pd.DataFrame:
        return self.table("digests")

    def copies(self) -> pd.DataFrame:
        return self.table("copies")

    def snapshots(self) -> pd.DataFrame:
        return self.table("snapshots")

    def prefix_hits(self) -> pd.DataFrame:
        """The scheduler's prefix-cache lookups for this run's requests (written by the
        process running the scheduler under ``<output_dir>/scheduler/``)."""
        from statescope.capture.prefix_log import read_hits

        steps = self.steps()
        return read_hits(self.path.parent, None if steps.empty else steps["req_id"].unique())

    def tensor(self, sha: str, shard: str | None = None):
        from safetensors import safe_open

        shards = [self.path / "shards" / shard] if shard else sorted((self.path / "shards").glob("*.safetensors"))
        for p in shards:
            with safe_open(str(p), framework="pt") as f:
                if sha in f.keys():
                    return f.get_tensor(sha)
        raise InputError(f"capture run {self.path}: no tensor {sha[:16]}... in its shards")

    def snapshot(self, req_id: str, req_step: int, kind: str):
        """The ``[layers, *shape]`` tensor of one request's state kind after one of its steps."""
        snaps = self.snapshots()
        if snaps.empty:
            raise InputError(f"capture run {self.path}: has no snapshots (mode "
                             f"{self.manifest.get('mode')!r})")
        hit = snaps[(snaps.req_id == req_id) & (snaps.req_step == req_step) & (snaps.kind == kind)]
        if hit.empty:
            raise InputError(f"capture run {self.path}: no {kind} snapshot for request {req_id!r} "
                             f"step {req_step}")
        row = hit.iloc[0]
        return self.tensor(row.sha256, row.shard)

    def ending(self) -> dict:
        """How the run ended: ``complete`` and why (``statescope.capture.ending.ending``)."""
        from statescope.capture.ending import ending

        return ending(self.manifest)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    def __repr__(self) -> str:
        m = self.manifest
        return (f"CaptureRun({self.path}, mode={m.get('mode')}, status={m.get('status')}, "
                f"bytes={m.get('sizes', {}).get('bytes_total')})")


def find_runs(output_dir: str | os.PathLike) -> list[Path]:
    """Run directories under ``output_dir``, oldest first (by manifest modification time)."""
    root = Path(output_dir)
    runs = [p.parent for p in root.glob(f"*/{MANIFEST}")]
    return sorted(runs, key=lambda p: (p / MANIFEST).stat().st_mtime)


# ---- sizing before a run ------------------------------------------------------------------------

# The reported model's GDN geometry (Qwen3.5-27B text config): 48 of 64 layers are GDN.
QWEN35_27B = {"num_hidden_layers": 64, "full_attention_interval": 4, "linear_num_key_heads": 16,
              "linear_key_head_dim": 128, "linear_num_value_heads": 48,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def gdn_geometry(hf_config: Mapping[str, Any], tp: int = 1, num_speculative_tokens: int = 0,
                 conv_dtype: str = "bfloat16", ssm_dtype: str = "float32") -> dict:
    """Per-sequence GDN state geometry from a Qwen3-Next/Qwen3.5 style config (text part)."""
    cfg = hf_config.get("text_config", hf_config)
    try:
        kh, kd = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
        vh, vd = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
        kernel = cfg["linear_conv_kernel_dim"]
        n_layers = cfg["num_hidden_layers"]
    except KeyError as exc:
        raise InputError(f"model config: missing {exc.args[0]!r}; expected a GDN hybrid "
                         "(Qwen3-Next / Qwen3.5) config") from None
    types = cfg.get("layer_types")
    if types:
        gdn_layers = sum(t == "linear_attention" for t in types)
    else:
        interval = cfg.get("full_attention_interval", 4)
        gdn_layers = n_layers - n_layers // interval
    conv_dim = (2 * kh * kd + vh * vd) // tp
    state_len = kernel - 1 + num_speculative_tokens
    if conv_dtype not in DTYPE_BYTES or ssm_dtype not in DTYPE_BYTES:
        raise InputError(f"dtype: expected one of {sorted(DTYPE_BYTES)}")
    return {"gdn_layers": gdn_layers, "conv_shape": [state_len, conv_dim],
            "ssm_shape": [vh // tp, vd, kd], "conv_bytes": state_len * conv_dim * DTYPE_BYTES[conv_dtype],
            "ssm_bytes": (vh // tp) * vd * kd * DTYPE_BYTES[ssm_dtype]}


def snapshot_bytes(geometry: Mapping[str, Any]) -> int:
    """Bytes of one full snapshot of one sequence (every GDN layer, conv window + recurrent state)."""
    return geometry["gdn_layers"] * (geometry["conv_bytes"] + geometry["ssm_bytes"])


def estimate_capture_bytes(geometry: Mapping[str, Any], requests: int, steps_per_request: int,
                           mode: str = "digest", snapshot_pairs: int = 0,
                           projections: int = 3) -> dict:
    """Upper-bound bytes of a run: digests and step rows for every (request, step), plus snapshots
    (no dedup assumed). Row sizes are uncompressed parquet estimates."""
    steps = requests * steps_per_request
    digest_row = 8 * (5 + projections) + 8 + 96  # stats, checksum, keys
    digest = 0 if mode == "off" else steps * 2 * geometry["gdn_layers"] * digest_row
    step_rows = 0 if mode == "off" else steps * 160
    snaps = snapshot_pairs * snapshot_bytes(geometry) if mode == "full" else 0
    return {"digest_bytes": digest, "step_bytes": step_rows, "snapshot_bytes": snaps,
            "total_bytes": digest + step_rows + snaps,
            "snapshot_bytes_per_sequence": snapshot_bytes(geometry)}
