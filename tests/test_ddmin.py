"""Delta debugging on pure predicates (no engine): the minimum it finds, that it is 1-minimal, that
no candidate is tested twice, and the trials it records."""
from __future__ import annotations

from statescope.verdict.ddmin import ddmin


def counting(pred):
    calls = []

    def fails(kept):
        calls.append(tuple(kept))
        return pred(kept)

    return fails, calls

def test_single_culprit_is_found_in_log_many_tests():
    fails, calls = counting(lambda kept: 37 in kept)
    res = ddmin(list(range(64)), fails)
    assert res.minimal == [37]
    assert len(calls) <= 2 * 6 + 2  # binary-search-like on a single culprit
    assert len(calls) == len(set(calls))  # no candidate twice

def test_a_pair_that_must_be_together():
    fails, calls = counting(lambda kept: 3 in kept and 11 in kept)
    res = ddmin(list(range(16)), fails)
    assert res.minimal == [3, 11]
    needed = dict((item, trial) for item, trial in res.needed())
    assert set(needed) == {3, 11}
    assert needed[3].kept == [11] and 3 in needed[3].removed and not needed[3].failed
    assert len(calls) == len(set(calls))

def test_result_is_one_minimal_for_every_small_predicate():
    """Every monotone-or-not predicate over 5 items given by a set of failing 'cores': the result
    fails and removing any one of its items passes."""
    items = list(range(5))
    for cores in ([{0, 4}], [{1}, {2, 3}], [{0, 1, 2, 3, 4}], [{2}]):
        pred = lambda kept, cores=cores: any(c <= set(kept) for c in cores)
        res = ddmin(items, pred)
        assert pred(res.minimal)
        for drop in res.minimal:
            assert not pred([x for x in res.minimal if x != drop])

def test_order_is_kept_and_trials_say_what_was_removed():
    res = ddmin(["a", "b", "c", "d"], lambda kept: "c" in kept and "a" in kept)
    assert res.minimal == ["a", "c"]
    for t in res.trials:
        assert sorted(t.kept + t.removed) == sorted(set(t.kept + t.removed))
        assert t.kept == sorted(t.kept)  # a subsequence, in the original order

def test_one_item_is_not_reduced_to_nothing():
    fails, calls = counting(lambda kept: True)
    assert ddmin(["only"], fails).minimal == ["only"] and calls == []

def test_non_monotone_predicate_still_terminates():
    for n in range(1, 9):
        for parity in (0, 1):
            res = ddmin(list(range(n)), lambda kept, p=parity: len(kept) % 2 == p or len(kept) == n)
            assert 1 <= len(res.minimal) <= n
            assert len({tuple(t.kept) for t in res.trials}) == len(res.trials)
