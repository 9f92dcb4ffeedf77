"""The committed end-to-end GPU results re-checked with statescope's own functions, and the GPU glue's
CPU-testable parts (decision oracle, sweep prompts, overhead ratios, race-variant geometry).

The results tests read ``data/results/gpu/e2e/`` (written by ``statescope.results.files.collect`` from
what the device returned) and recompute: the verdict table from the records, the overhead ratios from
the raw timed rounds, the engagement guards from the recorded counters, the kernel-agreement totals
and the decision's per-build counts from the oracle log. No GPU or vLLM is needed.
"""
from __future__ import annotations

import functools
import json
import math

import pytest

from statescope.capture.overhead import overhead_ratios
from statescope.gpu import build_decision as gpu_decision
from statescope.models import gpu_models
from statescope.results import e2e as gpu_results
from statescope.results import files
from statescope.workload.token_prompts import sweep_prompts
from statescope.errors import InputError

E2E = gpu_results.E2E_DIR


def _committed(name: str) -> dict | list:
    path = E2E / name
    assert path.is_file(), f"{path} is missing (see data/results/gpu/README.md)"
    return json.loads(path.read_text())


# ---- committed results ------------------------------------------------------------------------

def test_manifest_names_versions_gpu_and_commands():
    m = _committed("manifest.json")
    for key in ("vllm", "torch", "driver", "gpu", "commands", "device_seconds"):
        assert m.get(key), f"manifest.json: {key} missing"
    assert m["vllm"] == "0.26.0"
    env = [p["result"] for p in files.parts() if p["part"] == "environment" and p["status"] == "ok"]
    assert env and all(e["vllm"] == m["vllm"] and e["torch"] == m["torch"] for e in env)
    assert all(m["driver"] in e.get("nvidia_smi", "") for e in env)


def test_verdict_table_recomputed_from_records_equals_committed():
    committed = _committed("verdicts.json")
    assert gpu_results.verdict_table() == committed


def test_every_pair_has_an_outcome_and_trigger_guards_recorded():
    from statescope.verdict.stats import (CONTROL_BROKEN, CORRUPTION_DETECTED, ENGINE_BROKEN,
                                  GEOMETRY_NOT_EXERCISED, NO_EVIDENCE)

    allowed = {CONTROL_BROKEN, CORRUPTION_DETECTED, ENGINE_BROKEN, GEOMETRY_NOT_EXERCISED, NO_EVIDENCE}
    rows = _committed("verdicts.json")
    assert {r["model"] for r in rows} == set(gpu_results.MODELS)
    for r in rows:
        if r["outcome"] in allowed:
            assert set(r["guards"]) >= {"engine_ok", "control_quality", "prefix_cache_engaged", "spec_engaged"}
        else:  # a pair that did not run says so, and then no arm of that control is committed
            assert r["outcome"].startswith("not run")
            assert not [m for m in gpu_results.arms() if m["label"] == r["model"] and m["arm"] == r["control"]]


def test_trigger_summary_recomputed_and_engagement_cross_checked():
    summary = _committed("summary.json")
    assert gpu_results.trigger_summary() == summary["trigger"]
    for t in summary["trigger"]:
        m = [a for a in gpu_results.arms() if a["label"] == t["model"] and a["arm"] == "trigger"][-1]
        # Two independent hit logs agree: vLLM's per-request cached tokens and the capture's.
        assert t["requests_with_cache_hit"] == t["capture_hit_requests"]
        met = m["metrics"]
        assert t["spec_acceptance"] == met["spec_accepted_tokens"] / met["spec_draft_tokens"]
        if not met["prefix_cache_queries"]:
            assert t["prefix_cache_source"].startswith("RequestOutput.num_cached_tokens")
        census = t["census"]
        cap = m["after"]["capture"]["census"]
        assert sum(census.values()) == cap["copies"]
        assert census.get("postprocess|conv|left_shift_same_block", 0) == cap["counts"]["left_shift_same_block"]


def test_arms_ran_with_their_requested_configuration():
    metas = gpu_results.arms()
    assert metas
    for m in metas:
        r, c = m["resolved"], m["config"]
        assert r["vllm_version"] == _committed("manifest.json")["vllm"]
        assert r["enforce_eager"] == c["enforce_eager"]
        assert r["enable_prefix_caching"] == c["enable_prefix_caching"]
        assert r["num_speculative_tokens"] == (c["num_speculative_tokens"] if c["speculative_method"] else 0)
        if c["async_scheduling"] is not None:
            assert r["async_scheduling"] == c["async_scheduling"]
        if m["arm"] == "trigger":
            assert r["mamba_cache_mode"] == "align" and r["async_scheduling"]
            assert r["draft_architecture"] == "Qwen3_5MTP"


def test_overhead_ratio_recomputed_from_raw_timings():
    """The GPU overhead measurement on record (earlier session, capture_gpu.json: CUDA graphs on)
    and any in the e2e results: ratios recomputed from the raw per-round throughputs."""
    import statistics

    old = json.loads((E2E.parent / "capture_gpu.json").read_text())
    raw = old["tok_per_s"]
    assert math.isclose(old["ratio_median"]["digest"],
                        statistics.median(raw["digest"]) / statistics.median(raw["off"]), rel_tol=1e-12)
    assert old["ratio_median"]["digest"] < 0.97  # the 3% goal was not met there
    for row in gpu_results.overhead_table():
        assert 0 < row["ratio_median"] and row["rounds"] >= 3


def test_capture_on_off_recomputed_and_capture_did_not_change_outputs():
    """e2e/ and e2e_capture_off/ ran tiny-gui's compiled trigger twice: digest capture on, then off.
    The comparison is recomputed from both runs' records; capture must not have changed a single
    output token."""
    committed = _committed("summary.json")["capture_on_off"]
    got = json.loads(json.dumps(gpu_results.capture_on_off()))  # tuples -> lists, as committed
    assert got == committed
    assert got["requests"] >= 96 and got["same_tokens"] == got["requests"]
    assert got["differ_from_control_on"] == got["differ_from_control_off"]


def test_large_model_overhead_rows_explain_the_ratio():
    rows = [r for r in gpu_results.overhead_table() if r["model"].startswith("random hybrid")]
    assert len(rows) >= 2, "e2e/ measured two random-hybrid sizes"
    for r in rows:
        # the capture's own host time per step, and the captured rounds' wall time per step
        assert 0 < r["capture_host_ms_per_step"] < r["captured_round_ms_per_step"]
        assert r["ratio_median"] < 0.97  # what docs/gpu.md reports: the 3% goal is not met


def test_trigger_alone_results_stay_readable_beside_e2e():
    d = E2E.parent / "e2e_trigger_alone"
    rows = gpu_results.verdict_table(d)
    assert rows == json.loads((d / "verdicts.json").read_text())
    assert {r["outcome"] for r in rows} == {"not run"}


def test_localization_agrees_with_the_records_and_is_one_mechanism():
    """``statescope localize``'s committed result (made by scripts/gpu_localize.py before it), checked
    against the records and itself: the requests it calls divergent are the ones whose text left the
    control; every continuity break is a moved batch row in a batch with prefill rows; the departing
    requests all depart there."""
    loc = gpu_results.localization()
    on_off = gpu_results.capture_on_off()
    div = sorted((r["episode"], r["step"]) for r in loc["requests"] if r["divergent"])
    assert div == on_off["differ_from_control_on"]
    table = gpu_results.continuity_table()
    broken = sum(r["broken"] for r in table)
    assert broken == loc["continuity"]["break_transitions"] > 0
    assert all(r["broken"] == 0 for r in table if not (r["moved"] and r["prefill_rows_in_batch"]))
    dep = [r for r in gpu_results.departure_table() if r["first_state_departure_step"] is not None]
    assert len(dep) >= 5 and all(r["batch_has_prefill"] for r in dep)
    assert all(r["first_state_departure_step"] < 8 and r["gdn_layers"] == 3 for r in dep)
    top = loc["hypotheses"]["rows"][0]
    assert top["hypothesis"] == "H-accept" and top["contradicts"] == 0 and top["supports"] == len(dep)


def test_sweep_rows_are_consistent_and_show_the_mtp_rule():
    rows = gpu_results.sweep_table()
    assert rows
    for r in rows:
        assert r["prompt_tokens"] == r["full_blocks"] * r["block_size"] + r["extra_tokens"]
        assert r["cached_first"] == 0  # a fresh prompt on a reset cache cannot hit
        assert r["cached_second"] % r["block_size"] == 0
        if r["arm"] == "trigger":  # MTP(2): the last full block is never reused
            want = max(0, r["full_blocks"] - 1) if r["extra_tokens"] else 0
            assert r["hit_blocks"] == want, r


def test_kernel_agreement_totals_match_the_rows():
    rows = gpu_results.kernel_table()
    assert rows
    for r in rows:
        for kind in ("conv_in_place", "conv_between_blocks", "ssm"):
            assert 0 <= r[f"{kind}_mismatch"] <= r[f"{kind}_copies"]
    v1 = [r for r in rows if not (r["kernel"] == "postprocess" and r["has_idx_mapping"])]
    assert sum(r["conv_in_place_copies"] for r in v1) > 0 and sum(r["ssm_copies"] for r in v1) > 0
    # What docs/gpu.md states: the V1 paths agree byte for byte; the V2 (idx-mapping) post-process
    # differs only in where the accepted count goes.
    assert sum(r["states_mismatch"] for r in rows) == 0
    v2 = [r for r in rows if r["kernel"] == "postprocess" and r["has_idx_mapping"]]
    assert v2 and all(r["accepted_out_mismatch_cases"] == r["cases"] for r in v2)


def test_decision_counts_match_the_oracle_log():
    res = files.part("gpu_decision")
    assert res is not None
    per = {b["build"]: b for b in res["per_build"]}
    for build, b in per.items():
        log = [x for x in res["oracle_log"] if x["build"] == build]
        assert b["requests"] == sum(x["n"] for x in log) and b["failures"] == sum(x["k"] for x in log)
    probes = res["bisect"]["probes"]
    assert sum(p["n"] for p in probes) == res["bisect"]["requests_used"] == sum(x["n"] for x in res["oracle_log"])
    assert gpu_results.bisect_result().answer == res["bisect"]["answer"]


# ---- CPU-testable glue ------------------------------------------------------------------------

def _racy_copy(src, dst, sizes):
    """A CPU copy with the H-copy flaw: 64-byte chunks of each 1 KiB tile from the top down."""
    import ctypes

    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        for t in range(0, n, 1024):
            m = min(1024, n - t)
            for j in reversed(range(0, m, 64)):
                ctypes.memmove(d + t + j, s + t + j, min(64, m - j))


def test_decision_finds_the_patch_with_a_racy_cpu_copy():
    from statescope.patches.overlap_safe import overlap_safe_batch_memcpy

    fns = {gpu_decision.BUILDS[0]: _racy_copy,
           gpu_decision.BUILDS[1]: functools.partial(overlap_safe_batch_memcpy, kernel=_racy_copy),
           gpu_decision.BUILDS[2]: gpu_decision.torch_reference_copy}
    oracle = gpu_decision.CopyRaceOracle(fns, shift_bytes=576, launch_copies=40, device="cpu")
    result = gpu_decision.decide_builds(oracle, requests_per_probe=20, budget=400)
    assert result.answer == gpu_decision.BUILDS[1] and result.confidence >= 0.99
    per = {b["build"]: b for b in gpu_decision.build_verdicts(oracle.log)}
    assert per[gpu_decision.BUILDS[0]]["failures"] > 0
    assert per[gpu_decision.BUILDS[1]]["failures"] == 0


def test_reference_copy_is_a_memmove():
    import torch

    buf = torch.arange(256, dtype=torch.uint8)
    want = buf.clone()
    want[0:100] = buf[10:110].clone()
    gpu_decision.register_buffer(buf)
    try:
        gpu_decision.torch_reference_copy(torch.tensor([buf.data_ptr() + 10]), torch.tensor([buf.data_ptr()]),
                                          torch.tensor([100]))
    finally:
        gpu_decision.clear_buffers()
    assert torch.equal(buf, want)


def test_oracle_rejects_unknown_build():
    oracle = gpu_decision.CopyRaceOracle({"a": _racy_copy}, device="cpu", launch_copies=4)
    with pytest.raises(InputError, match="unknown build"):
        oracle("b", 2)


def test_overhead_ratios_and_sweep_prompts():
    rows = [{"mode": "off", "round": i, "seconds": 1.0, "tokens": 100} for i in range(3)] + \
        [{"mode": "digest", "round": i, "seconds": s, "tokens": 100} for i, s in enumerate((2.0, 1.25, 4.0))]
    r = overhead_ratios(rows)["digest"]
    assert r["ratio_median"] == pytest.approx(0.5) and r["ratio_best"] == pytest.approx(0.8)
    with pytest.raises(InputError):
        overhead_ratios(rows[3:])
    prompts = sweep_prompts(16, 100, blocks=(1, 2), offsets=(0, 3))
    assert [len(p) for _, _, p in prompts] == [16, 19, 32, 35]


def test_race_variant_geometry(tmp_path):
    src = gpu_results.E2E_DIR.parents[2] / "models" / "tiny-gui"
    assert gpu_models.conv_row_bytes(json.loads((src / "config.json").read_text())) % 128 == 0
    out = gpu_models.build_race_variant(src, tmp_path / "v")
    variant = json.loads((out / "config.json").read_text())
    assert gpu_models.conv_row_bytes(variant) == 576 and 576 % 128
    from safetensors import safe_open

    from statescope.models.tinymodel import expected_shapes

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == expected_shapes(variant)  # every tensor present, cut to the variant's dims
    with pytest.raises(InputError):
        gpu_models.build_race_variant(tmp_path / "nowhere", tmp_path / "w")


def test_kernel_comparison_flags_a_racy_build_only_on_in_place_shifts():
    """A stand-in "build" whose post-process copies like a barrier-less 8 KiB-tile kernel: the
    comparison must report mismatches for in-place conv shifts and nowhere else."""
    from types import SimpleNamespace

    from statescope.patches import cpu_kernels
    from statescope.gpu import kernel_agreement as gpu_kernels

    def racy(grid, *args, **kwargs):
        before = cpu_kernels.get_copy_semantics()
        cpu_kernels.set_copy_semantics("barrierless_tiles", 8192)
        try:
            cpu_kernels.postprocess_mamba_fused_kernel.impl(grid, *args, **kwargs)
        finally:
            cpu_kernels.set_copy_semantics(*before)

    build = SimpleNamespace(postprocess_mamba_fused_kernel=cpu_kernels.CpuKernel("racy", racy))
    row = gpu_kernels.summarize_case(gpu_kernels.run_case(
        gpu_kernels.make_case(gpu_kernels.GEOMETRIES["tiny"], 16, seed=3), build, "cpu"))
    assert row["conv_in_place_copies"] > 0 and row["conv_in_place_mismatch"] == row["conv_in_place_copies"]
    assert row["conv_between_blocks_mismatch"] == 0 and row["ssm_mismatch"] == 0
    assert row["states_mismatch"] > 0 and row["accepted_out_equal"] is True
    same = gpu_kernels.summarize_case(gpu_kernels.run_case(
        gpu_kernels.make_case(gpu_kernels.GEOMETRIES["tiny_ds"], 16, seed=3), cpu_kernels, "cpu"))
    assert same["states_mismatch"] == 0 and same["ssm_copies"] > 0
