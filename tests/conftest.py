"""Shared fixtures: one real vLLM-CPU engine alive at a time, reused across tests.

An engine start costs 5–60 s on two cores, so tests ask ``engine_pool.get(config)``: the pool keeps
the last engine and only restarts when a test needs a different configuration. Tests that need a
fresh prefix cache call ``engine.reset_prefix_cache()`` themselves.
"""
from __future__ import annotations

import os
import sys

import pytest

# the plugin lives beside this file; under some pytest versions and import modes (the H200's
# pytest kit) this directory is not on sys.path when the plugin is loaded
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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

        if self.engine is not None and self.config == config and self.engine.usable:
            return self.engine
        self.close()
        self.engine = OfflineEngine(config)
        self.config = config
        self.starts += 1
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:  # a pooled engine whose process groups are gone: nothing to keep
                pass
        self.engine, self.config = None, None


# The slowest files, slowest first (wall seconds of a fresh-clone `bin/test` run, 2 workers,
# docs/benchmarks.md "The test suite"): bin/test's workers take whole files in collection order,
# so the long ones start first and the short ones fill in beside them. A file missing here only
# runs later; nothing is skipped or deselected.
SLOWEST_FIRST = (
    "test_cluster.py", "test_notebooks.py", "test_reproduce.py", "test_builds.py",
    "test_capture_kill.py", "test_kill_resume.py", "test_server.py", "test_bisect_confirmed.py",
    "test_cli.py", "test_import_replay.py", "test_capture_server.py", "test_browser.py",
    "test_builds_existing.py", "test_engine_errors_and_guards.py", "test_build_census.py",
    "test_localize.py", "test_runners.py", "test_tiny_vllm.py", "test_hostile_inputs.py",
    "test_replay.py", "test_tiny_vl.py", "test_shrink.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept


@pytest.fixture(scope="session")
def engine_pool():
    pool = EnginePool()
    yield pool
    pool.close()
