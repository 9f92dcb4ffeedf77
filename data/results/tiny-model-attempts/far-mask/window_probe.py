"""Scratch diagnostic: teacher-forced held-out accuracy (the train script's probe) with full
attention and with the training window applied at inference."""
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "lib"))  # <repo>/lib
from statescope import guilang, guilang_seq, tinymodel as tm
torch.set_num_threads(1)
d = Path(sys.argv[1]); W = int(sys.argv[2]); n_ep = int(sys.argv[3]) if len(sys.argv) > 3 else 12
base, mtp, tok, cfg = tm.load_model_dir(d, torch.float32)
var = guilang_seq.read_variant(d)
out = {}
for name, win in (("full", 0), (f"window{W}", W)):
    by = {}
    with torch.no_grad():
        for e in range(n_ep):
            ep = guilang.generate_episode(10_000_000 + 5_000 + e, 3 + e % 10, **var)
            ids, ans = tm.encode_episode(tok, ep)
            x = torch.tensor([ids])
            kw = {} if not win else {"attention_mask": {"full_attention": tm.far_key_mask(len(ids), win), "linear_attention": None}}
            pred = base(input_ids=x, **kw).logits[0].argmax(-1)
            runs, cur = [], []
            for i, a in enumerate(ans):
                if a: cur.append(int(pred[i - 1]) == ids[i])
                elif cur: runs.append(all(cur)); cur = []
            starts = [i for i, a in enumerate(ans) if a and not ans[i - 1]]
            q = tok.token_to_id('="'); goal = ids.index(q)  # the goal's text=" is the first =" of the transcript
            for st, ok, s0 in zip(ep.steps, runs, starts):
                c = by.setdefault(st.kind, [0, 0]); c[0] += ok; c[1] += 1
                if st.kind == "type":
                    e0 = s0 + next(j for j in range(len(ids) - s0) if ids[s0 + j] == q) + 1
                    e1 = e0 + next(j for j in range(len(ids) - e0) if tok.decode([ids[e0 + j]]).startswith('"'))
                    val = ids[e0:e1]  # the answer's value tokens
                    ctx = ids[max(0, s0 - W):s0]
                    seen = any(ctx[i:i + len(val)] == val for i in range(len(ctx) - len(val) + 1))
                    far = "type_value_in_window" if seen else "type_value_only_beyond_window"
                    c = by.setdefault(far, [0, 0]); c[0] += ok; c[1] += 1
    kinds = {k: v for k, v in by.items() if not k.startswith("type_")}
    out[name] = {"all": round(sum(c for c, _ in kinds.values()) / sum(n for _, n in kinds.values()), 3),
                 **{k: f"{c}/{n}" for k, (c, n) in sorted(by.items())}}
print(json.dumps(out))
