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


def test_the_shrink_of_96_failing_episodes_at_its_defaults_ends_in_a_script_that_fails_every_time():
    """Issue 30 item 5 (0.32.0, Model Runner V1 forced; an H100): ``statescope shrink`` at its
    defaults took the 96-episode run (576 requests) to 5 requests; its exported plain-vLLM script
    fails the same request in both runs as exported and is clean with async off, with V2 and with
    ``--patch accept_sync``. Read back from the committed logs and result."""
    import json

    from statescope.results.minimal_reproducer import MINIMAL_ROOT

    def rows(**match):
        return [r for r in script_runs(MINIMAL_ROOT) if all(r[k] == v for k, v in match.items())]

    runs = rows(folder="repro", setting="as exported")
    assert len(runs) == 2 and all((r["corrupted"], r["requests"], r["rc"]) == (1, 5, 1) for r in runs)
    assert {tuple(r["corrupted_requests"]) for r in runs} == {("s51-ep0004 step 0",)}
    assert {(r["vllm"], r["runner"], r["async_scheduling"]) for r in runs} == {("0.32.0", "V1", True)}
    for setting in ("--set async_scheduling=false", "VLLM_USE_V2_MODEL_RUNNER=1",
                    "--patch accept_sync (PATCHED)"):
        [r] = rows(folder="repro", setting=setting)
        assert (r["corrupted"], r["requests"], r["rc"]) == (0, 5, 0), r
    [v2] = rows(folder="repro", setting="VLLM_USE_V2_MODEL_RUNNER=1")
    assert v2["runner"] == "V2"
    script = (MINIMAL_ROOT / "repro" / "repro.py").read_text()
    imports = [line.strip() for line in script.splitlines()
               if line.strip().startswith(("import statescope", "from statescope"))]
    assert imports == ["from statescope.patches.accept_sync import install_accept_sync"]  # --patch
    result = json.loads((MINIMAL_ROOT / "shrink" / "result.json").read_text())
    assert result["reproduced"] and result["original"]["n_requests"] == 576
    assert result["minimal"]["n_requests"] == 5
    assert result["minimal"]["failing_requests"] == [["s51-ep0004", 0]]
    assert result["original"]["resolved"]["runner_version"] == "V1"
    verify = result["trials"][-1]
    assert verify["phase"] == "verify" and verify["failed"] and verify["control_failures"] == []
    assert verify["trigger_failures"] == [[["s51-ep0004", 0]]] * 3  # K = 3, the same request
    # the cost as recorded: under 12 minutes, not under 40 engine runs
    assert result["seconds"] < 12 * 60 and result["engine_runs"] > 40


def test_the_three_request_script_on_0_32_0_fails_with_v1_only():
    from statescope.results.minimal_reproducer import MINIMAL_ROOT

    runs = script_runs(MINIMAL_ROOT)
    v1 = [r for r in runs if r["folder"] == "three_request_script"
          and r["setting"] == "VLLM_USE_V2_MODEL_RUNNER=0"]
    assert len(v1) == 2 and all((r["corrupted"], r["requests"], r["rc"]) == (1, 3, 1) for r in v1)
    others = [r for r in runs if r["folder"] == "three_request_script" and r not in v1]
    assert {r["setting"] for r in others} == {"--set async_scheduling=false",
                                              "VLLM_USE_V2_MODEL_RUNNER=1",
                                              "--patch accept_sync (PATCHED)"}
    assert all((r["corrupted"], r["rc"]) == (0, 0) for r in others), others
