"""How a build's commands run: a clean environment, a logged subprocess with a time limit, the
import check.

What it does: ``clean_env`` is the caller's environment (pip configuration, proxies, ``PIP_*``)
minus what would leak this driver's own virtual environment into a build's; ``run_logged`` runs one
command with its output appended to an open install or check log, timed, a timeout read as exit
124; ``VERIFY_IMPORTS`` is the one-line program a build must run to count as usable (it imports
statescope, vLLM and torch and prints their versions).

What it deliberately does not do: decide what to install or where (``statescope.builds.install``),
or know about existing environments (``statescope.builds.environment``).
"""
from __future__ import annotations

import os
import subprocess
import time

VERIFY_IMPORTS = ("import json, importlib.metadata as md, statescope, vllm, torch; "
           "print('STATESCOPE_VERSIONS ' + json.dumps({'vllm': vllm.__version__, "
           "'torch': torch.__version__, 'statescope': statescope.__version__}))")


def clean_env(extra: dict | None = None) -> dict:
    """The caller's environment (pip config, proxies, PIP_*) minus what would leak this venv in."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "__PYVENV_LAUNCHER__")}
    env.setdefault("OMP_NUM_THREADS", "1")
    return {**env, **(extra or {})}


def run_logged(cmd: list[str], log, step: str, env: dict, timeout_s: float) -> tuple[int, str]:
    log.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
    log.flush()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, timeout=timeout_s)
        out, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = (exc.stdout or b"") + f"\n[timed out after {timeout_s} s]\n".encode(), 124
    log.write(out + f"[{step}: exit {rc}, {time.perf_counter() - t0:.1f} s]\n".encode())
    log.flush()
    return rc, out.decode(errors="replace")
