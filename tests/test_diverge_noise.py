"""noise.compare_states / calibrate / in_units on hand-built state sources (no engine)."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

import statescope  # noqa: F401
from statescope.diverge import noise
from statescope.errors import InputError

L0 = "model.layers.0.linear_attn"


class Source:
    """Minimal run + reference source: conv [rows=3, ch=4] and ssm [heads=2, 2, 2] per position."""

    label = "fake"

    def __init__(self, conv: dict, ssm: dict) -> None:
        self.conv, self.ssm = conv, ssm

    def points(self) -> pd.DataFrame:
        return pd.DataFrame([{"prompt_sha": "p", "req_id": "r", "req_step": pos, "kind": k,
                              "position": pos, "engine_step": pos}
                             for pos in sorted(self.conv) for k in ("conv", "ssm")])

    def get(self, req_id, req_step, kind):
        return {L0: (self.conv if kind == "conv" else self.ssm)[req_step]}

    def at(self, sha, position, kind):
        table = self.conv if kind == "conv" else self.ssm
        return {L0: table[position]} if position in table else None

    def prepare(self, points):
        pass


def _states(n=3, bump=None):
    conv = {p: torch.ones(3, 4, dtype=torch.float64) * (p + 1) for p in range(n)}
    ssm = {p: torch.ones(2, 2, 2, dtype=torch.float64) * 0.01 * (p + 1) for p in range(n)}
    if bump:
        for (kind, pos, idx), value in bump.items():
            (conv if kind == "conv" else ssm)[pos][idx] += value
    return Source(conv, ssm)


def test_compare_gives_per_row_and_per_head_maxima_and_nan_as_infinite():
    ref = _states()
    run = _states(bump={("conv", 1, (0, 2)): 0.5, ("ssm", 2, (1, 0, 0)): 0.001})
    run.conv[0][2, 1] = float("nan")
    f = noise.compare_states(run, ref)
    assert len(f) == 6
    conv1 = f[(f.kind == "conv") & (f.position == 1)].iloc[0]
    assert conv1.max_abs == pytest.approx(0.5) and conv1.parts == pytest.approx([0.5, 0, 0])
    ssm2 = f[(f.kind == "ssm") & (f.position == 2)].iloc[0]
    assert ssm2.parts == pytest.approx([0, 0.001])
    conv0 = f[(f.kind == "conv") & (f.position == 0)].iloc[0]
    assert math.isinf(conv0.max_abs) and conv0.nan_or_inf


def test_calibration_uses_margin_and_floor_and_units_mark_the_rows_out():
    ref = _states()
    quiet = _states(bump={("conv", 1, (1, 0)): 1e-3})
    tol = noise.calibrate([noise.compare_states(quiet, ref)], ["quiet vs ref"])
    conv = tol.tol(L0, "conv")
    assert conv == pytest.approx(max(2 * 1e-3, 2 ** -8 * 2.0))  # floor: 1/256 of median scale 2
    assert tol.tol(L0, "ssm") == pytest.approx(2 ** -16 * 0.02)  # measured 0: the floor
    loud = _states(bump={("conv", 2, (2, 3)): 10 * conv})
    f = noise.in_units(noise.compare_states(loud, ref), tol)
    out = f[f.out]
    assert list(out.position) == [2] and out.iloc[0].parts_out == [2]
    assert out.iloc[0].units == pytest.approx(10)
    assert "quiet vs ref" in tol._repr_html_()
    both = noise.combine(tol, noise.calibrate([noise.compare_states(loud, ref)]))
    assert both.tol(L0, "conv") == pytest.approx(2 * 10 * conv)


def test_calibration_refuses_nan_and_empty_input():
    ref = _states()
    bad = _states()
    bad.ssm[1][0, 0, 0] = float("nan")
    with pytest.raises(InputError, match="not a clean pair"):
        noise.calibrate([noise.compare_states(bad, ref)])
    with pytest.raises(InputError, match="no clean comparisons"):
        noise.calibrate([])
    with pytest.raises(InputError, match="no calibration"):
        noise.calibrate([noise.compare_states(ref, ref)]).tol("model.layers.9.linear_attn", "conv")


def test_shape_mismatch_is_one_clear_error():
    ref = _states()
    other = _states()
    other.conv = {p: torch.ones(2, 4, dtype=torch.float64) for p in range(3)}
    with pytest.raises(InputError, match="shapes differ"):
        noise.compare_states(other, ref)
