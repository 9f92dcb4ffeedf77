"""The committed H200 runs of the workbook's own CLI (``data/results/gpu/cli/``, ``releases/``):
every verdict re-derived from the stored records equals what the CLI printed there, the manifests
name the H200, the builds and the commands, and the release x runner cells line up with each
release's source census. No GPU or vLLM engine needed."""
from __future__ import annotations

import json

import pytest

from statescope.results import cli_runs, releases

CLI, REL = cli_runs.CLI_DIR, cli_runs.RELEASES_DIR


def test_manifest_and_commands_name_the_h200_the_builds_and_the_cli():
    m = json.loads((CLI / "manifest.json").read_text())
    assert m["gpu"] == "NVIDIA H200" and m["driver"] and set(m["vllm"]) >= {"0.26.0", "0.28.0", "0.32.0"}
    commands = (CLI / "commands_call57.txt").read_text()
    for cmd in ("statescope doctor", "statescope reproduce", "statescope capture", "statescope census",
                "statescope diverge", "statescope continuity", "statescope render"):
        assert cmd in commands, cmd
    doctor = json.loads((CLI / "doctor" / "stdout.json").read_text())
    checks = {c["name"]: c for c in doctor["checks"]}
    assert doctor["ok"] and "0.26.0" in checks["vllm"]["detail"] and "H200" in checks["gpu"]["detail"]
    assert checks["device profile"]["detail"].startswith("cuda-triton")
    assert "V1" in checks["engine"]["detail"]
    # the in-process 0.26.0 engine's counters read 0 hits: the guard took the requests' own counts
    assert "per-request num_cached_tokens" in checks["prefix-cache hits"]["detail"]


@pytest.mark.parametrize("folder", sorted(p.name for p in CLI.glob("repro_*")))
def test_every_reproduce_verdict_recomputes_from_its_records(folder):
    got = cli_runs.verdict_of(CLI / folder)
    assert got["recomputed"] == got["reported"]


def test_seed_sets_spread_and_the_patch_removes_every_failure():
    rows = cli_runs.seed_spread()
    per_seed, pooled = rows[:-1], rows[-1]
    assert len(per_seed) >= 3  # the headline rate comes with its spread over seed sets
    unpatched = [int(r["unpatched"].split("/")[0]) for r in per_seed]
    assert min(unpatched) > 0 and len(set(unpatched)) > 1  # every seed set departs, by different amounts
    assert all(r["patched"].startswith("0/") for r in per_seed)
    k, n = (int(x) for x in pooled["unpatched"].split("/"))
    assert (k, n) == (sum(unpatched), sum(int(r["unpatched"].split("/")[1]) for r in per_seed))
    assert pooled["fisher_p_unpatched_over_patched"] < 1e-6


def test_each_one_factor_control_is_clean_and_the_trigger_is_not():
    rows = [r for r in cli_runs.reproduce_table() if r["seeds"] == "0:12" and r["trigger_patch"] == "none"]
    assert {r["control"] for r in rows} == {"no_async", "no_prefix_cache", "no_mtp"}
    assert all(r["control_failed"] == 0 < r["trigger_failed"] for r in rows)
    assert all(r["async_scheduling"] and r["runner"] == "V1" for r in rows)


def test_release_cells_resolve_what_they_asked_and_line_up_with_the_census():
    rows = releases.release_table()
    assert {r["release"] for r in rows} >= {"0.26.0", "0.28.0", "0.30.0", "0.32.0"}
    for r in rows:
        assert r["runner_resolved"] == r["runner_asked"] and r["guards_ok"], r
        assert r["async_trigger"] is True and r["async_control"] is False, r
    plain = [r for r in rows if r["patch"] == "none"]
    # V1 corrupts on every release; V2 on none (forced on 0.26/0.28, the default from 0.29)
    assert all(r["trigger_failed"] > 0 for r in plain if r["runner_resolved"] == "V1")
    assert all(r["trigger_failed"] == 0 for r in plain if r["runner_resolved"] == "V2")
    census = {r["release"]: r["default_runner (census)"] for r in rows}
    assert census == {"0.26.0": "V1", "0.28.0": "V1", "0.30.0": "V2", "0.32.0": "V2"}
    for v in ("0.26.0", "0.28.0", "0.32.0"):  # what each release's doctor resolved by default
        doctor = json.loads((REL / v / "doctor_call28.json").read_text())
        assert doctor["resolved"]["runner_version"] == census[v], v


def test_amplified_cells_are_labelled_and_cancelled_by_accept_sync():
    rows = releases.release_table()
    amp = [r for r in rows if "amplify" in r["patch"] or "amplified" in r["patch"]]
    assert amp and all(r["amplified"] for r in amp)
    assert all(r["trigger_failed"] == 0 for r in amp if "accept_sync" in r["patch"])
    assert all(r["trigger_failed"] == 0 for r in amp if r["runner_resolved"] == "V2")


def test_replayed_bisection_names_the_first_good_release_or_says_none_is():
    default = releases.bisection_answer(setting="default")
    assert default["first_good_release"].startswith("0.30.0") and "REPLAYED" in default
    assert releases.bisection_answer(setting="v1")["first_good_release"] is None
    assert releases.bisection_answer(setting="v2")["verdict"].startswith("every release is good")
