"""Models: the tiny Qwen3.5-architecture models — training, data, structured weights, the GPU-sized
random hybrids and the vLLM check of a trained model.
"""
from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "build_structured_model": "structured", "expected_shapes": "tinymodel",
})
