"""``planted_step`` names the capture step that read a PLANTED fault, whichever count the fault's
record carries: the scheduler's count of that step (exact match), or, where the step was not in
the scheduler output (a GPU under async scheduling), the runner's count before it (the first
step at or after it); a scheduled count that no step has (async scheduling's optimistic count)
names the last step at or before it."""
from types import SimpleNamespace

import pandas as pd
import pytest

from statescope.diverge.study import planted_step
from statescope.errors import InputError


def _study(rec: dict) -> SimpleNamespace:
    steps = pd.DataFrame({"req_id": ["a", "a", "a", "b"], "req_step": [0, 1, 2, 0],
                          "num_computed_tokens": [100, 131, 134, 131],
                          "prompt_sha": ["pa", "pa", "pa", "pb"]})
    run = SimpleNamespace(steps=lambda: steps)
    return SimpleNamespace(runs={"f": [SimpleNamespace(run=run)]}, planted={"f": [rec]})


def test_the_scheduled_count_matches_its_step_exactly():
    assert planted_step(_study({"req_id": "a", "num_computed_tokens": 131}), "f")["req_step"] == 1


def test_a_runner_count_names_the_first_step_at_or_after_it():
    rec = {"req_id": "a", "num_computed_tokens": 132, "computed_from": "runner"}
    assert planted_step(_study(rec), "f")["req_step"] == 2


def test_an_optimistic_scheduled_count_names_the_last_step_at_or_before_it():
    got = planted_step(_study({"req_id": "a", "num_computed_tokens": 133}), "f")
    assert got["req_step"] == 1 and got["matched"].startswith("last at or before")
    assert planted_step(_study({"req_id": "a", "num_computed_tokens": 131}), "f")["matched"] == "exact"


def test_a_count_before_every_captured_step_is_refused():
    with pytest.raises(InputError, match="no captured step of a at 99"):
        planted_step(_study({"req_id": "a", "num_computed_tokens": 99}), "f")
    with pytest.raises(InputError, match="no captured step of c"):
        planted_step(_study({"req_id": "c", "num_computed_tokens": 131}), "f")
