"""``statescope doctor``: is this machine able to run the workbook's failing configuration?

What it does: checks versions (statescope, Python, torch, vLLM, platform), the model directory, and
then starts the real engine with prefix caching + align + MTP(2), runs a small shared-prefix
multi-step workload, and reports the resolved configuration and vLLM's counters. Each check has a
pass/fail and one line of detail; the first failure is the one-line error the CLI prints.

The census block (``census``: ``statescope.builds.census`` over the installed vLLM's sources)
says which fixes of the bug family the build contains and which runner it picks by default.

What it deliberately does not do: judge corruption (that is ``statescope reproduce``); a passing
doctor only means the trigger configuration runs and its code paths are engaged.
"""
from __future__ import annotations

import html
import platform
import time
from dataclasses import dataclass, field

from statescope.errors import StatescopeError
from statescope.tables import KeyValueTable


@dataclass
class DoctorCheck:
    name: str
    ok: bool
    detail: str


@dataclass
class DoctorReport:
    checks: list[DoctorCheck] = field(default_factory=list)
    resolved: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    startup_s: float | None = None
    census: dict = field(default_factory=dict)  # BuildCensus.to_dict() of the installed vLLM

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def first_failure(self) -> DoctorCheck | None:
        return next((c for c in self.checks if not c.ok), None)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": [c.__dict__ for c in self.checks],
                "resolved": self.resolved, "metrics": self.metrics, "startup_s": self.startup_s,
                "census": self.census}

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{'✅' if c.ok else '❌'}</td><td>{html.escape(c.name)}</td>"
                       f"<td>{html.escape(c.detail)}</td></tr>" for c in self.checks)
        parts = [f"<table><caption>statescope doctor</caption>{rows}</table>"]
        if self.census:
            parts.append(f"<p><b>census</b>: {html.escape(self.census['summary'])}</p>")
        if self.resolved:
            parts.append(KeyValueTable("resolved configuration", self.resolved,
                                       {"warnings"} if self.resolved.get("warnings") else set()
                                       )._repr_html_())
        if self.metrics:
            parts.append(KeyValueTable("vLLM metrics", self.metrics)._repr_html_())
        return "".join(parts)


def run_doctor(model: str | None = None, *, start_engine: bool = True) -> DoctorReport:
    """Run every check; never raises for a broken environment (the report says what broke)."""
    import statescope
    from statescope.engine.offline import OfflineEngine, import_vllm
    from statescope.engine.config import EngineConfig, model_path
    from statescope.engine.modeldir import check_model_dir

    report = DoctorReport()
    add = report.checks.append
    add(DoctorCheck("statescope", True, f"{statescope.__version__} on Python {platform.python_version()}"))
    try:
        import torch

        add(DoctorCheck("torch", True, f"{torch.__version__} (cuda available: {torch.cuda.is_available()})"))
        vllm = import_vllm()
        add(DoctorCheck("vllm", True, f"{vllm.__version__}"))
    except (ImportError, StatescopeError) as exc:
        add(DoctorCheck("vllm", False, str(exc)))
        return report
    try:  # read from source, never fatal: the census is information, not a check
        from statescope.builds.census import census_installed

        report.census = census_installed().to_dict()
    except (StatescopeError, OSError) as exc:
        report.census = {"summary": f"census unavailable: {exc}", "brief": None}
    config = EngineConfig() if model is None else EngineConfig(model=str(model_path(model)))
    try:
        text = check_model_dir(config.model)
        add(DoctorCheck("model", True, f"{config.model}: {text.get('model_type')}, "
                                 f"{text.get('num_hidden_layers')} layers"))
    except StatescopeError as exc:
        add(DoctorCheck("model", False, str(exc)))
        return report
    if not start_engine:
        return report
    try:
        report.resolved, report.metrics, report.startup_s = _engine_probe(config)
    except Exception as exc:  # the doctor's job is to turn any engine failure into one line
        add(DoctorCheck("engine", False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
        return report
    r, m = report.resolved, report.metrics
    add(DoctorCheck("engine", True, f"started in {report.startup_s:.1f} s ({r.get('model_runner')})"))
    add(DoctorCheck("prefix caching + align", r["enable_prefix_caching"] and r["mamba_cache_mode"] == "align",
              f"enable_prefix_caching={r['enable_prefix_caching']} "
              f"mamba_cache_mode={r['mamba_cache_mode']} mamba_block_size={r['mamba_block_size']}"))
    add(DoctorCheck("MTP", r["num_speculative_tokens"] == 2,
              f"method={r['speculative_method']} num_speculative_tokens={r['num_speculative_tokens']}"
              f" draft={r['draft_architecture']}"))
    add(DoctorCheck("prefix-cache hits", m["prefix_cache_hits"] > 0,
              f"{m['prefix_cache_hits']} of {m['prefix_cache_queries']} queried tokens"))
    add(DoctorCheck("accepted drafts", m["spec_accepted_tokens"] > 0,
              f"{m['spec_accepted_tokens']} of {m['spec_draft_tokens']} draft tokens"))
    add(DoctorCheck("async scheduling", True, "on" if r["async_scheduling"] else
              "OFF as resolved — " + "; ".join(r["warnings"]) if r["warnings"] else "off"))
    return report


def _engine_probe(config) -> tuple[dict, dict, float]:
    from statescope.engine.offline import OfflineEngine
    from statescope.workload.episodes import run_episodes, shared_prefix_episodes

    t0 = time.perf_counter()
    with OfflineEngine(config) as engine:
        startup = time.perf_counter() - t0
        # Long shared prefix: with MTP a prompt needs more than two align blocks (384 tokens on
        # the tiny models) before the prefix cache can serve any of it.
        run_episodes(engine, shared_prefix_episodes(n_episodes=2, n_steps=3), max_tokens=12,
                     system_repeat=16)
        return engine.resolved(), engine.metrics(), startup
