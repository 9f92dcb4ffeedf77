"""Does the data hold up the bisection's answer? The change-point model's answer, checked against
the probes' own counts.

What it does: ``checked_answer(result)`` pools the probes on each side of the named change location
and tests (one-sided Fisher exact, ``statescope.verdict.stats``) that the side the mode calls good
fails less than the other. The model assumes exactly one change in the range, so it always names a
location -- even when every probe fails alike. The check turns that into one of: "first good:
X" / "first bad: X" (confirmed, p < ``alpha``), "none is good" / "none is bad" (the probes at and
after the answer fail like those before it, or every probe fails), "every item is good" (fix mode:
no probe failed), or "unconfirmed" (one side was never probed). ``first_good`` / ``first_bad`` is
the answer only when confirmed. ``outcome`` puts the verdict in the confirmed bisection's words
(``statescope.bisect.confirmed.OUTCOMES``): "first good" / "first bad" only when the answer and
its predecessor were both probed (the confirmation rule), "none is good" (find-fix, the probes
from the answer on fail like those before it), else "inconclusive" -- a search in which nothing
failed was never calibrated and answers nothing.

What it deliberately does not do: run probes, re-weigh the posterior, or model more than one change.
"""
from __future__ import annotations

from typing import Any

ALPHA = 0.05


def _pooled(probes, keep) -> tuple[int, int]:
    chosen = [p for p in probes if keep(p.index)]
    return sum(p.k for p in chosen), sum(p.n for p in chosen)


def checked_answer(result, *, alpha: float = ALPHA) -> dict[str, Any]:
    """The answer of ``result`` (a ``BisectResult``) checked against its probes (see the module)."""
    from statescope.verdict.stats import fisher_exact_one_sided

    a, fix = result.answer_index, result.mode == "fix"
    k_before, n_before = _pooled(result.probes, lambda i: i < a)
    k_after, n_after = _pooled(result.probes, lambda i: i >= a)
    word = "good" if fix else "bad"
    out: dict[str, Any] = {"answer": result.answer, "mode": result.mode, "alpha": alpha,
                           "before": f"{k_before}/{n_before}", "at_or_after": f"{k_after}/{n_after}",
                           "fisher_p": None, f"first_{word}": None}
    out["outcome"] = "inconclusive"
    k_all, n_all = k_before + k_after, n_before + n_after
    if n_all and k_all == 0:
        out["verdict"] = ("every probed item is good: no probe failed" if fix else
                          "none is bad: no probe failed")
        return out
    if n_before and n_after:
        # fix: the before side fails more; regression: the after side does
        p = (fisher_exact_one_sided(k_before, n_before, k_after, n_after) if fix else
             fisher_exact_one_sided(k_after, n_after, k_before, n_before))
        out["fisher_p"] = p
        probed = {q.index for q in result.probes}
        if p < alpha and {a - 1, a} <= probed:
            out[f"first_{word}"] = result.answer
            out["verdict"] = f"first {word}: {result.answer}"
            out["outcome"] = f"first {word}"
        elif p < alpha:
            out["verdict"] = (f"unconfirmed: {result.answer} and its predecessor were not both "
                              f"probed (p = {p:.3g})")
        else:
            out["outcome"] = "none is good" if fix else "inconclusive"
            out["verdict"] = (f"none is {word}: the probes from {result.answer} on fail "
                              f"{k_after}/{n_after}, those before it {k_before}/{n_before} "
                              f"(p = {p:.3g})")
        return out
    if n_all and k_all > 0 and fix and n_after and k_after > 0:
        out["verdict"] = f"none is good: every probe fails ({k_all}/{n_all})"
        end_failed = any(q.index == len(result.labels) - 1 and q.k > 0 for q in result.probes)
        out["outcome"] = "none is good" if end_failed else "inconclusive"
        return out
    side = "before" if not n_before else "at or after"
    out["verdict"] = f"unconfirmed: no probe {side} {result.answer}"
    return out
