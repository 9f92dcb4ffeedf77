"""Classify the Mamba state copies of one kernel launch by how their byte ranges meet (pure functions).

What it does: a copy is a dict (or any mapping) with absolute byte addresses ``src_addr`` /
``dst_addr``, ``nbytes`` per row, ``rows`` and ``row_stride`` (DS conv layout copies one strided
row per channel; everything else has ``rows=1``) and the physical ``src_block`` / ``dst_block``.
``classify_launch(copies)`` returns one kind per copy, the first that applies of:

- ``empty``: nothing moved (``nbytes == 0``, e.g. a bias as wide as the conv window);
- ``cycle``: part of a cycle of "my destination overlaps your source" among copies of the launch
  (no order of the copies is correct);
- ``chain``: its destination overlaps another copy's source, or its source another's
  destination (the result depends on the order the launch happens to run them in);
- ``same_address``: source and destination are the same bytes (a no-op copy onto itself);
- ``left_shift_same_block``: source and destination overlap inside one physical block with the
  destination below the source — the in-place conv shift of H-copy, correct only if every byte
  is read before it is overwritten;
- ``self_overlap``: any other overlap of a copy with itself (a right shift);
- ``disjoint``: none of the above.

``census_counts`` tallies kinds, optionally by extra columns.

What it deliberately does not do: decide whether a copy *was* corrupted (that needs the bytes:
``statescope.capture.digest`` and the runs' comparison), or know vLLM (``statescope.capture.census_decode``
builds the copies).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from statescope.errors import InputError

KINDS = ("empty", "cycle", "chain", "same_address", "left_shift_same_block", "self_overlap",
         "disjoint")


def _span(start: int, nbytes: int, rows: int, stride: int) -> tuple[int, int]:
    return start, start + (max(rows, 1) - 1) * stride + nbytes


def _rows_hit(start: int, nbytes: int, rows: int, stride: int, lo: int, hi: int) -> bool:
    """Does the strided set {start + r*stride + [0, nbytes) : 0 <= r < rows} meet [lo, hi)?"""
    if nbytes <= 0 or hi <= lo:
        return False
    if rows <= 1 or stride <= 0:
        return start < hi and lo < start + nbytes
    # row r meets [lo, hi) iff lo - nbytes < start + r*stride < hi
    r_lo = max(0, (lo - nbytes - start) // stride + 1)
    r_hi = min(rows - 1, -((start - hi) // stride) - 1)  # largest r with start + r*stride < hi
    return r_lo <= r_hi


def ranges_overlap(a_start: int, a_nbytes: int, a_rows: int, a_stride: int,
                   b_start: int, b_nbytes: int, b_rows: int, b_stride: int) -> bool:
    """Exact overlap test of two strided byte sets (rows of ``nbytes`` every ``stride`` bytes)."""
    if a_nbytes <= 0 or b_nbytes <= 0:
        return False
    a0, a1 = _span(a_start, a_nbytes, a_rows, a_stride)
    b0, b1 = _span(b_start, b_nbytes, b_rows, b_stride)
    if a1 <= b0 or b1 <= a0:
        return False
    if b_rows > a_rows:  # walk the set with fewer rows
        a_start, a_nbytes, a_rows, a_stride, b_start, b_nbytes, b_rows, b_stride = (
            b_start, b_nbytes, b_rows, b_stride, a_start, a_nbytes, a_rows, a_stride)
    return any(_rows_hit(a_start, a_nbytes, a_rows, a_stride, lo, lo + b_nbytes)
               for lo in (b_start + q * b_stride for q in range(max(b_rows, 1))))


def _geometry(c: Mapping, side: str) -> tuple[int, int, int, int]:
    return (int(c[f"{side}_addr"]), int(c["nbytes"]), int(c.get("rows", 1) or 1),
            int(c.get("row_stride", 0) or 0))


def self_kind(c: Mapping) -> str:
    """Kind of a copy on its own (ignoring the rest of the launch)."""
    src, dst = _geometry(c, "src"), _geometry(c, "dst")
    if src[1] <= 0:
        return "empty"
    if src[0] == dst[0]:
        return "same_address"
    if not ranges_overlap(*src, *dst):
        return "disjoint"
    if dst[0] < src[0] and c.get("src_block") == c.get("dst_block"):
        return "left_shift_same_block"
    return "self_overlap"


def clobber_edges(copies: Sequence[Mapping]) -> list[tuple[int, int]]:
    """(i, j), i != j, where copy i's destination overlaps copy j's source (sweep over spans)."""
    intervals = []
    for i, c in enumerate(copies):
        for side in ("src", "dst"):
            g = _geometry(c, side)
            if g[1] > 0:
                lo, hi = _span(*g)
                intervals.append((lo, hi, side, i, g))
    intervals.sort(key=lambda t: t[0])
    active: list[tuple] = []
    edges = set()
    for lo, hi, side, i, g in intervals:
        active = [a for a in active if a[1] > lo]
        for _, _, other_side, j, h in active:
            if j == i or other_side == side:
                continue
            if ranges_overlap(*g, *h):
                edges.add((i, j) if side == "dst" else (j, i))
        active.append((lo, hi, side, i, g))
    return sorted(edges)


def _in_cycles(n: int, edges: Iterable[tuple[int, int]]) -> set[int]:
    """Nodes in a strongly connected component of size > 1 (iterative Tarjan)."""
    adj: dict[int, list[int]] = {}
    for a, b in edges:
        adj.setdefault(a, []).append(b)
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    out: set[int] = set()
    counter = 0
    for root in range(n):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, k = work.pop()
            if k == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            nbrs = adj.get(v, [])
            if k < len(nbrs):
                work.append((v, k + 1))
                w = nbrs[k]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.update(comp)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def classify_launch(copies: Sequence[Mapping]) -> list[str]:
    """One kind from ``KINDS`` per copy of one launch, in input order."""
    edges = clobber_edges(copies)
    cyclic = _in_cycles(len(copies), edges)
    chained = {i for e in edges for i in e}
    kinds = []
    for i, c in enumerate(copies):
        own = self_kind(c)
        if own == "empty":
            kinds.append(own)
        elif i in cyclic:
            kinds.append("cycle")
        elif i in chained:
            kinds.append("chain")
        else:
            kinds.append(own)
    return kinds


def census_counts(rows: Iterable[Mapping], by: Sequence[str] = ()) -> dict:
    """Counts of ``row['kind']`` — a flat {kind: n} dict, or {"a|b|kind": n} with ``by`` columns."""
    counts: Counter = Counter()
    for r in rows:
        key = "|".join([str(r.get(b)) for b in by] + [str(r["kind"])])
        counts[key] += 1
    out = {k: counts.get(k, 0) for k in KINDS} if not by else {}
    out.update(counts)
    return dict(out)


def census_report(run_path: str | Path, allow_incomplete: bool = False) -> dict:
    """The census of one run (a run directory, or a directory of runs: the latest). An
    incomplete run raises ``InputError`` unless ``allow_incomplete`` (``warnings`` says so)."""
    from statescope.capture.census import census_counts
    from statescope.capture.ending import require_complete
    from statescope.capture.store import MANIFEST, CaptureRun, find_runs

    path = Path(run_path)
    if not (path / MANIFEST).is_file():
        runs = find_runs(path)
        if not runs:
            raise InputError(f"statescope census: {path} is not a capture run nor holds any")
        path = runs[-1]
    run = CaptureRun(path)
    warning = require_complete(run, allow_incomplete, "statescope census")
    rows = run.copies().to_dict("records")
    cc = run.manifest.get("census_crosscheck", {})
    return {"run": str(path), "copies": len(rows), "counts": census_counts(rows),
            "by_launch_and_state": census_counts(rows, by=["launch_kind", "state_kind"]),
            "engine_steps": run.manifest.get("engine_steps"), "crosscheck": cc,
            "crosscheck_ok": not cc or (cc.get("decoded_not_observed", 0) == 0
                                        and cc.get("observed_not_decoded", 0) == 0),
            "capture_errors": run.manifest.get("error_count", 0),
            "step_rows": len(run.steps()), "complete": warning is None, "warnings": [warning] if warning else []}
