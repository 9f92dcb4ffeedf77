"""``statescope model-check`` and ``statescope vision-probe``: tiny models measured through a real
vLLM engine.

What it does: ``model-check`` prints a few lines of ``statescope.models.tiny_vllm.check_model``'s
result (``--json``: the whole JSON, also written to ``--out``): validity, correctness, MTP acceptance, prefix-cache hit rate, block sizes,
and the planted-fault / cached-state sensitivities. ``vision-probe`` prints
``statescope.verdict.vision_probe.vision_probe``'s result in a few lines (``--json``: all of it;
written to ``--out``; progress on stderr): whether screenshots
are read and cached by content, and what chunk ends inside an image do.

What it deliberately does not do: train a model (``scripts/train_tiny_model.py``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any
from statescope.cli.exit_codes import add_json_flag, exit_epilog


def model_check_command(args: argparse.Namespace) -> int:
    from statescope.models.tiny_vllm import check_model

    res = check_model(args.model, args.episodes, args.fault_episodes, args.fault_at_token,
                      args.prefix_episodes)
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text if args.json else model_check_text(res))
    return 0


def model_check_text(res: dict) -> str:
    """The check's headline numbers in a few lines (``--json`` / ``--out`` have everything)."""
    def pct(x: Any) -> str:
        return "n/a" if x is None else f"{100 * x:.1f} %"

    lines = [f"model-check: {res.get('architecture')} + {res.get('draft_architecture')} on "
             f"{res.get('engine')} (block {res.get('block_size')}, mamba block "
             f"{res.get('mamba_block_size')})",
             f"  {res.get('requests')} requests: valid {pct(res.get('valid'))}, correct "
             f"{pct(res.get('correct'))}, draft acceptance {pct(res.get('acceptance'))}, "
             f"prefix-cache hit rate {pct(res.get('prefix_cache_hit_rate'))}"]
    for key in ("fault_sensitivity", "fault_sensitivity_no_mtp"):
        changed = (res.get(key) or {}).get("changed") or {}
        if changed:
            hit = sum(v.get("changed", 0) for v in changed.values())
            of = sum(v.get("eligible", 0) for v in changed.values())
            lines.append(f"  {key.replace('_', ' ')}: {hit}/{of} answers changed by planted faults")
    lines.append("  (--json: the whole result)")
    return "\n".join(lines)


def add_model_check_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("model-check",
                              epilog=exit_epilog("the engine could not start or run the model (the "
                                                 "measurements themselves are information: no "
                                                 "pass/fail threshold)"),
                              help="measure a trained tiny model through real vLLM "
                                                  "(validity, acceptance, state sensitivity)")
    p.add_argument("--model", default="data/models/tiny-gui")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--fault-episodes", type=int, default=3,
                   help="held-out episodes for the planted-fault sensitivity (0: skip)")
    p.add_argument("--fault-at-token", type=int, default=3,
                   help="output tokens before the planted fault acts (sequence values: ~10 = mid-value)")
    p.add_argument("--prefix-episodes", type=int, default=0,
                   help="held-out episodes for the perturbed-cached-state sensitivity (0: skip)")
    add_json_flag(p, help="print the whole result as JSON on stdout (default: a few lines)")
    p.set_defaults(func=model_check_command)


def vision_probe_command(args: argparse.Namespace) -> int:
    import sys
    import time

    from statescope.verdict.vision_probe import vision_probe

    # the probe starts an engine and runs three probes (minutes on a CPU): say so on stderr
    t0 = time.monotonic()
    print(f"vision-probe: starting an engine on {args.model} and probing screenshots, caching and "
          "chunk cuts (several minutes on a CPU) ...", file=sys.stderr, flush=True)
    out = vision_probe(args.model, args.out)
    print(f"vision-probe: done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    shown = {k: v for k, v in out.items() if k != "resolved"}
    print(json.dumps(shown, indent=1, default=str) if args.json else vision_probe_text(shown))
    return 0


def vision_probe_text(out: dict) -> str:
    """The probe's result in a few lines (``--json`` has everything)."""
    shots, eng, chunks = out.get("screenshots") or {}, out.get("engagement") or {}, out.get("chunks") or {}
    rows = shots.get("rows") or []
    changed = sum(1 for r in rows if r.get("output_changed"))
    stops = sum(1 for r in rows if r.get("swapped_hit_stops_before_image"))
    lines = [f"vision-probe: {out.get('model')} (engine start {out.get('engine_start_s')} s)",
             f"  screenshots read: {changed}/{len(rows)} swapped-image pairs change the output; "
             f"a cache hit stops before a swapped image in {stops}/{len(rows)}",
             f"  engagement: {eng.get('requests')} requests, {eng.get('images')} images, prefix-cache "
             f"hits {eng.get('prefix_cache_hits')}/{eng.get('prefix_cache_queries')} tokens, "
             f"{eng.get('requests_hit_past_an_image')} requests hit past an image, draft "
             f"acceptance {eng.get('acceptance')}",
             f"  chunks: {chunks.get('chunk_ends_inside_images')} of {chunks.get('prompts')} prompts "
             f"have a chunk end inside an image; batch = solo in {chunks.get('batch_equals_solo')}, "
             f"cached = solo in {chunks.get('cached_equals_solo')}",
             "  (--json: the whole result)"]
    return "\n".join(lines)


def add_vision_probe_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("vision-probe",
                              epilog=exit_epilog(),
                              help="screenshots through vLLM's multimodal path on "
                                                   "a VLM: read, cached by content, cut by chunks")
    p.add_argument("--model", default="tiny-vl", help="model directory or name under data/models")
    p.add_argument("--out", type=Path, default=None, help="write the whole result (JSON) here")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON (default: "
                                                       "a few lines)")
    p.set_defaults(func=vision_probe_command)
