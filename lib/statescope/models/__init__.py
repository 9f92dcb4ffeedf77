"""Models: the tiny Qwen3.5-architecture models — training, data, structured weights, the GPU-sized
random hybrids and the vLLM check of a trained model.
"""
