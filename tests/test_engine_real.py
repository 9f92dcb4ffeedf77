"""The four configurations of the foundation issue, on the real vLLM-CPU engine.

Each test runs the shared-prefix multi-step workload and asserts the *resolved* configuration and
vLLM's own counters: prefix-cache hits exactly where prefix caching is on, accepted drafts exactly
where MTP is on.
"""
from __future__ import annotations

import pytest

from conftest import MTP_ONLY, PREFIX_ALIGN, REFERENCE, TRIGGER
from statescope.workload.episodes import run_episodes, shared_prefix_episodes

pytestmark = pytest.mark.engine


def _run(engine_pool, config):
    engine = engine_pool.get(config)
    before = engine.metrics()
    rows = run_episodes(engine, shared_prefix_episodes(n_episodes=3, n_steps=3, seed=7),
                        max_tokens=12)
    after = engine.metrics()
    delta = {k: after[k] - before[k] for k in ("prefix_cache_hits", "prefix_cache_queries",
                                               "spec_draft_tokens", "spec_accepted_tokens")}
    return engine, rows, engine.resolved(), delta


@pytest.mark.parametrize("config,name", [(REFERENCE, "reference"), (PREFIX_ALIGN, "prefix+align"),
                                         (MTP_ONLY, "mtp"), (TRIGGER, "prefix+align+mtp")])
def test_configuration_runs_and_engages(engine_pool, config, name):
    engine, rows, resolved, delta = _run(engine_pool, config)
    assert len(rows) == 9 and all(r["output_token_ids"] for r in rows)
    assert resolved["device"] == "cpu" and resolved["model_runner"].endswith(".CPUModelRunner") and resolved["runner_version"] == "V1"
    assert resolved["enable_prefix_caching"] is config.enable_prefix_caching
    assert resolved["num_speculative_tokens"] == config.num_speculative_tokens
    # The CPU platform forces async scheduling off; the resolved config must say so, loudly.
    assert resolved["async_scheduling"] is False
    assert any("async" in w.lower() for w in resolved["warnings"])
    if config.enable_prefix_caching:
        assert resolved["mamba_cache_mode"] == "align"
        assert delta["prefix_cache_hits"] > 0
        # later steps of an episode re-use the earlier steps' prompts
        assert any(r["num_cached_tokens"] > 0 for r in rows if r["step"] > 0)
    else:
        assert delta["prefix_cache_hits"] == 0
        assert all(r["num_cached_tokens"] == 0 for r in rows)
    if config.speculative:
        assert resolved["speculative_method"] == "mtp"
        assert resolved["draft_architecture"] == "Qwen3_5MTP"
        assert delta["spec_draft_tokens"] > 0 and delta["spec_accepted_tokens"] > 0
    else:
        assert delta["spec_draft_tokens"] == 0


def test_records_carry_logprob_margins(engine_pool):
    engine = engine_pool.get(TRIGGER)
    rec = engine.generate(["goal: open menu 3\naction: "], max_tokens=6)[0]
    assert len(rec.margins) == len(rec.output_token_ids) == len(rec.logprobs)
    assert all(m is None or m >= 0 for m in rec.margins)
    assert rec.finish_reason in ("length", "stop")


def test_token_id_prompts_and_determinism(engine_pool):
    engine = engine_pool.get(TRIGGER)
    ids = engine.generate(["click the button"], max_tokens=1)[0].prompt_token_ids
    a = engine.generate([ids], max_tokens=8)[0]
    engine.reset_prefix_cache()
    b = engine.generate([ids], max_tokens=8)[0]
    assert a.prompt_token_ids == ids
    assert a.output_token_ids == b.output_token_ids
