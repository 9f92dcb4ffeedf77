"""Measure the tiny GUI-agent model through a real vLLM-CPU engine (``vllm_metrics.json``).

What it does: starts one in-process engine (``statescope.engine.OfflineEngine``; by default the
workbook's trigger configuration: prefix caching + ``align`` + MTP with 2 speculative tokens),
sends the chat-templated prompt of every step of held-out guilang episodes (greedy, top-2
logprobs), grades each answer (``guilang.grade``), and reports validity, correctness, the fraction
of output tokens whose top-1/top-2 logprob margin is below 0.1, vLLM's own MTP acceptance counters,
the prefix-cache hit rate, and the block sizes the engine resolved (attention ``block_size`` and
``mamba_block_size``, read back from the running config, not from what was asked).

    python -m statescope.tiny_vllm --episodes 10 --fault-episodes 10 \
        --out data/models/tiny-gui/vllm_metrics.json

What it deliberately does not do: train, compare against PyTorch (``scripts/train_tiny_model.py``
does that), or capture states.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

from statescope import guilang

EVAL_SEED0 = 10_000_000  # held-out episodes (training seeds are < 1e6), as the training script
NEAR_TIE = 0.1


def step_prompts(episodes: int, seed0: int = EVAL_SEED0) -> list[tuple[str, guilang.Step]]:
    """(prompt, step) for every step of held-out episodes seed0.. (3-12 steps each)."""
    out = []
    for e in range(episodes):
        ep = guilang.generate_episode(seed0 + e, 3 + e % 10)
        out += [(guilang.render_prompt(ep, s.index), s) for s in ep.steps]
    return out


def measure(model_dir: str | Path, episodes: int = 10, config=None, max_tokens: int = 24,
            engine=None) -> dict:
    """Run the held-out steps through one vLLM engine (``engine``, or a new one for ``config``,
    default: the trigger configuration on ``model_dir``); returns the metrics dict. With a given
    engine, the spec-decode counters are the difference over these requests."""
    from statescope.engine import EngineConfig, OfflineEngine

    pairs = step_prompts(episodes)
    t0 = time.perf_counter()
    with contextlib.nullcontext(engine) if engine is not None else \
            OfflineEngine(config or EngineConfig(model=str(model_dir))) as eng:
        before = eng.metrics()
        records = eng.generate([p for p, _ in pairs], max_tokens=max_tokens, logprobs=2)
        resolved, metrics = eng.resolved(), eng.metrics()
        startup = eng.startup_s
    for key in ("spec_draft_tokens", "spec_accepted_tokens"):
        metrics[key] -= before[key]
    metrics["spec_acceptance_rate"] = (metrics["spec_accepted_tokens"] / metrics["spec_draft_tokens"]
                                       if metrics["spec_draft_tokens"] else None)
    grades = [guilang.grade(r.text, s) for r, (_, s) in zip(records, pairs)]
    margins = [m for r in records for m in r.margins if m is not None]
    by_kind: dict[str, list[int]] = {}
    for g, (_, s) in zip(grades, pairs):
        by_kind.setdefault(s.kind, [0, 0])
        by_kind[s.kind][0] += g["correct"]
        by_kind[s.kind][1] += 1
    return {
        "engine": f"vllm {resolved['vllm_version']} on {resolved['device']}",
        "architecture": resolved["architecture"], "draft_architecture": resolved["draft_architecture"],
        "enable_prefix_caching": resolved["enable_prefix_caching"],
        "mamba_cache_mode": resolved["mamba_cache_mode"],
        "num_speculative_tokens": resolved["num_speculative_tokens"],
        "block_size": resolved["block_size"], "mamba_block_size": resolved["mamba_block_size"],
        "episodes": f"{EVAL_SEED0}..{EVAL_SEED0 + episodes - 1}", "requests": len(records),
        "valid": sum(g["valid"] for g in grades) / len(grades),
        "correct": sum(g["correct"] for g in grades) / len(grades),
        "correct_by_kind": {k: f"{c}/{n}" for k, (c, n) in sorted(by_kind.items())},
        "near_tie_fraction": sum(m < NEAR_TIE for m in margins) / max(1, len(margins)),
        "output_tokens": len(margins), "min_margin": min(margins) if margins else None,
        "draft_tokens": metrics["spec_draft_tokens"], "accepted_tokens": metrics["spec_accepted_tokens"],
        "acceptance": metrics["spec_acceptance_rate"],
        "accepted_per_pos": metrics["spec_accepted_per_pos"],
        "prefix_cache_hit_rate": metrics["prefix_cache_hit_rate"],
        "prompt_tokens": [min(len(r.prompt_token_ids) for r in records),
                          max(len(r.prompt_token_ids) for r in records)],
        "examples": [r.text for r in records[:6]], "max_tokens": max_tokens, "temperature": 0,
        "engine_start_s": round(startup, 1), "wall_s": round(time.perf_counter() - t0, 1),
    }


def fault_sensitivity(engine, episodes: int = 3, at_output_token: int = 3,
                      kinds: tuple[str, ...] = ("zero_conv", "zero_ssm"),
                      layer_sets: tuple = (None, [0], [1], [2]), max_tokens: int = 24) -> dict:
    """How often zeroing GDN state mid-answer changes the rest of the answer, inside vLLM.

    Runs the held-out step prompts clean, then once per (kind, GDN layer set) with a planted
    ``statescope.faults`` fault that zeroes the running conv window (``zero_conv``) or recurrent
    state (``zero_ssm``) of those layers once the request has produced ``at_output_token`` tokens.
    Returns {"<kind>/<layers>": {"changed", "eligible", "planted_req_ids"}}; eligible = answers
    longer than ``at_output_token + 1`` tokens (shorter ones end before the fault can act);
    ``planted_req_ids`` counts the distinct vLLM request ids the fault log names (0: never fired)."""
    from statescope.faults import FaultSpec, install_fault

    prompts = [p for p, _ in step_prompts(episodes)]
    clean = [r.output_token_ids for r in engine.generate(prompts, max_tokens=max_tokens, logprobs=0)]
    out: dict[str, dict] = {}
    try:
        for kind in kinds:
            for layers in layer_sets:
                spec = FaultSpec(kind=kind, rate=1.0, at_output_token=at_output_token, layers=layers)
                install_fault(spec)
                got = engine.generate(prompts, max_tokens=max_tokens, logprobs=0)
                fired = len({p.get("req_id") for p in spec.planted})
                # answers still running after at_output_token tokens are the ones it can hit
                pairs = [(c, r.output_token_ids) for c, r in zip(clean, got) if len(c) > at_output_token + 1]
                name = f"{kind}/{'all' if layers is None else 'gdn' + ','.join(map(str, layers))}"
                out[name] = {"changed": sum(c != g for c, g in pairs), "eligible": len(pairs),
                             "planted_req_ids": fired}
    finally:
        install_fault(FaultSpec(kind="zero_ssm", rate=0.0))  # selects no request: fault off
    return out


def main() -> None:
    import statescope  # noqa: F401  (CPU import shims before vLLM)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="data/models/tiny-gui")
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--fault-episodes", type=int, default=3,
                    help="held-out episodes for the planted-fault sensitivity (0: skip)")
    args = ap.parse_args()
    from statescope.engine import EngineConfig, OfflineEngine

    with OfflineEngine(EngineConfig(model=str(args.model))) as eng:
        res = measure(args.model, args.episodes, engine=eng)
        if args.fault_episodes:
            res["fault_sensitivity"] = {
                "at_output_token": 3, "episodes": args.fault_episodes,
                "changed": fault_sensitivity(eng, episodes=args.fault_episodes)}
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
