"""Two end-of-run checks every test run prints (a pytest plugin, loaded by ``conftest.py``).

What it does:
- **Wall time per test file** (setup + call + teardown of its tests, slowest first) at the end of
  the run, so the slow tiers are measured on every run, CI's included (``docs/benchmarks.md``
  keeps the figures of a fresh-clone run).
- **Skips that are not about a GPU fail the run.** On a machine without an accelerator a test may
  skip only because it needs one (its reason names CUDA, a GPU, an H100/H200 or NVIDIA; "device" alone is not enough). Any other skip is
  a check that silently did not run — the release sources it reads were not fetched, a tool was
  missing — so the session's exit status becomes 1 and the skips are listed.

What it deliberately does not do: change which tests run or how; a deselected test (``-m``) is not
a skip.
"""
from __future__ import annotations

import re
from collections import defaultdict

import pytest

# CUDA/GPU wording only: the bare word "device" also names a device *profile* file
GPU_REASON = re.compile(r"\b(cuda|gpu|gpus|h100|h200|nvidia)\b", re.IGNORECASE)


def is_gpu_reason(reason: str) -> bool:
    """True when a skip's reason says it needs an accelerator."""
    return bool(GPU_REASON.search(reason or ""))


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


class SuiteReport:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.bad_skips: list[tuple[str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _skip_reason(report)
            if not is_gpu_reason(reason):
                self.bad_skips.append((report.nodeid, reason))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.seconds:
            terminalreporter.section("wall time per test file")
            total = sum(self.seconds.values())
            for path, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
                terminalreporter.write_line(f"{s:8.1f} s  {path}")
            terminalreporter.write_line(f"{total:8.1f} s  in all ({len(self.seconds)} files)")
        if self.bad_skips:
            terminalreporter.section("skips that do not need a GPU (these fail the run)")
            for nodeid, reason in self.bad_skips:
                terminalreporter.write_line(f"{nodeid}: {reason}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if self.bad_skips and exitstatus == 0:
            session.exitstatus = 1


def pytest_configure(config) -> None:
    config.pluginmanager.register(SuiteReport(), "statescope-suite-report")
