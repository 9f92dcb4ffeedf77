"""Results read as tables: ``to_frame()`` returns a pandas DataFrame with one row per cell /
probe / hypothesis / check, built from small real values (no engines)."""
from __future__ import annotations

import pandas as pd

from test_figures_readable import _bisection, _matrix


def test_bisect_result_to_frame_has_one_row_per_probe():
    frame = _bisection().to_frame()
    assert isinstance(frame, pd.DataFrame)
    assert list(frame["label"]) == ["v0.26", "v0.25"] and list(frame["verdict"]) == ["failed", "clean"]
    assert list(frame["failed"]) == [3, 0] and list(frame["most_likely"]) == ["v0.26", "v0.26"]


def test_matrix_and_hypothesis_to_frame_are_their_tables():
    from statescope.diverge.hypotheses import HypothesisTable

    m = _matrix().to_frame()
    assert isinstance(m, pd.DataFrame) and len(m) == 4 and list(m["failed"]) == [0, 7, 0, 0]
    h = HypothesisTable(rows=[{"hypothesis": "H-copy", "score": 2}, {"hypothesis": "H-accept", "score": 0}],
                        diverged=2).to_frame()
    assert list(h["hypothesis"]) == ["H-copy", "H-accept"]
