"""Lessons 6–7: the async accepted-count race, and why a poisoned cached state keeps poisoning.

What it does: ``race_table`` plays the H-accept mechanism on three requests: with async
scheduling the host reads the accepted counts from a pinned buffer whose rows the next step's
batch condense has already moved, so a request can use another request's count (and shift its
conv window by the wrong number of rows). ``check_permuted_count`` plants exactly that
(``statescope.patches.faults`` ``permute_accepted``) in the real engine and shows the victim's state
diverging in every GDN layer's conv window *and* recurrent state at one step — the H-accept
signature. ``poison_timeline`` / ``check_poison_persists`` make one cached state garbage (NaN,
standing in for any corrupting copy) and follow later requests: every prefix-cache hit on it
comes back as token 0 (``!``), requests without the hit are clean, and a prefix-cache reset ends it.

What it deliberately does not do: reproduce a real race (the CPU build forces async scheduling
off; the resolved configuration says so) — both engine checks are labelled PLANTED.
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from statescope.teach.lesson import LessonCheck


def race_table(accepted: tuple[int, ...] = (3, 1, 2), finished_row: int = 1) -> pd.DataFrame:
    """Which count each request uses: synchronized vs read after the rows were condensed."""
    names = [f"req {chr(65 + i)}" for i in range(len(accepted))]
    alive = [i for i in range(len(accepted)) if i != finished_row]
    rows = []
    for new_row, old_row in enumerate(alive):
        racy = accepted[new_row]  # the host reads the row by its *new* index, before the copy landed
        rows.append({"request": names[old_row], "row before condense": old_row, "row after": new_row,
                     "accepted (sampled)": accepted[old_row], "used, synchronized": accepted[old_row],
                     "used, async race": racy, "conv rows shifted by": racy - 1,
                     "wrong?": racy != accepted[old_row]})
    return pd.DataFrame(rows)


def check_permuted_count(lesson: Any, n_prompts: int = 5) -> LessonCheck:
    """PLANTED H-accept: swap one request's used accepted count; where does its state diverge?"""
    from statescope.patches import faults
    from statescope.diverge.digest_diff import first_divergence
    from statescope.capture.session import boundary_prompts
    from statescope.workload.trace import prompt_sha

    # One prompt longer than a step's token budget: it finishes its prefill (1 token sampled) in a
    # later step, while the others verify drafts (3 accepted) — a step whose counts differ.
    from statescope.teach.lesson import varied_prompt

    budget = int(lesson.resolved.get("max_num_batched_tokens") or 2048)
    long_len = min(budget, lesson.engine.config.max_model_len - 64)
    prompts = boundary_prompts(lesson.block_size, n_prompts) + [varied_prompt(long_len, seed=11)]
    clean, _ = lesson.capture(prompts, max_tokens=12)
    spec = faults.FaultSpec(kind="permute_accepted", prompt_shas=[prompt_sha(prompts[0])])
    faults.install_fault(spec)
    try:
        faulty, _ = lesson.capture(prompts, max_tokens=12)
    finally:
        faults.uninstall_fault()
    div = first_divergence(clean, faulty)
    victim = faulty.steps()
    victim_id = victim[victim.prompt_sha == prompt_sha(prompts[0])].req_id.iloc[0]
    row = div[div.req_id_b == victim_id]
    first = row.iloc[0] if not row.empty else None
    kinds = sorted(first.kinds) if first is not None and not pd.isna(first.first_step) else []
    layers = list(first.layers) if kinds else []
    n_gdn = len({s["layer"] for s in faulty.manifest.get("states", [])})
    mine = [p for p in spec.planted if p["req_id"] == victim_id]
    swap = victim[(victim.req_id == victim_id)
                  & (victim.num_computed_tokens == mine[0]["num_computed_tokens"])].req_step if mine else []
    swap_step = int(swap.iloc[0]) if len(swap) else None
    first_step = int(first.first_step) if kinds else None
    # The swap happens in a step's post-process; the next step reads the wrongly chosen state.
    ok = (swap_step is not None and first_step in (swap_step, swap_step + 1)
          and kinds == ["conv", "ssm"] and len(layers) == n_gdn)
    async_on = lesson.resolved.get("async_scheduling")
    return LessonCheck("PLANTED swapped accepted count: conv and recurrent state of all GDN layers diverge at once",
                 ok, f"count swapped in the victim's step {swap_step} (used "
                     f"{mine[0]['num_accepted_used'] if mine else '—'} instead of "
                     f"{mine[0]['num_accepted_sampled'] if mine else '—'}); first divergence at step "
                     f"{first_step} in {kinds} of {len(layers)}/{n_gdn} GDN layers "
                     f"(async scheduling on this build: {async_on})",
                 {"planted": spec.planted[:2]})


def poison_cached_conv(engine: Any) -> int:
    """Fill every Mamba block's conv window with NaN (block 0 is vLLM's null block)."""
    def poison(worker: Any) -> int:
        from statescope.patches.faults import gdn_layers

        runner = worker.model_runner
        ctx = runner.compilation_config.static_forward_context
        for _gid, name in gdn_layers(runner):
            ctx[name].kv_cache[0][1:].fill_(float("nan"))
        return len(gdn_layers(runner))

    return int(engine.llm.collective_rpc(poison)[0])


def poison_timeline(lesson: Any, prefix: list[int], suffixes: list[list[int]], other: list[int]) -> pd.DataFrame:
    """Cold outputs, then cache ``prefix``, poison, run the hits and a miss, reset, run again."""
    eng = lesson.engine
    gen = lambda p: eng.generate([p], max_tokens=8, ignore_eos=True)[0]  # noqa: E731
    eng.reset_prefix_cache()
    cold = {i: gen(prefix + s).output_token_ids for i, s in enumerate(suffixes)}
    cold_other = gen(other).output_token_ids
    eng.reset_prefix_cache()
    gen(prefix)
    poison_cached_conv(eng)
    rows = []
    for phase, runs in (("after poisoning", True), ("after prefix-cache reset", False)):
        if not runs:
            eng.reset_prefix_cache()
        for i, s in enumerate(suffixes):
            rec = gen(prefix + s)
            rows.append({"phase": phase, "request": f"prefix + suffix {i}", "cached_tokens": rec.num_cached_tokens,
                         "output": rec.output_token_ids, "'!' (token 0) share": rec.output_token_ids.count(0) / len(rec.output_token_ids),
                         "same as cold run": rec.output_token_ids == cold[i]})
        if runs:
            rec = gen(other)
            rows.append({"phase": phase, "request": "unrelated prompt", "cached_tokens": rec.num_cached_tokens,
                         "output": rec.output_token_ids, "'!' (token 0) share": rec.output_token_ids.count(0) / len(rec.output_token_ids),
                         "same as cold run": rec.output_token_ids == cold_other})
    return pd.DataFrame(rows)


def poison_figure(timeline: pd.DataFrame) -> Any:
    import plotly.graph_objects as go

    colours = ["#cf222e" if c > 0 else "#0969da" for c in timeline.cached_tokens]
    share = timeline["'!' (token 0) share"]
    # a clean request has a zero-height bar: its label says "0 (clean)" so it never reads as missing
    fig = go.Figure(go.Bar(x=[f"{i}: {r}" for i, r in enumerate(timeline.request)], y=share,
                           marker_color=colours, textposition="outside", cliponaxis=False,
                           text=["0 (clean)" if v == 0 else f"{v:.0%}" for v in share]))
    fig.update_layout(title="share of '!' (token 0) per later request: red = prefix-cache hit, blue = miss",
                      height=360, width=900, yaxis_range=[0, 1.15], margin=dict(t=50, b=80),
                      xaxis_title="later request (in the order run)",
                      yaxis_title="share of '!' (token 0)", yaxis_tickformat=".0%")
    return fig


def check_poison_persists(timeline: pd.DataFrame) -> LessonCheck:
    after = timeline[timeline.phase == "after poisoning"]
    hits, miss = after[after.cached_tokens > 0], after[after.cached_tokens == 0]
    reset = timeline[timeline.phase == "after prefix-cache reset"]
    ok = (len(hits) >= 2 and (~hits["same as cold run"]).all() and bool(miss["same as cold run"].all())
          and bool(reset["same as cold run"].all()))
    return LessonCheck("PLANTED poisoned cached state poisons every later hit until the cache is reset", ok,
                 f"{int((~hits['same as cold run']).sum())}/{len(hits)} hits corrupted, "
                 f"{int(miss['same as cold run'].sum())}/{len(miss)} misses clean, "
                 f"{int(reset['same as cold run'].sum())}/{len(reset)} clean after reset")
