"""The seed's question answered on the H200 in one command per setting (data/results/gpu/bisect_releases).

`statescope bisect --builds env:0.26.0 env:0.28.0 env:0.29.0 env:0.30.0 env:0.32.0 --mode fix`
ran three times side by side (`scripts/gpu_cli.sh bisect_releases`, commands in the folder's
`commands.txt`). Asserted: each report's answer (default settings: first good 0.29.0, confirmed by
0.28.0 bad and 0.29.0 good; Model Runner V1 forced: none is good; V1 forced with `accept_sync` on
the trigger: already good at the first build), and that the confirmed search, replayed on the CPU
with the probes' recorded counts as its oracle, asks for exactly the probes the GPU ran, in the same
order and with the same seeds, and reaches the same outcome. A replay that wanted a probe the GPU
never ran fails with KeyError. CPU only, no engine.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from statescope.bisect.confirmed import confirmed_bisect
from statescope.bisect.seeds import SeedPool

BISECT = Path(__file__).resolve().parents[1] / "data/results/gpu/bisect_releases"
RELEASES = ["0.26.0", "0.28.0", "0.29.0", "0.30.0", "0.32.0"]
EXPECTED = {
    "default": ("first good", "0.29.0"),
    "v1_forced": ("none is good", None),
    "v1_accept_sync": ("already good at the first build", None),
}


def _report(name: str) -> dict:
    from statescope.results.release_bisections import report

    return report(name, BISECT)  # the reader notebook 08 uses


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_setting_gets_the_answer_the_releases_imply(name):
    report = _report(name)
    outcome, release = EXPECTED[name]
    assert report["outcome"]["outcome"] == outcome
    assert [lab.split()[1] for lab in report["labels"]] == RELEASES
    if release is None:
        assert report["outcome"]["answer_index"] is None
    else:
        assert RELEASES[report["outcome"]["answer_index"]] == release
    assert (BISECT / name / "rc").read_text().strip() == str(report["outcome"]["exit_status"])
    cost = report["cost"]
    assert cost["cells"] == len(report["probes"]) and cost["engine_starts"] == 2 * cost["cells"]


def test_default_answer_is_confirmed_on_both_sides():
    items = _report("default")["outcome"]["items"]
    by_release = {label.split()[1]: v for label, v in items.items()}
    assert by_release["0.28.0"]["state"] == "bad" and by_release["0.28.0"]["failed"] > 0
    assert by_release["0.29.0"]["state"] == "good"
    assert by_release["0.29.0"]["failed"] == 0 and by_release["0.29.0"]["units"] >= 192


def test_the_notebook_table_reads_the_same_answers(tmp_path):
    from statescope.errors import InputError
    from statescope.results.release_bisections import live_bisections

    rows = {r["setting"]: r for r in live_bisections()}
    assert {k: (r["outcome"], r["answer"]) for k, r in rows.items()} == EXPECTED
    assert rows["default"]["probes"].split(", ")[-1] == "0.28.0 11/96"
    with pytest.raises(InputError, match="default/stdout.json"):
        live_bisections(tmp_path)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_search_replayed_on_the_recorded_counts_asks_for_the_same_probes(name):
    report = _report(name)
    recorded = {(p["index"], tuple(p["seeds"])): (p["n"], p["k"]) for p in report["probes"]}
    asked: list[tuple[int, list[int]]] = []

    def oracle(item, seeds):
        i = RELEASES.index(item)
        asked.append((i, list(seeds)))
        return recorded[(i, tuple(seeds))]  # KeyError: a probe the GPU never ran

    lo, hi = report["settings"]["seed_pool"]
    size = report["settings"]["set_size"]
    pool = SeedPool(range(lo, hi), size, rng_seed=0, first=list(range(size)))
    result = confirmed_bisect(RELEASES, oracle, mode="fix", pool=pool,
                              calibration_sets=report["settings"]["calibration_sets"],
                              good_sets=report["settings"]["good_sets"])
    assert asked == [(p["index"], p["seeds"]) for p in report["probes"]]
    assert result.outcome["outcome"] == report["outcome"]["outcome"]
    assert result.outcome["answer_index"] == report["outcome"]["answer_index"]
