"""Score each mechanism of the bug family (CONTEXT §2) against first-divergence evidence.

What it does: one small pure function per hypothesis takes one first-divergence record (a request
of ``diverge.DivergenceReport.requests``: ``first_step``, ``kinds``, ``layers``, ``conv_rows``,
``ssm_lag``, ``events``) and a ``RunContext`` (async scheduling, speculation, prefix-cache hits,
block sizes, GDN layer count, a planted fault if any) and returns a ``MechanismVerdict``: ``supports``,
``contradicts`` or ``not exercised``, with a one-line reason. ``hypothesis_table(report, context)``
scores every diverged request under every hypothesis and ranks the mechanisms: those some request
supports first (by supporting minus contradicting requests), then the contradicted, then those
the run did not exercise — a mechanism no request supports is never the finding, and when none
is supported ``HypothesisTable.finding_line()`` says "no mechanism fits the evidence". Labels:
``observed`` (supported), ``contradicted``, ``not exercised``; a mechanism whose fault was
planted on purpose is labelled EMULATED/PLANTED so nobody mistakes it for a finding about a real
build: the CPU ``barrierless_tiles`` copy emulates H-copy, the ``permute_accepted``
fault (``statescope.patches.faults``) H-accept, and ``drop_postprocess_copy`` H-lostcopy — a lost
post-process copy, listed after the §2 rows because §2 has no row for it.

``hypothesis_table(..., continuity=conv_shift_check(run))`` adds the exact conv-window continuity
check (``statescope.diverge.conv_continuity``) to each record as ``conv_continuity`` (its transitions at the
first divergent step and the one before): a wrong conv shift there is direct evidence that a wrong
accepted count reached the state update (H-accept), and a window that is an exact shift of the
previous one says the decode conv update ran, not a prefill kernel (against H-reorder).

What it deliberately does not do: read captures (``statescope.diverge.report`` does) or claim a verdict
from one run: a mechanism that is not exercised by the run's configuration is neither supported
nor refuted.
"""
from __future__ import annotations

import html
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import pandas as pd

SUPPORTS, CONTRADICTS, NOT_EXERCISED = "supports", "contradicts", "not exercised"
# planted CPU fault / copy semantics -> the mechanism it emulates
PLANTED = {"barrierless_tiles": "H-copy", "permute_accepted": "H-accept",
           "drop_postprocess_copy": "H-lostcopy"}


@dataclass(frozen=True)
class MechanismVerdict:
    verdict: str
    why: str


@dataclass(frozen=True)
class RunContext:
    async_scheduling: bool = False
    spec: bool = False
    prefix_cache_hits: int = 0  # requests of the run that started from a cached prefix
    block_size: int | None = None
    mamba_block_size: int | None = None
    gdn_layers: int = 0
    same_block_shifts: int = 0  # in-place conv shifts with bytes to move, whole run
    postprocess_copies: int = 0  # post-process copies with bytes to move, whole run
    planted: str | None = None  # fault planted on purpose (a key of PLANTED)


def run_context(run: Any, planted: str | None = None, gdn_layers: int = 0) -> RunContext:
    """The context of a ``CaptureRun`` from its manifest, step records and census."""
    res = run.manifest.get("resolved", {})
    st, cp = run.steps(), run.copies()
    hits = 0 if st.empty else int(st.groupby("req_id")["prefix_hit_tokens"].max().fillna(0).gt(0).sum())
    shifts = 0 if cp.empty else int(((cp["kind"] == "left_shift_same_block") & (cp["nbytes"] > 0)).sum())
    post = 0 if cp.empty or "launch_kind" not in cp else int(
        ((cp["launch_kind"] == "postprocess") & (cp["nbytes"] > 0)).sum())
    layers = gdn_layers or (0 if run.digests().empty else int(run.digests()["layer"].nunique()))
    return RunContext(async_scheduling=bool(res.get("async_scheduling")),
                      spec=int(res.get("num_speculative_tokens") or 0) > 0, prefix_cache_hits=hits,
                      block_size=res.get("block_size"), mamba_block_size=res.get("mamba_block_size"),
                      gdn_layers=layers, same_block_shifts=shifts, postprocess_copies=post,
                      planted=None if planted in (None, "memmove") else planted)


def _ev(rec: Mapping[str, Any]) -> Mapping[str, Any]:
    return rec.get("events") or {}


def _last(values: Any, default: Any = None) -> Any:
    return values[-1] if values else default


def score_copy(rec: Mapping[str, Any], ctx: RunContext) -> MechanismVerdict:
    """H-copy: conv window first, leading rows, right after a same-block left shift."""
    ev, step = _ev(rec), rec["first_step"]
    if not ev.get("same_block_left_shift") and ctx.same_block_shifts == 0:
        return MechanismVerdict(NOT_EXERCISED, "no same-block left-shift copy in the run")
    if not ev.get("same_block_left_shift"):
        return MechanismVerdict(CONTRADICTS, f"no same-block left shift at or just before step {step}")
    if list(rec["kinds"]) != ["conv"]:
        return MechanismVerdict(CONTRADICTS, f"{'+'.join(rec['kinds'])} diverge together at step {step}, "
                                    "not the conv window alone")
    if 0 not in rec.get("conv_rows", []):
        return MechanismVerdict(CONTRADICTS, f"leading conv row intact; rows {rec.get('conv_rows')} differ")
    lag = rec.get("ssm_lag")
    tail = "; recurrent state one step later" if lag == 1 else ""
    return MechanismVerdict(SUPPORTS, f"conv leading row diverges at step {step}, right after a same-block "
                             f"left shift{tail}")


def _breaks(rec: Mapping[str, Any]) -> list[dict]:
    return list((rec.get("conv_continuity") or {}).get("breaks") or [])


def score_accept(rec: Mapping[str, Any], ctx: RunContext) -> MechanismVerdict:
    """H-accept: a wrong accepted count reached the state update. Direct evidence, when the record
    carries the conv continuity check: the conv update at or just before the first divergent step
    applied a shift other than the accepted count sampled the step before. Otherwise the signature:
    the recurrent state of every GDN layer at once (a wrong conv read offset feeds every later
    layer). Needs async + spec, or the planted ``permute_accepted`` fault that emulates the race on
    a synchronous build. ``num_accepted_used`` (the count the post-process launch read) equal to
    the one sampled is only a note: the next forward's conv/recurrent update reads its own copy of
    the count, which that column does not show. The conv window's live rows may stay intact:
    measured on the tiny model, when a step accepts as many tokens as the live window holds, those
    rows are all fresh inputs."""
    planted = ctx.planted == "permute_accepted"
    if not ((ctx.async_scheduling or planted) and ctx.spec):
        return MechanismVerdict(NOT_EXERCISED, "needs async scheduling and speculative decoding "
                                      f"(async={ctx.async_scheduling}, spec={ctx.spec})")
    breaks = _breaks(rec)
    if breaks:
        b = breaks[0]
        # a wrong count is per request: every GDN layer's window moves by the same other shift.
        # Carried rows that match no shift, or a break in some layers only, are a value change.
        partial = bool(ctx.gdn_layers) and b["layers"] < ctx.gdn_layers
        if partial or (not b["observed_shifts"] and not b.get("inplace_shift_bias")):
            what = ("match no shift of the previous window" if not b["observed_shifts"] else
                    f"fit shift {b['observed_shifts']}")
            return MechanismVerdict(CONTRADICTS, f"conv rows at step {b['req_step']} {what} in "
                                    f"{b['layers']} of {ctx.gdn_layers or '?'} GDN layers: a value "
                                    "change, not a wrong accepted count (that moves every GDN "
                                    "layer's window by the same other shift)")
        if b.get("inplace_shift_bias"):
            return MechanismVerdict(SUPPORTS, f"rows of the in-place conv shift by {b['inplace_shift_bias']} "
                                     f"at step {b['req_step']} do not follow the accepted count "
                                     f"sampled the step before ({b['expected_shift']} after bias)")
        return MechanismVerdict(SUPPORTS, f"conv update at step {b['req_step']} shifted the window by "
                                 f"{b['observed_shifts']} where the accepted count sampled the step "
                                 f"before gives {b['expected_shift']} (exact row checksums, "
                                 f"{b['layers']} GDN layers): a wrong accepted count was read")
    every = ctx.gdn_layers and len(rec["layers"]) >= ctx.gdn_layers
    if not ("ssm" in rec["kinds"] and every):
        return MechanismVerdict(CONTRADICTS, f"only {'+'.join(rec['kinds'])} in {len(rec['layers'])} of "
                                    f"{ctx.gdn_layers} GDN layers diverge first")
    mismatch = _ev(rec).get("accepted_mismatch")
    how = ("the count used differs from the one sampled" if mismatch else
           "signature only; the post-process launch's count equals the one sampled (not decisive: "
           "the next forward's update reads its own copy)" if mismatch is False else
           "signature only: the count used is not recorded (no num_accepted_used column)")
    checked = (rec.get("conv_continuity") or {}).get("steps")
    if checked and not mismatch:
        how += f"; conv shifts intact at steps {checked}"
    return MechanismVerdict(SUPPORTS, f"{'+'.join(rec['kinds'])} of all {ctx.gdn_layers} GDN layers "
                             f"diverge at once at step {rec['first_step']}; {how}")


def score_lostcopy(rec: Mapping[str, Any], ctx: RunContext) -> MechanismVerdict:
    """H-lostcopy (not a §2 row; the planted dropped copy): a post-process copy that did not land.
    The destination block keeps stale bytes, so conv window *and* recurrent state diverge in the
    step of the copy itself, all live conv rows, with the accepted count intact."""
    ev = _ev(rec)
    if ctx.postprocess_copies == 0 and not ev.get("postprocess_copy_steps"):
        return MechanismVerdict(NOT_EXERCISED, "no post-process copy in the run")
    if rec["first_step"] not in (ev.get("postprocess_copy_steps") or []):
        return MechanismVerdict(CONTRADICTS, f"no post-process copy in step {rec['first_step']}")
    if ev.get("accepted_mismatch"):
        return MechanismVerdict(CONTRADICTS, "the accepted count used was wrong (a wrong copy decision, "
                                    "H-accept), not a lost copy")
    if set(rec["kinds"]) >= {"conv", "ssm"}:
        return MechanismVerdict(SUPPORTS, f"conv and recurrent state diverge together in step "
                                 f"{rec['first_step']}, the step of a post-process copy")
    return MechanismVerdict(CONTRADICTS, f"only {'+'.join(rec['kinds'])} diverges in the copy's step")


def _after_hit(rec: Mapping[str, Any], ctx: RunContext, name: str) -> MechanismVerdict:
    if ctx.prefix_cache_hits == 0:
        return MechanismVerdict(NOT_EXERCISED, "no request started from a cached prefix")
    if not _ev(rec).get("prefix_hit_tokens"):
        return MechanismVerdict(CONTRADICTS, "this request had no prefix-cache hit")
    if rec["first_step"] <= 1:
        return MechanismVerdict(SUPPORTS, f"diverges from the first decode step after a "
                                 f"{_ev(rec)['prefix_hit_tokens']}-token prefix hit ({name})")
    return MechanismVerdict(CONTRADICTS, f"prefix hit, but the first divergence waits until step "
                                f"{rec['first_step']}")


def score_drop(rec: Mapping[str, Any], ctx: RunContext) -> MechanismVerdict:
    """H-drop: from the first decode step after a prefix hit; only with a drafter."""
    if not ctx.spec:
        return MechanismVerdict(NOT_EXERCISED, "drop_eagle_block only matters with speculative decoding")
    return _after_hit(rec, ctx, "ignored drop_eagle_block")


def score_midblock(rec: Mapping[str, Any], ctx: RunContext) -> MechanismVerdict:
    """H-midblock: a mid-block state served for a boundary hash: from the first step after a hit."""
    return _after_hit(rec, ctx, "mid-block state cached under a boundary hash")


def score_split(rec: Mapping[str, Any], ctx: RunContext) -> MechanismVerdict:
    """H-split: only when the attention and Mamba block sizes differ; at a block crossing."""
    if not ctx.block_size or not ctx.mamba_block_size or ctx.block_size == ctx.mamba_block_size:
        return MechanismVerdict(NOT_EXERCISED, f"block sizes equal ({ctx.block_size} / {ctx.mamba_block_size})")
    if _ev(rec).get("block_crossing"):
        return MechanismVerdict(SUPPORTS, f"diverges at a block crossing (step {rec['first_step']}) with "
                                 f"block sizes {ctx.block_size} != {ctx.mamba_block_size}")
    return MechanismVerdict(CONTRADICTS, "no block crossing at or just before the divergence")


def score_empty(rec: Mapping[str, Any], ctx: RunContext) -> MechanismVerdict:
    """H-empty: a decode step with an empty draft schedule."""
    if not ctx.spec:
        return MechanismVerdict(NOT_EXERCISED, "no speculative decoding")
    drafts = _last(_ev(rec).get("num_drafts"))
    if drafts is None:
        return MechanismVerdict(NOT_EXERCISED, "draft count of the step not recorded")
    if rec["first_step"] > 0 and drafts == 0:
        return MechanismVerdict(SUPPORTS, f"decode step {rec['first_step']} scheduled no drafts")
    return MechanismVerdict(CONTRADICTS, f"step {rec['first_step']} scheduled {drafts} drafts"
                   if drafts else "divergence in the prefill step, not a decode with no drafts")


def score_reorder(rec: Mapping[str, Any], ctx: RunContext) -> MechanismVerdict:
    """H-reorder: a decode row in a batch with prefills, whole state of the step wrong: the
    recurrent state of every GDN layer at once (a wrong kernel computes all of them)."""
    if not ctx.spec:
        return MechanismVerdict(NOT_EXERCISED, "the drafter's reorder threshold needs speculative decoding")
    ev = _ev(rec)
    prefill_steps = ev.get("prefill_steps")
    in_step = (rec["first_step"] in prefill_steps) if prefill_steps is not None \
        else ev.get("batch_has_prefill")
    if not in_step:
        return MechanismVerdict(CONTRADICTS, f"no prefill in the batch of step {rec['first_step']}")
    shifted = [b for b in _breaks(rec) if b["req_step"] == rec["first_step"]
               and b["observed_shifts"] and not b.get("inplace_shift_bias")]
    if shifted:  # a prefill kernel writes the step's last kernel-1 inputs (all new with MTP >= K-2)
        return MechanismVerdict(CONTRADICTS, f"conv window at step {rec['first_step']} is the previous "
                                    f"window shifted by {shifted[0]['observed_shifts']}: the decode "
                                    "conv update ran (a prefill kernel would hold new inputs in "
                                    "rows 0..K-2)")
    if ctx.gdn_layers and len(rec["layers"]) < ctx.gdn_layers:
        return MechanismVerdict(CONTRADICTS, f"{len(rec['layers'])} of {ctx.gdn_layers} GDN layers "
                                f"diverge at step {rec['first_step']}: a decode row run through "
                                "prefill kernels gets every GDN layer's update from them")
    if rec["first_step"] > 0 and "ssm" in rec["kinds"]:
        return MechanismVerdict(SUPPORTS, f"decode step {rec['first_step']} shared the batch with a prefill "
                                 "and its recurrent state diverges at once")
    return MechanismVerdict(CONTRADICTS, "recurrent state intact at the first divergence "
                                "(a wrong kernel would change it at once)")


SCORERS: dict[str, Callable[[Mapping[str, Any], RunContext], MechanismVerdict]] = {
    "H-copy": score_copy, "H-accept": score_accept, "H-drop": score_drop,
    "H-midblock": score_midblock, "H-split": score_split, "H-empty": score_empty,
    "H-reorder": score_reorder, "H-lostcopy": score_lostcopy}


@dataclass
class HypothesisTable:
    """Mechanisms ranked by how the diverged requests score them."""

    rows: list[dict] = field(default_factory=list)
    context: RunContext | None = None
    diverged: int = 0  # diverged requests scored

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)

    def to_frame(self) -> pd.DataFrame:
        """``frame()``: one row per hypothesis (the name every result uses)."""
        return self.frame()

    def ranking(self) -> list[str]:
        return [r["hypothesis"] for r in self.rows]

    def finding(self) -> list[str]:
        """The mechanisms that fit best: supported by some request, the top score (several on
        a tie); empty when no mechanism is supported."""
        best = [r for r in self.rows if r["supports"]]
        top = max((r["score"] for r in best), default=None)
        return [r["hypothesis"] for r in best if r["score"] == top]

    def finding_line(self) -> str:
        if not self.diverged:
            return "no request diverged: nothing to explain"
        names = self.finding()
        if not names:
            return (f"no mechanism fits the evidence: {self.diverged} diverged request(s), every "
                    "mechanism contradicted or not exercised")
        rows = {r["hypothesis"]: r for r in self.rows}
        parts = [f"{n} ({rows[n]['supports']} of {self.diverged} diverged request(s) support, "
                 f"{rows[n]['contradicts']} contradict{'; ' + rows[n]['label'] if rows[n]['label'].startswith('EMULATED') else ''})"
                 for n in names]
        return ("fits: " if len(names) == 1 else "tie, equally supported: ") + "; ".join(parts)

    def to_dict(self) -> dict:
        return {"context": asdict(self.context) if self.context else None, "rows": self.rows,
                "finding": self.finding(), "finding_line": self.finding_line()}

    def _repr_html_(self) -> str:
        ctx = self.context
        head = ("<p><b>Hypotheses</b>, ranked by supporting minus contradicting requests"
                + (f" (context: async={ctx.async_scheduling}, spec={ctx.spec}, prefix hits="
                   f"{ctx.prefix_cache_hits}, planted={ctx.planted})" if ctx else "") + ". "
                f"<b>Finding</b>: {html.escape(self.finding_line())}.</p>")
        cols = ["rank", "hypothesis", "label", "supports", "contradicts", "not_exercised", "why"]
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in cols) + "</tr>"
                       for r in self.rows)
        return (head + "<table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>" + body
                + "</table>")


CONTINUITY_WINDOW = 1  # steps before the first divergent one whose conv shift counts as evidence


def with_continuity(rec: Mapping[str, Any], continuity: pd.DataFrame) -> dict:
    """``rec`` plus ``conv_continuity``: the request's checked transitions at and up to
    ``CONTINUITY_WINDOW`` steps before its first divergent step, and the broken ones among them
    (``statescope.diverge.conv_continuity.conv_shift_check`` rows, one entry per transition)."""
    step = rec["first_step"]
    mine = continuity[(continuity["req_id"] == rec.get("req_id"))
                      & continuity["req_step"].between(step - CONTINUITY_WINDOW, step)]
    breaks = []
    for (req_step,), g in mine[~mine["ok"]].groupby(["req_step"]):
        first = g.iloc[0]
        breaks.append({"req_step": int(req_step), "expected_shift": int(first["expected_shift"]),
                       "observed_shifts": [int(x) for x in first["observed_shifts"]],
                       "layers": int(len(g)), "moved": bool(first.get("moved", False)),
                       "inplace_shift_bias": int(first.get("inplace_shift_bias", 0) or 0),
                       "prefill_rows_in_batch": int(first.get("prefill_rows_in_batch", 0))})
    return {**rec, "conv_continuity": {"steps": sorted({int(x) for x in mine["req_step"]}),
                                       "breaks": breaks}}


def hypothesis_table(report: Any, context: RunContext,
                     continuity: pd.DataFrame | None = None) -> HypothesisTable:
    """Score every diverged request of ``report`` (a DivergenceReport or a list of records);
    ``continuity``: the run's ``conv_continuity.conv_shift_check`` frame, when there is one."""
    records = report.diverged if hasattr(report, "diverged") else [
        r for r in report if r.get("first_step") is not None]
    if continuity is not None and not continuity.empty:
        records = [with_continuity(r, continuity) for r in records]
    emulated = PLANTED.get(context.planted or "")
    rows = []
    for name, scorer in SCORERS.items():
        verdicts = [scorer(r, context) for r in records]
        n = Counter(v.verdict for v in verdicts)
        lead = (SUPPORTS if n[SUPPORTS] else CONTRADICTS if n[CONTRADICTS] else NOT_EXERCISED)
        whys = Counter(v.why for v in verdicts if v.verdict == lead)
        why = whys.most_common(1)[0][0] if whys else "no request diverged from the reference"
        label = ("observed" if n[SUPPORTS] else "contradicted" if n[CONTRADICTS]
                 else "not exercised")
        rows.append({"hypothesis": name, "supports": n[SUPPORTS], "contradicts": n[CONTRADICTS],
                     "not_exercised": n[NOT_EXERCISED], "score": n[SUPPORTS] - n[CONTRADICTS],
                     "label": f"EMULATED (PLANTED {context.planted})" if name == emulated
                     else label,
                     "why": why})
    # supported first, then contradicted, then not exercised; stable: ties keep §2 order
    rows.sort(key=lambda r: (0 if r["supports"] else 1 if r["contradicts"] else 2,
                             -r["score"], -r["supports"]))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    return HypothesisTable(rows, context, diverged=len(records))
