"""Where a captured run's state first departs from a captured reference run of the same prompts.

What it does: ``divergence_report(run_dir, reference_dir)`` lines the two runs up with
``digest_diff.digest_diff`` — by default on the column each step's successor resumes from, or on
every column when both runs digested the draft columns; the report's ``columns`` says which —
pairing each request's states (requests matched by prompt) by the token position they stand for
(``pairing="auto"``, the default, or ``"position"``; ``statescope.diverge.positions``), so a run
that scheduled differently from its reference (async on vs off, another
``max_num_batched_tokens``, other batch partners, other acceptance) is compared token for token,
or by request step (``pairing="step"``: only runs that scheduled alike line up). A swapped
accepted count is seen by position too: the next step's running-column state is compared
(``digest_diff``), where the corrupted run's resume positions may no longer meet the
reference's (tests/test_conv_continuity.py). The report's ``pairing`` says ``token position`` or
``engine step (fallback: <why>)``: a capture whose steps table lacks the columns positions need
is paired by request step, with a warning. Positions present in one run only are no divergence:
``unpaired_positions`` counts them (report and request). Per request it reports the first paired
position whose digests differ (``position``), the run's step that reached it (``first_step``: the
run's own step counter, which the events and hypotheses read) and the reference's
(``reference_step``), and every difference of that run step, layer by layer (``per_layer``, in
model order, each with its first ``position``): which state kinds, which live conv rows (row 0 = the window's
leading, oldest row; the last = the newest), which block columns of the recurrent state, the size
of the difference (largest relative difference of a statistic, or of a live row's sum for the conv
window) and whether NaN/Inf appeared. The first layer that differs is the ``origin_layer`` (within
a step, information flows only to later layers); the record's ``kinds``, ``conv_rows`` and
``magnitude`` are the origin layer's, ``layers`` lists every layer that differs at that step.
Next to it go the events of that step and the one before, read from the run's own step records
and copy census (``step_events``): prefix-cache hit, block-boundary crossing, drafts scheduled,
accepted count (and, where the capture records ``num_accepted_sampled`` / ``num_accepted_used``,
whether the count the state update used differs from the one sampled), a same-block left-shift
copy, post-process copies, and which engine steps also ran a prefill.

An incomplete run (``CaptureRun.ending()``: the engine raised, fewer requests finished than
planned, hook errors, never closed) is refused with an ``InputError`` naming it, unless
``allow_incomplete``: then the report carries a loud warning. Paired by step, requests whose two
runs captured different numbers of steps are named in the warnings too (by position they are
expected and only counted: ``steps_run`` / ``steps_reference``). Paired by position, steps
that scheduled drafts without an accepted count are warned about (their states have no
position); a recorded computed-token count that differs from the carried one (async
scheduling's optimistic count) is a ``notes`` line.

``statescope.diverge.by_position`` builds the same report by token position in tolerance units.
``DivergenceReport`` has ``to_dict()``, ``text()`` (the terminal form), ``_repr_html_`` and
``heatmap()`` (plotly, layer × step or token position, log10 of the difference).

What it deliberately does not do: judge which mechanism fits (``statescope.diverge.hypotheses``), record
runs (``statescope.capture.session``), compare runs of different workloads, or compare states at
positions only one run reached.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from statescope.diverge.digest_diff import COLUMN_NOTES, digest_diff, sorted_layers
from statescope.diverge.text import short_layer
from statescope.capture.store import CaptureRun
from statescope.errors import InputError

EVENT_WINDOW = 1  # events are read at the first divergent step and this many steps before it


def open_capture(path: str | os.PathLike | CaptureRun, what: str) -> CaptureRun:
    if isinstance(path, CaptureRun):
        return path
    if not os.path.isdir(path):
        raise InputError(f"diverge {what} {path}: not a directory (expected a capture run)")
    return CaptureRun(path)


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    scale = np.maximum(np.maximum(np.abs(a), np.abs(b)), 1e-30)
    rel = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b) / scale)
    return np.nan_to_num(rel, nan=np.inf)


def _window(values: Any, offset: Any, width: int) -> list:
    if values is None or (isinstance(values, float) and math.isnan(values)):
        return []
    return list(values)[int(offset):int(offset) + width]


def _live_rows(row: pd.Series, width: int) -> tuple[list[int], float]:
    """Indices (within the live window) of conv rows that differ — by checksum, by hash (where
    both runs recorded one: it sees values permuted within a row) or by sum — and the largest
    row-sum gap."""
    oa, ob = row.get("conv_live_offset_a"), row.get("conv_live_offset_b")
    if oa is None or ob is None or pd.isna(oa) or pd.isna(ob) or row["row_checksums_a"] is None:
        return [], float(row["stat_rel_diff"])
    ca, cb = _window(row["row_checksums_a"], oa, width), _window(row["row_checksums_b"], ob, width)
    ha, hb = _window(row.get("row_hashes_a"), oa, width), _window(row.get("row_hashes_b"), ob, width)
    sa = np.array(_window(row["row_sums_a"], oa, width), float)
    sb = np.array(_window(row["row_sums_b"], ob, width), float)
    n = min(len(ca), len(cb), len(sa), len(sb))
    rel = _rel(sa[:n], sb[:n]) if n else np.zeros(0)
    hashed = len(ha) >= n and len(hb) >= n
    rows = [i for i in range(n) if ca[i] != cb[i] or rel[i] > 0 or (hashed and ha[i] != hb[i])]
    return rows, float(rel.max()) if n else 0.0


def _magnitudes(m: pd.DataFrame, width: int) -> pd.DataFrame:
    """Add ``magnitude`` (live rows for conv) and ``conv_rows`` columns to a digest_diff frame."""
    mags, rows = [], []
    for _, r in m.iterrows():
        if r["kind"] == "conv":
            idx, mag = _live_rows(r, width)
            rows.append(idx)
            mags.append(mag if not r["same"] else 0.0)
        else:
            rows.append([])
            mags.append(float(r["stat_rel_diff"]) if not r["same"] else 0.0)
    m = m.copy()
    m["magnitude"], m["conv_rows"] = mags, rows
    return m


def step_events(run: CaptureRun, req_id: str, steps: list[int]) -> dict[str, Any]:
    """What the run's step records and copy census say about ``req_id`` at ``steps``."""
    st, cp = run.steps(), run.copies()
    mine = st[st["req_id"] == req_id].sort_values("req_step")
    at = mine[mine["req_step"].isin(steps)]
    ev: dict[str, Any] = {"steps": [int(s) for s in steps], "prefix_hit_tokens": 0,
                          "block_crossing": False, "num_drafts": [], "accepted": [],
                          "same_block_left_shift": False, "shift_steps": [], "copy_kinds": {},
                          "postprocess_copy_steps": [], "batch_has_prefill": False, "prefill_steps": [],
                          "accepted_mismatch": None, "accepted_used": None,
                          "accepted_recorded": "sampled only (no num_accepted_used column)"}
    if mine.empty:
        return ev
    hits = mine["prefix_hit_tokens"].fillna(0)
    ev["prefix_hit_tokens"] = int(hits.max())
    by_step = mine.set_index("req_step")
    bs = int(run.manifest.get("block_size") or 0) or 1
    nct = by_step["num_computed_tokens"]
    for s in steps:  # computed tokens before vs after the step lie in different blocks
        if s not in by_step.index:
            continue
        after = nct[s + 1] if s + 1 in nct.index else nct[s] + int(by_step.loc[s, "accepted"])
        if nct[s] // bs != after // bs:
            ev["block_crossing"] = True
    ev["num_drafts"] = [int(x) for x in at["num_drafts"]]
    acc = next((c for c in ("accepted", "num_accepted_sampled") if c in at), None)
    ev["accepted"] = [int(x) if pd.notna(x) else None for x in at[acc]] if acc else []
    if {"num_accepted_sampled", "num_accepted_used"} <= set(at.columns):
        pairs = at[["num_accepted_sampled", "num_accepted_used"]].dropna()
        if len(pairs):  # the count the state update used vs the one sampled (H-accept)
            ev["accepted_used"] = [int(x) for x in pairs["num_accepted_used"]]
            ev["accepted_mismatch"] = bool((pairs.iloc[:, 0] != pairs.iloc[:, 1]).any())
            ev["accepted_recorded"] = "sampled and used"
    engine_steps = {int(e): int(s) for e, s in zip(at["engine_step"], at["req_step"])}
    if not cp.empty:
        mc = cp[(cp["req_id"] == req_id) & cp["engine_step"].isin(list(engine_steps))]
        ev["copy_kinds"] = {str(k): int(v) for k, v in mc["kind"].value_counts().items()}
        sh = mc[(mc["kind"] == "left_shift_same_block") & (mc["nbytes"] > 0)]
        ev["same_block_left_shift"] = bool(len(sh))
        ev["shift_steps"] = sorted({engine_steps[int(e)] for e in sh["engine_step"]})
        pp = mc[(mc["launch_kind"] == "postprocess") & (mc["nbytes"] > 0)] \
            if "launch_kind" in mc else mc.iloc[:0]
        ev["postprocess_copy_steps"] = sorted({engine_steps[int(e)] for e in pp["engine_step"]})
    batch = st[st["engine_step"].isin(list(engine_steps))]
    prefill = batch["num_scheduled_tokens"] > batch["num_drafts"] + 1
    ev["batch_has_prefill"] = bool(prefill.any())
    ev["prefill_steps"] = sorted({engine_steps[int(e)] for e in batch[prefill]["engine_step"]})
    return ev


@dataclass(repr=False)  # the generated repr dumped every request and the cells frame (~5 KB)
class DivergenceReport:
    """Per-request first divergence of ``run`` against ``reference`` (see module docstring)."""

    run: str
    reference: str
    requests: list[dict] = field(default_factory=list)
    cells: pd.DataFrame = field(default_factory=pd.DataFrame)  # prompt, req_step, layer, kind, magnitude
    gdn_layers: int = 0
    conv_window: int = 0
    unit: str = "relative difference"  # of ``magnitude``; "tolerance units" for position reports
    tolerance: dict | None = None  # the noise calibration used, when there is one
    columns: str | None = None  # which block columns were compared (digest_diff.COLUMN_NOTES)
    warnings: list[str] = field(default_factory=list)  # incomplete runs, step counts that differ
    endings: dict = field(default_factory=dict)  # "run" / "reference" -> CaptureRun.ending()
    pairing: str | None = None  # "token position" | "engine step (fallback: ...)" | "engine step"
    unpaired_positions: dict | None = None  # by position: states in one run only (not compared)
    notes: list[str] = field(default_factory=list)  # facts worth a line that are no warning

    @property
    def diverged(self) -> list[dict]:
        return [r for r in self.requests if r["first_step"] is not None]

    def to_dict(self) -> dict:
        return {"run": self.run, "reference": self.reference, "gdn_layers": self.gdn_layers,
                "conv_window": self.conv_window, "unit": self.unit, "tolerance": self.tolerance,
                "columns": self.columns, "columns_note": COLUMN_NOTES.get(self.columns or ""),
                "pairing": self.pairing, "unpaired_positions": self.unpaired_positions,
                "warnings": self.warnings, "notes": self.notes, "endings": self.endings,
                "requests_compared": len(self.requests),
                "requests_diverged": len(self.diverged), "requests": self.requests}

    def table(self) -> pd.DataFrame:
        """One row per request: first step (an integer, or None), origin layer and its kinds,
        every layer that differs there (model layer numbers), live conv rows, magnitude, events."""
        rows = []
        for r in self.requests:
            ev = r.get("events", {})
            rows.append({"req_id": r["req_id"], "first_step": r["first_step"],
                         **({"position": r["position"]} if "position" in r else {}),
                         "origin_layer": short_layer(r.get("origin_layer")),
                         "kinds": ",".join(r["kinds"]),
                         "layers": ",".join(short_layer(x) for x in r["layers"]),
                         "conv_rows": r["conv_rows"], "magnitude": r["magnitude"],
                         "nan_or_inf": r["nan_or_inf"],
                         "same_block_shift": ev.get("same_block_left_shift"),
                         "block_crossing": ev.get("block_crossing"),
                         "prefix_hit_tokens": ev.get("prefix_hit_tokens"),
                         "accepted": ev.get("accepted")})
        return pd.DataFrame(rows).astype({"first_step": "object"}) if rows else pd.DataFrame()

    def to_frame(self) -> pd.DataFrame:
        """``table()``: a pandas DataFrame to filter and export."""
        return self.table()

    def __repr__(self) -> str:
        """A few lines and the first rows of the table (``text()`` has every detail)."""
        head = (f"DivergenceReport: {len(self.diverged)} of {len(self.requests)} requests diverge "
                f"({self.run} vs reference {self.reference}; magnitude in {self.unit})")
        lines = [head, *[f"WARNING: {w}" for w in self.warnings[:3]]]
        table = self.table()
        if not table.empty:
            cols = [c for c in ("req_id", "first_step", "origin_layer", "kinds", "conv_rows",
                                "magnitude") if c in table]
            lines.append(table[cols].head(REPR_ROWS).to_string(index=False))
            if len(table) > REPR_ROWS:
                lines.append(f"... {len(table) - REPR_ROWS} more rows: .to_frame() has them all")
        return "\n".join(lines)

    def text(self, all_requests: bool = False) -> str:
        """The terminal form (``statescope.diverge.text``)."""
        from statescope.diverge.text import report_text

        return report_text(self, all_requests)

    def _repr_html_(self) -> str:
        import html

        head = (f"<p><b>Divergence</b> of <code>{self.run}</code> from <code>{self.reference}</code>: "
                f"{len(self.diverged)} of {len(self.requests)} requests diverge "
                f"({self.gdn_layers} GDN layers, live conv window {self.conv_window} rows; "
                f"conv row 0 = leading/oldest; magnitude in {self.unit}; compared: "
                f"{html.escape(COLUMN_NOTES.get(self.columns or '', 'by position'))}; paired by: "
                f"{html.escape(self.pairing or 'engine step')}).</p>")
        warn = "".join(f"<p><b>WARNING</b>: {html.escape(w)}</p>" for w in self.warnings)
        table = self.table()
        more = (f"<p>… {len(table) - REPR_HTML_ROWS} more rows: <code>.to_frame()</code> has them "
                "all.</p>") if len(table) > REPR_HTML_ROWS else ""
        return head + warn + table.head(REPR_HTML_ROWS).to_html(index=False) + more

    def heatmap(self, req_id: str | None = None):
        """Plotly heatmap, (layer, kind) × request step, of log10 difference for one request
        (default: the first that diverges; all requests' maximum when none does)."""
        import plotly.graph_objects as go

        c = self.cells
        target = req_id or (self.diverged[0]["req_id"] if self.diverged else None)
        if target is not None:
            sha = {r["req_id"]: r["prompt_sha"] for r in self.requests}.get(target, target)
            c = c[c["prompt_sha"] == sha]
            if c.empty:
                raise InputError(f"diverge heatmap: no request {target!r} in the report")
        c = c.assign(row=c["layer"].str.replace(".linear_attn", "", regex=False) + " " + c["kind"])
        x = "position" if "position" in c and target is not None else "req_step"
        grid = c.pivot_table(index="row", columns=x, values="magnitude", aggfunc="max")
        low = -3.0 if self.unit == "tolerance units" else -12.0
        z = np.log10(np.clip(grid.to_numpy(float), 10 ** low, None))
        z = np.where(np.isinf(grid.to_numpy(float)), 12.0, z)
        fig = go.Figure(go.Heatmap(z=z, x=list(grid.columns), y=list(grid.index),
                                   colorscale="Viridis", zmin=low,
                                   colorbar={"title": f"log10 {self.unit}"}))
        fig.update_layout(title=f"State divergence, request {target or 'all (max)'}",
                          xaxis_title="token position" if x == "position" else "request step",
                          yaxis_title="layer / state", height=360)
        self._mark_events(fig, c, x, target)
        return fig

    def _mark_events(self, fig: Any, cells: pd.DataFrame, x: str, target: str | None) -> None:
        """Vertical markers: same-block shifts, post-process copies, the first divergence."""
        rec = next((r for r in self.diverged if r["req_id"] == target), None)
        if rec is None:
            return
        where = cells.groupby("req_step")[x].min() if x in cells else pd.Series(dtype=float)
        ev = rec.get("events") or {}
        marks = [(s, "shift", "orange") for s in ev.get("shift_steps", [])]
        marks += [(s, "post-process copy", "white") for s in ev.get("postprocess_copy_steps", [])]
        marks.append((rec["first_step"], "first divergence", "red"))
        # each kind of mark is labelled once, each label at its own height: adjacent steps'
        # labels would otherwise print over one another
        levels = {"first divergence": 1.0, "post-process copy": 0.9, "shift": 0.8}
        labelled: set[str] = set()
        for step, label, colour in marks:
            if step in where.index:
                words = {} if label in labelled else {
                    "annotation_text": label, "annotation_position": "top left",
                    "annotation_y": levels[label]}
                labelled.add(label)
                fig.add_vline(x=float(where[step]), line_color=colour, line_dash="dot", **words)


REPR_ROWS, REPR_HTML_ROWS = 8, 40  # rows a report shows of itself in a terminal / a notebook


def _differs_by(rows: pd.DataFrame) -> list[str]:
    """Which digests saw the difference: for the recurrent state the exact ``checksum`` /
    ``hash`` and the ``floats`` (statistics); for the conv window its ``live rows`` (per-row
    checksum, hash and sum of the rows the next step reads)."""
    ssm = rows[rows["kind"] == "ssm"]
    out = ["live rows"] if (rows["kind"] == "conv").any() else []
    if len(ssm) and (ssm["checksum_a"] != ssm["checksum_b"]).any():
        out.append("checksum")
    if len(ssm) and {"hash_a", "hash_b"} <= set(ssm) and (
            ssm["hash_a"].notna() & ssm["hash_b"].notna() & (ssm["hash_a"] != ssm["hash_b"])).any():
        out.append("hash")
    if len(ssm) and (ssm["stat_rel_diff"] > 0).any():
        out.append("floats")
    return out


def _per_layer(at: pd.DataFrame) -> list[dict]:
    """The first divergent step's rows, one record per layer in model order."""
    out = []
    for layer in sorted_layers(at["layer"]):
        g = at[at["layer"] == layer]
        conv = g[g["kind"] == "conv"]
        ssm = g[g["kind"] == "ssm"]
        cols = sorted({int(c) for c in ssm[[c for c in ("column_offset_b", "column_offset")
                                             if c in ssm][0]]}) if len(ssm) else []
        mag = float(g["magnitude"].max())
        out.append({"layer": layer, "kinds": sorted(g["kind"].unique()),
                    "conv_rows": sorted({i for rows in conv["conv_rows"] for i in rows}),
                    "ssm_columns": cols, "magnitude": "inf" if math.isinf(mag) else mag,
                    "differs_by": _differs_by(g),
                    "nan_or_inf": bool((g[[c for c in ("nan_b", "inf_b") if c in g]].fillna(0)
                                        .to_numpy() > 0).any())})
    return out


def check_completeness(report: DivergenceReport, runs: dict, allow_incomplete: bool) -> None:
    """Refuse (``InputError``) or loudly warn about a run that did not run to its end."""
    for what, run in runs.items():
        end = run.ending()
        report.endings[what] = {k: end.get(k) for k in ("complete", "why", "status", "recorded",
                                                         "requests_planned", "requests_finished",
                                                         "engine_error")}
        if end["complete"]:
            continue
        msg = (f"capture {what} {run.path} is incomplete: {end['why']} (manifest 'ended' / "
               f"'status' {end.get('status')!r})")
        if not allow_incomplete:
            raise InputError(msg + "; compare a complete capture, or pass --allow-incomplete "
                                   "(allow_incomplete=True) to compare the steps it has")
        report.warnings.append("INCOMPLETE: " + msg + "; only the steps it captured are compared")


PAIRING_NOTES = {"position": "token position", "step": "engine step"}


def _pairing_label(paired: str, fallback: str | None) -> str:
    label = PAIRING_NOTES.get(paired, paired)
    return f"{label} (fallback: {fallback})" if fallback else label


def _position_checks(report: DivergenceReport, runs: dict) -> None:
    """Warn where a step has no position; note recorded computed-token counts that differ from
    the accepted tokens carried step to step (async scheduling's optimistic count)."""
    from statescope.diverge.positions import position_checks, token_positions

    for what, run in runs.items():
        c = position_checks(token_positions(run.steps()))
        if c["unplaced"]:
            report.warnings.append(
                f"{what} {run.path}: {c['unplaced']} step row(s) scheduled drafts but recorded no "
                "accepted count: their states have no token position and are not compared")
        for key, name in (("scheduler_differs", "the scheduler's num_computed_tokens"),
                          ("runner_differs", "the runner's num_computed_runner")):
            if c[key]:
                report.notes.append(
                    f"{what}: {name} differs from the tokens carried from the previous step in "
                    f"{c[key]} step row(s) (async scheduling counts drafts before their rejection "
                    "is known); positions follow the accepted tokens")


def _request_record(g: pd.DataFrame, run: CaptureRun, steps_of: dict, by_position: bool,
                    unpaired: dict) -> dict[str, Any]:
    sha = g["prompt_sha"].iloc[0]
    bad = g[~g["same"].astype(bool)]
    n_run, n_ref = (int(steps_of[k].get(sha, 0)) for k in ("run", "reference"))
    rec: dict[str, Any] = {"prompt_sha": sha, "req_id": g["req_id_b"].iloc[0],
                           "reference_req_id": g["req_id_a"].iloc[0],
                           "steps_compared": int(g["req_step"].nunique()),
                           "steps_run": n_run, "steps_reference": n_ref, "first_step": None,
                           "origin_layer": None, "kinds": [], "layers": [], "conv_rows": [],
                           "per_layer": [], "magnitude": 0.0, "nan_or_inf": False,
                           "ssm_lag": None, "events": {}}
    if by_position:
        only_run, only_ref = unpaired.get(sha, (0, 0))
        rec.update(position=None, reference_step=None,
                   positions_compared=int(g["position"].nunique()),
                   unpaired_positions={"run": int(only_run), "reference": int(only_ref)})
    if bad.empty:
        return rec
    if by_position:  # the first paired position that differs; the run's step that reached it
        pos = int(bad["position"].min())
        first_rows = bad[bad["position"] == pos]
        first = int(first_rows["req_step"].min())
        rec.update(position=pos, reference_step=int(first_rows["req_step_a"].min()))
    else:
        first = int(bad["req_step"].min())
    at = bad[bad["req_step"] == first]  # every row of that run step that differs
    per_layer = _per_layer(at)
    if by_position:
        for pl in per_layer:
            pl["position"] = int(at[at["layer"] == pl["layer"]]["position"].min())
    origin = per_layer[0]
    mine = bad[bad["layer"] == origin["layer"]]
    bad_ssm = mine[mine["kind"] == "ssm"]["req_step"]
    rec.update(first_step=first, origin_layer=origin["layer"], kinds=origin["kinds"],
               layers=[x["layer"] for x in per_layer], conv_rows=origin["conv_rows"],
               per_layer=per_layer, magnitude=origin["magnitude"],
               nan_or_inf=any(x["nan_or_inf"] for x in per_layer),
               ssm_lag=(int(bad_ssm.min()) - first) if len(bad_ssm) else None,
               events=step_events(run, rec["req_id"],
                                  list(range(max(0, first - EVENT_WINDOW), first + 1))))
    return rec


def divergence_report(run_dir: str | os.PathLike | CaptureRun,
                      reference_dir: str | os.PathLike | CaptureRun,
                      rtol: float = 1e-5, columns: str = "auto",
                      allow_incomplete: bool = False, pairing: str = "auto") -> DivergenceReport:
    """Compare ``run_dir`` against ``reference_dir`` (two captures of the same prompts);
    ``columns``: which block columns (``digest_diff``: auto | all | resume | running);
    ``pairing``: auto (the default: token position, else request step with a warning) | position
    | step."""
    run, ref = open_capture(run_dir, "run"), open_capture(reference_dir, "reference")
    width = int(run.manifest.get("conv_window", 0))
    report = DivergenceReport(str(run.path), str(ref.path), conv_window=width)
    check_completeness(report, {"run": run, "reference": ref}, allow_incomplete)
    m = digest_diff(ref, run, rtol, columns=columns, pairing=pairing)
    report.columns = m.attrs.get("columns")
    by_position = m.attrs.get("pairing") == "position"
    fallback = m.attrs.get("pairing_fallback")
    report.pairing = _pairing_label(m.attrs.get("pairing"), fallback)
    if fallback:
        report.warnings.append(
            f"paired by engine step, not token position: {fallback} (an older capture); where the "
            "two runs scheduled a request differently its steps do not line up and may show as "
            "a false divergence")
    if by_position:
        _position_checks(report, {"run": run, "reference": ref})
    unpaired_frame = m.attrs.get("unpaired")
    unpaired = ({} if unpaired_frame is None else
                {r.prompt_sha: (r.only_b, r.only_a) for r in unpaired_frame.itertuples()})
    if by_position:  # a of digest_diff is the reference, b the run
        report.unpaired_positions = {
            "run": int(sum(v[0] for v in unpaired.values())),
            "reference": int(sum(v[1] for v in unpaired.values())),
            "requests": int(sum(1 for v in unpaired.values() if v[0] or v[1]))}
    if m.empty:
        return report
    m = _magnitudes(m, width)
    report.gdn_layers = int(m["layer"].nunique())
    report.cells = m[["prompt_sha", "req_id_b", "req_step", "layer", "kind", "magnitude"]
                     + (["position"] if by_position else [])]
    steps_of = {r: st.groupby("prompt_sha")["req_step"].nunique()
                for r, st in (("run", run.steps()), ("reference", ref.steps()))}
    short = []
    for sha, g in m.groupby("prompt_sha"):
        rec = _request_record(g, run, steps_of, by_position, unpaired)
        if rec["steps_run"] != rec["steps_reference"]:
            short.append(f"{rec['req_id']} ({rec['steps_run']} vs {rec['steps_reference']})")
        report.requests.append(rec)
    if short and not by_position:  # by position a different step count is no misalignment
        report.warnings.append(f"{len(short)} request(s) captured a different number of steps in "
                               f"the run than in the reference (run vs reference): "
                               f"{', '.join(short[:8])}{' ...' if len(short) > 8 else ''}")
    report.requests.sort(key=lambda r: (r["first_step"] is None, r["first_step"] or 0, r["req_id"]))
    return report


# ---- CLI ----------------------------------------------------------------------------------------


