"""Scrubbing: allowlisted environment, redaction of secrets/paths/hosts/IPs, the leak check."""
from __future__ import annotations

import pytest

from statescope.share import scrub
from statescope.share.leakcheck import check_tree
from statescope.share.scrub import REPO, Scrubber, SecretLeak, allowed_env, find_secrets

# Token-shaped fakes (none is a real credential), one per pattern family.
FAKES = {
    "hf": "hf_" + "Ab1" * 12,
    "sk": "sk-" + "proj" + "Z9y8" * 6,
    "bearer": "Bearer " + "eyJhbGciOiJIUzI1NiJ9.payload.sig",
    "aws": "AKIA" + "ABCDEFGH23456789",
    "ghp": "ghp_" + "x1Y2" * 9,
    "assign": "HF_TOKEN=notprefixedbutsecret123",
}


@pytest.mark.parametrize("name", sorted(FAKES))
def test_every_pattern_is_found_and_scrubbed(name):
    text = f"before {FAKES[name]} after"
    assert find_secrets(text), f"{name} not recognised"
    cleaned = Scrubber.for_environment({}).scrub(text)
    assert not find_secrets(cleaned), cleaned
    assert "before" in cleaned and "after" in cleaned


def test_plain_text_is_not_a_secret():
    text = "vLLM 0.28.0, torch 2.13.0+cpu, task-list, bearer of news, 127.0.0.1, OMP_NUM_THREADS=1"
    assert find_secrets(text) == []
    assert Scrubber.for_environment({}).scrub(text) == text


def test_env_secret_values_paths_hosts_and_ips_are_replaced(monkeypatch):
    monkeypatch.setattr(scrub, "_host_names", lambda: ["gpu-node-17.example.internal"])
    env = {"MY_SERVICE_TOKEN": "opaque-value-without-shape", "HOME": "/Users/alice"}
    s = Scrubber.for_environment(env)
    text = (f"token opaque-value-without-shape at {REPO}/runs/x and /Users/alice/.cache on "
            "gpu-node-17.example.internal (10.2.3.4, 192.168.0.9) via 127.0.0.1")
    out = s.scrub(text)
    for leaked in ("opaque-value-without-shape", str(REPO), "/Users/alice", "gpu-node-17",
                   "10.2.3.4", "192.168.0.9"):
        assert leaked not in out, (leaked, out)
    assert "[redacted:MY_SERVICE_TOKEN]" in out and "[repo]/runs/x" in out
    assert "~/.cache" in out and "[host]" in out and "[ip]" in out and "127.0.0.1" in out


def test_scrub_obj_reaches_nested_strings():
    s = Scrubber.for_environment({})
    out = s.scrub_obj({"a": [FAKES["ghp"], {"b": FAKES["aws"]}], "n": 3})
    assert not find_secrets(str(out)) and out["n"] == 3


def test_allowed_env_is_an_allowlist_without_credentials():
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0",
           "VLLM_API_KEY": "k" * 20, "HF_TOKEN": FAKES["hf"], "AWS_SECRET_ACCESS_KEY": "s" * 30,
           "PATH": "/usr/bin", "USER": "alice", "STATESCOPE_MODEL": f"{REPO}/data/models/x"}
    got = allowed_env(env)
    assert got == {"CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "1",
                   "STATESCOPE_MODEL": "[repo]/data/models/x", "VLLM_USE_V2_MODEL_RUNNER": "0"}


def test_check_tree_names_file_and_pattern_never_the_value(tmp_path):
    (tmp_path / "clean.md").write_text("nothing here")
    sub = tmp_path / "data"
    sub.mkdir()
    (sub / "fig.json").write_text('{"note": "%s"}' % FAKES["sk"])
    with pytest.raises(SecretLeak) as info:
        check_tree(tmp_path, environ={})
    msg = str(info.value)
    assert "fig.json" in msg and "sk-" in msg and FAKES["sk"] not in msg


def test_check_tree_finds_raw_env_secret_values(tmp_path):
    (tmp_path / "a.txt").write_text("value: opaque-value-without-shape")
    with pytest.raises(SecretLeak):
        check_tree(tmp_path, environ={"DB_PASSWORD": "opaque-value-without-shape"})
    assert check_tree(tmp_path, environ={}) == 1
