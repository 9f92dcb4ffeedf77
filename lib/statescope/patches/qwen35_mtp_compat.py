"""Let vLLM 0.26.0 load text-only Qwen3.5 checkpoints with their MTP head (what 0.28.0 does natively).

What it does: vLLM 0.26.0 ships the ``Qwen3_5ForCausalLM`` class but does not list it in its model
registry, and its MTP config override converts only the multimodal ``qwen3_5`` / ``qwen3_5_moe``
model types into the ``Qwen3_5MTP`` drafter — so a ``qwen3_5_text`` checkpoint such as the trained
``tiny-gui`` cannot start there with ``method="mtp"``. ``enable_qwen35_text()`` registers the class
under that architecture name and wraps ``SpeculativeConfig.hf_config_override`` so that a
``qwen3_5_text`` / ``qwen3_5_moe_text`` config is handed to the original override as the matching
multimodal type. vLLM 0.28.0 does both itself (its registry and override list the ``_text`` types),
so there the call changes nothing. It must run in the process that builds the engine, before it does
(the in-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

What it deliberately does not do: touch kernels, the runner or anything the state copies use; the
results record that it was applied (``applied()``).
"""
from __future__ import annotations

from typing import Any

_applied: list[str] = []
TEXT_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def enable_qwen35_text() -> list[str]:
    """Apply what this vLLM lacks; returns the names of the changes made (empty when none needed)."""
    from vllm import ModelRegistry
    from vllm.config.speculative import SpeculativeConfig

    done = []
    if "Qwen3_5ForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("Qwen3_5ForCausalLM", _hybrid_text_class())
        done.append("registry: Qwen3_5ForCausalLM (+ IsHybrid state hooks)")
    original = SpeculativeConfig.hf_config_override
    if not getattr(original, "_statescope_text_types", False) and not _handles_text_types(original):
        def override(hf_config: Any) -> Any:
            multimodal = TEXT_TYPES.get(getattr(hf_config, "model_type", None))
            if multimodal:
                hf_config.model_type = multimodal
            return original(hf_config)

        override._statescope_text_types = True  # type: ignore[attr-defined]
        SpeculativeConfig.hf_config_override = staticmethod(override)
        done.append("SpeculativeConfig.hf_config_override: qwen3_5_text -> Qwen3_5MTP")
    _applied.extend(done)
    return done


def _hybrid_text_class() -> Any:
    """0.26.0's text class lacks the ``IsHybrid`` hooks (state shapes, dtypes, copy functions) that
    make the engine size Mamba blocks; borrow them from the multimodal class, which has them."""
    from vllm.model_executor.models.interfaces import IsHybrid
    from vllm.model_executor.models.qwen3_5 import (Qwen3_5ForCausalLM,
                                                    Qwen3_5ForConditionalGeneration as MM)

    hooks = {name: classmethod(getattr(MM, name).__func__) for name in
             ("get_mamba_state_shape_from_config", "get_mamba_state_dtype_from_config",
              "get_mamba_state_copy_func") if hasattr(MM, name)}
    return type("Qwen3_5ForCausalLM", (Qwen3_5ForCausalLM, IsHybrid), hooks)


def _handles_text_types(override: Any) -> bool:
    """Whether this vLLM's own override already converts ``qwen3_5_text`` (0.28.0 does)."""
    import inspect

    try:
        return "qwen3_5_text" in inspect.getsource(override)
    except (OSError, TypeError):
        return False


def applied() -> list[str]:
    return list(_applied)
