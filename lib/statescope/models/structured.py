"""Build the deterministic *structured* tiny Qwen3.5 model (no training, seconds on a CPU).

What it does: writes a Hugging Face model directory (config.json, bf16 safetensors with ``mtp.*``
weights, a byte-level tokenizer whose token id 0 is ``!``, a chat template) for a 4-layer
Qwen3.5-architecture text model — 3 Gated DeltaNet layers + 1 full-attention layer, GDN key/value
head dim 128 (what vLLM's CPU GDN kernels accept) — plus one MTP layer that vLLM resolves as
``Qwen3_5MTP``.

Why structured: random weights give ~0 MTP acceptance. Here the embedding/unembedding pair is wired
so that the residual stream of token ``t`` points at token ``t+1`` ("successor" language), the
layers add a state-dependent perturbation scaled by ``layer_scale``, and the MTP head's ``fc``
passes the *next* token's embedding through, so its draft is the successor of the successor: drafts
are accepted whenever the base model follows the successor rule. ``layer_scale`` trades acceptance
for dependence on recurrent state.

What it deliberately does not do: produce a model that means anything. The trained GUI-agent model
(``statescope.models.tinymodel``) replaces it as the embedded default once present; the loading code in
``statescope.engine.offline`` is model-agnostic.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_BYTES = 256
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def text_config(vocab_size: int = 320, hidden_size: int = 256) -> dict:
    """The Qwen3.5 text config of the tiny model (fields vLLM and transformers both read)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mtp_num_hidden_layers": 1,
        "bos_token_id": VOCAB_BYTES,
        "eos_token_id": VOCAB_BYTES + 2,
        "pad_token_id": VOCAB_BYTES,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def write_byte_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer without merges: 256 byte tokens (id 0 is ``!``) + 3 specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # bytes_to_unicode order starts at '!': keep it so that token id 0 is '!' as in Qwen vocabularies.
    alphabet.sort(key=lambda ch: (ch != "!", ord(ch)))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    assert tok.token_to_id("!") == 0 and tok.token_to_id("<|im_end|>") == VOCAB_BYTES + 2
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "model_max_length": 8192, "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False,
    }, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=1))


def _structured_weights(cfg: dict, seed: int, layer_scale: float) -> dict[str, torch.Tensor]:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{k: v for k, v in cfg.items()
                                                   if k not in ("architectures", "torch_dtype")}))
    sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(v, h, generator=g)
    emb = emb / emb.norm(dim=1, keepdim=True) * h ** 0.5
    sd["model.embed_tokens.weight"] = emb
    # Unembedding row t+1 is embedding t: a residual stream near E[t] predicts t+1.
    sd["lm_head.weight"] = torch.roll(emb, shifts=1, dims=0) / h ** 0.5 * 4.0
    for name in list(sd):
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            sd[name] = sd[name] * layer_scale
    # MTP head: fc keeps the (normed) embedding half of [emb(next), hidden], so the MTP hidden state
    # is near E[next] and its draft is next+1; its decoder layer copies the attention layer.
    fc = torch.zeros(h, 2 * h)
    fc[:, :h] = torch.eye(h)
    sd["mtp.fc.weight"] = fc
    for part in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{part}.weight"] = torch.zeros(h)  # zero-centred RMSNorm: weight 0 means scale 1
    attn_layer = cfg["layer_types"].index("full_attention")
    prefix = f"model.layers.{attn_layer}."
    for name in list(sd):
        if name.startswith(prefix):
            sd["mtp.layers.0." + name[len(prefix):]] = sd[name].clone()
    return {k: t.to(torch.bfloat16).contiguous() for k, t in sd.items()}


def build_structured_model(out: Path | str, seed: int = 0, layer_scale: float = 0.35) -> Path:
    """Write the structured tiny model to ``out`` and return the directory."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = text_config()
    save_file(_structured_weights(cfg, seed, layer_scale), str(out / "model.safetensors"),
              metadata={"format": "pt", "statescope": f"structured seed={seed} "
                                                       f"layer_scale={layer_scale}"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"]}, indent=1))
    write_byte_tokenizer(out)
    return out


if __name__ == "__main__":  # python -m statescope.models.structured OUT_DIR
    import sys

    print(build_structured_model(sys.argv[1] if len(sys.argv) > 1 else "data/models/tiny-qwen35"))
