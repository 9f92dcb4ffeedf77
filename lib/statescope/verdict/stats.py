"""ArmVerdict statistics: exact intervals and tests, sample sizes, a sequential test, and the A/B verdict.

What it does: Clopper–Pearson intervals, Fisher's exact test, detection and two-arm sample sizes, a
Bernoulli Wald SPRT, and ``decide()``, which turns a trigger and a control arm summary into one of
five outcomes after engagement guards (engine errors, control quality, the geometry really being
exercised). What it deliberately does not do: count failures (see ``statescope.verdict.detect``), read
metrics or run engines; it judges numbers it is handed.
"""
from __future__ import annotations

import dataclasses
import html
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats as _st

from statescope.errors import InputError
from statescope.intervals import median_interval  # noqa: F401  (a base module: capture uses it too)

CORRUPTION_DETECTED = "corruption detected"
NO_EVIDENCE = "no evidence"
GEOMETRY_NOT_EXERCISED = "geometry not exercised"
CONTROL_BROKEN = "control broken"
ENGINE_BROKEN = "engine broken"
UNITS = ("request", "episode", "engine_lifetime")


def _check_counts(k: int, n: int, what: str) -> None:
    if not (isinstance(k, numbers.Integral) and isinstance(n, numbers.Integral)) or not 0 <= k <= n:
        raise InputError(f"{what}: expected integers 0 <= k <= n, got k={k!r}, n={n!r}")


def _check_prob(p: float, what: str, *, open_lo: bool = True, open_hi: bool = True) -> None:
    if not isinstance(p, numbers.Real) or not ((0 < p if open_lo else 0 <= p)
                                                and (p < 1 if open_hi else p <= 1)):
        raise InputError(f"{what}: expected a probability in {'(' if open_lo else '['}0, 1"
                         f"{')' if open_hi else ']'}, got {p!r}")


def clopper_pearson(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper–Pearson) two-sided interval for a binomial rate k/n."""
    _check_counts(k, n, "clopper_pearson")
    if n == 0:
        raise InputError("clopper_pearson: expected n >= 1 (no observations give no interval)")
    _check_prob(conf, "clopper_pearson conf")
    tail = (1 - conf) / 2
    lo = 0.0 if k == 0 else float(_st.beta.ppf(tail, k, n - k + 1))
    hi = 1.0 if k == n else float(_st.beta.ppf(1 - tail, k + 1, n - k))
    return lo, hi


def _fisher(k1: int, n1: int, k2: int, n2: int, alternative: str) -> float:
    _check_counts(k1, n1, "fisher arm 1")
    _check_counts(k2, n2, "fisher arm 2")
    table = [[k1, n1 - k1], [k2, n2 - k2]]
    return float(_st.fisher_exact(table, alternative=alternative).pvalue)


def fisher_exact_one_sided(k1: int, n1: int, k2: int, n2: int) -> float:
    """p-value of Fisher's exact test for 'rate of arm 1 > rate of arm 2'."""
    return _fisher(k1, n1, k2, n2, "greater")


def fisher_exact_two_sided(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p-value of Fisher's exact test (sum of tables no more likely than the one seen)."""
    return _fisher(k1, n1, k2, n2, "two-sided")


def requests_for_detection(rate: float, conf: float = 0.95) -> int:
    """Smallest n with P(at least one failure in n independent units) >= conf at this rate."""
    _check_prob(rate, "requests_for_detection rate", open_hi=False)
    _check_prob(conf, "requests_for_detection conf")
    if rate == 1:
        return 1
    n = max(1, math.ceil(math.log1p(-conf) / math.log1p(-rate)))
    # The closed form sits near integers for common inputs; settle rounding by direct check.
    while 1 - (1 - rate) ** n < conf:
        n += 1
    while n > 1 and 1 - (1 - rate) ** (n - 1) >= conf:
        n -= 1
    return n


def _fisher_power(n: int, p1: float, p0: float, alpha: float) -> float:
    """Exact power of the one-sided Fisher test with n units per arm (sum over control outcomes)."""
    k = np.arange(n + 1)
    w = _st.binom.pmf(k, n, p0)
    k2 = k[w >= 1e-12]  # control outcomes that carry weight
    # For each control outcome k2, bisect for the smallest rejecting k1 (p falls as k1 grows); the
    # p-value of 'arm 1 higher' is P(X >= k1) for X ~ hypergeometric(2n, k1 + k2, n).
    lo, hi = np.zeros_like(k2), np.full_like(k2, n + 1)  # invariant: crit in [lo, hi]
    while np.any(lo < hi):
        mid = (lo + hi) // 2
        act = lo < hi
        rej = _st.hypergeom.sf(mid - 1, 2 * n, np.minimum(mid + k2, 2 * n), n) <= alpha
        hi, lo = np.where(act & rej, mid, hi), np.where(act & ~rej, mid + 1, lo)
    return float(np.sum(w[k2] * _st.binom.sf(lo - 1, n, p1)))


def two_arm_sample_size(p1: float, p0: float, alpha: float = 0.05, power: float = 0.9,
                        *, method: str = "normal") -> int:
    """Units per arm for a one-sided test of 'p1 > p0' at level alpha with the given power.

    method='normal': the unpooled normal approximation
    n = (z_{1-alpha} + z_{power})^2 * (p1(1-p1) + p0(1-p0)) / (p1 - p0)^2, rounded up
    (0.056 vs 0, alpha 0.05, power 0.9 gives 144.4 -> 145). method='exact': the smallest n at which
    the exact power of the one-sided Fisher test reaches `power`, searched upward from half the normal
    estimate (from 2 if that already has the power); slow, so refused when the normal n > 2000.
    """
    _check_prob(p1, "two_arm_sample_size p1")
    _check_prob(p0, "two_arm_sample_size p0", open_lo=False)
    _check_prob(alpha, "two_arm_sample_size alpha")
    _check_prob(power, "two_arm_sample_size power")
    if p1 <= p0:
        raise InputError(f"two_arm_sample_size: expected p1 > p0, got p1={p1}, p0={p0}")
    z = _st.norm.ppf(1 - alpha) + _st.norm.ppf(power)
    n_normal = math.ceil(z * z * (p1 * (1 - p1) + p0 * (1 - p0)) / (p1 - p0) ** 2)
    if method == "normal":
        return n_normal
    if method != "exact":
        raise InputError(f"two_arm_sample_size method: expected 'normal' or 'exact', got {method!r}")
    if n_normal > 2000:
        raise InputError(f"two_arm_sample_size: method='exact' expected a normal estimate <= 2000 "
                         f"per arm, got {n_normal}; use method='normal'")
    start = max(2, n_normal // 2)
    start = 2 if _fisher_power(start, p1, p0, alpha) >= power else start
    for n in range(start, 10 * n_normal + 50):
        if _fisher_power(n, p1, p0, alpha) >= power:
            return n
    raise InputError(f"two_arm_sample_size: exact search found no n up to {10 * n_normal + 50}")


class SPRT:
    """Wald's sequential probability ratio test for a Bernoulli failure rate, H0: p0 vs H1: p1."""

    def __init__(self, p0: float, p1: float, alpha: float = 0.05, beta: float = 0.05) -> None:
        for name, p in (("p0", p0), ("p1", p1), ("alpha", alpha), ("beta", beta)):
            _check_prob(p, f"SPRT {name}")
        if p1 <= p0:
            raise InputError(f"SPRT: expected p1 > p0, got p0={p0}, p1={p1}")
        self.p0, self.p1, self.alpha, self.beta = p0, p1, alpha, beta
        self.upper = math.log((1 - beta) / alpha)  # cross it: accept H1
        self.lower = math.log(beta / (1 - alpha))  # cross it: accept H0
        self.step_failed = math.log(p1 / p0)
        self.step_clean = math.log1p(-p1) - math.log1p(-p0)
        self.n = 0
        self.k = 0
        self.decision = "continue"

    @property
    def bounds(self) -> tuple[float, float]:
        """(lower, upper) log-likelihood-ratio bounds: at or below lower accept H0, at or above upper H1."""
        return self.lower, self.upper

    @property
    def llr(self) -> float:
        # Computed from the counts, not accumulated, so it carries no running rounding error.
        return self.k * self.step_failed + (self.n - self.k) * self.step_clean

    def clean_observations_to_accept_h0(self) -> int:
        """Clean observations needed from the start to accept H0 (the formula update() follows)."""
        return math.ceil(self.lower / self.step_clean)

    def update(self, failed: bool) -> str:
        """Add one observation; returns 'continue', 'accept_h0' or 'accept_h1'."""
        if self.decision != "continue":
            raise InputError(f"SPRT.update: the test already stopped with {self.decision!r} "
                             f"after {self.n} observations; start a new SPRT")
        self.n += 1
        self.k += bool(failed)
        llr = self.llr
        if llr >= self.upper:
            self.decision = "accept_h1"
        elif llr <= self.lower:
            self.decision = "accept_h0"
        return self.decision


@dataclass
class ArmSummary:
    """One arm's counts; n_units/n_failed_units are counted in `unit`, the unit of independence."""
    name: str
    n_units: int
    n_failed_units: int
    unit: str = "request"
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    resolved: dict = field(default_factory=dict)
    expect_prefix_cache: bool = False
    expect_spec: bool = False
    n_engine_errors: int = 0
    n_requests: int | None = None
    engagement_sources: dict = field(default_factory=dict)  # where the guard counts came from


@dataclass
class Guard:
    name: str
    passed: bool
    detail: str


@dataclass
class ArmVerdict:
    """decide()'s result: the outcome, the numbers behind it, every guard, and a plain explanation."""
    outcome: str
    trigger: ArmSummary
    control: ArmSummary
    unit: str
    trigger_rate: float | None
    trigger_ci: tuple[float, float] | None
    control_rate: float | None
    control_ci: tuple[float, float] | None
    fisher_p: float | None
    alpha: float
    guards: list[Guard]
    explanation: str

    def to_dict(self) -> dict[str, Any]:
        # json round trip: tuples become lists, odd values in `resolved` become strings.
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))

    def _repr_html_(self) -> str:
        colour = {CORRUPTION_DETECTED: "#c62828", NO_EVIDENCE: "#2e7d32", GEOMETRY_NOT_EXERCISED:
                  "#ef6c00", CONTROL_BROKEN: "#6a1b9a", ENGINE_BROKEN: "#616161"}[self.outcome]
        e, td = html.escape, "<td style='padding:2px 8px'>{}</td>".format

        def arm_row(arm: ArmSummary, rate: float | None, ci: tuple | None, p: str) -> str:
            r = "n/a" if rate is None else f"{rate:.2%}"
            c = "n/a" if ci is None else f"[{ci[0]:.2%}, {ci[1]:.2%}]"
            return "<tr>" + "".join(td(x) for x in (e(arm.name), f"{arm.n_failed_units}/{arm.n_units}",
                                                      r, c, p)) + "</tr>"
        p = "n/a" if self.fisher_p is None else f"{self.fisher_p:.3g}"
        guards = "".join(f"<tr>{td(e(g.name))}{td('pass' if g.passed else '<b>FAIL</b>')}"
                         f"{td(e(g.detail))}</tr>" for g in self.guards)
        return (f"<div><div style='background:{colour};color:white;padding:4px 8px;font-weight:bold'>"
                f"{e(self.outcome)}</div><table><tr><th>arm</th><th>failed/{e(self.unit)}s</th>"
                f"<th>rate</th><th>95% CI</th><th>Fisher p (one-sided)</th></tr>"
                f"{arm_row(self.trigger, self.trigger_rate, self.trigger_ci, p)}"
                f"{arm_row(self.control, self.control_rate, self.control_ci, '')}</table>"
                f"<table><tr><th>guard</th><th>result</th><th>detail</th></tr>{guards}</table>"
                f"<p>{e(self.explanation)}</p></div>")


def _check_arm(arm: ArmSummary, role: str) -> ArmSummary:
    """Validate an arm; returns a copy with plain-int counts (numpy ints arrive from DataFrames)."""
    _check_counts(arm.n_failed_units, arm.n_units, f"{role} arm {arm.name!r} n_failed_units/n_units")
    if arm.unit not in UNITS:
        raise InputError(f"{role} arm {arm.name!r} unit: expected one of {UNITS}, got {arm.unit!r}")
    if not isinstance(arm.resolved, dict):
        raise InputError(f"{role} arm {arm.name!r} resolved: expected a dict, got {type(arm.resolved)}")
    counts = {}
    for f in ("n_units", "n_failed_units", "prefix_cache_queries", "prefix_cache_hits",
              "spec_draft_tokens", "spec_accepted_tokens", "n_engine_errors"):
        v = getattr(arm, f)
        if not isinstance(v, numbers.Integral) or v < 0:
            raise InputError(f"{role} arm {arm.name!r} {f}: expected a non-negative int, got {v!r}")
        counts[f] = int(v)
    return dataclasses.replace(arm, **counts)


def _contradictions(arm: ArmSummary) -> tuple[list[str], list[str]]:
    """Resolved settings that contradict the arm's expectations: (prefix-cache ones, spec ones)."""
    r, pc, sp = arm.resolved, [], []
    if arm.expect_prefix_cache:
        if r.get("enable_prefix_caching") is False:
            pc.append("resolved enable_prefix_caching=False")
        if r.get("mamba_cache_mode") == "none":
            pc.append("resolved mamba_cache_mode='none' caches no recurrent state")
    if arm.expect_spec:
        for key in ("num_speculative_tokens", "num_spec_tokens", "speculative_config"):
            if key in r and not r[key]:
                sp.append(f"resolved {key}={r[key]!r}")
    return pc, sp


def _guards(t: ArmSummary, c: ArmSummary, control_max_rate: float) -> dict[str, Guard]:
    g: dict[str, Guard] = {}
    errs = t.n_engine_errors + c.n_engine_errors
    empty = [a.name for a in (t, c) if a.n_units == 0]
    g["engine_ok"] = Guard("engine_ok", errs == 0 and not empty,
                           f"{t.n_engine_errors} trigger / {c.n_engine_errors} control engine errors"
                           + (f"; no completed units in {empty}" if empty else ""))
    c_rate = c.n_failed_units / c.n_units if c.n_units else None
    g["control_quality"] = Guard("control_quality", c_rate is not None and c_rate <= control_max_rate,
                                 f"control failure rate {c_rate if c_rate is None else f'{c_rate:.2%}'}"
                                 f" (max {control_max_rate:.2%})")
    same = bool(t.resolved) and t.resolved == c.resolved
    g["arms_distinct"] = Guard("arms_distinct", not same,
                               "trigger and control resolved to the same configuration" if same else
                               ("resolved configs differ" if t.resolved and c.resolved else
                                "not checked: resolved config missing for an arm"))
    pc, sp = _contradictions(t)
    src = t.engagement_sources or {}
    pc_src = f" (source: {src['prefix_cache_source']})" if src.get("prefix_cache_source") else ""
    sp_src = f" (source: {src['spec_source']})" if src.get("spec_source") else ""
    for name, expected, got, what, bad in (
            ("prefix_cache_engaged", t.expect_prefix_cache, t.prefix_cache_hits,
             f"{t.prefix_cache_hits} hits / {t.prefix_cache_queries} queries{pc_src}", pc),
            ("spec_engaged", t.expect_spec, t.spec_accepted_tokens,
             f"{t.spec_accepted_tokens} accepted / {t.spec_draft_tokens} draft tokens{sp_src}", sp)):
        if not expected:
            g[name] = Guard(name, True, f"not expected ({what})")
        else:
            g[name] = Guard(name, got > 0 and not bad, "; ".join([what] + bad))
    return g


def decide(trigger: ArmSummary, control: ArmSummary, alpha: float = 0.01,
           control_max_rate: float = 0.05) -> ArmVerdict:
    """Judge a trigger arm against a control arm; guards are checked before the Fisher test."""
    trigger, control = _check_arm(trigger, "trigger"), _check_arm(control, "control")
    _check_prob(alpha, "decide alpha")
    _check_prob(control_max_rate, "decide control_max_rate", open_lo=False)
    if trigger.unit != control.unit:
        raise InputError(f"decide: arms count different units (trigger {trigger.unit!r}, control "
                         f"{control.unit!r}); expected the same unit of independence")
    g = _guards(trigger, control, control_max_rate)
    t, c, unit = trigger, control, trigger.unit
    t_rate = t.n_failed_units / t.n_units if t.n_units else None
    c_rate = c.n_failed_units / c.n_units if c.n_units else None
    t_ci = clopper_pearson(t.n_failed_units, t.n_units) if t.n_units else None
    c_ci = clopper_pearson(c.n_failed_units, c.n_units) if c.n_units else None
    p = (fisher_exact_one_sided(t.n_failed_units, t.n_units, c.n_failed_units, c.n_units)
         if t.n_units and c.n_units else None)
    counts = (f"Trigger {t.n_failed_units}/{t.n_units}, control {c.n_failed_units}/{c.n_units} "
              f"failed {unit}s")
    note = (" Requests are counted as independent units; a poisoned cached state can persist across "
            "requests of one engine lifetime, so confirm with 'episode' or 'engine_lifetime' units."
            if unit == "request" else f" Each {unit} is one independent unit.")
    if not g["engine_ok"].passed:
        outcome, why = ENGINE_BROKEN, (f"The engine failed ({g['engine_ok'].detail}), so the run says "
                                       "nothing about the bug; fix the environment and rerun.")
    elif not g["control_quality"].passed or not g["arms_distinct"].passed:
        bad = g["control_quality"] if not g["control_quality"].passed else g["arms_distinct"]
        outcome, why = CONTROL_BROKEN, (f"The control arm is not a usable baseline ({bad.detail}); "
                                        f"{counts}. No comparison was made.")
    elif not g["prefix_cache_engaged"].passed or not g["spec_engaged"].passed:
        failed = [x for x in ("prefix_cache_engaged", "spec_engaged") if not g[x].passed]
        outcome, why = GEOMETRY_NOT_EXERCISED, (
            "The trigger arm never reached the code path under test ("
            + "; ".join(f"{x}: {g[x].detail}" for x in failed) + f"). {counts}; a clean result here "
            "would not clear the suspect path.")
    elif p < alpha:
        outcome, why = CORRUPTION_DETECTED, (
            f"{counts}: the trigger fails more often than the control (one-sided Fisher p={p:.3g} "
            f"< alpha={alpha}); trigger rate {t_rate:.2%}, 95% CI [{t_ci[0]:.2%}, {t_ci[1]:.2%}].")
    else:
        outcome, why = NO_EVIDENCE, (
            f"{counts}: no significant excess in the trigger (one-sided Fisher p={p:.3g}, "
            f"alpha={alpha}). Power: this run rules out a trigger failure rate above {t_ci[1]:.2%} "
            f"(upper 95% Clopper-Pearson bound); smaller rates remain possible.")
    return ArmVerdict(outcome, t, c, unit, t_rate, t_ci, c_rate, c_ci, p, alpha, list(g.values()),
                   why + note)
