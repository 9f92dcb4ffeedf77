"""Read round 3 of the GPU results (``data/results/gpu/e2e_round3/``): the verdict, the factor check,
and the capture-overhead breakdown.

What it does: ``verdicts`` recomputes the trigger-vs-control verdicts of the eager 12-seed set from
its records (``statescope.verdict.rejudge.verdict_rows``, as round 2's are); ``departures`` lists the trigger's
requests whose answer differs from the async-off control, with what kind of wrong answer each is;
``factor_table`` compares every tiny-gui configuration run on the H200 (round 2 and 3, compiled and
eager) with round 2's eager async-off control on the 288 requests they share, which is what says
which factors a departure needs; ``digest_bench``, ``triton_overheads`` and ``probe_table`` are the
capture-overhead measurements with the one-launch Triton digest.

What it deliberately does not do: run anything on a device, or rank mechanisms (the localization
of round 2, ``gpu_results.localization``, and ``statescope.diverge.hypotheses`` do that).
"""
from __future__ import annotations

import re
from pathlib import Path

from statescope.results import e2e as gr
from statescope.errors import InputError
from statescope.records import rows_by_request

R3_DIR = gr.E2E_DIR.parent / "e2e_round3"
_TYPED = re.compile(r'text="([^"]*)"')


def _by_arm(d: Path, label: str = "tiny-gui") -> dict[str, dict]:
    """{arm name: {(episode, step): record}} for each arm meta in ``d`` (its own config hash)."""
    recs = gr.records(label, d)
    out = {}
    for m in gr.arms(d):
        if m.get("label") != label:
            continue
        rows = rows_by_request(recs, m["arm"], m["key"])
        if not rows:
            raise InputError(f"{d}: arm {m['arm']} ({m['key']}) has no records in records_{label}.jsonl")
        out[m["arm"]] = rows
    return out


def verdicts(d: Path = R3_DIR) -> list[dict]:
    """Trigger vs each one-factor control (episode unit, one-sided Fisher, alpha 0.01), recomputed."""
    return [r for r in gr.verdict_table(d) if r["model"] == "tiny-gui"]


def _kind(text: str, ctl: str, other_values: set[str]) -> str:
    typed, want = _TYPED.search(text), _TYPED.search(ctl)
    if "\n" in text or "@(" in text or (typed is None and want is not None):
        return "run-on (the answer continues into screen text)"
    if typed and want and typed.group(1) != want.group(1):
        return ("another request's value" if typed.group(1) in other_values
                else "wrong value")
    return "wrong id"


def departures(d: Path = R3_DIR, control: str = "no_async") -> list[dict]:
    """The trigger's requests whose output tokens differ from ``control``'s, with the wrong answer's
    kind; "another request's value" = the typed text is what the control typed in a different
    episode of the run (its requests share batches with this one)."""
    arms = _by_arm(d)
    trg, ctl = arms["trigger"], arms[control]
    out = []
    typed = {k: m.group(1) for k, r in ctl.items() for m in [_TYPED.search(r["text"])] if m}
    for key in sorted(k for k in trg if k in ctl and trg[k]["output_token_ids"] != ctl[k]["output_token_ids"]):
        others = {v for k, v in typed.items() if k[0] != key[0]}
        out.append({"episode": key[0], "step": key[1], "trigger": trg[key]["text"][:48],
                    "control": ctl[key]["text"][:48], "kind": _kind(trg[key]["text"], ctl[key]["text"], others),
                    "prefix_hit_tokens": trg[key].get("num_cached_tokens")})
    return out


def factor_table(r3: Path = R3_DIR) -> list[dict]:
    """Each tiny-gui configuration run on the H200 vs round 2's eager async-off control, on the 288
    requests every set shares (seeds 0-5): how many differ, and which."""
    r2 = _by_arm(gr.E2E_DIR)
    ref = r2["no_async"]
    sets = [("round 2", "trigger", "compiled", "alone", r2["trigger"]),
            ("round 2", "no_prefix_cache", "eager", "alone", r2["no_prefix_cache"]),
            ("round 2", "no_mtp", "eager", "alone", r2["no_mtp"])]
    fac = _by_arm(r3 / "factors")
    for arm, recs in fac.items():
        meta = next(m for m in gr.arms(r3 / "factors") if m["arm"] == arm)
        sets.append(("round 3", arm, "eager" if meta["config"]["enforce_eager"] else "compiled", "alone", recs))
    for arm, recs in _by_arm(r3).items():
        sets.append(("round 3 (12 seeds)", arm, "eager", "two engines at once", recs))
    out = []
    for rnd, arm, mode, sharing, recs in sets:
        common = sorted(set(ref) & set(recs))
        diff = [k for k in common if recs[k]["output_token_ids"] != ref[k]["output_token_ids"]]
        out.append({"round": rnd, "arm": arm, "execution": mode, "gpu": sharing, "requests": len(common),
                    "differ_from_eager_no_async": len(diff),
                    "which": ", ".join(f"{e}/{s}" for e, s in diff)})
    return out


