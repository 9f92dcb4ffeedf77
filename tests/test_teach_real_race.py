"""Notebook 07's section 6b (``statescope.teach.real_race``) on the committed H200 capture of the
3-request reproducer: the step table names A, B, C in arrival order, B breaks exactly once (moved
row beside C's prefill, shift 1 where its count asks for 3), and the check fails on a table where
the break is gone or doubled. CPU only, no engine."""
import pytest

from statescope.errors import InputError
from statescope.teach import real_race


def test_the_table_shows_the_one_break_where_b_moves_beside_a_prefill():
    steps = real_race.reproducer_steps()
    assert list(dict.fromkeys(steps["request"])) == ["A", "B", "C"]
    broken = steps[steps["window ok"].eq(False)]
    assert len(broken) == 1
    b = broken.iloc[0]
    assert (b["request"], b["engine step"], b["batch row"], b["shift asked"], b["shift seen"]) == \
        ("B", 6, 0, 3, [1])
    assert steps[(steps["engine step"] == 6) & steps["prefill"]]["request"].tolist() == ["C"]
    assert real_race.check_real_race(steps).ok


def test_the_check_fails_when_the_break_is_gone_or_doubled():
    steps = real_race.reproducer_steps()
    healed = steps.copy()
    healed.loc[healed["window ok"].eq(False), "window ok"] = True
    assert not real_race.check_real_race(healed).ok
    doubled = steps.copy()
    doubled.loc[doubled["window ok"].eq(True).idxmax(), "window ok"] = False
    assert not real_race.check_real_race(doubled).ok


def test_a_missing_archive_is_one_clear_error(tmp_path):
    with pytest.raises(InputError, match="no such capture archive"):
        real_race.reproducer_steps(tmp_path / "none.tar.gz")
