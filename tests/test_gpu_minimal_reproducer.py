"""The committed H200 runs of the exported plain-vLLM reproducer, read back
(``statescope.results.minimal_reproducer``): deterministic with V1 + async, clean with async off
and with V2, on 0.26.0 and (the same script) on 0.32.0."""
import pytest

from statescope.errors import InputError
from statescope.results.minimal_reproducer import script_runs, shrink_conditions


def _rows(**match):
    return [r for r in script_runs() if all(r[k] == v for k, v in match.items())]


def test_the_batch_shrunk_script_fails_the_same_way_three_times_and_is_clean_otherwise():
    runs = _rows(folder="batch_phase/repro", setting="as exported")
    assert len(runs) == 3 and {r["corrupted"] for r in runs} == {8} and {r["rc"] for r in runs} == {1}
    assert len({tuple(r["corrupted_requests"]) for r in runs}) == 1  # the same 8 requests each time
    assert all(r["runner"] == "V1" and r["async_scheduling"] for r in runs)
    for setting in ("--set async_scheduling=false", "VLLM_USE_V2_MODEL_RUNNER=1"):
        [r] = _rows(folder="batch_phase/repro", setting=setting)
        assert (r["corrupted"], r["rc"]) == (0, 0), r


def test_the_same_script_on_a_later_release_fails_with_v1_forced_only():
    v1 = _rows(folder="on_0.32.0", setting="VLLM_USE_V2_MODEL_RUNNER=0")
    assert len(v1) == 2 and all((r["corrupted"], r["rc"]) == (1, 1) for r in v1)
    # that script predates the `resolved:` line: the release is the folder's, not read back
    assert {r["release"] for r in v1} == {"0.32.0"} and {r["vllm"] for r in v1} == {None}
    [default] = _rows(folder="on_0.32.0", setting="the release's default")
    assert (default["corrupted"], default["rc"]) == (0, 0)


def test_the_three_request_script_fails_three_times_and_is_clean_async_off_v2_and_patched():
    runs = _rows(folder="at_two_seqs/repro", setting="as exported")
    assert len(runs) == 3 and all((r["corrupted"], r["requests"], r["rc"]) == (1, 3, 1) for r in runs)
    assert {tuple(r["corrupted_requests"]) for r in runs} == {("s2-ep0001 step 0",)}
    assert all(r["runner"] == "V1" and r["async_scheduling"] for r in runs)
    for setting in ("--set async_scheduling=false", "VLLM_USE_V2_MODEL_RUNNER=1",
                    "--patch accept_sync (PATCHED)"):
        [r] = _rows(folder="at_two_seqs/repro", setting=setting)
        assert (r["corrupted"], r["requests"], r["rc"]) == (0, 3, 0), r
    conditions = shrink_conditions("at_two_seqs/shrink")
    assert sum("without it the failure is gone" in c for c in conditions) == 3


def test_on_a_current_release_with_v1_forced_the_shrink_finds_the_same_three_requests():
    """0.32.0, Model Runner V1 forced: the 0.26.0 three-request script fails the same request
    three times out of three (clean at the release default, V2), and a shrink of the 198-request
    trace there (batch of two) ends at the same three requests and the same failing one."""
    import json

    from statescope.results.minimal_reproducer import ROOT

    runs = _rows(folder="on_0.32.0_v1_forced/repro", setting="VLLM_USE_V2_MODEL_RUNNER=0")
    assert len(runs) == 3 and all((r["corrupted"], r["requests"], r["rc"]) == (1, 3, 1) for r in runs)
    assert {tuple(r["corrupted_requests"]) for r in runs} == {("s2-ep0001 step 0",)}
    assert {(r["vllm"], r["runner"]) for r in runs} == {("0.32.0", "V1")}
    [default] = _rows(folder="on_0.32.0_v1_forced/repro", setting="the release's default")
    assert (default["corrupted"], default["runner"]) == (0, "V2")
    here = (ROOT / "on_0.32.0_v1_forced/shrink/minimal.jsonl").read_text().splitlines()
    there = (ROOT / "at_two_seqs/shrink/minimal.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in here] == [json.loads(x) for x in there]
    result = json.loads((ROOT / "on_0.32.0_v1_forced/shrink/result.json").read_text())
    assert result["original"]["resolved"]["runner_version"] == "V1"
    assert result["minimal"]["failing_requests"] == [["s2-ep0001", 0]]
    conditions = shrink_conditions("on_0.32.0_v1_forced/shrink")
    assert sum("without it the failure is gone" in c for c in conditions) == 3


def test_the_batch_conditions_are_stated():
    conditions = shrink_conditions()
    assert any("max_num_seqs=1 passes" in c for c in conditions)
    assert any("reversed still fails" in c for c in conditions)


def test_a_folder_without_logs_is_refused(tmp_path):
    with pytest.raises(InputError, match="no script logs"):
        script_runs(tmp_path)
