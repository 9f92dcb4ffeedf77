"""Which release and which setting fix it? The committed release x runner x async cells of
``data/results/gpu/releases/`` (real vLLM 0.26.0, 0.28.0, 0.30.0, 0.32.0 on the H200) beside each
release's source census, and the bisection those cells support.

Each ``<release>/cell_<runner>_<seeds>[_<patch>]`` folder is one ``statescope reproduce`` run
(``scripts/gpu_cli.sh releases``): the tiny-gui trigger (prefix caching + align + MTP(2), async
scheduling on, eager) against its async-off control, with the model runner forced
(``model_runner=v1|v2``) and read back from the engine (``runner_version``). Patched cells reuse
the cell's control run (``--control-run``): ``amplify_accept_race`` (AMPLIFIED: the accepted-count
copy forced to land before the row moves), ``amplify_accept_race=delay`` (AMPLIFIED: held with a
device-side sleep), and the amplifier under ``accept_sync``.

``release_table`` gives one row per cell with the resolved runner, async setting, counts and p,
and the census's default runner for that release (``statescope.builds.census``), so the row for
"the default setting" of each release can be read off. ``default_setting_rows`` picks, per release,
the cell of the runner the release uses by default. ``replayed_bisection`` runs
``statescope.bisect.bayesian_bisect`` over the releases with the recorded cells as its oracle —
REPLAYED: no engine started; each probe returns the cell's recorded counts.

What it deliberately does not do: claim a release that was not run (0.29.0, 0.31.0, 0.33.0 appear
only through the census), or read amplified cells as real-world rates.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from statescope.errors import InputError
from statescope.results.cli_runs import RELEASES_DIR

RELEASES = ("0.26.0", "0.28.0", "0.30.0", "0.32.0")


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _cell(folder: Path) -> dict | None:
    path = folder / "stdout.json"
    if not path.is_file():
        return None
    try:
        rep = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not JSON ({exc})") from None
    return rep if "outcome" in rep else None


def default_runner(version: str) -> str | None:
    """The runner the census reads as this release's default for hybrid + MTP + align + async."""
    from statescope.builds.census import census_for_release

    try:
        c = census_for_release(version)
    except Exception:  # a release the committed census does not hold
        return None
    for finding in c.to_dict().get("findings", []):
        if finding.get("mechanism", "").startswith("default runner") or finding.get("key") == "runner":
            text = str(finding.get("status") or finding.get("value") or "")
            return "V2" if "V2" in text else "V1" if "V1" in text else None
    brief = c.brief() if hasattr(c, "brief") else ""
    return "V2" if "runner V2" in brief else "V1" if "runner V1" in brief else None


def release_table(d: str | Path = RELEASES_DIR) -> list[dict]:
    """One row per recorded cell: release, runner (asked / resolved), patch, verdict and counts."""
    rows = []
    for rel in sorted((p for p in Path(d).iterdir() if p.is_dir()), key=lambda p: _version_key(p.name)):
        census_default = default_runner(rel.name)
        for folder in sorted(rel.glob("cell_*")):
            rep = _cell(folder)
            if rep is None:
                continue
            _, runner, seeds, *patch = folder.name.split("_", 3)
            res = rep["trigger"].get("resolved") or {}
            rows.append({"release": rel.name, "runner_asked": runner.upper(),
                         "runner_resolved": res.get("runner_version"),
                         "default_runner (census)": census_default,
                         "async_trigger": res.get("async_scheduling"),
                         "async_control": (rep["control"].get("resolved") or {}).get("async_scheduling"),
                         "patch": patch[0] if patch else "none",
                         "amplified": any("AMPLIFIED" in l for l in rep["labels"]["trigger"]),
                         "outcome": rep["outcome"],
                         "trigger_failed": rep["trigger"]["n_failed_units"],
                         "trigger_units": rep["trigger"]["n_units"],
                         "control_failed": rep["control"]["n_failed_units"],
                         "control_units": rep["control"]["n_units"],
                         "fisher_p": rep["fisher_p"], "seeds": seeds.replace("-", ":"),
                         "guards_ok": all(g["passed"] for g in rep["guards"])})
    return rows


def default_setting_rows(d: str | Path = RELEASES_DIR) -> list[dict]:
    """Per release, the unpatched cell of the runner the census names as its default."""
    out = []
    for r in release_table(d):
        if r["patch"] == "none" and r["runner_resolved"] == r["default_runner (census)"]:
            out.append(r)
    return out


def replayed_bisection(d: str | Path = RELEASES_DIR, *, setting: str = "default",
                       confidence: float = 0.95):
    """``bayesian_bisect`` (find-fix mode) over the recorded releases, each probe answered by the
    recorded cell of ``setting`` ("default": the release's default runner; "v1"/"v2": forced):
    REPLAYED from committed results, no engine started. Returns the ``BisectResult``."""
    from statescope.bisect import bayesian_bisect

    cells = {r["release"]: r for r in release_table(d) if r["patch"] == "none"
             and (r["runner_resolved"] == r["default_runner (census)"] if setting == "default"
                  else r["runner_asked"] == setting.upper())}
    items = [v for v in sorted(cells, key=_version_key)]
    if len(items) < 2:
        raise InputError(f"replayed_bisection: {len(items)} recorded release(s) for setting "
                         f"{setting!r} in {d}; expected at least 2")

    def probe(release: str, n: int) -> tuple[int, int]:
        c = cells[release]
        return c["trigger_units"], c["trigger_failed"]  # the recorded cell, whatever n asks

    return bayesian_bisect(items, probe, mode="fix", requests_per_probe=96, confidence=confidence,
                           labels=[f"{v} ({cells[v]['runner_resolved']})" for v in items])


def bisection_answer(d: str | Path = RELEASES_DIR, *, setting: str = "default") -> dict[str, Any]:
    """The replayed bisection's answer, checked against the answer's own recorded cell: the
    change-point model assumes a change exists in the range, so it can name an item it never
    probed. Here every item has a recorded cell; if the named release's cell does not fail less
    than the first release's (one-sided Fisher p >= 0.05), the answer is "none is good"."""
    from statescope.verdict.stats import fisher_exact_one_sided

    res = replayed_bisection(d, setting=setting)
    cells = {f"{r['release']} ({r['runner_resolved']})": r for r in release_table(d)
             if r["patch"] == "none" and (r["runner_resolved"] == r["default_runner (census)"]
                                          if setting == "default" else r["runner_asked"] == setting.upper())}
    first = cells[sorted(cells, key=lambda k: _version_key(k.split()[0]))[0]]
    named = cells.get(res.answer)
    p = (fisher_exact_one_sided(first["trigger_failed"], first["trigger_units"],
                                named["trigger_failed"], named["trigger_units"]) if named else None)
    good = named is not None and p is not None and p < 0.05
    return {"setting": setting, "REPLAYED": "from recorded cells, no engine started",
            "model_answer": res.answer, "model_confidence": round(res.confidence, 4),
            "probes": [(pr.label, pr.k, pr.n) for pr in res.probes],
            "answer_cell": (f"{named['trigger_failed']}/{named['trigger_units']}" if named else None),
            "first_release_cell": f"{first['trigger_failed']}/{first['trigger_units']}",
            "fisher_p_first_over_answer": p,
            "first_good_release": res.answer if good else None,
            "verdict": (f"first good release: {res.answer}" if good else
                        "every release is good under this setting: the first already fails "
                        f"{first['trigger_failed']}/{first['trigger_units']}"
                        if first["trigger_failed"] == 0 else
                        f"none is good in {sorted(cells, key=lambda k: _version_key(k.split()[0]))}: "
                        f"the model named {res.answer}, whose own cell fails as the first release's")}


def summary(d: str | Path = RELEASES_DIR) -> dict[str, Any]:
    """The answer in a few fields: which releases/runners corrupt, which do not, and what the
    replayed bisections name."""
    rows = [r for r in release_table(d) if r["patch"] == "none"]
    bad = sorted({(r["release"], r["runner_resolved"]) for r in rows if r["trigger_failed"] > r["control_failed"]})
    clean = sorted({(r["release"], r["runner_resolved"]) for r in rows if r["trigger_failed"] == 0})
    out = {"corrupting": bad, "clean": clean}
    for setting in ("default", "v1", "v2"):
        try:
            out[f"bisection_{setting}"] = bisection_answer(d, setting=setting)
        except InputError as exc:
            out[f"bisection_{setting}"] = {"first_good_release": None, "why": str(exc)}
    return out
