"""Which fixes does this build contain? The source census of the bug family, for any vLLM build.

What it does: ``census(tree)`` runs every signature (``statescope.builds.signatures_*``) over a
build's Python sources and returns a ``BuildCensus``: version, distribution and origin, one
``CensusCheck`` per signature, a verdict per mechanism, ``exposure(runner=..., async_scheduling=...)``
(what the checks mean for one configuration -- what a release x runner GPU result should be lined
up against), ``headline``/``summary`` (the short block ``statescope doctor`` prints) and ``brief``
(the one-line column of build matrices and bisections). ``census_installed``, ``census_of_build``
(an environment made by ``statescope build add``), ``census_for_release`` (the committed census of
PyPI releases first, else the release's sources, fetched once) and ``census_path`` find the sources
(``statescope.builds.census_sources``). ``load_release_census`` / ``release_frame`` read the
committed census of every PyPI release 0.24.0 ... 0.33.0 (``data/results/census/``).

What it deliberately does not do: run a build or import its vLLM (every answer is read from
source), or claim more than the signatures can see: a check that cannot decide says "unknown".
"""
from __future__ import annotations

import html
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from statescope.builds import signatures_copy as copy_sigs
from statescope.builds import signatures_runner as runner_sigs
from statescope.builds import signatures_sched as sched_sigs
from statescope.builds.census_ast import ABSENT, NOT_APPLICABLE, PRESENT, UNKNOWN, CensusCheck, SourceTree
from statescope.builds.spec import REPO
from statescope.errors import InputError, StatescopeError

SIGNATURES: tuple[Callable[[SourceTree], CensusCheck], ...] = (
    runner_sigs.default_runner, runner_sigs.v1_waits_for_accepted_counts,
    runner_sigs.non_align_async_skips_counts, sched_sigs.async_allowed_with_align,
    sched_sigs.cpu_platform_turns_async_off, copy_sigs.raw_copy_orders_left_overlap,
    copy_sigs.fused_conv_copy_ordered, copy_sigs.empty_draft_count_reset,
    sched_sigs.align_split_uses_mamba_block_size, sched_sigs.mamba_hit_honours_drop_eagle_block,
    runner_sigs.reorder_threshold_keeps_decode_ordering)
HAZARDS = ("H-copy", "H-accept", "H-empty", "H-split", "H-drop", "H-reorder")  # fixed/open lists
RESULTS_DIR = REPO / "data" / "results" / "census"
RELEASES_FILE = RESULTS_DIR / "releases.json"
PYPI_RELEASES = ("0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0",
                 "0.30.0", "0.31.0", "0.32.0", "0.33.0")


def _combine(verdicts: list[str]) -> str:
    """One verdict from several checks of a mechanism: unknown wins, then mixed -> partial."""
    if UNKNOWN in verdicts:
        return UNKNOWN
    real = [v for v in verdicts if v != NOT_APPLICABLE]
    if not real:
        return NOT_APPLICABLE
    return real[0] if len(set(real)) == 1 else "partial"


@dataclass
class BuildCensus:
    """The census of one build: which shapes of the bug family its sources contain."""
    build: str
    version: str | None
    distribution: str | None
    origin: str
    root: str
    checks: list[CensusCheck]
    seconds: float = 0.0
    commit: str | None = None
    source: dict = field(default_factory=dict)  # census_source.json of a fetched release

    def check(self, name: str) -> CensusCheck:
        for c in self.checks:
            if c.check == name:
                return c
        raise InputError(f"census check {name!r}: expected one of {[c.check for c in self.checks]}")

    @property
    def runner(self) -> str | None:
        """The default runner for hybrid + MTP + align + async (V1 / V2), None when unknown."""
        return self.check("default_runner").value

    def mechanisms(self) -> dict[str, str]:
        """mechanism -> present / absent / partial / not applicable / unknown. H-accept is its
        V1 check (#45100 and the async/runner checks are context, not the fix)."""
        groups: dict[str, list[str]] = {}
        for c in self.checks:
            if c.check in ("non_align_async_skips_counts", "cpu_platform_turns_async_off",
                           "default_runner"):
                continue
            groups.setdefault(c.mechanism, []).append(c.verdict)
        return {m: _combine(v) for m, v in groups.items()}

    def exposure(self, runner: str | None = None, async_scheduling: bool = True,
                 platform: str = "cuda") -> dict[str, str]:
        """What the checks predict for one configuration (hybrid + MTP + align): per hazard
        "exposed", "not exposed (why)" or "unknown". ``runner`` None = the build's default."""
        runner = runner or self.runner
        mech = self.mechanisms()
        async_off = platform == "cpu" and self.check("cpu_platform_turns_async_off").verdict == PRESENT
        refused = self.check("async_allowed_with_align").verdict == ABSENT  # #33352's shape
        out: dict[str, str] = {}
        fix = mech.get("H-accept", UNKNOWN)
        if runner == "V2":
            out["H-accept"] = "not exposed (runner V2 keeps accepted counts on the device)"
        elif runner != "V1" or fix == UNKNOWN:
            out["H-accept"] = "unknown"
        elif fix == PRESENT:
            out["H-accept"] = "not exposed (V1 waits for the accepted-count copy)"
        elif not async_scheduling or async_off or refused:
            out["H-accept"] = "not exposed (async scheduling off" + (
                " on the CPU platform)" if async_off else
                " for Mamba prefix caching)" if refused else ")")
        else:
            out["H-accept"] = "exposed"
        for m in ("H-copy", "H-empty", "H-split", "H-drop", "H-reorder"):
            v = mech.get(m, UNKNOWN)
            if m == "H-copy" and platform == "cpu":
                out[m] = "not exposed (no GPU copy kernels run on CPU)"
            elif m == "H-reorder" and runner == "V2":
                out[m] = "unknown (the census reads V1's threshold rule)"
            elif v in (ABSENT, "partial"):
                out[m] = "exposed" + (" when the Mamba and attention block sizes differ"
                                      if m == "H-split" else "")
            elif v in (PRESENT, NOT_APPLICABLE):
                out[m] = f"not exposed ({'fix present' if v == PRESENT else 'not applicable'})"
            else:
                out[m] = "unknown"
        return out

    # ---- words ---------------------------------------------------------------------------
    @property
    def headline(self) -> str:
        """One sentence on the runner and H-accept, the question that matters most."""
        runner, fix = self.runner, self.mechanisms().get("H-accept", UNKNOWN)
        forced = self.check("default_runner").extra.get("forces_v1", [])
        if runner == "V2":
            n_features = sum(f.startswith("unsupported by V2") for f in forced)
            how = [f.rsplit(" (line", 1)[0] for f in forced if not f.startswith("unsupported by V2")]
            how += [f"one of {n_features} features V2 does not support"] if n_features else []
            tail = "V1 waits for the accepted-count copy" if fix == PRESENT else \
                f"not exposed to H-accept unless V1 is forced ({'; '.join(how)})"
            return f"runner V2 by default — {tail}"
        if runner == "V1":
            if fix == PRESENT:
                return ("runner V1 by default — V1 waits for the accepted-count copy: not exposed "
                        "to H-accept")
            cpu = self.check("cpu_platform_turns_async_off").verdict == PRESENT
            return ("runner V1 by default — exposed to H-accept whenever async scheduling runs with "
                    "align + MTP" + (" (the CPU platform turns async off)" if cpu else "")) \
                if fix == ABSENT else "runner V1 by default — H-accept: unknown"
        return "default runner: unknown"

    def pr_tokens(self) -> str:
        """``#50729 absent; #53077 present; ...`` in the order of the mechanisms."""
        mech = self.mechanisms()
        parts = []
        for mname, prs in (("H-copy", "#50729"), ("H-empty", "#53077"), ("H-split", "#54076"),
                           ("H-drop", "#48375/#57128"), ("H-reorder", "#55898")):
            parts.append(f"{prs} {mech.get(mname, UNKNOWN)}")
        parts.append(f"#45100 {self.check('non_align_async_skips_counts').verdict}")
        parts.append(f"#33997 {self.check('async_allowed_with_align').verdict}")
        return "; ".join(parts)

    def summary(self) -> str:
        """The short block: what the build is, the headline, then one token per PR."""
        what = f"vLLM {self.version or '?'}" + (f" ({self.distribution})" if self.distribution else "")
        return f"this build: {what}: {self.headline}; {self.pr_tokens()}"

    def brief(self) -> str:
        """One line for a matrix or bisection column: the runner, then fixed / open hazards."""
        mech = self.mechanisms()
        name = {"H-accept": "H-accept(V1)"}  # the check reads the V1 runner
        fixed = [name.get(m, m) for m in HAZARDS if mech.get(m) == PRESENT]
        open_ = [name.get(m, m) for m in HAZARDS if mech.get(m) in (ABSENT, "partial")]
        other = [f"{name.get(m, m)} {mech.get(m)}" for m in HAZARDS
                 if mech.get(m) in (UNKNOWN, NOT_APPLICABLE)]
        return "; ".join([f"runner {self.runner or '?'}", "fixed: " + (" ".join(fixed) or "-"),
                          "open: " + (" ".join(open_) or "-")] + other)

    # ---- serialisation and display ------------------------------------------------------
    def to_dict(self) -> dict:
        return {"build": self.build, "version": self.version, "distribution": self.distribution,
                "commit": self.commit, "origin": self.origin, "root": self.root,
                "seconds": self.seconds, "source": self.source, "runner": self.runner,
                "mechanisms": self.mechanisms(), "headline": self.headline,
                "summary": self.summary(), "brief": self.brief(),
                "checks": [c.to_dict() for c in self.checks]}

    @classmethod
    def from_dict(cls, d: dict) -> "BuildCensus":
        try:
            return cls(d["build"], d.get("version"), d.get("distribution"), d.get("origin", "?"),
                       d.get("root", ""), [CensusCheck.from_dict(c) for c in d["checks"]],
                       d.get("seconds", 0.0), d.get("commit"), d.get("source") or {})
        except (KeyError, TypeError) as exc:
            raise InputError(f"census record: expected build, checks[...] fields ({exc})") from None

    def frame(self):
        import pandas as pd

        return pd.DataFrame([{"mechanism": c.mechanism, "check": c.check, "PRs": " ".join(c.prs),
                              "verdict": c.verdict, "value": c.value, "where": c.where,
                              "detail": c.detail} for c in self.checks])

    def to_frame(self):
        """``frame()``: one row per check (the name every result uses)."""
        return self.frame()

    def _repr_html_(self) -> str:
        e = html.escape
        colour = {PRESENT: "#2e7d32", ABSENT: "#c62828", NOT_APPLICABLE: "#666", UNKNOWN: "#b26a00"}
        rows = "".join(f"<tr><td>{e(c.mechanism)}</td><td>{e(c.check)}</td><td>{e(' '.join(c.prs))}</td>"
                       f"<td style='color:{colour[c.verdict]};font-weight:bold'>{e(c.verdict)}"
                       f"{' (' + e(c.value) + ')' if c.value else ''}</td><td><code>{e(c.where)}"
                       f"</code></td><td>{e(c.detail)}</td></tr>" for c in self.checks)
        return (f"<div><b>{e(self.build)}</b>: vLLM {e(str(self.version))} "
                f"({e(str(self.distribution))}) — {e(self.headline)}<table><tr><th>mechanism</th>"
                f"<th>check</th><th>PRs</th><th>verdict</th><th>where</th><th>why</th></tr>{rows}"
                "</table></div>")


def census(tree: SourceTree) -> BuildCensus:
    """Every signature over one build's sources."""
    t0 = time.perf_counter()
    checks = [sig(tree) for sig in SIGNATURES]
    info = tree.version_info()
    note = tree.root / "census_source.json"
    return BuildCensus(tree.label, info["version"], info["distribution"], tree.origin,
                       str(tree.root), checks, round(time.perf_counter() - t0, 3), info["commit"],
                       json.loads(note.read_text()) if note.is_file() else {})


def census_installed() -> BuildCensus:
    from statescope.builds.census_sources import installed_tree

    return census(installed_tree())


def census_of_build(name: str) -> BuildCensus:
    """The census of an environment made by ``statescope build add`` (spec text or install key)."""
    from statescope.builds.census_sources import build_tree

    return census(build_tree(name))


def census_path(path: str | Path) -> BuildCensus:
    return census(SourceTree.locate(path))


def load_release_census(path: str | Path = RELEASES_FILE) -> list[BuildCensus]:
    """The committed census of PyPI releases; InputError naming the file when unreadable."""
    p = Path(path)
    try:
        payload = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"{p}: no committed census (see data/results/census/README.md)") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{p}: expected census JSON ({exc})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("censuses"), list):
        raise InputError(f"{p}: expected {{'kind': 'census', 'censuses': [...]}}")
    return [BuildCensus.from_dict(d) for d in payload["censuses"]]


def census_for_release(version: str, *, recompute: bool = False, fetch: bool = True,
                       committed: str | Path = RELEASES_FILE) -> BuildCensus:
    """The census of PyPI release ``version``: the committed one unless ``recompute`` (or the
    release is not committed), else read from its sources (fetched once into the cache)."""
    from statescope.builds.census_sources import release_tree

    if not recompute and Path(committed).is_file():
        for c in load_release_census(committed):
            if c.version == str(version):
                return c
    return census(release_tree(str(version), fetch=fetch))


def census_many(names: Iterable[str] = (), *, installed: bool = False,
                releases: Iterable[str] = (), fetch: bool = True) -> list[BuildCensus]:
    """The census of each NAME (a path or a ``statescope build add`` build), the installed
    build, and each release (read from its sources, never from the committed file)."""
    from statescope.builds.census_sources import installed_tree, release_tree, resolve

    trees = [resolve(n) for n in names] + ([installed_tree()] if installed else [])
    trees += [release_tree(v, fetch=fetch) for v in releases]
    return [census(t) for t in trees]


def installed_brief() -> str | None:
    """The installed vLLM's source census in one line; None when it cannot be read."""
    try:
        return census_installed().brief()
    except (StatescopeError, OSError):
        return None


def build_brief(spec) -> str | None:
    """``brief()`` of an installed build environment, None when it has none (never raises: a
    matrix row must not fail on its census)."""
    try:
        return census_of_build(spec.text if hasattr(spec, "text") else str(spec)).brief()
    except (StatescopeError, OSError):
        return None


def release_frame(censuses: Iterable[BuildCensus] | None = None):
    """One row per build: the runner and each mechanism's verdict (committed releases by default)."""
    import pandas as pd

    rows = []
    for c in censuses if censuses is not None else load_release_census():
        m = c.mechanisms()
        rows.append({"release": c.version, "read from": c.distribution, "runner": c.runner,
                     **{("H-accept (V1)" if k == "H-accept" else k): m.get(k) for k in HAZARDS},
                     "#45100": c.check("non_align_async_skips_counts").verdict,
                     "#33997": c.check("async_allowed_with_align").verdict,
                     "H-accept (default config, CUDA)": c.exposure()["H-accept"]})
    return pd.DataFrame(rows)


def runner_kind(observed: str | None) -> str | None:
    """V1 / V2 from what a run recorded: "V1"/"V2", the runner's module path, or a class name.
    ``GPUModelRunner`` alone cannot tell (V2's class has the same name): None."""
    text = str(observed or "")
    if text in ("V1", "V2"):
        return text
    if "worker.gpu.model_runner" in text or "worker/gpu/model_runner" in text:
        return "V2"
    if "gpu_model_runner" in text or "cpu_model_runner" in text or text == "CPUModelRunner":
        return "V1"  # the CPU runner subclasses V1's GPUModelRunner
    return None


def lineup(rows: Iterable[dict]):
    """Observed runs beside the census of their release: each row gives ``vllm`` (the release),
    ``runner`` (see ``runner_kind``) and optionally ``async_scheduling``, ``mamba_cache_mode``,
    ``num_speculative_tokens``, ``platform`` and a ``label`` (a run's resolved configuration has
    these keys), and ``failed/units`` when known; the table shows the census's default runner,
    whether the observed one agrees (True / False / "cannot tell"), and the H-accept exposure the
    census predicts for that run."""
    import pandas as pd

    out = []
    for r in rows:
        row = {"run": r.get("label"), "release": r.get("vllm"), "runner (observed)": r.get("runner"),
               **({"failed/units": r["failed/units"]} if "failed/units" in r else {})}
        try:
            c = census_for_release(str(r.get("vllm")), fetch=False)
        except InputError as exc:
            out.append({**row, "census": f"no census: {exc}"})
            continue
        seen = runner_kind(r.get("runner"))
        predicted = c.exposure(runner=seen, platform=r.get("platform", "cuda"),
                               async_scheduling=bool(r.get("async_scheduling", True)))["H-accept"]
        if r.get("mamba_cache_mode", "align") != "align" or not r.get("num_speculative_tokens", 1):
            predicted = "not exposed (needs align + MTP)"
        row.update({"runner (census default)": c.runner,
                    "agrees": "cannot tell" if seen is None else seen == c.runner,
                    "H-accept predicted": predicted, "census": c.brief()})
        out.append(row)
    return pd.DataFrame(out)
