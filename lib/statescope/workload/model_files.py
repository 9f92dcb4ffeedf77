"""What a workload reads from a model directory: where its tokenizer is, whether it has a vision
tower, and its Hugging Face processor.

What it does: ``tokenizer_dir(path)`` is the model's ``tokenizer/`` folder when it has one, else
the directory itself (transformers forces its own Qwen3.5 tokenizer class on a ``qwen3_5`` model
directory, whose pre-tokenizer splits digits; a folder of its own keeps a trained BPE intact).
``is_multimodal(path)`` says whether ``config.json`` declares a ``vision_config``.
``load_processor(path)`` is the processor (image processor + that tokenizer), for counting image
tokens. They live here, below the engine, because prompts are shaped (``statescope.workload.geometry``)
before any engine exists; ``statescope.engine.modeldir`` uses them to check a directory.

What it deliberately does not do: validate the directory (``statescope.engine.modeldir``) or load
weights.
"""
from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_SUBDIR = "tokenizer"


def tokenizer_dir(path: str | Path) -> Path:
    """Where a model's tokenizer lives: its ``tokenizer/`` folder when it has one, else the model
    directory."""
    root = Path(path)
    sub = root / TOKENIZER_SUBDIR
    return sub if (sub / "tokenizer.json").is_file() else root


def is_multimodal(path: str | Path) -> bool:
    """Whether the model directory's config declares a vision tower (``vision_config``)."""
    try:
        return "vision_config" in json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False


def load_processor(model_dir: Path | str):
    """The model's Hugging Face processor with the tokenizer from its own folder."""
    import statescope  # noqa: F401  (CPU shims before torchvision)
    import torch  # noqa: F401  (transformers probes torchaudio only after torch is in)
    from transformers import AutoProcessor, AutoTokenizer

    return AutoProcessor.from_pretrained(str(model_dir),
                                         tokenizer=AutoTokenizer.from_pretrained(str(tokenizer_dir(model_dir))))
