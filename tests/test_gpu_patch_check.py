"""The patch check of the GPU results (``data/results/gpu/e2e_patch_check/``) re-derived from its
committed files: the accept_sync patch removes what the factor check (``e2e_factors/``) detected,
with the cache and the drafts still engaged. No GPU or vLLM is needed."""
from __future__ import annotations

import json

import pytest

from statescope.results import overhead
from statescope.results import patch_check
from statescope.errors import InputError
from statescope.verdict.stats import CORRUPTION_DETECTED, NO_EVIDENCE

PATCH_CHECK = patch_check.PATCH_CHECK_DIR


def test_manifest_names_the_build_and_every_call():
    m = json.loads((PATCH_CHECK / "manifest.json").read_text())
    assert m["vllm"] == "0.26.0" and m["gpu"] == "NVIDIA H200" and m["date_utc"] == "2026-11-30"
    assert any("accept_sync" in c for c in m["commands"])


def test_verdicts_recomputed_equal_committed():
    assert patch_check.patch_verdicts() == json.loads((PATCH_CHECK / "verdicts.json").read_text())


def test_unpatched_detects_and_patched_is_clean_with_guards_engaged():
    rows = patch_check.patch_verdicts()
    assert len(rows) == 6
    for r in rows:
        assert r["trigger_units"] == r["control_units"] == 96
        assert all(r["guards"].values()), r["guard_details"]  # cache hit, drafts accepted, ...
        if r["trigger_build"] == "unpatched":
            assert r["outcome"] == CORRUPTION_DETECTED and r["patches"] == []
        else:
            assert r["outcome"] == NO_EVIDENCE and r["patches"] == ["accept_sync"]
            assert r["trigger_failed"] == 0


def test_unpatched_departs_on_the_factor_checks_requests_and_patched_on_none():
    rows = patch_check.patch_table()
    for r in rows:
        if r["trigger"] == "unpatched":
            assert r["differ"] > 0 and r["same_as_factors_trigger"]  # deterministic under the same load
        else:
            assert r["differ"] == 0
        assert r["prefix_cache_hit_rate"] > 0.5 and r["spec_acceptance_rate"] > 0.5


def test_patched_vs_unpatched_fisher():
    res = patch_check.patched_vs_unpatched()
    assert res["patched_failed_episodes"] == 0 < res["unpatched_failed_episodes"]
    assert res["fisher_p_one_sided"] < 0.01


def test_missing_arm_is_one_clear_error(tmp_path):
    (tmp_path / "arms_J.jsonl").write_text("")
    with pytest.raises(InputError, match="tiny-gui"):
        patch_check.patch_table(tmp_path)


def test_cli_reports_the_patch_check_with_its_patch_section(capsys):
    from statescope.cli.main import main

    assert main(["gpu-results", str(PATCH_CHECK), "--json"]) == 1  # the unpatched trigger: corruption detected
    rep = json.loads(capsys.readouterr().out)
    assert rep["patch"]["patched_vs_unpatched"]["patched_failed_episodes"] == 0
    builds = {(r["trigger_build"], r["outcome"]) for r in rep["verdicts"]}
    assert ("accept_sync", NO_EVIDENCE) in builds and ("unpatched", CORRUPTION_DETECTED) in builds


def test_overhead_modes_graph_equals_eager_and_idle_emission_cut_the_flusher():
    rows = overhead.deferred_rows_table()
    by = {(r["file"], r["mode"]): r for r in rows}
    for f in ("probe_1p3b.json", "probe_7b.json"):
        agree = by[(f, "digest")]["graph_vs_eager_identical"]
        done, total = map(int, agree.split("/"))
        assert done == total > 100_000  # the replayed digests are the eager ones, row for row
        # rows made at idle: the flusher's share of the step is a fraction of making them in the
        # background (1.6-3.2 ms per step beside the factor check, e2e_factors/)
        assert by[(f, "digest_eager")]["host_ms_flusher"] < 0.5 < by[(f, "digest_bg")]["host_ms_flusher"]
        assert by[(f, "digest_eager")]["digest_graph"] == "off" and by[(f, "digest")]["digest_graph"] == "on"
    # the goal (>= 0.97 of capture off) is still not met by the digest in any probe
    assert all(r["paired_ratio_median"] < 0.97 for r in rows if r["mode"].startswith("digest"))
