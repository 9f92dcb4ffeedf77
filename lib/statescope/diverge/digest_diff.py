"""Line two capture runs of one workload up and say where their state digests first differ.

What it does: ``digest_diff(a, b)`` joins the digests of two runs on what is stable across runs —
the prompt (``prompt_sha``: requests are matched by their prompt), layer, state kind and where in
the request the state stands (``pairing``):

- ``"auto"`` (the default): position where both runs' step tables can place their states, else
  step, with the reason in ``attrs["pairing_fallback"]`` (``compared_pairing``);
  ``attrs["pairing"]`` says which;
- ``"position"``: the token position the state stands for (``statescope.diverge.positions``: the
  runner's computed-token count, the non-draft tokens scheduled and the drafts accepted). Two runs
  that schedule a request differently — async scheduling on or off, another
  ``max_num_batched_tokens``, other batch partners, other speculative acceptance — take different
  numbers of steps to reach one token, and their states still pair. Positions only one run has (a
  prefill chunked elsewhere, a prefix hit, a run that stopped at another token, states of rejected
  drafts) do not join; ``attrs["unpaired"]`` counts them per prompt. Where one run reaches a
  position twice the later step's state is kept. ``req_step`` is ``b``'s step (``req_step_a`` /
  ``req_step_b`` both runs'). With resume-column digests the recurrent state of the running
  column (the state after the step's first token) is compared too: a wrong accepted count
  corrupts the next step's states, and a run that then accepts otherwise than its reference may
  share no resume position with it again (``_running_kept``);
- ``"step"``: the request's own step counter, which lines up only where both runs scheduled the
  request alike (a run of another schedule shows false divergences); ``first_divergence``
  keeps it as its default, for the runs of one configuration it reduces (a clean run and a
  planted fault).

Each pair is marked ``same``:

- recurrent state (``ssm``): the exact numbers agree (the word-sum ``checksum`` and, where both
  runs recorded it, the position-keyed word ``hash``) and the float statistics agree within
  ``rtol`` (the projections make a permuted state differ even when its checksum does not); a
  signed statistic (sum, projections) is relative to the state's norm as well as to itself, so a
  sum that nearly cancels does not magnify rounding (``_rel_to_norm``);
- conv window (``conv``), by default (``conv="live"``): only the rows the next step will read are
  compared — ``conv_window`` rows from each run's ``conv_live_offset`` — by per-row checksum,
  per-row hash (where recorded) and sum. The other rows of a window hold bytes left by the
  block's previous user, which differ between runs with different histories and mean nothing.
  ``conv="window"`` compares everything.

Across engine configurations (``configs_differ``: the manifests' resolved scheduling keys or
runner class differ; ``across_configs`` overrides), paired by position, the comparison follows
the noise the H200 capture pairs show (``data/results/gpu/capture_pairs``): recurrent states
and live conv rows agree by float statistics / row sums within ``schedule_rtol`` (default
``SCHEDULE_RTOL``), not bit for bit; a step with an all-zero conv window (a block not written
yet) has its windows dropped; states after a request's end that no step read are dropped
(``_after_the_end``); and differences a later agreeing state contradicts are forgiven
(``statescope.diverge.transient``). ``attrs["across_configs"]`` says whether these applied.

Which column of a request's block row is compared (``columns``; ``compared_columns`` says which
and why, and the frame carries it in ``attrs["columns"]``):

- ``"all"``: both runs digested every draft column (spec ``draft_columns``): the recurrent state
  of every column (joined on ``column_offset`` too), the conv window of the running column;
- ``"resume"``: the column the next step resumes from (digest column ``resume``, recorded by
  captures since the resume-column digest): the recurrent state after the accepted tokens, the
  conv window's live rows in the running column;
- ``"running"``: the running column only (captures older than the resume-column digest): a
  corruption of the slot the next step resumes from shows one step late, when that step has
  read it.

``"auto"`` (the default) takes the first of these both runs support. ``column_offset=j`` (older
callers) compares the j-th column after the running one, whatever it is.

``first_divergence(a, b)`` reduces that to one row per request: the first request-local step
where anything differs (by position: ``b``'s step at the first differing position,
``first_position``), the layers there (in model order), the origin layer (the first of them:
within a step, information only flows to later layers) and its kinds, and the kinds of any layer.
``shifts_by_request(run)`` lists, per request, the steps at which the census saw an in-place
conv shift (``left_shift_same_block`` with bytes to move).

Runs recorded with different digest versions (``digest_version`` in the manifest: the projections
changed definition in version 2) agree only on exact numbers, so only those are compared and a
``DigestMismatchWarning`` says so; runs digested by different kernels (``digest_kernel``: the CPU
C kernel vs the torch path) compare as usual (their floats agree to ~4e-6 relative, inside the
default ``rtol``) with a warning, since a tighter ``rtol`` would flag kernel noise as divergence.

What it deliberately does not do: decide which hypothesis a divergence supports (the verdict
tools do), count a position only one run has as a difference, or compare runs of different
workloads (rows that do not join are dropped).
"""
from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from statescope.capture.store import CaptureRun
from statescope.diverge.transient import mark_transient
from statescope.diverge.positions import digest_positions, position_support, token_positions
from statescope.errors import InputError

KEYS = ["prompt_sha", "req_step", "layer", "kind"]
POSITION_KEYS = ["prompt_sha", "position", "layer", "kind"]
PAIRINGS = ("auto", "position", "step")
SCHEDULE_RTOL = 1e-2  # recurrent-state statistics of two schedules, paired by position
COLUMN_MODES = ("auto", "all", "resume", "running")
COLUMN_NOTES = {
    "all": "every captured column: the recurrent state of the running column and each draft "
           "column, the conv window's live rows in the running column",
    "resume": "the column each step's successor resumes from: the recurrent state after the "
              "accepted tokens, the conv window's live rows",
    "running": "the running column only (a capture without resume-column digests): a corruption "
               "of the slot the next step resumes from shows one step late",
}


class DigestMismatchWarning(UserWarning):
    """Two runs' digests were made by different digest versions or kernels."""


def comparable_stats(a: CaptureRun, b: CaptureRun) -> bool:
    """False when the two runs' float statistics are not comparable (different digest versions);
    warns when only the kernels differ."""
    va, vb = a.manifest.get("digest_version", 1), b.manifest.get("digest_version", 1)
    if va != vb:
        warnings.warn(f"digest_version {va} vs {vb}: comparing exact numbers only (float "
                      "statistics changed definition between versions)", DigestMismatchWarning,
                      stacklevel=3)
        return False
    ka, kb = a.manifest.get("digest_kernel"), b.manifest.get("digest_kernel")
    if ka != kb:
        warnings.warn(f"digest_kernel {ka} vs {kb}: float statistics agree only to ~4e-6 relative; "
                      "keep rtol >= 1e-5", DigestMismatchWarning, stacklevel=3)
    return True


def _has_drafts(run: CaptureRun) -> bool:
    return bool((run.manifest.get("spec") or {}).get("draft_columns"))


def compared_columns(a: CaptureRun, b: CaptureRun, columns: str = "auto") -> str:
    """The column mode two runs are compared in (see the module docstring); an explicit mode
    one of the runs cannot support is an ``InputError`` naming the run."""
    if columns not in COLUMN_MODES:
        raise InputError(f"digest_diff columns={columns!r}: expected one of {COLUMN_MODES}")
    support = {"all": _has_drafts, "resume": lambda r: "digest_columns" in r.manifest,
               "running": lambda r: True}
    if columns != "auto":
        for run in (a, b):
            if not support[columns](run):
                raise InputError(f"capture run {run.path}: cannot compare columns={columns!r} "
                                 f"(its digests lack {'draft columns' if columns == 'all' else 'the resume column'})")
        return columns
    return next(mode for mode in ("all", "resume", "running")
                if support[mode](a) and support[mode](b))


def _running_kept(d: pd.DataFrame) -> pd.Series:
    """Resume-column digests paired by position: which rows to keep — every conv and resume row,
    and the recurrent state of the running column where it stands before the step's last
    accepted token (``conv_live_offset`` > 0: the state after the step's first token).

    Why the running column: a wrong accepted count corrupts the state the *next* step starts
    from, and that step's resume column then sits at a position of its own acceptance. When
    the corrupted run accepts otherwise than the reference from there on (its logits are wrong)
    no resume position may be shared again, and the corruption goes unseen — the swap partner
    of a planted ``permute_accepted`` (tests/test_conv_continuity.py). The running column's
    state, after the step's first token (the one sampled before), sits at a position the
    reference reached too. Where the offset is 0 the step kept no draft or the post-process
    reset the count: the resume row stands for the step, the running one is not added."""
    ssm_running = (d["kind"] != "conv") & ~d["resume"].fillna(False).astype(bool)
    return ~ssm_running | (d["conv_live_offset"].fillna(0) > 0)


CONFIG_KEYS = ("async_scheduling", "max_num_seqs", "max_num_batched_tokens", "vllm_version",
               "enable_chunked_prefill")


def configs_differ(a: CaptureRun, b: CaptureRun) -> bool:
    """Both manifests name their resolved engine configuration and some scheduling key differs
    (async scheduling, batch limits, release; the runner class): the runs computed their states
    by other float sums, so the noise rules of ``digest_diff`` apply."""
    ra, rb = a.manifest.get("resolved"), b.manifest.get("resolved")
    if not isinstance(ra, dict) or not isinstance(rb, dict):
        return False
    return (any(ra.get(k) != rb.get(k) for k in CONFIG_KEYS)
            or a.manifest.get("runner_class") != b.manifest.get("runner_class"))


def _digests(run: CaptureRun, mode: str, column_offset: int | None,
             by_position: bool = False, skip_last: bool = False) -> pd.DataFrame:
    d, st = run.digests(), run.steps()
    if d.empty:
        return d
    if "column_offset" not in d.columns:
        d = d.assign(column_offset=0)
    conv = d["kind"] == "conv"
    if column_offset is not None:
        d = d[d["column_offset"] == column_offset]
    elif mode == "resume":  # conv: the running column (its live rows); ssm: the resume column
        resume = d["resume"].fillna(False).astype(bool)
        # by position the ssm running column too (see _running_kept)
        d = d[(d["column_offset"] == 0 if by_position else conv & (d["column_offset"] == 0))
              | (~conv & resume)]
    elif mode == "all":
        d = d[~conv | (d["column_offset"] == 0)]
    else:
        d = d[d["column_offset"] == 0]
    if not by_position:
        off = st[["req_id", "engine_step", "conv_live_offset"]]
        return d.merge(off, on=["req_id", "engine_step"], how="left")
    st = token_positions(st)
    st = st.assign(steps_left=st.groupby("req_id")["req_step"].transform("max") - st["req_step"])
    if "conv_live_offset" not in st:  # a capture without drafts: every live window starts at 0
        st = st.assign(conv_live_offset=0)
    d = d.merge(st[["req_id", "engine_step", "conv_live_offset", "end_position", "steps_left"]],
                on=["req_id", "engine_step"], how="left")
    if skip_last:  # an all-zero conv window is a block not written yet (no token's rows are
        # 0); the step's other layers' windows (other block groups) hold old bytes then too
        conv = d["kind"] == "conv"
        zero = conv & d["row_checksums"].map(unwritten_window)
        unwritten = set(zip(d.loc[zero, "req_id"], d.loc[zero, "engine_step"]))
        d = d[~(conv & pd.Series([k in unwritten for k in zip(d["req_id"], d["engine_step"])],
                                 index=d.index))]
        # the conv window and running column of the last step: see _after_the_end
        resume = d["resume"].fillna(False).astype(bool) if "resume" in d else d["kind"] != "conv"
        d = d[~((d["steps_left"] == 0) & ((d["kind"] == "conv") | ~resume))]
    if mode == "resume":
        d = d[_running_kept(d)]
    d = d.assign(position=digest_positions(d))
    d = d[d["position"].notna()].astype({"position": "int64"})
    # one state per (prompt, layer, kind, position): the latest step's, if two steps reach one
    return d.sort_values("req_step", kind="stable").drop_duplicates(POSITION_KEYS, keep="last")


def unwritten_window(row_checksums) -> bool:
    """A conv window whose row checksums are all zero: a block not written yet (no token's conv
    rows are all 0). Shared with ``conv_continuity``, which skips such steps too."""
    return row_checksums is not None and len(row_checksums) > 0 and \
        not any(int(v) for v in row_checksums)


def _after_the_end(m: pd.DataFrame) -> pd.Series:
    """Position-paired rows of a state after a request's final token that neither run read on:
    one run's last step, the other's last or the step before it (async scheduling's extra
    step, whose output is dropped). No later step reads such a state, and the last step's
    post-process leaves it half written (Model Runner V2's resume column, the H200 pairs); where
    the other run went on from it (another answer) it was read, and is compared. The conv window
    and running column of a last step are never compared across configurations (``_digests``)."""
    a, b = m["steps_left_a"], m["steps_left_b"]
    return ((a == 0) & (b <= 1)) | ((b == 0) & (a <= 1))


def _live(values, offset, width: int) -> list | None:
    if values is None or offset is None or (isinstance(offset, float) and np.isnan(offset)):
        return None
    values = list(values)
    return values[int(offset):int(offset) + width]


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    scale = np.maximum(np.maximum(np.abs(a), np.abs(b)), 1e-30)
    rel = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b) / scale)
    return np.nan_to_num(rel, nan=np.inf)


# statistics that can cancel towards 0 (sum, and the projections, whose spread is the state's
# Frobenius norm): their difference is relative to the state's norm, not to their own size
SIGNED_STATS = ("sum", "proj")


def _rel_to_norm(m: pd.DataFrame, stats: list[str]) -> np.ndarray:
    """Per row, the largest difference of ``stats`` relative to each statistic's size, where a
    signed statistic (``SIGNED_STATS``) is also measured against the state's norm
    (sqrt(sumsq), when both runs recorded it): a sum that nearly cancels to 0 would otherwise
    turn a rounding difference into a large "relative" one (the H200 V1 pairs: a recurrent state
    of norm 0.66 with sum 0.028 read 0.0104 "relative" for a 4e-4-of-norm difference)."""
    va = m[[c + "_a" for c in stats]].to_numpy(float)
    vb = m[[c + "_b" for c in stats]].to_numpy(float)
    scale = np.maximum(np.maximum(np.abs(va), np.abs(vb)), 1e-30)
    if "sumsq" in stats:
        norm = np.sqrt(np.maximum(m["sumsq_a"].to_numpy(float), m["sumsq_b"].to_numpy(float)))
        norm = np.nan_to_num(norm, nan=0.0)[:, None]
        signed = [i for i, c in enumerate(stats) if c.startswith(SIGNED_STATS)]
        scale[:, signed] = np.maximum(scale[:, signed], norm)
    rel = np.where(np.isnan(va) & np.isnan(vb), 0.0, np.abs(va - vb) / scale)
    return np.nan_to_num(rel, nan=np.inf).max(axis=1)


def _exact_same(m: pd.DataFrame) -> pd.Series:
    """Checksums equal, and hashes equal where both rows recorded one."""
    same = m["checksum_a"] == m["checksum_b"]
    if "hash_a" in m and "hash_b" in m:
        both = m["hash_a"].notna() & m["hash_b"].notna()
        same &= ~both | (m["hash_a"] == m["hash_b"])
    return same


def _live_same(r: pd.Series, width: int, rtol: float, with_hash: bool,
               noisy: bool = False) -> bool:
    """The live rows agree: exactly (checksums, hashes) and by sum within ``rtol``; across
    configurations (``noisy``) by sum within ``rtol`` alone (bf16 rows of two batchings differ
    in last bits; a wrong shift or a changed row moves a row's sum by far more)."""
    oa, ob = r["conv_live_offset_a"], r["conv_live_offset_b"]
    ca, cb = _live(r["row_checksums_a"], oa, width), _live(r["row_checksums_b"], ob, width)
    sa, sb = _live(r["row_sums_a"], oa, width), _live(r["row_sums_b"], ob, width)
    if sa is None or sb is None or len(sa) != len(sb):
        return False
    if noisy:
        return bool((_rel(np.array(sa, float), np.array(sb, float)) <= rtol).all())
    if ca is None or ca != cb:
        return False
    if with_hash:
        ha, hb = _live(r["row_hashes_a"], oa, width), _live(r["row_hashes_b"], ob, width)
        if ha is not None and hb is not None and ha != hb:
            return False
    return bool((_rel(np.array(sa, float), np.array(sb, float)) <= rtol).all())


def compared_pairing(a: CaptureRun, b: CaptureRun, pairing: str = "auto") -> tuple[str, str | None]:
    """``("position" | "step", why)``: how two runs' rows are paired (see the module docstring);
    ``why`` names the run and columns behind a fallback from ``auto`` to step pairing. An
    explicit ``position`` one of the runs cannot support is an ``InputError``."""
    if pairing not in PAIRINGS:
        raise InputError(f"digest_diff pairing={pairing!r}: expected one of {PAIRINGS}")
    if pairing == "step":
        return "step", None
    why = position_support(a) or position_support(b)
    if why is None:
        return "position", None
    if pairing == "position":
        raise InputError(f"{why}: cannot pair its states by token position (pairing='step' "
                         "pairs by request step)")
    return "step", why


def _unpaired(da: pd.DataFrame, db: pd.DataFrame, m: pd.DataFrame) -> pd.DataFrame:
    """Per prompt of both runs: token positions with states in one run only (no row joined)."""
    both = set(da["prompt_sha"]) & set(db["prompt_sha"])
    joined = set(zip(m["prompt_sha"], m["position"]))
    rows = {}
    for side, d in (("a", da), ("b", db)):
        keys = set(zip(d["prompt_sha"], d["position"])) - joined
        for sha, _ in keys:
            if sha in both:
                rows.setdefault(sha, {"a": 0, "b": 0})[side] += 1
    out = pd.DataFrame([{"prompt_sha": k, "only_a": v["a"], "only_b": v["b"]}
                        for k, v in sorted(rows.items())],
                       columns=["prompt_sha", "only_a", "only_b"])
    return out


def digest_diff(a: CaptureRun, b: CaptureRun, rtol: float = 1e-5, conv: str = "live",
                column_offset: int | None = None, columns: str = "auto",
                pairing: str = "auto", schedule_rtol: float = SCHEDULE_RTOL,
                across_configs: bool | None = None) -> pd.DataFrame:
    """One row per joined (prompt, request step | token position, layer, kind[, column offset])
    with ``same``; ``attrs["columns"]`` says which columns were compared, ``attrs["pairing"]``
    how rows were paired (see the module docstring)."""
    if conv not in ("live", "window"):
        raise InputError(f"digest_diff conv={conv!r}: expected 'live' or 'window'")
    mode = "offset" if column_offset is not None else compared_columns(a, b, columns)
    paired, why = compared_pairing(a, b, pairing)
    by_position = paired == "position"
    noisy = by_position and (configs_differ(a, b) if across_configs is None else across_configs)
    da, db = (_digests(a, mode, column_offset, by_position, skip_last=noisy),
              _digests(b, mode, column_offset, by_position, skip_last=noisy))
    attrs = {"columns": mode, "pairing": paired, "pairing_fallback": why, "across_configs": noisy}
    if da.empty or db.empty:
        out = pd.DataFrame(columns=(POSITION_KEYS if by_position else KEYS) + ["same"])
        out.attrs.update(attrs)
        return out
    stats = [c for c in a.manifest.get("digest_stats", []) if c in da.columns and c in db.columns]
    if not comparable_stats(a, b):
        stats = []
    if by_position:  # the position is the key: a column offset or step may differ between runs
        m = da.merge(db, on=POSITION_KEYS, suffixes=("_a", "_b"))
        attrs["unpaired"] = _unpaired(da, db, m)
        m["req_step"] = m["req_step_b"]  # the second run's step (diverge: the run's)
    else:
        keys = KEYS + (["column_offset"] if mode == "all" else [])
        m = da.merge(db, on=keys, suffixes=("_a", "_b"))
    m["stat_rel_diff"] = _rel_to_norm(m, stats) if stats else 0.0
    if noisy and stats:
        # two configurations' schedules (other chunk boundaries, other batch partners) compute a state by other
        # float sums: the exact words differ by rounding and the statistics by up to ~6e-4
        # relative (the H200 capture pairs), while a wrong state moves them by ~1 (the
        # projections move under a permutation too): recurrent states agree within schedule_rtol
        m["same"] = m["stat_rel_diff"] <= max(rtol, schedule_rtol)
    else:
        m["same"] = _exact_same(m) & (m["stat_rel_diff"] <= rtol)
    if conv == "live":
        width = int(a.manifest.get("conv_window", 0))
        is_conv = m["kind"] == "conv"
        with_hash = "row_hashes_a" in m and "row_hashes_b" in m
        live = [_live_same(r, width, max(rtol, schedule_rtol) if noisy else rtol, with_hash, noisy)
                for _, r in m[is_conv].iterrows()]
        if live:  # a table without conv rows (e.g. a recurrent-only spec) has nothing to set
            m.loc[is_conv, "same"] = live
    if noisy:
        m = m[~_after_the_end(m)]
        m = mark_transient(m)
        attrs["transient_positions"] = m.attrs["transient_positions"]
    m.attrs.update(attrs)
    return m


def layer_order(name: str) -> tuple:
    """Sort key: ``model.layers.10.linear_attn`` after ``model.layers.2.linear_attn``."""
    return tuple(int(p) if p.isdigit() else -1 for p in str(name).split(".")), str(name)


def sorted_layers(names) -> list[str]:
    return sorted({str(n) for n in names}, key=layer_order)


def first_divergence(a: CaptureRun, b: CaptureRun, rtol: float = 1e-5,
                     conv: str = "live", columns: str = "auto", pairing: str = "step") -> pd.DataFrame:
    """Per request (prompt): first differing request step (``b``'s, with ``pairing`` "position":
    the step of ``b`` at the first differing token position, in ``first_position``), the layers
    there (model order), the origin layer and its kinds, the kinds of any layer (``kinds``),
    steps compared. ``pairing`` defaults to step here, unlike ``digest_diff``: its callers (the
    lessons, the capture notebook) compare a clean run with a planted fault of one
    configuration, and read the step the fault fired at."""
    m = digest_diff(a, b, rtol, conv, columns=columns, pairing=pairing)
    by_position = m.attrs.get("pairing") == "position"
    rows = []
    for sha, g in m.groupby("prompt_sha"):
        bad = g[~g["same"].astype(bool)]
        pos = int(bad["position"].min()) if by_position and len(bad) else None
        first = (int(bad[bad["position"] == pos]["req_step"].min()) if pos is not None
                 else int(bad["req_step"].min()) if len(bad) else None)
        at = bad[bad["req_step"] == first] if first is not None else bad
        layers = sorted_layers(at["layer"])
        origin = layers[0] if layers else None
        rows.append({"prompt_sha": sha, "req_id_a": g["req_id_a"].iloc[0],
                     "req_id_b": g["req_id_b"].iloc[0],
                     "steps_compared": int(g["req_step"].nunique()), "first_step": first,
                     "kinds": sorted(at["kind"].unique()), "layers": layers,
                     "origin_layer": origin,
                     "origin_kinds": sorted(at[at["layer"] == origin]["kind"].unique()),
                     **({"first_position": pos} if by_position else {})})
    out = pd.DataFrame(rows)
    out.attrs.update({k: m.attrs.get(k) for k in ("columns", "pairing", "pairing_fallback")})
    return out


def shifts_by_request(run: CaptureRun) -> pd.DataFrame:
    """Engine steps and request-local steps of in-place conv shifts, one row per request."""
    cp, st = run.copies(), run.steps()
    if cp.empty:
        return pd.DataFrame(columns=["req_id", "engine_steps", "req_steps"])
    hits = cp[(cp["kind"] == "left_shift_same_block") & (cp["nbytes"] > 0)]
    out = []
    for rid, g in hits.groupby("req_id"):
        steps = sorted(int(s) for s in g["engine_step"].unique())
        mine = (st[st["req_id"] == rid].set_index("engine_step")["req_step"]
                if not st.empty else pd.Series(dtype=int))
        out.append({"req_id": rid, "engine_steps": steps,
                    "req_steps": [int(mine[s]) for s in steps if s in mine.index]})
    return pd.DataFrame(out)
