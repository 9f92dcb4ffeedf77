"""Build the tiny Qwen3.5 *vision-language* model (``data/models/tiny-vl``) from the trained text model.

What it does: ``build_tiny_vl(out)`` writes a Hugging Face model directory that vLLM resolves as
``Qwen3_5ForConditionalGeneration`` (the class vLLM runs Qwen3.5 VLMs with) and, with MTP, drafts
with ``Qwen3_5MTP``:

* text: the trained ``tiny-gui`` weights, unchanged (3 Gated DeltaNet + 1 full-attention layer,
  the MTP layer), under the VLM's names (``model.language_model.*``); its vocabulary grows by the
  four vision specials ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``,
  ``<|video_pad|>`` (ids 832–835: seeded embedding rows, zero ``lm_head`` rows so they are never
  the argmax). RoPE becomes interleaved M-RoPE (sections 6/5/5 of the 16 rotary pairs, the real
  checkpoints' 11/11/10 of 32 scaled): for text tokens the three position ids agree, so text runs
  exactly as the text model; image tokens get (t, h, w) grid positions as in Qwen3.5.
* vision: a 2-block ViT (hidden 64, 2 heads, patch 16, temporal patch 2, 2×2 merge → 256 =
  the text hidden size), seeded N(0, 0.02) weights (``merger_scale`` scales the merger's output
  projection; 1.0 = none). Measured in PyTorch on 36 held-out steps with the screenshots
  *before* the observation text (as presets send them): 36/36 answers correct, and another
  step's screenshots change the logprobs of every answer but 0/36 greedy answers — the image is
  read, the text decides (merger scales 0.03–10 gave 35–36/36 correct, 0–1 changed). Screenshots
  *after* the text break the trained copy (0/18 correct): the focus line must come last.
  ``min_pixels`` 4,096 / ``max_pixels`` 65,536: a 320×200 screenshot becomes 60 image tokens.
* tokenizer: the trained BPE in a ``tokenizer/`` folder of its own
  (``statescope.workload.model_files``, which also loads the processor): transformers forces its
  Qwen3.5 tokenizer class on a ``qwen3_5`` model directory, whose pre-tokenizer would split
  ``97`` into ``9 7`` and break the trained ids.
  The chat template emits ``<|vision_start|><|image_pad|><|vision_end|>`` for every image part.

What it deliberately does not do: train anything (the vision tower is structured noise: the model
cannot read a screenshot's text; the observation text carries the task), or run vLLM
(``tests/test_tiny_vl.py`` does). Made in seconds, deterministic for a given seed and torch build.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from statescope.models.structured import SPECIAL_TOKENS

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_CONFIG = {
    "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "in_channels": 3,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 256,
    "num_position_embeddings": 256, "deepstack_visual_indexes": [],
    "hidden_act": "gelu_pytorch_tanh", "model_type": "qwen3_5_vision",
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
}
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 256 * 256
MROPE_SECTION = [6, 5, 5]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% elif c['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _default_text_model() -> Path:
    from statescope.engine.config import MODELS_DIR

    return MODELS_DIR / "tiny-gui"


def vl_config(text_cfg: dict) -> dict:
    """The VLM config.json for a Qwen3.5 text config (vocabulary grown by the vision specials)."""
    v0 = text_cfg["vocab_size"]
    text = {k: v for k, v in text_cfg.items() if k not in ("architectures", "torch_dtype")}
    text.update(vocab_size=v0 + len(VISION_TOKENS), model_type="qwen3_5_text")
    text["rope_parameters"] = {**text_cfg["rope_parameters"], "mrope_section": MROPE_SECTION,
                               "mrope_interleaved": True}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": text, "vision_config": dict(VISION_CONFIG),
            "vision_start_token_id": v0, "vision_end_token_id": v0 + 1,
            "image_token_id": v0 + 2, "video_token_id": v0 + 3,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _vision_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the vision tower, as the checkpoint stores them."""
    v = cfg["vision_config"]
    h, inner, p, t = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["temporal_patch_size"]
    merged = h * v["spatial_merge_size"] ** 2
    shapes = {"patch_embed.proj.weight": (h, v["in_channels"], t, p, p), "patch_embed.proj.bias": (h,),
              "pos_embed.weight": (v["num_position_embeddings"], h)}
    for i in range(v["depth"]):
        b = f"blocks.{i}."
        shapes.update({b + "norm1.weight": (h,), b + "norm1.bias": (h,), b + "norm2.weight": (h,),
                       b + "norm2.bias": (h,), b + "attn.qkv.weight": (3 * h, h),
                       b + "attn.qkv.bias": (3 * h,), b + "attn.proj.weight": (h, h),
                       b + "attn.proj.bias": (h,), b + "mlp.linear_fc1.weight": (inner, h),
                       b + "mlp.linear_fc1.bias": (inner,), b + "mlp.linear_fc2.weight": (h, inner),
                       b + "mlp.linear_fc2.bias": (h,)})
    shapes.update({"merger.norm.weight": (h,), "merger.norm.bias": (h,),
                   "merger.linear_fc1.weight": (merged, merged), "merger.linear_fc1.bias": (merged,),
                   "merger.linear_fc2.weight": (v["out_hidden_size"], merged),
                   "merger.linear_fc2.bias": (v["out_hidden_size"],)})
    return shapes


def _vision_weights(cfg: dict, gen: torch.Generator, merger_scale: float) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in _vision_shapes(cfg).items():
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "merger.norm.weight":
            t = torch.ones(shape)  # LayerNorm scale
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        if name.startswith("merger.linear_fc2"):
            t = t * merger_scale
        out["model.visual." + name] = t
    return out


def _text_weights(text_dir: Path, n_new: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name, t in load_file(str(text_dir / "model.safetensors")).items():
        t = t.float()
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = (torch.randn(n_new, t.shape[1], generator=gen) * t.std()
                    if name.startswith("model.") else torch.zeros(n_new, t.shape[1]))
            t = torch.cat([t, rows])
        # the VLM keeps the text model under model.language_model; lm_head and mtp.* stay put
        out["model.language_model." + name[len("model."):] if name.startswith("model.") else name] = t
    return out


def _processor_config() -> dict:
    common = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "merge_size": 2,
              "patch_size": 16, "resample": 3, "rescale_factor": 1 / 255, "temporal_patch_size": 2}
    return {"processor_class": "Qwen3VLProcessor",
            "image_processor": {**common, "image_processor_type": "Qwen2VLImageProcessor",
                                "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}},
            "video_processor": {**common, "video_processor_type": "Qwen3VLVideoProcessor",
                                "do_sample_frames": True, "fps": 2, "min_frames": 4,
                                "max_frames": 768, "return_metadata": False,
                                "size": {"shortest_edge": MIN_PIXELS,
                                         "longest_edge": 4 * MAX_PIXELS}}}


def _write_tokenizer(text_dir: Path, tok_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(text_dir / "tokenizer.json"))
    v0 = tok.get_vocab_size()
    tok.add_special_tokens(VISION_TOKENS)
    if [tok.token_to_id(t) for t in VISION_TOKENS] != list(range(v0, v0 + len(VISION_TOKENS))):
        raise AssertionError("vision specials did not get the next ids")
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    cfg = json.loads((text_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    shutil.copy(text_dir / "special_tokens_map.json", tok_dir / "special_tokens_map.json")
    # A text config beside the tokenizer: AutoTokenizer then honours tokenizer_config's class.
    (tok_dir / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}, indent=1))


def build_tiny_vl(out: Path | str, *, text_model: Path | str | None = None, seed: int = 0,
                  merger_scale: float = 1.0) -> Path:
    """Write the tiny VLM to ``out`` (text weights from ``text_model``, default tiny-gui)."""
    from safetensors.torch import save_file

    text_dir = Path(text_model) if text_model else _default_text_model()
    text_cfg = json.loads((text_dir / "config.json").read_text())
    if text_cfg.get("vocab_size", 0) < len(SPECIAL_TOKENS) or "rope_parameters" not in text_cfg:
        raise ValueError(f"{text_dir}/config.json: expected a Qwen3.5 text config")
    cfg = vl_config(text_cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = _text_weights(text_dir, len(VISION_TOKENS), gen)
    weights.update(_vision_weights(cfg, gen, merger_scale))
    save_file({k: t.to(torch.bfloat16).contiguous() for k, t in sorted(weights.items())},
              str(out / "model.safetensors"),
              metadata={"format": "pt", "statescope": f"tiny-vl seed={seed} "
                                                       f"merger_scale={merger_scale} "
                                                       f"text={text_dir.name}"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    shutil.copy(text_dir / "generation_config.json", out / "generation_config.json")
    (out / "processor_config.json").write_text(json.dumps(_processor_config(), indent=1))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _write_tokenizer(text_dir, out / "tokenizer")
    return out


if __name__ == "__main__":  # python -m statescope.models.tiny_vl [OUT_DIR]
    import sys

    print(build_tiny_vl(sys.argv[1] if len(sys.argv) > 1 else "data/models/tiny-vl"))
