"""Turn one finished capture step into table rows: steps, digests, copies (census), snapshots.

What it does: ``RunEmitter`` is the half of ``statescope.capture.run.RunCapture`` that runs after
a step's fence is done (flusher thread or explicit flush), on host values only: per-request step
facts (with the accepted counts read back — sampled and used — the first live row of the conv
window and the column the next step resumes from), one digest row per (request, layer, kind,
digested column) with the checksum and word hash — per token row too for conv windows — one census row per
copy — decoded by ``statescope.capture.census_decode`` and classified per launch by ``statescope.capture.census``
— and content-addressed snapshot tensors. ``StandaloneEmitter`` is the same without a runner, built
from a run's manifest (``statescope.capture.spool.recover``). On a CPU build the decoded census is cross-checked
against the copies ``statescope.patches.cpu_kernels`` reports doing (``observed`` column, counts in the
manifest under ``census_crosscheck``).

What it deliberately does not do: touch device state or decide what is recorded.
"""
from __future__ import annotations

from typing import Any

import torch

from statescope.capture import facts as cf
from statescope.capture import census
from statescope.capture import census_decode as cd
from statescope.capture import resume
from statescope.capture.digest import unpack
from statescope.capture.digest_graph import unflatten
from statescope.errors import InputError

KINDS = ("conv", "ssm")


def _rows_of(counts: Any, metas: list) -> list | None:
    """The selected requests' entries of a per-batch-row count tensor (None where absent)."""
    if counts is None:
        return None
    values = counts.tolist()
    return [values[m["batch_row"]] if m["batch_row"] < len(values) else None for m in metas]


class RunEmitter:
    """Mixin: expects ``writer``, ``geoms``, ``layers``, ``groups``, ``digester``, ``spec``,
    ``crosscheck`` and ``lock`` from ``RunCapture``."""

    def _emit(self, item: dict) -> None:
        if "packed" in item:  # GPU: the step's results arrived in one pinned buffer
            flat, layout, keys, launches = item.pop("packed")
            values = unpack(flat, layout)
            item.update(zip(keys, values))
            for launch, data in zip(launches, values[len(keys):]):
                launch.data = data
        if "digest_flat" in item:  # one graph replay's buffer for padded columns
            layout, columns = item.pop("digest_layout")
            (item["stats"], item["checksum"], item["conv_row_checks"],
             item["conv_row_sums"]) = unflatten(item.pop("digest_flat"), layout, columns)
        for launch in item["launches"]:
            if getattr(launch, "v2_align", False):  # a spooled record keeps the field too
                launch.data = torch.from_numpy(cd.v2_align_as_v1_inputs(launch.data.numpy()))
                launch.v2_align = False
        if item.pop("used_in_launch", False):  # the counts the post-process read: its column 0
            staged = [ln for ln in item["launches"] if ln.block_size is not None]
            item["used"] = staged[-1].data[:, 0].clone() if staged else None
        for launch in item["launches"]:
            if launch.block_size is not None:  # post-process inputs staged in the step: decide now
                launch.data = torch.from_numpy(cd.postprocess_decisions_np(launch.data.numpy(),
                                                                           launch.block_size))
                launch.block_size = None
        cf.expand(item, self.groups)  # per-request metas and block lists from the compact record
        metas, es = item["metas"], item["engine_step"]
        acc, used = (_rows_of(item.get(k), metas) for k in ("accepted", "used"))
        offsets = item.get("resume_offsets")  # per selected request (None: no drafts this step)
        offsets = offsets.tolist() if offsets is not None else [0] * len(metas)
        resets = self._window_resets(item)
        dev_cols = item.get("running_col_device")  # Model Runner V2: the device's running column
        dev_cols = dev_cols.tolist() if dev_cols is not None else None
        for r, meta in enumerate(metas):
            meta.setdefault("snapshot", False)
            meta["accepted"] = acc[r] if acc is not None else None
            meta["num_accepted_sampled"] = meta["accepted"]
            meta["num_accepted_used"] = used[r] if used is not None else None
            # first live row of the running block's conv window for the next read
            reset = resets.get(meta["req_id"], False)
            meta["conv_live_offset"] = (0 if reset or meta["accepted"] is None
                                        else max(0, meta["accepted"] - 1))
            meta["resume_col_offset"] = int(offsets[r])  # the column the next step reads
            if dev_cols is not None:
                meta["running_col_device"] = int(dev_cols[r])
        self.writer.add_rows("steps", metas)
        if metas:
            self._emit_digests(item, metas, es)
        for r, kind, t in item.get("snaps", []):
            sha, shard = self.writer.add_tensor(t)
            layers = [g.layer for g in self.geoms if g.kind == kind]
            self.writer.add_rows("snapshots", [dict(
                engine_step=es, req_id=metas[r]["req_id"], req_step=metas[r]["req_step"],
                prompt_sha=metas[r]["prompt_sha"], kind=kind, layers=layers, sha256=sha,
                shard=shard, shape=list(t.shape), dtype=str(t.dtype).replace("torch.", ""),
                nbytes=t.numel() * t.element_size())])
        if self.spec.census:
            for launch in item["launches"]:
                self.writer.add_rows("copies", self._census_rows(launch, item, es))

    def _window_resets(self, item: dict) -> dict:
        """req_id -> whether the post-process reset its accepted count to 1 (state moved to
        the start of the running block), from the launch's decisions."""
        out = {}
        for launch in item["launches"]:
            if launch.kind == "postprocess":
                for row, d in enumerate(launch.data.numpy().tolist()):
                    if row < len(item["batch"]):
                        out[item["batch"][row]] = bool(d[4])
        return out

    def _emit_digests(self, item: dict, metas: list, es: int) -> None:
        """Columnar: one row per (kind, layer, digested column), numpy arrays buffered by the
        writer and joined into one table per write (not one per step). ``resume`` marks the row
        whose state the request's next step reads: the running column for the conv window, the
        column ``resume_col_offset`` after it for the recurrent state. An extra resume column
        (``statescope.capture.resume``) is kept for the recurrent state only, and only when it
        is not the running column."""
        import numpy as np

        stats, exact = item["stats"].numpy(), item["checksum"].numpy()  # [2, L, C, S], [2, L, C, 2]
        layers, ncols = exact.shape[1], exact.shape[2]
        digest_rows = np.asarray(item["digest_rows"], dtype=np.int64).reshape(-1, 2)
        blocks = np.asarray(item["digest_blocks"], dtype=np.int64).reshape(layers, -1)
        offsets = np.array([m["resume_col_offset"] for m in metas], dtype=np.int64)
        base = len(digest_rows)
        if "resume_extra" in item:
            group_pos = [self.groups.index(g) for _, g in self.layers]
            rows_e, blocks_e = resume.resolve(offsets, np.asarray(item["resume_extra"], np.int64),
                                              metas, group_pos)
            digest_rows = np.concatenate([digest_rows, rows_e])
            blocks = np.concatenate([blocks, blocks_e], 1)
        meta_of, col_off = digest_rows.T
        is_resume_col = col_off == offsets[meta_of]
        is_extra = np.arange(ncols) >= base
        names = np.array([n for n, _ in self.layers], dtype=object)
        req_ids = np.array([m["req_id"] for m in metas], dtype=object)
        req_steps = np.array([m["req_step"] for m in metas], dtype=np.int64)
        shas = np.array([m["prompt_sha"] for m in metas], dtype=object)
        for k, kind in enumerate(KINDS):
            if kind == "conv":  # the window lives in the running column (its live rows move)
                keep, flag = ~is_extra, col_off == 0
            else:  # an extra column equal to the running one duplicates it
                keep, flag = ~is_extra | (col_off > 0), is_resume_col
            sel = np.flatnonzero(keep)
            n = len(sel) * layers
            cols = {"engine_step": np.full(n, es, dtype=np.int64),
                    "req_id": np.tile(req_ids[meta_of[sel]], layers),
                    "req_step": np.tile(req_steps[meta_of[sel]], layers),
                    "prompt_sha": np.tile(shas[meta_of[sel]], layers),
                    "column_offset": np.tile(col_off[sel], layers),
                    "resume": np.tile(flag[sel], layers),
                    "layer": np.repeat(names, len(sel)),
                    "layer_index": np.repeat(np.arange(layers, dtype=np.int64), len(sel)),
                    "block_id": blocks[:, sel].reshape(-1),
                    "kind": np.full(n, kind, dtype=object),
                    "checksum": exact[k][:, sel, 0].reshape(-1).astype(np.int64),
                    "hash": exact[k][:, sel, 1].reshape(-1).astype(np.int64)}
            for j, name in enumerate(self.digester.names):
                cols[name] = stats[k][:, sel, j].reshape(-1).astype(np.float64)
            if kind == "conv":  # per-token-row digests of the window (see digest_diff)
                rows_exact = item["conv_row_checks"].numpy()[:, sel]  # [L, C, rows, 2]
                rsums = item["conv_row_sums"].numpy()[:, sel]
                cols["row_checksums"] = rows_exact[..., 0].reshape(n, -1).astype(np.int64)
                cols["row_hashes"] = rows_exact[..., 1].reshape(n, -1).astype(np.int64)
                cols["row_sums"] = rsums.reshape(n, -1).astype(np.float64)
            self.writer.add_columns("digests", cols)

    def _census_rows(self, launch: Any, item: dict, es: int) -> list[dict]:
        batch, block_ids = item["batch"], item["block_ids"]
        if launch.kind == "scalar":
            src, dst, sizes = launch.data
            owners = [dict(launch.owners.get(i, {})) for i in range(len(sizes))]
            for o in owners:
                o["batch_row"] = batch.index(o["req_id"]) if o.get("req_id") in batch else -1
            rows = cd.decode_scalar(self.geoms, src, dst, sizes, owners)
        elif launch.kind == "precopy":
            dst_cols, src_cols, biases = launch.data.numpy().T.tolist()
            rows = cd.decode_fused_precopy(self.geoms, dst_cols, src_cols, biases, batch, block_ids)
        else:
            rows = cd.decode_fused_postprocess(self.geoms, launch.data.numpy().tolist(), batch,
                                               block_ids)
        kinds = census.classify_launch(rows)
        seen = {(e.state_base_addr + e.src_offset, e.state_base_addr + e.dst_offset, e.nbytes)
                for e in launch.observed}
        observing = launch.kind != "scalar" and self._observing()
        for row, kind in zip(rows, kinds):
            key = (row["src_addr"], row["dst_addr"], row["nbytes"])
            row.update(engine_step=es, launch=launch.seq, launch_kind=launch.kind, kind=kind,
                       observed=(key in seen) if observing else None)
        if observing:
            decoded = {(r["src_addr"], r["dst_addr"], r["nbytes"]) for r in rows}
            self.crosscheck["decoded"] += len(decoded)
            self.crosscheck["observed"] += len(seen)
            self.crosscheck["decoded_not_observed"] += len(decoded - seen)
            self.crosscheck["observed_not_decoded"] += len(seen - decoded)
        return rows

    def _observing(self) -> bool:
        """Whether statescope's CPU kernels (which report their copies) are in use."""
        try:
            from statescope.patches import cpu_kernels

            return cpu_kernels.is_installed()
        except ImportError:
            return False


class StandaloneEmitter(RunEmitter):
    """``RunEmitter`` for a run on disk, from its manifest alone (no vLLM, no device): used to emit
    spooled steps after the process that captured them died."""

    def __init__(self, run_dir: Any, manifest: dict) -> None:
        import threading

        from statescope.capture.spec import CaptureSpec
        from statescope.capture.store import CaptureWriter
        from statescope.capture.digest import Digester

        try:
            self.geoms = [cd.StateGeometry(**dict(g, shape=tuple(g["shape"]))) for g in manifest["states"]]
            self.spec = CaptureSpec.from_dict(manifest["spec"])
            stats = list(manifest["digest_stats"])
        except (KeyError, TypeError) as exc:
            raise InputError(f"{run_dir}: manifest.json lacks what emission needs ({exc}); expected "
                             f"'states', 'spec' and 'digest_stats' as a capture run writes them") from None
        self.layers = [(g.layer, g.group) for g in self.geoms if g.kind == "conv"]
        self.groups = list(manifest.get("mamba_groups") or [])
        self.digester = Digester(self.spec.projections, self.spec.digest_seed)
        if list(self.digester.names) != stats:
            raise InputError(f"{run_dir}: digest_stats {stats} differ from this statescope's "
                             f"{list(self.digester.names)}")
        self.crosscheck = dict(manifest.get("census_crosscheck") or
                               {"decoded": 0, "observed": 0, "decoded_not_observed": 0,
                                "observed_not_decoded": 0})
        self.lock = threading.RLock()
        self.writer = CaptureWriter.reopen(run_dir)

    def _observing(self) -> bool:
        return False  # the process that ran the copies is gone

