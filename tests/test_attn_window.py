"""Far-key masking (opt-in training flag ``--attn-window``): the mask allows exactly the keys
q - W < s <= q in windowed rows (plain causal in the others), transformers' attention layer honours
it, and a window covering the whole sequence gives the default (unmasked) loss."""
import pytest
import torch

from statescope.workload import guilang
from statescope.models import tinymodel as tm

torch.set_num_threads(1)


def test_mask_allows_exactly_the_window():
    t, w = 9, 3
    m = tm.far_key_mask(t, w)
    assert m.shape == (1, 1, t, t)
    for q in range(t):
        for s in range(t):
            assert (m[0, 0, q, s] == 0) == (q - w < s <= q), (q, s)
    rows = torch.tensor([True, False, True])
    mb = tm.far_key_mask(t, w, rows)
    assert mb.shape == (3, 1, t, t)
    assert torch.equal(mb[0], m[0]) and torch.equal(mb[2], m[0])
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    assert torch.equal(mb[1, 0] == 0, causal)
    assert torch.equal(tm.far_key_mask(t, t) == 0, causal[None, None])
    with pytest.raises(ValueError):
        tm.far_key_mask(t, 0)


@pytest.fixture(scope="module")
def small():
    texts = ["".join(x for x, _ in guilang.transcript_segments(guilang.generate_episode(s, n)))
             for s in range(20) for n in (3, 6)]
    tok = tm.train_tokenizer(texts, vocab_size=400)
    cfg = tm.model_config(tok)
    cfg.update(hidden_size=64, intermediate_size=96)
    return tok, tm.new_base_model(cfg, seed=0).eval()


def test_attention_layer_ignores_far_keys(small):
    """The full-attention layer's output at q does not move when inputs at s <= q - W change, and
    does when the input at s = q - W + 1 changes (through transformers' own attention interface)."""
    _, base = small
    attn = base.model.layers[base.config.layer_types.index("full_attention")].self_attn
    t, w, q = 24, 5, 20
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, t, base.config.hidden_size, generator=g)
    pos = torch.arange(t)[None]
    cos_sin = base.model.rotary_emb(x, pos[None].expand(3, 1, t))
    mask = tm.far_key_mask(t, w)
    with torch.no_grad():
        ref = attn(x, cos_sin, mask)[0][0, q]
        far = x.clone()
        far[0, : q - w + 1] += torch.randn(q - w + 1, x.shape[-1], generator=g)
        assert torch.allclose(attn(far, cos_sin, mask)[0][0, q], ref, atol=1e-6)
        near = x.clone()
        near[0, q - w + 1] += torch.randn(x.shape[-1], generator=g)
        assert (attn(near, cos_sin, mask)[0][0, q] - ref).abs().max() > 1e-3
        # without the mask the far change is seen
        assert (attn(far, cos_sin, None)[0][0, q] - attn(x, cos_sin, None)[0][0, q]).abs().max() > 1e-3


def test_whole_sequence_window_equals_default_loss(small):
    tok, base = small
    ids = torch.tensor([tm.encode_episode(tok, guilang.generate_episode(3, 3))[0][:60]] * 2)
    w = torch.ones(ids.shape)
    with torch.no_grad():
        plain = tm.base_loss(base, ids, w)
        whole = tm.base_loss(base, ids, w, tm.far_key_mask(ids.shape[1], ids.shape[1]))
        short = tm.base_loss(base, ids, w, tm.far_key_mask(ids.shape[1], 4, torch.tensor([True, False])))
    assert torch.allclose(plain, whole, atol=1e-5)
    assert abs(float(short - plain)) > 1e-4
