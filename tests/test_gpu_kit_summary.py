"""``install_all.sh``'s summary names every requirement problem of a release it installed.

The release install pipes the requirement check's rows through ``sed "s/^/$NAME requires: /"``
into the release's log, and install_all.sh's summary greps that log. The check prints its rows
indented (``  CONFLICT numpy ...``), so a log line reads ``0.29.0 requires:   CONFLICT ...``; a
summary pattern expecting one space after ``requires:`` printed only ``check: 2 problem(s)``.
This test runs the script's own sed prefix and summary grep (read from ``scripts/gpu_kit.sh``)
over rows in the check's own format. No GPU needed.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_kit.sh"


def _summary_pattern() -> str:
    line = next(l for l in SCRIPT.read_text().splitlines() if l.strip().startswith("installed) grep -E"))
    return re.search(r"grep -E '([^']+)'", line).group(1)


def _check_rows() -> list[str]:
    """Rows as the check prints them (``f"  {title:8s} {row}"`` and its last line)."""
    return [f"  {'MISSING':8s} triton (required by torch: triton==3.6.0)",
            f"  {'CONFLICT':8s} numpy 2.3.1 [image] but vllm wants <2.3",
            f"  {'ACCEPTED':8s} setuptools 80 [image] but torch wants <80  -- accepted: build only",
            "check: 2 problem(s)"]


def test_the_summary_names_each_problem_row():
    text = SCRIPT.read_text()
    # what the release install keeps of the check, and the prefix it writes before each row
    assert ("""grep -E 'MISSING|CONFLICT|^check:' "$DEST/requires-check.txt" | head -20 | """
            """sed "s/^/$NAME requires: /\"""") in text
    kept = subprocess.run(["grep", "-E", "MISSING|CONFLICT|^check:"], input="\n".join(_check_rows()),
                          capture_output=True, text=True).stdout.splitlines()
    log = "\n".join(["vllm 0.29.0 torch 2.13.0+cu130 cuda True"]
                    + [f"0.29.0 requires: {row}" for row in kept]) + "\n"
    shown = subprocess.run(["grep", "-E", _summary_pattern()], input=log, capture_output=True,
                           text=True).stdout.splitlines()
    assert any("MISSING" in l and "triton" in l for l in shown), shown
    assert any("CONFLICT" in l and "numpy" in l for l in shown), shown
    assert any("check: 2 problem(s)" in l for l in shown), shown
    assert not any("ACCEPTED" in l for l in shown)  # accepted rows are not problems
