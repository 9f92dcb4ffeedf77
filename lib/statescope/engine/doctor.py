"""``statescope doctor``: is this machine able to run the workbook's failing configuration?

What it does: checks versions (statescope, Python, torch, vLLM, platform), the model directory, and
then starts the real engine with prefix caching + align + MTP(2), runs a small shared-prefix
multi-step workload, and reports the resolved configuration and vLLM's counters. Each check has a
pass/fail and one line of detail; the first failure is the one-line error the CLI prints.

The report carries a census block (``census``: filled by the CLI from ``statescope.builds.census``
over the installed vLLM's sources — a wing above this one): which fixes of the bug family the build
contains and which runner it picks by default.

What it deliberately does not do: judge corruption (that is ``statescope reproduce``); a passing
doctor only means the trigger configuration runs and its code paths are engaged.
"""
from __future__ import annotations

import html
import platform
import time
from dataclasses import dataclass, field

from statescope.errors import EngineStartError, StatescopeError
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
    from statescope.patches.device_profiles import choose_profile

    report = DoctorReport()
    add = report.checks.append
    add(DoctorCheck("statescope", True, f"{statescope.__version__} on Python {platform.python_version()}"))
    try:
        import torch

        add(DoctorCheck("torch", True, f"{torch.__version__} (cuda available: {torch.cuda.is_available()})"))
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            add(DoctorCheck("gpu", True, f"{p.name}, {p.total_memory // 2**30} GiB, "
                                         f"{torch.cuda.device_count()} device(s), CUDA {torch.version.cuda}"))
        vllm = import_vllm()
        add(DoctorCheck("vllm", True, f"{vllm.__version__} ({getattr(vllm, '__file__', '?')})"))
    except (ImportError, StatescopeError) as exc:
        add(DoctorCheck("vllm", False, str(exc)))
        return report
    try:
        profile = choose_profile()
    except StatescopeError as exc:
        add(DoctorCheck("device profile", False, str(exc)))
        return report
    add(DoctorCheck("device profile", True, profile.describe()))
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
    except Exception as exc:  # the doctor's job is to say what broke: vLLM's own error, verbatim
        add(DoctorCheck("engine", False, str(exc) if isinstance(exc, EngineStartError)
                        else f"{type(exc).__name__}: {exc}"))
        return report
    r, m = report.resolved, report.metrics
    add(DoctorCheck("engine", True, f"started in {report.startup_s:.1f} s "
                                    f"(runner {r.get('model_runner')}, {r.get('runner_version') or '?'})"))
    add(DoctorCheck("prefix caching + align", r["enable_prefix_caching"] and r["mamba_cache_mode"] == "align",
              f"enable_prefix_caching={r['enable_prefix_caching']} "
              f"mamba_cache_mode={r['mamba_cache_mode']} mamba_block_size={r['mamba_block_size']}"))
    add(DoctorCheck("MTP", r["num_speculative_tokens"] == 2,
              f"method={r['speculative_method']} num_speculative_tokens={r['num_speculative_tokens']}"
              f" draft={r['draft_architecture']}"))
    add(DoctorCheck("prefix-cache hits", m["prefix_cache_hits"] > 0,
              f"{m['prefix_cache_hits']} of {m['prefix_cache_queries']} queried tokens "
              f"(source: {m.get('prefix_cache_source', 'vLLM counters')})"))
    add(DoctorCheck("accepted drafts", m["spec_accepted_tokens"] > 0,
              f"{m['spec_accepted_tokens']} of {m['spec_draft_tokens']} draft tokens "
              f"(source: {m.get('spec_source', 'vLLM counters')})"))
    add(DoctorCheck("async scheduling", True, "on" if r["async_scheduling"] else
              "OFF as resolved — " + "; ".join(r["warnings"]) if r["warnings"] else "off"))
    return report


def _engine_probe(config) -> tuple[dict, dict, float]:
    from statescope.engine.offline import OfflineEngine
    from statescope.resolved import engagement_metrics
    from statescope.workload.episodes import run_episodes, shared_prefix_episodes

    t0 = time.perf_counter()
    with OfflineEngine(config) as engine:
        startup = time.perf_counter() - t0
        # Long shared prefix: with MTP a prompt needs more than two align blocks (384 tokens on
        # the tiny models) before the prefix cache can serve any of it.
        rows = run_episodes(engine, shared_prefix_episodes(n_episodes=2, n_steps=3), max_tokens=12,
                            system_repeat=16)
        # the guards' best source: vLLM's counters, else the requests' own counts
        return engine.resolved(), engagement_metrics(engine.metrics(), rows), startup
