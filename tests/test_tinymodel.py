"""tinymodel: tokenizer properties, MTP forward == transformers' own decoder layer, bit-for-bit
training determinism, model-dir validation errors, and (when present) the trained model's answers."""
import json
from pathlib import Path

import pytest
import torch

from statescope.workload import guilang
from statescope.models import tinymodel as tm
from statescope.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT / "data" / "models" / "tiny-gui"
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    texts = ["".join(t for t, _ in guilang.transcript_segments(guilang.generate_episode(s, n)))
             for s in range(30) for n in (3, 8)]
    return tm.train_tokenizer(texts, vocab_size=400)


@pytest.fixture(scope="module")
def small(tok):
    cfg = tm.model_config(tok)
    cfg.update(hidden_size=64, intermediate_size=96)
    base = tm.new_base_model(cfg, seed=0).eval()
    torch.manual_seed(1)
    return cfg, base, tm.MTPHead(base.config).eval()


def test_tokenizer(tok):
    assert tok.token_to_id("!") == 0
    assert tok.decode([0, 0, 0]) == "!!!"
    assert tok.get_vocab_size() <= 400
    specials = [tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert specials == list(range(tok.get_vocab_size() - 3, tok.get_vocab_size()))
    ep = guilang.generate_episode(123, 6)
    ids, ans = tm.encode_episode(tok, ep)
    # segment-wise encoding == encoding the prompt text in one go (what vLLM does)
    assert ids == tok.encode("".join(t for t, _ in guilang.transcript_segments(ep))).ids
    answers = tok.decode([i for i, a in zip(ids, ans) if a], skip_special_tokens=False)
    assert answers == "".join(s.action + "<|im_end|>" for s in ep.steps)


def test_tokenizer_training_is_deterministic(tok):
    texts = ["".join(t for t, _ in guilang.transcript_segments(guilang.generate_episode(s, n)))
             for s in range(30) for n in (3, 8)]
    assert tm.train_tokenizer(texts, vocab_size=400).to_str() == tok.to_str()


def test_mtp_matches_transformers_decoder_layer(small, tok):
    """Step 1 and the chained step 2 equal transformers' own layer run on the same token rows."""
    cfg, base, mtp = small
    ids = torch.tensor([tm.encode_episode(tok, guilang.generate_episode(1, 3))[0][:40]])
    with torch.no_grad():
        hidden = base.model(input_ids=ids).last_hidden_state
        l1, l2 = tm.mtp_forward(base, mtp, ids, hidden)
        emb = base.model.embed_tokens
        x1 = mtp.project(emb(ids[:, 1:]), hidden[:, :-1])
        layer = mtp.layers[0]
        pos = torch.arange(x1.shape[1])[None]
        ref1 = base.lm_head(mtp.norm(layer(x1, position_embeddings=base.model.rotary_emb(x1, pos))))
        assert torch.allclose(l1, ref1, atol=1e-4)
        j = 17  # step 2 at position j+1: rows = step-1 inputs at 0..j, then the chained input
        m1 = mtp.norm(layer(x1, position_embeddings=base.model.rotary_emb(x1, pos)))
        x2 = mtp.project(emb(ids[:, j + 2:j + 3]), m1[:, j:j + 1])
        rows = torch.cat([x1[:, :j + 1], x2], 1)
        p2 = torch.arange(j + 2)[None]
        ref2 = base.lm_head(mtp.norm(layer(rows, position_embeddings=base.model.rotary_emb(rows, p2))))
        assert torch.allclose(l2[:, j], ref2[:, -1], atol=1e-4)
        assert not torch.allclose(l2[:, j], l1[:, j + 1], atol=1e-3)  # chaining really differs


def test_training_is_bit_for_bit_deterministic(small, tok):
    cfg = small[0]
    ids = torch.tensor([tm.encode_episode(tok, guilang.generate_episode(s, 3))[0][:120] for s in (1, 2)])
    w = torch.ones_like(ids, dtype=torch.float32)

    def run() -> dict:
        base = tm.new_base_model(cfg, seed=5)
        opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
        for _ in range(2):
            loss = tm.base_loss(base, ids, w)
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.manual_seed(6)
        mtp = tm.MTPHead(base.config)
        with torch.no_grad():
            hidden = base.model(input_ids=ids).last_hidden_state
        tm.mtp_loss(base, mtp, ids, w, hidden).backward()
        return {**base.state_dict(), **{f"mtp.{k}": p.grad for k, p in mtp.named_parameters()}}

    a, b = run(), run()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], tm.new_base_model(cfg, seed=5).model.embed_tokens.weight)


@pytest.fixture()
def saved(small, tok, tmp_path):
    cfg, base, mtp = small
    return tm.save_model_dir(tmp_path / "m", cfg, base, mtp, tok, note="test")


def test_validate_and_load_roundtrip(saved, small):
    info = tm.validate_model_dir(saved)
    assert info["config"]["vocab_size"] == small[0]["vocab_size"]
    base, mtp, tok, cfg = tm.load_model_dir(saved)
    assert torch.equal(base.lm_head.weight, small[1].lm_head.weight.to(torch.bfloat16).float())
    tc = json.loads((saved / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and "<|im_start|>" in tc["chat_template"]


def _rewrite(path: Path, drop: str | None = None) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path))
    sd.pop(drop)
    save_file(sd, str(path))


def test_missing_mtp_weight_is_one_clear_error(saved):
    _rewrite(saved / "model.safetensors", drop="mtp.fc.weight")
    with pytest.raises(InputError, match=r"model\.safetensors: tensor 'mtp\.fc\.weight' missing \(expected shape"):
        tm.validate_model_dir(saved)


def test_wrong_head_dim_is_one_clear_error(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["linear_value_head_dim"] = 64
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=r"config\.json: field 'linear_value_head_dim' is 64, expected 128"):
        tm.validate_model_dir(saved)


def test_truncated_safetensors_is_one_clear_error(saved):
    f = saved / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"model\.safetensors: truncated"):
        tm.validate_model_dir(saved)
    f.write_bytes(data[:5])
    with pytest.raises(InputError, match="truncated"):
        tm.validate_model_dir(saved)


def test_wrong_shape_and_missing_files(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    f = saved / "model.safetensors"
    sd = load_file(str(f))
    sd["mtp.norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    save_file(sd, str(f))
    with pytest.raises(InputError, match=r"'mtp\.norm\.weight' has shape \[3\]"):
        tm.validate_model_dir(saved)
    (saved / "tokenizer.json").unlink()
    with pytest.raises(InputError, match=r"tokenizer\.json: missing"):
        tm.validate_model_dir(saved)
    with pytest.raises(InputError, match="config.json: missing"):
        tm.validate_model_dir(tmp_path / "nowhere")


def test_committed_geometry_lets_blocks_be_small():
    """vLLM sizes the attention page to hold one Mamba state page: with 1 value head (float32 SSM
    state) and 4 KV heads of 128 (bf16), 128 tokens of attention page cover a Mamba page even
    with the 2 extra conv rows of MTP(2) -- the old 2-value-head / 1-KV-head geometry needed 384."""
    def tokens_per_state(cfg: dict, spec: int = 2) -> float:
        conv_dim = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + \
            cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
        mamba = (cfg["linear_conv_kernel_dim"] - 1 + spec) * conv_dim * 2 + \
            cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"] * cfg["linear_key_head_dim"] * 4
        return mamba / (2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2)

    cfg = tm.validate_model_dir(TRAINED)["config"]
    assert (cfg["linear_num_value_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (1, 4, 128)
    assert tokens_per_state(cfg) <= 64
    old = {**cfg, "linear_num_value_heads": 2, "num_key_value_heads": 1}
    assert tokens_per_state(old) > 256  # what forced 384-token blocks before


def test_trained_model_answers_held_out_steps():
    """Teacher-forced argmax over held-out episodes: most answers must come out exactly right."""
    tm.validate_model_dir(TRAINED)
    base, _, tok, _ = tm.load_model_dir(TRAINED)
    right = total = 0
    with torch.no_grad():
        for seed in range(5):
            ep = guilang.generate_episode(20_000_000 + seed, 6)
            ids, ans = tm.encode_episode(tok, ep)
            pred = base(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
            ok = [int(pred[i - 1]) == ids[i] for i, a in enumerate(ans) if a]
            # one answer = a run of answer tokens; count answers with every token right
            runs, cur = [], []
            for i, a in enumerate(ans):
                if a:
                    cur.append(int(pred[i - 1]) == ids[i])
                elif cur:
                    runs.append(all(cur))
                    cur = []
            right += sum(runs)
            total += len(runs)
            assert len(ok) > 0
    assert total == 30 and right / total >= 0.8
    assert not (TRAINED / "metrics.json").exists() or "eval" in json.loads((TRAINED / "metrics.json").read_text())
