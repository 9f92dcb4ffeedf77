"""Model directories for the GPU runs: the race-susceptible tiny variant and a large random hybrid.

What it does: ``build_race_variant`` derives, from a tiny Qwen3.5-architecture model directory (the
trained ``tiny-gui``), a variant whose Gated DeltaNet layers have key/value head dim ``head_dim``
and one value head, so the conv state's one-token row is ``(2 * head_dim + head_dim) * 2`` bytes
(96 -> 288 channels -> 576 B in bf16: not a multiple of 128 B, a shift class on which vLLM
0.26.0's copy kernels raced in the probe). Its GDN weights are the trained ones sliced to the new
dims (first query/key/value channels, first value head); everything else — embeddings, MLPs, the
attention layer and the MTP head — is copied unchanged, so the variant stays close to the trained
model and MTP drafts keep being accepted. ``large_hybrid_dir`` writes a config (and the tiny
model's tokenizer) for a ~1.3 B-parameter Qwen3.5-architecture hybrid meant for
``load_format="dummy"``: nothing is trained or committed. ``conv_row_bytes`` reads a config's
one-token conv shift.

What it deliberately does not do: train, or claim the variant means anything beyond its geometry.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from statescope.errors import InputError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def conv_row_bytes(cfg: dict, dtype_bytes: int = 2, tp: int = 1) -> int:
    """Bytes of one token row of the SD conv state (the shift of a one-token bias)."""
    try:
        kd = cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"]
        vd = cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]
    except KeyError as exc:
        raise InputError(f"config: expected linear_* head fields, missing {exc}") from None
    return (2 * kd + vd) // tp * dtype_bytes


def _read_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise InputError(f"{path}: expected a model directory with config.json")
    return json.loads(path.read_text())


def _slice_gdn(name: str, t, cfg: dict, head_dim: int):
    """The trained GDN tensor ``name`` cut to ``head_dim`` and one value head."""
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    nk = cfg["linear_num_key_heads"]
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        q, k, v = t[:head_dim], t[nk * kd:nk * kd + head_dim], t[2 * nk * kd:2 * nk * kd + head_dim]
        import torch

        return torch.cat([q, k, v], 0)
    if name.endswith("in_proj_z.weight"):
        return t[:head_dim]
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "dt_bias", "A_log")):
        return t[:1]
    if name.endswith("linear_attn.norm.weight"):
        return t[:head_dim]
    if name.endswith("out_proj.weight"):
        return t[:, :head_dim] * (vd / head_dim) ** 0.5
    return t


def build_race_variant(src: str | Path, out: str | Path, head_dim: int = 96) -> Path:
    """Write the variant of ``src`` with GDN head dim ``head_dim`` (one key and one value head)."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    cfg = _read_config(src)
    if cfg.get("linear_num_key_heads") != 1 or head_dim > cfg.get("linear_key_head_dim", 0):
        raise InputError(f"{src}/config.json: expected one GDN key head of dim >= {head_dim}")
    out.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(src / "model.safetensors"))
    new = {k: (_slice_gdn(k, v, cfg, head_dim) if ".linear_attn." in k else v).contiguous()
           for k, v in weights.items()}
    variant = dict(cfg, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                   linear_num_value_heads=1)
    save_file(new, str(out / "model.safetensors"),
              metadata={"format": "pt", "statescope": f"race variant of {src.name}: GDN head dim "
                                                       f"{head_dim}, 1 value head (sliced weights)"})
    (out / "config.json").write_text(json.dumps(variant, indent=1))
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return out


def large_hybrid_config(vocab_size: int, bos: int, eos: int, layers: int = 24,
                        hidden: int = 2048) -> dict:
    """A Qwen3.5-architecture text config of about 1.3 B parameters (3 GDN : 1 attention)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(layers)],
        "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 128, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False, "attention_bias": False, "mtp_num_hidden_layers": 1,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": bos,
        "torch_dtype": "bfloat16", "dtype": "bfloat16",
    }


def large_hybrid_dir(tokenizer_src: str | Path, out: str | Path, **kw: int) -> Path:
    """Config + tokenizer for the large random hybrid (load it with ``load_format='dummy'``)."""
    src, out = Path(tokenizer_src), Path(out)
    cfg = _read_config(src)
    out.mkdir(parents=True, exist_ok=True)
    big = large_hybrid_config(cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"], **kw)
    (out / "config.json").write_text(json.dumps(big, indent=1))
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    # A one-element placeholder: the directory check wants a weights file; load_format="dummy"
    # never reads it (the engine fills every parameter with random values).
    import torch
    from safetensors.torch import save_file

    save_file({"statescope_placeholder": torch.zeros(1)}, str(out / "placeholder.safetensors"),
              metadata={"statescope": "placeholder: load with load_format='dummy'"})
    return out


def approx_params(cfg: dict) -> int:
    """Parameter count of a Qwen3.5 text config (embeddings, layers, head; MTP not counted)."""
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    kd = cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"]
    vd = cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    mlp = 3 * h * inter
    gdn = (2 * kd + vd) * h + vd * h + vd * h + (2 * kd + vd) * cfg["linear_conv_kernel_dim"]
    attn = 2 * nq * hd * h + 2 * nkv * hd * h + nq * hd * h
    total = 2 * v * h
    for kind in cfg["layer_types"]:
        total += mlp + (gdn if kind == "linear_attention" else attn)
    return total
