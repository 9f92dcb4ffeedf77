"""Verdicts re-judged from stored records (``statescope.verdict.rejudge``) and the one action-syntax rule.

Fast (no engine): the rule that decides whether answers are graded on action syntax
(``statescope.workload.guilang.action_validator_for``) turns on at 90 % valid control answers and
not below; re-judging the committed GPU arms grades syntax exactly where the control spoke the
language; an arm whose vLLM counters read 0 gets its prefix-cache pair from the requests, labelled.
"""
from __future__ import annotations

from statescope.results import e2e
from statescope.verdict.rejudge import CONTROLS, arm_run_from_records, engagement_metrics, verdict_rows
from statescope.workload.guilang import action_validator_for, is_valid_action

VALID, INVALID = "click(id=3)", "!!!!!!!!"


def test_action_syntax_is_graded_only_when_the_control_speaks_the_language():
    assert action_validator_for([VALID] * 9 + [INVALID]) is is_valid_action  # 90 %
    assert action_validator_for([VALID] * 8 + [INVALID] * 2) is None  # 80 %
    assert action_validator_for([]) is None
    assert action_validator_for(iter([VALID])) is is_valid_action  # any iterable of texts


def test_rejudged_rows_grade_syntax_where_the_control_spoke_the_language():
    metas = [m for m in e2e.arms() if m.get("label") == "tiny-gui"]
    records = e2e.records("tiny-gui")
    rows = verdict_rows(metas, records, label="tiny-gui")
    assert [r["control"] for r in rows] == list(CONTROLS)
    for r in rows:
        meta = [m for m in metas if m["arm"] == r["control"]]
        if not meta:
            assert r["outcome"] == "not run"
            continue
        ctl = arm_run_from_records(meta[0], records)
        assert r["action_syntax_graded"] == (action_validator_for(x["text"] for x in ctl.rows) is not None)
        assert r["control_units"] == len({x["episode"] for x in ctl.rows})


def test_engagement_from_the_requests_when_vllm_reported_no_counters():
    rows = [{"prompt_tokens": 100, "num_cached_tokens": 64}, {"prompt_token_ids": [1] * 50, "num_cached_tokens": 0}]
    got = engagement_metrics({"prefix_cache_queries": 0, "spec_draft_tokens": 5}, rows)
    assert (got["prefix_cache_queries"], got["prefix_cache_hits"]) == (150, 64)
    assert got["prefix_cache_source"].startswith("per-request num_cached_tokens")
    # counters that show hits are the first source; counters that show none give way to the requests
    assert engagement_metrics({"prefix_cache_queries": 7, "prefix_cache_hits": 3},
                              rows)["prefix_cache_source"] == "vLLM counters"
    assert engagement_metrics({"prefix_cache_queries": 7}, rows)["prefix_cache_hits"] == 64
