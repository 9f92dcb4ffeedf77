"""``planted_step`` names the capture step that read a PLANTED fault, whichever count the fault's
record carries: the scheduler's count of that step (exact match), or, where the step was not in
the scheduler output (a GPU under async scheduling), the runner's count before it (the first
step at or after it)."""
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


def test_a_scheduled_count_that_no_step_has_is_refused():
    with pytest.raises(InputError, match="no captured step of a at 132"):
        planted_step(_study({"req_id": "a", "num_computed_tokens": 132}), "f")
