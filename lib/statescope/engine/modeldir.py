"""Checks a model directory before vLLM sees it, so bad input gives one clear line.

What it does: ``check_model_dir(path)`` verifies the directory exists, holds a readable
``config.json`` naming an architecture, weights (``*.safetensors``) and a tokenizer (in the
directory or its ``tokenizer/`` folder: ``statescope.workload.model_files.tokenizer_dir``), and — for
Qwen3.5/Qwen3-Next hybrids — that the GDN geometry is one the CPU build's kernels accept when vLLM
runs on the CPU (linear key/value head dim 128, bf16). Returns the parsed text config.

What it deliberately does not do: load weights (the trained model's deeper validation, including
``mtp.*`` tensors and truncated files, is ``statescope.models.tinymodel.validate_model_dir``).
"""
from __future__ import annotations

import json
from pathlib import Path

from statescope.errors import InputError
from statescope.workload.model_files import TOKENIZER_SUBDIR, tokenizer_dir

HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")


def check_model_dir(path: str | Path, *, cpu: bool | None = None) -> dict:
    """Validate ``path``; returns the text config dict. Raises InputError naming what is wrong."""
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"model directory {root}: does not exist (expected a Hugging Face model "
                         "directory with config.json, *.safetensors and a tokenizer)")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise InputError(f"{cfg_file}: missing (expected the model's Hugging Face config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{cfg_file}: not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict) or not cfg.get("architectures"):
        raise InputError(f"{cfg_file}: field 'architectures' missing (expected e.g. "
                         "['Qwen3_5ForCausalLM'])")
    if not any(root.glob("*.safetensors")):
        raise InputError(f"model directory {root}: no *.safetensors weights found")
    tok = tokenizer_dir(root)
    if not (tok / "tokenizer.json").is_file() and not (tok / "tokenizer_config.json").is_file():
        raise InputError(f"model directory {root}: no tokenizer.json/tokenizer_config.json "
                         f"(in the directory or its {TOKENIZER_SUBDIR}/ folder)")
    text = cfg.get("text_config", cfg)
    if cpu is None:
        cpu = _running_on_cpu()
    if cpu and text.get("model_type") in HYBRID_MODEL_TYPES:
        for key in ("linear_key_head_dim", "linear_value_head_dim"):
            if text.get(key, 128) != 128:
                raise InputError(f"{cfg_file}: {key}={text.get(key)}; vLLM's CPU GDN kernels "
                                 "need 128 ('Unexpected head dim size')")
    return text


def _running_on_cpu() -> bool:
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()
