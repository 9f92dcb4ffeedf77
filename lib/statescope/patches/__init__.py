"""Patches: code that changes vLLM from inside — CPU import shims, CPU align-mode kernels, planted
faults, the overlap-safe copy, the accepted-count sync, the Qwen3.5 registration, and the registry
that names them.
"""
