"""Train the tiny GUI-agent model (tokenizer -> base -> MTP head), save it, and measure it.

What it does: deterministic from --seed (same torch build, thread count and device): trains the BPE
tokenizer on guilang text; the 4-layer Qwen3.5 base model (transformers' PyTorch implementation):
first ``--copy-warmup`` dense copy steps (``tiny_data.copy_batch``: random strings repeated once,
which forms the copy circuit the answers need), then the short-to-long guilang curriculum
(``tiny_data.batch``: answers and screen values weigh 1, other prompt tokens ``--context-weight``);
then the MTP head on the frozen base. Writes the bf16 model dir with train_log.jsonl and
metrics.json. Metrics (held-out episodes, bf16-rounded weights run in float32): greedy
validity/correctness, near-tie fraction of greedy output tokens, MTP acceptance (k=2, simulated as
vLLM's draft/verify loop accepts on greedy output), and sensitivity of the rest of an answer to a
corrupted GDN conv window / recurrent state (by mode and by layer).

What it deliberately does not do: run vLLM (``statescope.models.tiny_vllm`` measures it there).

  OMP_NUM_THREADS=2 python scripts/train_tiny_model.py --threads 2 --base-steps 550 --out DIR
  python scripts/train_tiny_model.py --device cuda --base-steps 550 --out DIR   # how tiny-gui was made
  python scripts/train_tiny_model.py --eval-only --out data/models/tiny-gui
  python scripts/train_tiny_model.py --attention-layer 0 --out DIR   # the attention-first experiment
  python scripts/train_tiny_model.py --value-words 7 --value-alphabet 4 --warmup-alphabet 4 \
      --value-sens-prompts 20 --out DIR     # opt-in sequence values (statescope.workload.guilang_seq)

``--value-words N`` trains and evaluates on the sequence-value language (values of N-2..N words
from ``--value-alphabet`` words; recorded in DIR/guilang_variant.json, which ``--eval-only`` and
``statescope.models.tiny_vllm`` read); ``--value-sens-prompts`` adds the mid-value sensitivity grid;
``--value-sens-other-point`` also swaps in another request's state at a random *other* token
(reported separately, ``value_sensitivity_other_point_*``). ``--attn-window W
[--attn-window-frac p]`` hides keys W or more tokens back from the attention layer in (a fraction p
of) the guilang training samples (``tm.far_key_mask``), so far information must pass through the
GDN state; the copy warm-up, the MTP phase and every evaluation run full attention.
All new flags default to off: the default run writes the same model as before.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import torch

from statescope.workload import guilang
from statescope.workload import guilang_seq
from statescope.models import tiny_data
from statescope.models import tinymodel as tm

EVAL_SEED0 = 10_000_000    # held-out episode seeds start here (training seeds are < 1e6)
NEAR_TIE = 0.1


def lr_at(step: int, total: int, peak: float, warmup: int = 20) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def train_loop(params, loss_fn, steps: int, lr: float, log, tag: str, probe=None) -> None:
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            rec = {"phase": tag, "step": step, "loss": round(loss.item(), 5), "s": round(time.time() - t0, 1)}
            if probe is not None and (step % 100 == 0 or step == steps - 1):
                rec["probe"] = probe()
            log(rec)


def train(out: Path, seed: int, base_steps: int, mtp_steps: int, budget: int, lr: float,
          context_weight: float, device: str = "cpu", probe_every: bool = False, warmup: int = 150,
          attention_layer: int = 3, variant: dict | None = None, warmup_alphabet: int = 0,
          gdn_dt: float = 0.0, gdn_dt_layers: list[float] | None = None, attn_window: int = 0,
          attn_window_frac: float = 1.0) -> dict:
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "train_log.jsonl").open("w")

    def log(rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        log_file.write(json.dumps(rec) + "\n")
        log_file.flush()

    t0 = time.time()
    texts = ["".join(s for s, _ in guilang.transcript_segments(guilang.generate_episode(900_000 + s, n)))
             for s in range(400) for n in (3, 6, 9, 12)]
    tok = tm.train_tokenizer(texts, vocab_size=1024)
    cfg = tm.model_config(tok, attention_layer)
    base = tm.new_base_model(cfg, seed).to(device)
    if gdn_dt or gdn_dt_layers:  # opt-in: slow GDN decay at init (dt_bias=1 forgets ~99 %/token)
        gdn_layers = [layer for layer in base.model.layers if hasattr(layer, "linear_attn")]
        # per GDN layer (ordinal order); 0 keeps that layer's default init
        dts = gdn_dt_layers if gdn_dt_layers else [gdn_dt] * len(gdn_layers)
        if len(dts) != len(gdn_layers):
            raise ValueError(f"--gdn-dt-layers: {len(dts)} values for {len(gdn_layers)} GDN layers")
        with torch.no_grad():
            for layer, dt in zip(gdn_layers, dts):
                if dt:
                    layer.linear_attn.dt_bias.fill_(math.log(math.expm1(dt)))
    log({"phase": "setup", "vocab": tok.get_vocab_size(), "params": sum(p.numel() for p in base.parameters()),
         "threads": torch.get_num_threads(), "torch": torch.__version__})
    base.train()

    n_text = tok.get_vocab_size() - 3  # the specials are the last 3 ids

    def base_step(s: int) -> torch.Tensor:
        if s < warmup:
            ids, w = tiny_data.copy_batch(s, seed, budget, n_text, alphabet=warmup_alphabet)
        else:
            ids, w, _ = tiny_data.batch(tok, s - warmup, base_steps - warmup, seed, budget, context_weight,
                                        variant)
            if attn_window:  # opt-in far-key masking, guilang steps only (evaluation: full attention)
                return tm.base_loss(base, ids.to(device), w.to(device), window_mask(s, ids.shape))
        return tm.base_loss(base, ids.to(device), w.to(device))

    def window_mask(s: int, shape) -> torch.Tensor:
        rows = None  # every sample windowed; else a seeded draw per sample (global rng untouched)
        if attn_window_frac < 1:
            g = torch.Generator().manual_seed(seed * 7919 + 3_000_000 + s)
            rows = torch.rand(shape[0], generator=g) < attn_window_frac
        return tm.far_key_mask(shape[1], attn_window, rows, device=device)

    probe = (lambda: teacher_forced(base, tok, 12, device, variant)) if probe_every else None
    train_loop(list(base.parameters()), base_step, base_steps, lr, log, "base", probe)
    base_s = time.time() - t0
    base.eval()
    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed + 1)
    mtp = tm.MTPHead(base.config).to(device)
    # Start the MTP decoder layer from the base attention layer: same shapes, a sensible start.
    attn_idx = cfg["layer_types"].index("full_attention")
    mtp.layers[0].load_state_dict(base.model.layers[attn_idx].state_dict())

    def mtp_step(s: int) -> torch.Tensor:
        ids, w, _ = tiny_data.batch(tok, 50_000 + s, 50_000 + mtp_steps, seed, budget, context_weight,
                                    variant)
        ids, w = ids.to(device), w.to(device)
        with torch.no_grad():
            hidden = base.model(input_ids=ids).last_hidden_state
        return tm.mtp_loss(base, mtp, ids, w, hidden)

    train_loop(list(mtp.parameters()), mtp_step, mtp_steps, lr, log, "mtp")
    total_s = time.time() - t0
    note = (f"guilang seed={seed} copy_warmup={warmup} base_steps={base_steps} mtp_steps={mtp_steps} tokens/batch={budget} "
            f"lr={lr} context_weight={context_weight}")
    if attention_layer != 3:  # the default keeps the note (and the file) as before
        note += f" attention_layer={attention_layer}"
    if variant:  # opt-in sequence values (guilang_seq)
        note += " " + " ".join(f"{k}={v}" for k, v in variant.items())
    if warmup_alphabet:
        note += f" warmup_alphabet={warmup_alphabet}"
    if gdn_dt:
        note += f" gdn_dt={gdn_dt}"
    if gdn_dt_layers:
        note += f" gdn_dt_layers={','.join(map(str, gdn_dt_layers))}"
    if attn_window:
        note += f" attn_window={attn_window} attn_window_frac={attn_window_frac}"
    tm.save_model_dir(out, cfg, base.cpu(), mtp.cpu(), tok, note)
    guilang_seq.write_variant(out, variant)
    log({"phase": "done", "base_s": round(base_s, 1), "total_s": round(total_s, 1)})
    log_file.close()
    return {"train_seconds": round(total_s, 1), "base_seconds": round(base_s, 1), "seed": seed,
            "base_steps": base_steps, "mtp_steps": mtp_steps, "tokens_per_batch": budget, "lr": lr,
            "context_weight": context_weight, "copy_warmup_steps": warmup, "attention_layer": attention_layer,
            "threads": torch.get_num_threads(), **({"variant": variant, "warmup_alphabet": warmup_alphabet,
                                                    "gdn_dt": gdn_dt}
                                                   if variant or warmup_alphabet or gdn_dt else {}),
            **({"gdn_dt_layers": gdn_dt_layers} if gdn_dt_layers else {}),
            **({"attn_window": attn_window, "attn_window_frac": attn_window_frac} if attn_window else {})}


def teacher_forced(base, tok, n_episodes: int, device: str = "cpu", variant: dict | None = None) -> dict:
    """Fraction of held-out answers whose every token is the argmax given the gold prefix, by kind
    (a cheap training probe; the real metrics decode greedily)."""
    was = base.training
    base.eval()
    by_kind: dict[str, list[int]] = {}
    with torch.no_grad():
        for e in range(n_episodes):
            ep = guilang.generate_episode(EVAL_SEED0 + 5_000 + e, 3 + e % 10, **(variant or {}))
            ids, ans = tm.encode_episode(tok, ep)
            pred = base(input_ids=torch.tensor([ids], device=device)).logits[0].argmax(-1).cpu()
            runs, cur = [], []
            for i, a in enumerate(ans):
                if a:
                    cur.append(int(pred[i - 1]) == ids[i])
                elif cur:
                    runs.append(all(cur))
                    cur = []
            for step, ok in zip(ep.steps, runs):
                by_kind.setdefault(step.kind, [0, 0])
                by_kind[step.kind][0] += ok
                by_kind[step.kind][1] += 1
    base.train(was)
    right = sum(c for c, _ in by_kind.values())
    return {"all": round(right / sum(n for _, n in by_kind.values()), 3),
            **{k: f"{c}/{n}" for k, (c, n) in sorted(by_kind.items())}}


# ----------------------------------------------------------------------------- evaluation
def _greedy(base, prompt_ids: list[int], eos: int, max_new: int = 24) -> tuple[list[int], list[float]]:
    """Greedy decode with the transformers cache; returns tokens and top1-top2 logit margins."""
    out = base(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    cache, logits = out.past_key_values, out.logits[0, -1]
    toks, margins = [], []
    for _ in range(max_new):
        top = logits.float().topk(2)
        toks.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        if toks[-1] == eos:
            break
        out = base(input_ids=torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]
    return toks, margins


def _acceptance(answer_pos: list[int], ids: list[int], l1: torch.Tensor, l2: torch.Tensor) -> tuple[int, int]:
    """Drafted/accepted counts of a k=2 MTP loop over one answer (teacher-forced = greedy path).

    Position c holds the last known token; draft 1 = argmax l1[c-1] (predicts c+1), draft 2 =
    argmax l2[c-1] (predicts c+2); drafts past the answer's end count as rejected."""
    start, end = answer_pos[0], answer_pos[-1]  # first answer token comes from the prefill
    c, drafted, accepted = start, 0, 0
    while c < end:
        d1, d2 = int(l1[c - 1].argmax()), int(l2[c - 1].argmax())
        drafted += 2
        a = 0
        if c + 1 <= end and d1 == ids[c + 1]:
            a = 1
            if c + 2 <= end and d2 == ids[c + 2]:
                a = 2
        accepted += a
        c += a + 1
    return drafted, accepted


def evaluate(model_dir: Path, n_episodes: int = 60, sens_trials: int = 60, value_prompts: int = 0,
             value_other_point: bool = False) -> dict:
    base, mtp, tok, cfg = tm.load_model_dir(model_dir, torch.float32)
    variant = guilang_seq.read_variant(model_dir)
    eos = cfg["eos_token_id"]
    valid = correct = steps = 0
    margins: list[float] = []
    drafted = accepted = 0
    by_kind: dict[str, list[int]] = {}
    prompts: list[tuple[list[int], list[int]]] = []  # (prompt ids, gold answer ids) for sensitivity
    with torch.no_grad():
        for e in range(n_episodes):
            ep = guilang.generate_episode(EVAL_SEED0 + e, 3 + e % 10, **variant)
            ids, ans = tm.encode_episode(tok, ep)
            x = torch.tensor([ids])
            hidden = base.model(input_ids=x).last_hidden_state
            logits = base.lm_head(hidden)[0]
            l1, l2 = tm.mtp_forward(base, mtp, x, hidden)
            l1, l2 = l1[0], l2[0]
            pos = [i for i, a in enumerate(ans) if a]
            spans, cur = [], []
            for p in pos:  # split answer positions into one span per step
                if cur and p != cur[-1] + 1:
                    spans.append(cur)
                    cur = []
                cur.append(p)
            spans.append(cur)
            for step, span in zip(ep.steps, spans):
                steps += 1
                pred = logits[[p - 1 for p in span]].float()
                top = pred.topk(2, dim=-1)
                if bool((top.indices[:, 0] == torch.tensor([ids[p] for p in span])).all()):
                    text, mg = step.action, (top.values[:, 0] - top.values[:, 1]).tolist()
                else:  # greedy left the gold path: decode for real
                    toks, mg = _greedy(base, ids[:span[0]], eos)
                    text = tok.decode([t for t in toks if t != eos])
                g = guilang.grade(text, step)
                valid += g["valid"]
                correct += g["correct"]
                by_kind.setdefault(step.kind, [0, 0])
                by_kind[step.kind][0] += g["correct"]
                by_kind[step.kind][1] += 1
                margins += mg
                d, a = _acceptance(span, ids, l1, l2)
                drafted, accepted = drafted + d, accepted + a
                prompts.append((ids[:span[0]], [ids[p] for p in span]))
    sens = sensitivity(base, prompts, eos, sens_trials, tok.token_to_id("="))
    if value_prompts:  # opt-in: damage GDN state inside a sequence value (guilang_seq)
        with torch.no_grad():
            sens.update(guilang_seq.value_sensitivity(base, prompts, eos, tok.token_to_id('="'), value_prompts,
                                                     other_point=value_other_point))
    return {"eval_episodes": n_episodes, "eval_steps": steps, "validity": valid / steps,
            "correctness": correct / steps,
            "correct_by_kind": {k: f"{c}/{n}" for k, (c, n) in sorted(by_kind.items())},
            "near_tie_fraction": sum(m < NEAR_TIE for m in margins) / len(margins),
            "greedy_tokens": len(margins), "min_margin": min(margins),
            "mtp_k2_acceptance_pytorch": accepted / drafted, "mtp_drafted": drafted, **sens}


def _id_index(answer: list[int], eq: int) -> int | None:
    """Number of answer tokens before the ``=`` of ``id=`` (None if no id): the state is corrupted
    after ``id``; ``=`` still comes from the clean logits, the id and the rest from corrupted state."""
    return answer.index(eq) if eq in answer[:4] else None


def sensitivity(base, prompts, eos: int, trials: int, eq: int) -> dict:
    """Corrupt one GDN layer's conv window or recurrent state mid-answer, right after ``id`` (the
    answer tokens up to it are already emitted); count how often the rest of the greedy answer
    changes. Modes: zero, or swap in another request's state at the same answer token."""
    gdn = [i for i, t in enumerate(base.config.layer_types) if t == "linear_attention"]
    rng = random.Random(1234)
    cands = [(p, g, _id_index(g, eq)) for p, g in prompts if _id_index(g, eq) is not None]
    res: dict[str, list[int]] = {}
    by_layer: dict[str, list[int]] = {}
    for trial in range(trials):
        (prompt, gold, k), (other, ogold, ok) = rng.sample(cands, 2)
        layer, part, mode = rng.choice(gdn), ("conv", "recurrent")[trial % 2], ("zero", "swap")[trial // 2 % 2]
        runs = []
        for corrupt in (False, True):
            out = base(input_ids=torch.tensor([prompt + gold[:k]]), use_cache=True)
            cache = out.past_key_values
            if corrupt:
                lay = cache.layers[layer]
                states = lay.conv_states if part == "conv" else lay.recurrent_states
                if mode == "zero":
                    states[0].zero_()
                else:
                    o = base(input_ids=torch.tensor([other + ogold[:ok]]), use_cache=True).past_key_values
                    src = o.layers[layer]
                    states[0].copy_((src.conv_states if part == "conv" else src.recurrent_states)[0])
            logits, toks = out.logits[0, -1], []
            for _ in range(len(gold) - k + 4):
                toks.append(int(logits.argmax()))
                if toks[-1] == eos:
                    break
                out = base(input_ids=torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True)
                logits = out.logits[0, -1]
            runs.append(toks)
        res.setdefault(f"{part}_{mode}", []).append(int(runs[0] != runs[1]))
        by_layer.setdefault(f"layer{layer}_{part}", []).append(int(runs[0] != runs[1]))
    flat = [v for vs in res.values() for v in vs]
    return {"sensitivity_changed_fraction": sum(flat) / len(flat),
            "sensitivity_by_mode": {k: f"{sum(v)}/{len(v)}" for k, v in sorted(res.items())},
            "sensitivity_by_layer": {k: f"{sum(v)}/{len(v)}" for k, v in sorted(by_layer.items())},
            "sensitivity_trials": len(flat)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("data/models/tiny-gui"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-steps", type=int, default=550)
    ap.add_argument("--mtp-steps", type=int, default=120)
    ap.add_argument("--tokens", type=int, default=4096, help="token budget of one batch")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--context-weight", type=float, default=0.1)
    ap.add_argument("--copy-warmup", type=int, default=150, help="dense copy steps before guilang")
    ap.add_argument("--attention-layer", type=int, default=3,
                    help="index of the full-attention layer (0 was tried: no copy circuit formed)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (how the committed model was trained)")
    ap.add_argument("--probe", action="store_true", help="log teacher-forced accuracy every 100 steps")
    ap.add_argument("--eval-episodes", type=int, default=60)
    ap.add_argument("--sens-trials", type=int, default=60)
    ap.add_argument("--value-words", type=int, default=0,
                    help="opt-in: sequence values of N-2..N words (guilang_seq); 0 = the default language")
    ap.add_argument("--value-alphabet", type=int, default=4, help="words the sequence values draw from")
    ap.add_argument("--value-runs", type=int, default=0, help="opt-in: sequence values as this many runs")
    ap.add_argument("--warmup-alphabet", type=int, default=0,
                    help="opt-in: every other copy warm-up row over this many random tokens")
    ap.add_argument("--gdn-dt", type=float, default=0.0,
                    help="opt-in: init every GDN dt_bias to softplus^-1(X) (slow decay, e.g. 0.01)")
    ap.add_argument("--gdn-dt-layers", default="",
                    help="opt-in: per-GDN-layer --gdn-dt, comma-separated (0 = default init), e.g. 0.001,0,0")
    ap.add_argument("--attn-window", type=int, default=0,
                    help="opt-in: in guilang training steps the attention layer sees only keys s with "
                         "t-W < s <= t (far-key masking; evaluation always uses full attention)")
    ap.add_argument("--attn-window-frac", type=float, default=1.0,
                    help="opt-in: fraction of training samples that get --attn-window (the rest full)")
    ap.add_argument("--value-sens-prompts", type=int, default=0,
                    help="opt-in: prompts of the mid-value sensitivity grid (sequence-value models)")
    ap.add_argument("--value-sens-other-point", action="store_true",
                    help="opt-in: the grid also swaps in another request's state at a random other "
                         "token (reported separately)")
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--no-eval", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device != "cpu":  # bit-for-bit on one GPU + torch build too (CUBLAS_WORKSPACE_CONFIG)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    metrics_file = args.out / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if args.eval_only and metrics_file.exists() else {}
    if not args.eval_only:
        metrics = {"training": train(args.out, args.seed, args.base_steps, args.mtp_steps, args.tokens,
                                     args.lr, args.context_weight, args.device, args.probe,
                                     args.copy_warmup, args.attention_layer,
                                     guilang_seq.variant(args.value_words, args.value_alphabet, args.value_runs),
                                     args.warmup_alphabet, args.gdn_dt,
                                     [float(x) for x in args.gdn_dt_layers.split(",")] if args.gdn_dt_layers else None,
                                     args.attn_window, args.attn_window_frac)}
        metrics_file.write_text(json.dumps(metrics, indent=1))
    if args.no_eval:
        return
    t = time.time()
    metrics["eval"] = evaluate(args.out, args.eval_episodes, args.sens_trials, args.value_sens_prompts,
                               args.value_sens_other_point)
    metrics["eval"]["eval_seconds"] = round(time.time() - t, 1)
    metrics_file.write_text(json.dumps(metrics, indent=1))
    print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
