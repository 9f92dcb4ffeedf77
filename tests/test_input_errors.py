"""Bad input gets one clear statescope error before vLLM is involved."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from statescope.engine.offline import OfflineEngine, import_vllm
from statescope.engine.config import EngineConfig
from statescope.errors import EnvironmentBroken, InputError


@pytest.mark.parametrize("changes,needle", [
    ({"num_speculative_tokens": -1}, "num_speculative_tokens=-1"),
    ({"mamba_cache_mode": "sometimes"}, "mamba_cache_mode='sometimes'"),
    ({"speculative_method": "eagle9"}, "speculative_method"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"enable_prefix_caching": True, "mamba_cache_mode": "none"}, "mamba_cache_mode"),
])
def test_bad_engine_config_values(changes, needle):
    with pytest.raises(InputError) as info:
        EngineConfig(**changes)
    assert needle in str(info.value) and "expected" in str(info.value)


def test_engine_kwargs_mapping():
    kw = EngineConfig(mamba_block_size=64, async_scheduling=True).engine_kwargs()
    assert kw["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert kw["mamba_cache_mode"] == "align" and kw["mamba_block_size"] == 64
    assert kw["async_scheduling"] is True and kw["enable_prefix_caching"] is True
    ref = EngineConfig(enable_prefix_caching=False, mamba_cache_mode=None, speculative_method=None,
                       num_speculative_tokens=0).engine_kwargs()
    assert "speculative_config" not in ref and "mamba_cache_mode" not in ref


def test_model_dir_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(InputError, match="config.json: missing"):
        OfflineEngine(EngineConfig(model=str(tmp_path)))


def test_model_dir_missing(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        OfflineEngine(EngineConfig(model=str(tmp_path / "nope")))


def test_model_dir_wrong_gdn_head_dim(tmp_path):
    from statescope.engine.modeldir import check_model_dir

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "linear_key_head_dim": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(InputError, match="linear_key_head_dim=64"):
        check_model_dir(tmp_path, cpu=True)


def test_unsupported_vllm_version(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.1.0")
    with pytest.raises(EnvironmentBroken, match="vLLM 0.1.0 is not supported"):
        import_vllm()


def test_missing_vllm_is_one_clear_line():
    code = ("import sys; sys.modules['vllm'] = None\n"
            "from statescope.cli.main import main; sys.exit(main(['doctor', '--no-engine']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("statescope doctor: vllm: vLLM is not importable")
    assert "Traceback" not in proc.stderr
