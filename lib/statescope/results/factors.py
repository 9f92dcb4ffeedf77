"""Which factors does the corruption need? Read ``data/results/gpu/e2e_factors/``: the eager 12-seed
verdict, the factor check, and the capture-overhead breakdown measured beside them.

What it does: ``verdicts`` recomputes the trigger-vs-control verdicts of the eager 12-seed set from
its records (``statescope.verdict.rejudge.verdict_rows``, as ``e2e/``'s are); ``departures`` lists the trigger's
requests whose answer differs from the async-off control, with what kind of wrong answer each is;
``factor_table`` compares every tiny-gui configuration run on the H200 (``e2e/`` and
``e2e_factors/``, compiled and eager) with ``e2e/``'s eager async-off control on the 288 requests
they share, which is what says which factors a departure needs; ``digest_bench``, ``triton_overheads``
and ``probe_table`` (``statescope.results.overhead``) are the capture-overhead measurements with the
one-launch Triton digest.

What it deliberately does not do: run anything on a device, or rank mechanisms (the localization
of ``e2e/``, ``statescope.results.e2e.localization``, and ``statescope.diverge.hypotheses`` do that).
"""
from __future__ import annotations

import re
from pathlib import Path

from statescope.results import e2e
from statescope.errors import InputError
from statescope.records import rows_by_request

FACTORS_DIR = e2e.E2E_DIR.parent / "e2e_factors"
_TYPED = re.compile(r'text="([^"]*)"')


def _by_arm(d: Path, label: str = "tiny-gui") -> dict[str, dict]:
    """{arm name: {(episode, step): record}} for each arm meta in ``d`` (its own config hash)."""
    recs = e2e.records(label, d)
    out = {}
    for m in e2e.arms(d):
        if m.get("label") != label:
            continue
        rows = rows_by_request(recs, m["arm"], m["key"])
        if not rows:
            raise InputError(f"{d}: arm {m['arm']} ({m['key']}) has no records in records_{label}.jsonl")
        out[m["arm"]] = rows
    return out


def verdicts(d: Path = FACTORS_DIR) -> list[dict]:
    """Trigger vs each one-factor control (episode unit, one-sided Fisher, alpha 0.01), recomputed."""
    return [r for r in e2e.verdict_table(d) if r["model"] == "tiny-gui"]


def _kind(text: str, ctl: str, other_values: set[str]) -> str:
    typed, want = _TYPED.search(text), _TYPED.search(ctl)
    if "\n" in text or "@(" in text or (typed is None and want is not None):
        return "run-on (the answer continues into screen text)"
    if typed and want and typed.group(1) != want.group(1):
        return ("another request's value" if typed.group(1) in other_values
                else "wrong value")
    return "wrong id"


def departures(d: Path = FACTORS_DIR, control: str = "no_async") -> list[dict]:
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


def factor_table(d: Path = FACTORS_DIR) -> list[dict]:
    """Each tiny-gui configuration run on the H200 vs ``e2e/``'s eager async-off control, on the 288
    requests every set shares (seeds 0-5): how many differ, and which. ``folder`` names the results
    folder under ``data/results/gpu/`` each set comes from."""
    first = _by_arm(e2e.E2E_DIR)
    ref = first["no_async"]
    sets = [("e2e", "trigger", "compiled", "alone", first["trigger"]),
            ("e2e", "no_prefix_cache", "eager", "alone", first["no_prefix_cache"]),
            ("e2e", "no_mtp", "eager", "alone", first["no_mtp"])]
    fac = _by_arm(d / "factors")
    for arm, recs in fac.items():
        meta = next(m for m in e2e.arms(d / "factors") if m["arm"] == arm)
        sets.append((f"{Path(d).name}/factors", arm, "eager" if meta["config"]["enforce_eager"] else "compiled",
                     "alone", recs))
    for arm, recs in _by_arm(d).items():
        sets.append((f"{Path(d).name} (12 seeds)", arm, "eager", "two engines at once", recs))
    out = []
    for folder, arm, mode, sharing, recs in sets:
        common = sorted(set(ref) & set(recs))
        diff = [k for k in common if recs[k]["output_token_ids"] != ref[k]["output_token_ids"]]
        out.append({"folder": folder, "arm": arm, "execution": mode, "gpu": sharing, "requests": len(common),
                    "differ_from_eager_no_async": len(diff),
                    "which": ", ".join(f"{e}/{s}" for e, s in diff)})
    return out


