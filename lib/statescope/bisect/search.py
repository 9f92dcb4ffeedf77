"""Searches over an ordered list: Bayesian bisection, textbook bisection, and one-setting bisection.

What it does: ``bayesian_bisect`` probes the item of largest expected information gain about the
change location (``statescope.bisect.model``) until one location holds ``confidence`` of the
posterior, the request budget would be exceeded, or no probe is informative; an item whose probe
raises ``EnvironmentBroken`` (a build that does not install or run) is skipped from then on, like
``git bisect skip``. ``mode='regression'``: the after regime fails more; ``mode='fix'``: the before
regime does (the answer is the first fixed item). ``plain_bisect`` is the textbook baseline (a
probe is "bad" iff it shows >= 1 failure). ``bisect_settings`` runs the Bayesian search over
ordered values of one setting. A probe is any callable ``probe(item, n) -> k | (n_done, k)``.

What it deliberately does not do: run experiments or install builds (``statescope.builds.run``
makes a probe that does), or treat requests of one engine lifetime as dependent (pass a probe
that counts independent units).
"""
from __future__ import annotations

import numbers
from dataclasses import asdict
from typing import Any, Callable, Sequence

import numpy as np

from statescope.bisect.model import ChangePointPosterior, RatePrior
from statescope.bisect.result import BisectResult, ProbeRecord
from statescope.errors import EnvironmentBroken, InputError

Probe = Callable[[Any, int], "int | tuple[int, int]"]  # (item, n requests) -> k or (n_done, k)


def _observe(probe: Probe, item: Any, n: int, label: str) -> tuple[int, int]:
    out = probe(item, n)
    n_done, k = (n, out) if isinstance(out, numbers.Integral) else tuple(out)
    if not (isinstance(n_done, numbers.Integral) and isinstance(k, numbers.Integral) and 0 <= k <= n_done):
        raise InputError(f"probe of {label}: expected k or (n_done, k) with 0 <= k <= n_done, got {out!r}")
    return int(n_done), int(k)


def _check_run_args(items: Sequence, requests_per_probe: int, labels: Sequence[str] | None) -> list[str]:
    if not isinstance(requests_per_probe, numbers.Integral) or requests_per_probe < 1:
        raise InputError(f"requests_per_probe={requests_per_probe!r}: expected an integer >= 1")
    names = [str(x) for x in items] if labels is None else [str(x) for x in labels]
    if len(names) != len(items):
        raise InputError(f"labels: expected {len(items)} labels, got {len(names)}")
    return names


def _record(post: ChangePointPosterior, step: int, index: int, label: str, n: int, k: int,
            used: int, info: float | None) -> tuple[ProbeRecord, np.ndarray]:
    m = post.marginal()
    best = int(np.argmax(m))
    return ProbeRecord(step, index, label, n, k, used, best, float(m[best]), info), m


def bayesian_bisect(items: Sequence, probe: Probe, *, mode: str = "regression",
                    requests_per_probe: int = 20, budget: int | None = None,
                    confidence: float = 0.95, max_probes: int = 200, prior: RatePrior | None = None,
                    observations: dict[int, tuple[int, int]] | None = None,
                    labels: Sequence[str] | None = None,
                    stop_when: Callable[[], bool] | None = None) -> BisectResult:
    """Probe the item of largest expected information gain until one location has ``confidence``.

    ``budget`` caps the total requests (None: only ``max_probes`` caps); ``stop_when()`` is asked
    before each probe and True ends the search (stopped: "time limit"); ``observations`` adds
    counts already measured, {item index: (n, k)}, e.g. the reproduction on the last build. An
    item whose probe raises ``EnvironmentBroken`` (a build that does not install or run) is skipped
    from then on, like ``git bisect skip``; the posterior then cannot split it from its neighbour."""
    names = _check_run_args(items, requests_per_probe, labels)
    if not 0 < confidence < 1:
        raise InputError(f"confidence={confidence!r}: expected a probability in (0, 1)")
    post = ChangePointPosterior(len(items), mode, prior)
    for i, (n, k) in (observations or {}).items():
        post.add(int(i), int(n), int(k))
    first = post.marginal()
    probes, posteriors, used, stopped, skipped, skipped_at = [], [], 0, "max_probes", {}, set()
    m = first
    while len(probes) < max_probes:
        # evidence is probes or given observations; the prior alone is never "confident" (with
        # two items a one-change model places the change before any probe)
        if m.max() >= confidence and (probes or observations):
            stopped = "confident"
            break
        if budget is not None and used + requests_per_probe > budget:
            stopped = "budget"
            break
        if stop_when is not None and stop_when():
            stopped = "time limit"
            break
        gain = post.information_gain(requests_per_probe)
        gain[list(skipped_at)] = -1.0
        j = int(np.argmax(gain))
        if gain[j] < 1e-9:
            stopped = "no informative probe"
            break
        try:
            n, k = _observe(probe, items[j], requests_per_probe, names[j])
        except EnvironmentBroken as exc:
            skipped[names[j]], skipped_at = str(exc), skipped_at | {j}
            continue
        post.add(j, n, k)
        used += n
        rec, m = _record(post, len(probes) + 1, j, names[j], n, k, used, float(gain[j]))
        probes.append(rec)
        posteriors.append(m.tolist())
    best = int(np.argmax(m))
    return BisectResult("bayesian", mode, names, probes, first.tolist(), posteriors, best,
                        float(m[best]), used, stopped,
                        {"requests_per_probe": requests_per_probe, "budget": budget,
                         "confidence": confidence, "prior": asdict(post.prior)}, skipped)


def plain_bisect(items: Sequence, probe: Probe, *, mode: str = "regression",
                 requests_per_probe: int = 20, prior: RatePrior | None = None,
                 labels: Sequence[str] | None = None) -> BisectResult:
    """Textbook bisection: a probe is "bad" iff it shows >= 1 failure; one probe per item.

    Its answer is the binary search's; the reported confidence is the Bayesian posterior mass on
    that answer given the same probes (how much the evidence supports it)."""
    names = _check_run_args(items, requests_per_probe, labels)
    post = ChangePointPosterior(len(items), mode, prior)
    first = post.marginal()
    lo, hi, used, probes, posteriors = 0, len(items) - 1, 0, [], []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        n, k = _observe(probe, items[mid], requests_per_probe, names[mid])
        post.add(mid, n, k)
        used += n
        after = (k > 0) == (mode == "regression")  # failures mean "after" only for a regression
        hi, lo = (mid, lo) if after else (hi, mid)
        rec, m = _record(post, len(probes) + 1, mid, names[mid], n, k, used, None)
        probes.append(rec)
        posteriors.append(m.tolist())
    final = np.array(posteriors[-1]) if posteriors else first
    return BisectResult("plain", mode, names, probes, first.tolist(), posteriors, hi,
                        float(final[hi]), used, "bisection finished",
                        {"requests_per_probe": requests_per_probe})


def bisect_settings(axis: str, values: Sequence, probe: Probe, **kwargs: Any) -> BisectResult:
    """Bayesian bisection over ordered values of one setting; ``probe(value, n)`` as for items."""
    vals = list(values)
    if len(set(map(repr, vals))) != len(vals):
        raise InputError(f"bisect_settings {axis}: expected distinct values, got {vals}")
    if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in vals):
        diffs = np.diff(np.asarray(vals, dtype=float))
        if not (np.all(diffs > 0) or np.all(diffs < 0)):
            raise InputError(f"bisect_settings {axis}: expected numeric values in increasing or "
                             f"decreasing order, got {vals}")
    result = bayesian_bisect(vals, probe, labels=[f"{axis}={v}" for v in vals], **kwargs)
    result.settings["axis"] = axis
    return result
