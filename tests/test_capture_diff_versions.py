"""digest_diff across digest versions and kernels: exact numbers only across versions, a warning either way.

Small fakes of a capture run (manifest + digest/step tables) are enough: digest_diff is a pure join.
"""
from __future__ import annotations

import warnings

import pandas as pd
import pytest

from statescope.diverge.digest_diff import DigestMismatchWarning, digest_diff


class FakeRun:
    def __init__(self, sum_value: float, checksum: int, **manifest):
        self.manifest = {"digest_stats": ["sum"], "conv_window": 3, **manifest}
        self._d = pd.DataFrame([{"prompt_sha": "p", "req_step": 0, "layer": 0, "kind": "ssm",
                                 "req_id": "r", "engine_step": 1, "sum": sum_value,
                                 "checksum": checksum}])
        self._s = pd.DataFrame([{"req_id": "r", "engine_step": 1, "conv_live_offset": 0}])

    def digests(self) -> pd.DataFrame:
        return self._d

    def steps(self) -> pd.DataFrame:
        return self._s


def test_same_version_and_kernel_compares_floats_without_warning():
    a = FakeRun(1.0, 7, digest_version=2, digest_kernel="torch")
    b = FakeRun(2.0, 7, digest_version=2, digest_kernel="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not digest_diff(a, b)["same"].all()  # same checksum, different sum: differs


def test_different_versions_compare_checksums_only_and_warn():
    a = FakeRun(1.0, 7, digest_version=1)
    b = FakeRun(2.0, 7, digest_version=2)
    with pytest.warns(DigestMismatchWarning, match="exact numbers only"):
        assert digest_diff(a, b)["same"].all()
    with pytest.warns(DigestMismatchWarning):
        assert not digest_diff(a, FakeRun(1.0, 8, digest_version=2))["same"].any()


def test_different_kernels_warn_and_still_compare_floats():
    a = FakeRun(1.0, 7, digest_version=2, digest_kernel="c_in_place")
    with pytest.warns(DigestMismatchWarning, match="digest_kernel"):
        assert digest_diff(a, FakeRun(1.0 + 1e-6, 7, digest_version=2, digest_kernel="torch"))["same"].all()
    with pytest.warns(DigestMismatchWarning):
        assert not digest_diff(a, FakeRun(1.1, 7, digest_version=2, digest_kernel="torch"))["same"].any()
