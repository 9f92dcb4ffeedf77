"""One capture run = one model runner: per-step bookkeeping in the step, emission to disk later.

What it does, in the step (called from ``statescope.capture.hooks`` through the recorder):
``begin_step`` notes what the scheduler scheduled (computed tokens at schedule time, scheduled
and draft tokens, the prefix-cache hit of a newly scheduled request); the copy hooks note each
copy launch (scalar: the host pointer arrays; fused: the launch's decision inputs, copied on the
device; for the post-process also the accepted counts it is given, ``note_used``);
``note_sampled`` counts accepted tokens per row on the device; ``end_step`` reads the selected
requests' running blocks from the input batch's block tables (``statescope.capture.facts``: a
compact record of numpy arrays; the per-request rows are made at emit), digests them
(``statescope.capture.digest``), takes the snapshots the spec asks for, starts the device->host copies
(whole per-row count tensors: the selected rows are picked at emit) and records a ``Fence``.
Nothing in the step reads a device value on the host. Digested per (layer, request): the running
column; for a request with drafts the column the next step resumes from (``statescope.capture.resume``:
picked on the device from the accepted counts, an extra column dropped at emit when it is the
running one); and, with ``draft_columns``, every column after the running one that holds a
candidate state of the step's drafts — all in one call per state kind over all layers and columns. On a CPU build the digest runs in
the step, straight from the blocks (``Digester.digest_in_place``, one pass, no gather; the torch
gather + reductions into kept buffers where the C kernel is unavailable); handing the blocks to
the flusher thread instead needs a copy per step and measured no faster on the shared two-core
machine (the other core is rarely idle).

Later (``drain``, from the recorder's flusher thread or an explicit flush): steps whose fence is
done are turned into table rows by ``statescope.capture.emit`` (the ``RunEmitter`` base class)
and written through ``statescope.capture.store.CaptureWriter`` — at once (``emit: "background"``,
the CPU default), or, on an accelerator (``emit: "idle"``), first appended to the run's spool and
made into rows when the engine idles (``statescope.capture.spool``: the step's host time is the
throughput there).

What it deliberately does not do: install hooks or own threads (``statescope.capture.recorder``).
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from statescope.capture import facts as cf
from statescope.capture import census_decode as cd
from statescope.capture import resume
from statescope.capture.adapters import mamba_groups
from statescope.capture.emit import KINDS, RunEmitter
from statescope.capture.spool import IDLE_S, Spool
from statescope.capture.store import CaptureWriter
from statescope.capture.digest import (Digester, Fence, gather_snapshot, host_to_device, pack,
                                       to_host_async)
from statescope.capture.digest_graph import ENV_GRAPH
from statescope.capture.digest_graph import digest_kinds  # noqa: F401 (its old home; tests, benchmarks)
from statescope.capture.digest_graph import digest_kernel_name as _digest_kernel_name
from statescope.capture.digest_graph import engine_step_digest as _engine_step_digest
from statescope.capture import word_hash

PACKED = ("stats", "checksum", "conv_row_checks", "conv_row_sums", "accepted", "used", "digest_flat",
          "resume_offsets", "running_col_device")
DEVICE_PATH_ON_CPU = False  # tests: run the accelerator path (in-step reduce, packed copy) on CPU
STEP_DIGEST_ON_CPU = False  # tests: the CUDA path's padded one-buffer digest (eagerly) on CPU
USED_IN_LAUNCH = "in launch"  # ``_Step.used``: the post-process launch's staged column 0


@dataclass
class _Launch:
    seq: int
    kind: str  # "scalar" | "precopy" | "postprocess"
    data: Any = None  # scalar: (src, dst, sizes) host arrays; fused: tensor of decisions
    owners: dict = field(default_factory=dict)
    observed: list = field(default_factory=list)
    block_size: int | None = None  # set: ``data`` holds the post-process inputs, decided at emit
    v2_align: bool = False  # ``data`` holds V2's (accepted, running column, new computed) per row


@dataclass
class _Step:
    engine_step: int
    sched: dict  # req_id -> dict of schedule-time facts
    accepted: torch.Tensor | None = None  # per batch row: sampled by the rejection sampler
    used: Any = None  # per batch row: what the post-process kernel was given (or USED_IN_LAUNCH)
    launches: list = field(default_factory=list)
    current: _Launch | None = None
    scalar_owners: dict = field(default_factory=dict)
    slots_key: Any = None  # V2: (id, rows) of the idx_mapping ``slots`` was made from
    slots: Any = None  # its first rows as int64 (the fused launches' row pick)


class RunCapture(RunEmitter):
    def __init__(self, spec: Any, runner: Any, run_dir: Any, manifest: dict) -> None:
        self.spec = spec
        self.runner_ref = weakref.ref(runner)
        kvc = runner.kv_cache_config
        self.groups, mspec = mamba_groups(kvc)
        self.block_size = int(mspec.block_size)
        self.layers = [(name, g) for g in self.groups for name in kvc.kv_cache_groups[g].layer_names]
        self.layer_group_pos = [self.groups.index(g) for _, g in self.layers]
        from vllm.v1.worker import mamba_utils as mu

        dim_first = bool(getattr(mu, "is_conv_state_dim_first", lambda: False)())
        states = self._states(runner)
        self.geoms = cd.geometry_from_states(
            [(n, g, s) for (n, g), s in zip(self.layers, states)], dim_first)
        self.device = states[0][0].device
        # accelerator path: reduce in the step (async device ops) and pack results for one
        # pinned copy. The spec's accelerator_path (or DEVICE_PATH_ON_CPU, for tests) forces it on
        # CPU to show the GPU logic (the digest numbers still come from the C kernel there).
        self.device_path = self.device.type != "cpu" or DEVICE_PATH_ON_CPU or spec.accelerator_path
        self.digester = Digester(spec.projections, spec.digest_seed)
        # CUDA: both kinds' digests into one buffer per step, as a graph replay (the default;
        # STATESCOPE_DIGEST_GRAPH=0 launches them eagerly: statescope.capture.digest_graph)
        self.step_digest = None
        self.want_graph = os.environ.get(ENV_GRAPH, "1") != "0"  # CUDA only (StepDigest.graphs_on)
        if self.device.type == "cuda" or (self.device_path and STEP_DIGEST_ON_CPU):
            self.step_digest = _engine_step_digest(runner, self.layers, self.geoms[0], spec,
                                                   self.device, self.device_path)
        spec_cfg = runner.vllm_config.speculative_config
        num_spec = int(spec_cfg.num_speculative_tokens) if spec_cfg else 0
        manifest.update(conv_window=self.geoms[0].conv_width - num_spec,
                        num_speculative_tokens=num_spec,
                        states=[g.to_dict() for g in self.geoms], block_size=self.block_size,
                        mamba_groups=self.groups, digest_stats=list(self.digester.names),
                        state_device=str(self.device),  # the kernel is built here, not mid-step
                        digest_kernel=_digest_kernel_name(self.device),
                        digest_graph=(self.step_digest.status(self.want_graph)
                                      if self.step_digest else "off"),
                        # 2: projections are bilinear forms u @ X @ v (1: dense vectors); runs
                        # of different versions or kernels agree on checksums, not on floats
                        digest_version=2,
                        # exact numbers per block (and per conv token row); older runs: checksum
                        digest_exact=["checksum", "hash"],
                        digest_hash=word_hash.DEFINITION,
                        # which column of a request's block row the digests cover
                        digest_columns=("running+drafts" if spec.draft_columns
                                        else "running+resume"))
        self.defer = spec.emit == "idle" or (spec.emit == "auto" and self.device_path)
        manifest.update(emit="idle" if self.defer else "background")
        self.writer = CaptureWriter(run_dir, manifest, spec.max_bytes)
        self.spool = Spool(run_dir) if self.defer else None
        self.deferred: list = []  # spooled, not yet emitted (in order)
        self.emit_s = 0.0  # host seconds spent making rows, wherever (manifest emit_ms_total)
        self.last_step_t = time.monotonic()
        self.lock = threading.RLock()  # guards ``pending``; re-entrant for the SIGTERM handler
        self.drain_lock = threading.RLock()  # one drainer at a time (flusher vs explicit flush)
        self.pending: deque = deque()
        self.step: _Step | None = None
        self.engine_step = 0
        self.reqs: dict[str, dict] = {}
        self.table_source = cf.TableSource()  # block tables: input batch (checked) or requests
        self._tokenizer: Any = None
        self.snap_reserved = 0
        self.skipped = 0
        self.crosscheck = {"decoded": 0, "observed": 0, "decoded_not_observed": 0,
                           "observed_not_decoded": 0}
        self.steps_since_write = 0
        self.last_write = time.monotonic()
        self.wake: threading.Event | None = None  # set by the recorder: wakes its flusher
        # a recorded request finished: write its rows at the next drain, so that a killed run
        # keeps every finished request (the spool keeps them already where there is one)
        self.finished_due = False

    # ---- in the step -------------------------------------------------------------------------

    def _states(self, runner: Any) -> list:
        ctx = runner.compilation_config.static_forward_context
        return [list(ctx[name].kv_cache[:2]) for name, _ in self.layers]

    def _tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            runner = self.runner_ref()
            self._tokenizer = AutoTokenizer.from_pretrained(runner.model_config.tokenizer)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def begin_step(self, so: Any) -> None:
        self.engine_step += 1
        self.last_step_t = time.monotonic()
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        if so.finished_req_ids and self.spool is None:
            self.finished_due = True
            if self.wake is not None:
                self.wake.set()
        spec_tokens = so.scheduled_spec_decode_tokens
        sched = {}
        for new in so.scheduled_new_reqs:
            sched[new.req_id] = {"num_computed_tokens": int(new.num_computed_tokens), "is_new": True,
                                 "prefix_hit_tokens": int(new.num_computed_tokens)}
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for rid, comp in zip(cached.req_ids, cached.num_computed_tokens):
            sched[rid] = {"num_computed_tokens": int(comp), "is_new": rid in resumed,
                          "prefix_hit_tokens": int(comp) if rid in resumed else None}
        for rid, facts in sched.items():
            facts["num_scheduled_tokens"] = int(so.num_scheduled_tokens.get(rid, 0))
            facts["num_drafts"] = len(spec_tokens.get(rid, ()))
        self.step = _Step(self.engine_step, sched)

    def note_sampled(self, output_token_ids: torch.Tensor) -> None:
        if self.step is not None:
            self.step.accepted = (output_token_ids != -1).sum(1)

    def note_accepted(self, num_sampled: torch.Tensor) -> None:
        """Model Runner V2: the sampler's per-batch-row count of kept tokens, copied (int64)."""
        if self.step is not None:
            self.step.accepted = num_sampled.to(torch.int64, copy=True)

    def note_used(self, num_accepted: torch.Tensor | None, copied: bool = False) -> None:
        """The accepted counts a state-update launch reads (cloned before the launch: the kernel
        may rewrite them in place; ``copied``: the caller's tensor already is such a copy; None:
        they are column 0 of the post-process launch's staged inputs, read from there at emit)."""
        if self.step is not None:
            self.step.used = (USED_IN_LAUNCH if num_accepted is None else num_accepted if copied
                              else num_accepted.to(torch.int64, copy=True))

    def scalar_meta(self, before: int, after: int, owner: dict) -> None:
        if self.step is not None:
            for off in range(before, after):
                self.step.scalar_owners[off] = owner

    def open_launch(self, kind: str, data: Any, owners: dict | None = None,
                    block_size: int | None = None, v2_align: bool = False) -> None:
        if self.step is None:
            return
        launch = _Launch(len(self.step.launches), kind, data, owners or {}, block_size=block_size,
                         v2_align=v2_align)
        self.step.launches.append(launch)
        self.step.current = launch
        self.step.scalar_owners = {}

    def launch_done(self) -> None:
        if self.step is not None:
            self.step.current = None

    def observed_copy(self, event: Any) -> None:
        if self.step is not None and self.step.current is not None:
            self.step.current.observed.append(event)

    def _selected(self, runner: Any, rid: str) -> dict:
        info = self.reqs.get(rid)
        if info is None:
            prompt = list(runner.requests[rid].prompt_token_ids or [])
            from statescope.workload.trace import prompt_sha

            info = {"selected": self.spec.selects(rid, prompt, self._tokenize),
                    "prompt_sha": prompt_sha(prompt), "prompt_len": len(prompt), "steps": 0}
            self.reqs[rid] = info
        return info

    def end_step(self, runner: Any) -> None:
        """The step's compact record (``statescope.capture.facts``: numpy arrays, no per-request
        dicts) and its digests, counts and copies started on the device."""
        step, self.step = self.step, None
        if step is None or not step.sched:
            return
        index = runner.input_batch.req_id_to_index
        requests = runner.requests
        live = sorted((rid for rid in step.sched if rid in index and rid in requests), key=index.get)
        sel = [rid for rid in live if self._selected(runner, rid)["selected"]]
        need = live if step.launches else sel  # whose block tables the emitter reads
        rows = np.fromiter((index[rid] for rid in need), dtype=np.int64, count=len(need))
        tables = self.table_source.tables(runner, self.groups, need, rows)
        out: dict[str, Any] = {"engine_step": step.engine_step, "launches": step.launches,
                               "batch": live, "table_reqs": need, "tables": tables}
        if sel:
            sched = [step.sched[rid] for rid in sel]
            infos = [self.reqs[rid] for rid in sel]
            # one pass over the selected requests: batch row, drafts, step count, computed tokens
            per_req = np.array([(index[rid], f["num_drafts"], i["steps"],
                                 requests[rid].num_computed_tokens)
                                for rid, f, i in zip(sel, sched, infos)], dtype=np.int64).reshape(-1, 4)
            pos = np.arange(len(sel)) if need is sel else np.searchsorted(rows, per_req[:, 0])
            cols = self._running_cols(runner, sel, sched, tables[0][1][pos])
            device_cols = getattr(runner, "device_running_cols", None)  # Model Runner V2 only
            if device_cols is not None:
                got = device_cols(sel)
                if got is not None:
                    out["running_col_device"] = got
            columns, digest_rows, running, running_pos = cf.digest_columns(
                tables, pos, cols, per_req[:, 1], bool(self.spec.draft_columns))
            out["facts"] = {
                "sel": sel, "sched": sched, "block_size": self.block_size,
                "prompt_sha": [i["prompt_sha"] for i in infos],
                "prompt_len": [i["prompt_len"] for i in infos],
                "req_step": per_req[:, 2], "batch_row": per_req[:, 0], "running_col": cols,
                "running": running, "num_computed_runner": per_req[:, 3]}
            for i in infos:
                i["steps"] += 1
            blocks = columns[:, self.layer_group_pos].T  # [L, C]
            out["digest_rows"], out["digest_blocks"] = digest_rows, blocks
            # the column each request's next step resumes from (statescope.capture.resume)
            ends = np.fromiter((f["num_computed_tokens"] + f["num_scheduled_tokens"] for f in sched),
                               dtype=np.int64, count=len(sched))
            off, extra_req, extra = resume.plan(
                step.accepted, step.launches, per_req, ends, tables, pos, cols,
                self.layer_group_pos, self.block_size, bool(self.spec.draft_columns), self.device)
            if off is not None:
                out["resume_offsets"] = off
            if extra_req is not None:
                out["resume_extra"] = extra_req
            self._digest_into(out, runner, blocks, extra)
            # whole per-row counts: which rows are the selected requests' is read at emit
            for key, counts in (("accepted", step.accepted), ("used", step.used)):
                if isinstance(counts, torch.Tensor):
                    out[key] = counts
            if step.used is USED_IN_LAUNCH:
                out["used_in_launch"] = True
            if self.spec.mode == "full":  # the only mode with snapshots (``wants_snapshot``)
                cf.expand(out, self.groups)  # snapshots are rare: per-request metas now
                out["snaps"] = self._snapshots(self._states(runner), blocks[:, running_pos],
                                               out["metas"])
        if self.device_path:
            self._pack(out)
        out["fence"] = Fence(self.device)
        with self.lock:
            self.pending.append(out)

    def _running_cols(self, runner: Any, sel: list, sched: list, nblocks: np.ndarray) -> np.ndarray:
        """Each selected request's running column of its (first group's) block row: the runner's
        ``mamba_state_idx`` in align mode, else the block holding its last computed token."""
        idx = getattr(runner, "mamba_state_idx", None)
        align = idx is not None and runner.cache_config.mamba_cache_mode == "align"
        cols = np.empty(len(sel), dtype=np.int64)
        for r, (rid, facts) in enumerate(zip(sel, sched)):
            if align and rid in idx:
                cols[r] = idx[rid]
            elif nblocks[r] <= 1:
                cols[r] = 0
            else:
                end = facts["num_computed_tokens"] + facts["num_scheduled_tokens"]
                cols[r] = min(int(nblocks[r]) - 1, max(0, -(-end // self.block_size) - 1))
        return cols

    def _digest_into(self, item: dict, runner: Any, blocks: np.ndarray,
                     extra: torch.Tensor | None = None) -> None:
        """Both kinds' digests of the ``[L, C]`` host block table, then the ``[L, E]`` device
        columns ``extra``, into ``item``: on CUDA one flat buffer (``statescope.capture.digest_graph``:
        a graph replay, or eager where graphs are off or failed; unpacked at emit), else
        ``digest_kinds`` as launched here."""
        if self.step_digest is not None:
            res = self.step_digest.run(blocks, self.want_graph, extra)
            status = self.step_digest.status(self.want_graph)
            if status != self.writer.manifest.get("digest_graph"):
                self.writer.note(digest_graph=status)
            if res is not None:
                item["digest_flat"], item["digest_layout"] = res[0], (res[1], res[2])
                return
        idx = host_to_device(torch.from_numpy(np.ascontiguousarray(blocks)), self.device)
        if extra is not None:
            idx = torch.cat([idx, extra.to(idx.dtype)], 1)
        stats, checks, item["conv_row_checks"], item["conv_row_sums"] = digest_kinds(
            self.digester, self.geoms[0], self._states(runner), idx, reuse=not self.device_path)
        item["stats"], item["checksum"] = stats, checks

    def _pack(self, item: dict) -> None:
        """GPU: one pinned device->host copy for all of a step's small results (digests, accepted
        counts, fused-launch decisions); ``RunEmitter`` unpacks it once the fence is done."""
        keys = [k for k in PACKED if k in item]
        launches = [ln for ln in item["launches"] if isinstance(ln.data, torch.Tensor)]
        if not keys and not launches:
            return
        flat, layout = pack([item.pop(k) for k in keys] + [ln.data for ln in launches])
        item["packed"] = (to_host_async(flat), layout, keys, launches)

    def _snapshots(self, states: list, blocks: np.ndarray, metas: list) -> list:
        """Full snapshots the spec asks for; ``blocks`` is ``[L, R]`` (host) running blocks."""
        snaps = []
        per_req = sum(g.natural_bytes for g in self.geoms)
        for r, meta in enumerate(metas):
            if not self.spec.wants_snapshot(meta["req_id"], meta["req_step"]):
                continue
            budget = self.spec.max_bytes - (self.writer.bytes_written - self.writer.tensor_bytes)
            if self.snap_reserved + per_req > budget:
                self.skipped += 1
                continue
            self.snap_reserved += per_req
            meta["snapshot"] = True
            ids = host_to_device(torch.from_numpy(np.ascontiguousarray(blocks[:, r])), self.device)
            for k, kind in enumerate(KINDS):
                t = gather_snapshot([s[k] for s in states], ids)
                snaps.append((r, kind, to_host_async(t)))
        return snaps

    # ---- later: rows and files ---------------------------------------------------------------

    def drain(self, force: bool = False) -> int:
        """Emit finished steps (all of them, waiting, when ``force``); returns steps emitted."""
        with self.drain_lock:
            return self._drain(force)

    def idle(self) -> bool:
        """No engine step has started for ``IDLE_S`` seconds."""
        return time.monotonic() - self.last_step_t > IDLE_S

    def _drain(self, force: bool, write: bool = True) -> int:
        done = []
        with self.lock:
            while self.pending and (force or self.pending[0]["fence"].done()):
                done.append(self.pending.popleft())
        if force:
            for item in done:
                item["fence"].wait()
        if self.spool is not None:  # deferred: spool now (cheap), rows when the engine idles
            self.spool.append_many(done)
            self.deferred += done
            if not (force or self.deferred and (self.idle()
                                                or len(self.deferred) >= self.spec.defer_max_steps)):
                return len(done)
            done, self.deferred = self.deferred, []
        t0 = time.thread_time()
        for item in done:
            self._emit(item)
        self.emit_s += time.thread_time() - t0
        if self.spool is not None and done:
            self.writer.note(spool_emitted=self.spool.offset)
        self.steps_since_write += len(done)
        idle = time.monotonic() - self.last_write > self.spec.flush_interval_s
        batch = self.spool is not None and bool(done)  # a deferred batch: persist it now
        finished = self.finished_due and not self.pending  # every step up to a finish emitted
        if write and self.steps_since_write and (force or idle or batch or finished
                                       or self.steps_since_write >= self.spec.flush_every_steps):
            self.write()
            self.finished_due = self.finished_due and not finished
            if batch:  # its steps are in the tables (manifest says up to which byte): start afresh
                self.spool.truncate()
                self.writer.note(spool_emitted=0)
                self.writer.write_manifest()
        return len(done)

    def _note_totals(self) -> None:
        self.writer.note(snapshots_skipped=self.skipped, truncated=self.skipped > 0,
                         census_crosscheck=dict(self.crosscheck), engine_steps=self.engine_step,
                         block_table_source=self.table_source.source,
                         emit_ms_total=round(self.emit_s * 1e3, 3))

    def write(self) -> None:
        self._note_totals()
        self.writer.write()
        self.steps_since_write = 0
        self.last_write = time.monotonic()

    def close(self, status: str = "complete") -> None:
        with self.drain_lock:
            self._close(status)

    def _close(self, status: str) -> None:
        self._drain(force=True, write=False)  # the writer's close writes the tables once
        self._note_totals()
        self.writer.close(status)
        if self.spool is not None:  # every spooled step is in the tables now
            self.spool.close()
            self.spool.path.unlink(missing_ok=True)
