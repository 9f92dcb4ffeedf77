"""oracle: float64 reference vs transformers' float32 forward (logits, cached GDN states, and logits
of transformers re-run from oracle-injected states), conv-window shifting, bad input."""
from pathlib import Path

import pytest
import torch

from statescope.diverge import oracle
from statescope.errors import InputError

ROOT = Path(__file__).resolve().parents[1] / "data" / "models"
DIRS = [d for d in (ROOT / "tiny-qwen35", ROOT / "tiny-gui") if (d / "model.safetensors").exists()]
torch.set_num_threads(1)
# float32 transformers (chunked GDN) vs float64 token-by-token oracle on bf16-rounded weights
LOGIT_ATOL, STATE_ATOL = 2e-3, 1e-4


def _hf(model_dir):
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _ids(model_dir, n=90, seed=0):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tok.get_vocab_size() - 3, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=DIRS, ids=[d.name for d in DIRS])
def setup(request):
    return request.param, _hf(request.param)


def test_logits_match_transformers(setup):
    d, model = setup
    ids = _ids(d)
    with torch.no_grad():
        hf = model(input_ids=torch.tensor([ids])).logits[0].double()
    ref = oracle.reference_logits(d, ids)
    assert ref.shape == hf.shape
    assert (ref - hf).abs().max() < LOGIT_ATOL * max(1.0, float(hf.abs().max()))


def test_states_match_transformers_cache_in_vllm_layout(setup):
    d, model = setup
    ids = _ids(d)
    p = 70
    states = oracle.gdn_states(d, ids, positions=[p])
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([ids[:p + 1]]), use_cache=True).past_key_values
    assert sorted(states) == [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    for layer, [(win, rec)] in states.items():
        cfg = model.config
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        assert win.shape == (cfg.linear_conv_kernel_dim - 1, conv_dim)
        assert rec.shape == (cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim)
        hf_conv = cache.layers[layer].conv_states[0][0]          # (conv_dim, kernel), oldest first
        hf_rec = cache.layers[layer].recurrent_states[0][0]      # (h, k, v)
        assert (win - hf_conv[:, 1:].T.double()).abs().max() < STATE_ATOL
        assert (rec - hf_rec.transpose(-1, -2).double()).abs().max() < STATE_ATOL
        assert float(rec.abs().max()) > 10 * STATE_ATOL  # the comparison is not vacuous


def _rerun_from(model, ids, p, states, n_more=6):
    """Prefill transformers on ids[:p+1], overwrite its GDN states, then feed ids[p+1:p+1+n_more]."""
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([ids[:p + 1]]), use_cache=True).past_key_values
        for layer, (win, rec) in states.items():
            conv = cache.layers[layer].conv_states[0]
            conv.zero_()  # the oldest column is never read again: the window alone must suffice
            conv[0, :, 1:] = win.T.to(conv.dtype)
            cache.layers[layer].recurrent_states[0][0] = rec.transpose(-1, -2).to(conv.dtype)
        out = []
        for t in ids[p + 1:p + 1 + n_more]:
            out.append(model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0, -1])
    return torch.stack(out).double()


def test_transformers_rerun_from_oracle_states_matches(setup):
    d, model = setup
    ids = _ids(d, seed=1)
    p = 60
    states = {k: v[0] for k, v in oracle.gdn_states(d, ids, positions=[p]).items()}
    with torch.no_grad():
        full = model(input_ids=torch.tensor([ids[:p + 7]])).logits[0, p + 1:p + 7].double()
    got = _rerun_from(model, ids, p, states)
    scale = max(1.0, float(full.abs().max()))
    err = float((got - full).abs().max())
    assert err < LOGIT_ATOL * scale
    # negative control: another request's GDN states (window + recurrent) change the logits by far
    # more than the oracle's error (the placeholder model forgets fast, so compare to err, not 1)
    other = {k: v[0] for k, v in oracle.gdn_states(d, _ids(d, seed=2), positions=[p]).items()}
    assert float((_rerun_from(model, ids, p, other) - full).abs().max()) > 50 * max(err, 1e-7)


def test_conv_window_shifts_one_row_per_token():
    d = DIRS[0]
    ids = _ids(d, n=12)
    states = oracle.gdn_states(d, ids)  # every position
    for layer, per_pos in states.items():
        assert len(per_pos) == 12
        first = per_pos[0][0]
        assert torch.count_nonzero(first[:-1]) == 0 and torch.count_nonzero(first[-1]) > 0
        for t in range(11):
            assert torch.equal(per_pos[t + 1][0][:-1], per_pos[t][0][1:])
            assert not torch.equal(per_pos[t + 1][0][-1], per_pos[t][0][-1])
    # layer 0's newest row is in_proj_qkv(input_layernorm(embed(token))), computed here directly
    from safetensors.torch import load_file

    w = {k: v.double() for k, v in load_file(str(d / "model.safetensors")).items() if k.startswith("model.")}
    x = w["model.embed_tokens.weight"][ids[5]]
    x = x * torch.rsqrt(x.pow(2).mean() + 1e-6) * (1 + w["model.layers.0.input_layernorm.weight"])
    row = w["model.layers.0.linear_attn.in_proj_qkv.weight"] @ x
    assert torch.allclose(states[0][5][0][-1], row, atol=1e-9)


def test_positions_subset_and_bad_input():
    d = DIRS[0]
    ids = _ids(d, n=20)
    some = oracle.gdn_states(d, ids, positions=[3, 9])
    every = oracle.gdn_states(d, ids)
    for layer in some:
        assert torch.equal(some[layer][1][1], every[layer][9][1])
    with pytest.raises(InputError, match="positions"):
        oracle.gdn_states(d, ids, positions=[20])
    with pytest.raises(InputError, match="token_ids"):
        oracle.gdn_states(d, [10 ** 6])
    with pytest.raises(InputError, match="cannot load"):
        oracle.gdn_states(d.parent / "no-such-model", ids)
