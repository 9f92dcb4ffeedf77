"""``statescope model-check`` and ``statescope vision-probe``: tiny models measured through a real
vLLM engine.

What it does: ``model-check`` prints ``statescope.models.tiny_vllm.check_model``'s JSON (also
written to ``--out``): validity, correctness, MTP acceptance, prefix-cache hit rate, block sizes,
and the planted-fault / cached-state sensitivities. ``vision-probe`` prints
``statescope.verdict.vision_probe.vision_probe``'s JSON (written to ``--out``): whether screenshots
are read and cached by content, and what chunk ends inside an image do.

What it deliberately does not do: train a model (``scripts/train_tiny_model.py``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any
from statescope.cli.exit_codes import exit_epilog


def model_check_command(args: argparse.Namespace) -> int:
    from statescope.models.tiny_vllm import check_model

    res = check_model(args.model, args.episodes, args.fault_episodes, args.fault_at_token,
                      args.prefix_episodes)
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


def add_model_check_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("model-check",
                              epilog=exit_epilog(),
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
    p.set_defaults(func=model_check_command)


def vision_probe_command(args: argparse.Namespace) -> int:
    from statescope.verdict.vision_probe import vision_probe

    out = vision_probe(args.model, args.out)
    print(json.dumps({k: v for k, v in out.items() if k != "resolved"}, indent=1, default=str))
    return 0


def add_vision_probe_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("vision-probe",
                              epilog=exit_epilog(),
                              help="screenshots through vLLM's multimodal path on "
                                                   "a VLM: read, cached by content, cut by chunks")
    p.add_argument("--model", default="tiny-vl", help="model directory or name under data/models")
    p.add_argument("--out", type=Path, default=None, help="write the whole result (JSON) here")
    p.set_defaults(func=vision_probe_command)
