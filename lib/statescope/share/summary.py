"""An issue-ready ``summary.md``: verdicts first, logs and environment folded, under GitHub's limit.

What it does: ``checks_in`` collects the pass/fail lines a notebook printed (``PASS ...`` /
``FAIL ...``, the teaching notebook's check cells), ``verdicts_in`` the reproduce verdict boxes
it displayed; ``summary_markdown`` writes the
verdict table, links to the full renders, figure list, then ``<details>`` blocks for the cell log
and the environment manifest. Long sections are cut (the log first) so the whole stays under
``COMMENT_LIMIT`` characters (GitHub's comment limit is 65,536).

What it deliberately does not do: interpret results (a verdict is what the notebook printed).
"""
from __future__ import annotations

import re
from typing import Any

COMMENT_LIMIT = 65_536
SAFETY = 1_500  # room for what a person adds around a pasted summary
LOG_LIMIT = 24_000
RESULT_LIMIT, RESULT_LINES = 600, 8  # of one displayed value in the cell log
CHECK_LINE = re.compile(r"^\s*(PASS|FAIL)\b[\s:·—-]+(.+)$", re.M)
# statescope's reproduce verdict boxes (statescope.verdict.reproduce / statescope.verdict.detect HTML).
VERDICT_HTML = re.compile(r">\s*(corruption detected|no evidence|geometry not exercised|control broken)\s*<"
                          r".*?<p>(.*?)</p>", re.S | re.I)
TAG = re.compile(r"<[^>]+>")


def cell_text(nb: Any) -> list[tuple[int, str]]:
    """(cell index, text) of every stream/plain-text output, terminal colour codes removed (an
    issue thread shows them as garbage)."""
    from statescope.share.decoded import ANSI

    return [(ci, ANSI.sub("", text)) for ci, text in _cell_text(nb)]


def _cell_text(nb: Any) -> list[tuple[int, str]]:
    out = []
    for ci, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []):
            if o.get("metadata", {}).get("statescope") == "static-figure":
                continue
            if o.get("output_type") == "stream":
                out.append((ci, o.get("text", "")))
            elif "text/plain" in o.get("data", {}):
                out.append((ci, _short_result(o["data"]["text/plain"])))
            elif o.get("output_type") == "error":
                out.append((ci, f"{o.get('ename')}: {o.get('evalue')}"))
    return out


def _short_result(text: Any) -> str:
    """A displayed value's text form, cut to ``RESULT_LIMIT``: a report object's repr is for the
    full render, not the issue text (a whole ``DivergenceReport(...)`` was ~5 KB)."""
    text = "".join(text) if isinstance(text, list) else str(text)
    if len(text) <= RESULT_LIMIT:
        return text
    head = "\n".join(text[:RESULT_LIMIT].splitlines()[:RESULT_LINES])
    return f"{head}\n… [{len(text) - len(head)} more characters of this result: see the full render]"


def checks_in(nb: Any) -> list[tuple[str, str]]:
    """(PASS|FAIL, what) for every check line printed by the notebook, in order."""
    found = []
    for _ci, text in cell_text(nb):
        text = text.strip("'\"")
        found += [(m.group(1), m.group(2).strip().strip("'\"")) for m in CHECK_LINE.finditer(text)]
    return found


def verdicts_in(nb: Any) -> list[tuple[int, str, str]]:
    """(cell, verdict, first sentence of its explanation) for each verdict box a cell displayed."""
    import html as _html

    found = []
    for ci, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []):
            text = o.get("data", {}).get("text/html", "")
            for m in VERDICT_HTML.finditer(text if isinstance(text, str) else "".join(text)):
                detail = _html.unescape(TAG.sub("", m.group(2))).split(": ")[0][:160]
                if "PLANTED" in m.group(0):  # a planted or emulated fault must stay labelled
                    detail += " — PLANTED FAULT"
                found.append((ci, m.group(1).lower(), detail))
    return found


def _cut(text: str, budget: int) -> str:
    if len(text) <= budget:
        return text
    keep = max(0, budget - 80)
    return text[:keep // 2] + f"\n… [{len(text) - keep} characters cut] …\n" + text[-(keep // 2):]


def summary_markdown(result: dict, nb: Any, manifest_md: str, limit: int = COMMENT_LIMIT) -> str:
    """The summary for one rendered notebook; ``result`` is the render's result dictionary."""
    status = "ok" if result["ok"] else f"FAILED: {result['error']}"
    rows = [f"| notebook `{result['notebook']}` executed | {'PASS' if result['ok'] else 'FAIL'} | "
            f"{status.replace('|', '/')} ({result['seconds']:.0f} s) |"]
    for verdict, what in checks_in(nb):
        rows.append(f"| {what.replace('|', '/')} | {verdict} | check cell |")
    for ci, verdict, detail in verdicts_in(nb):
        rows.append(f"| reproduce verdict (cell {ci}) | **{verdict}** | {detail.replace('|', '/')} |")
    figs = result.get("figures", [])
    exported = sum(1 for f in figs if f.get("png"))
    rows.append(f"| figures exported as PNG | {'PASS' if exported == len(figs) else 'FAIL'} | "
                f"{exported}/{len(figs)} |")
    head = (f"### statescope: `{result['notebook']}`\n\n| what | verdict | detail |\n|---|---|---|\n"
            + "\n".join(rows) + "\n\n")
    if result.get("parameters"):
        head += "Parameters: `" + ", ".join(f"{k}={v!r}" for k, v in result["parameters"].items()) + "`\n\n"
    head += (f"Full render: `{result['notebook']}.html` (interactive) and `{result['notebook']}.md`; "
             "figure data under `data/`.\n\n")
    fig_lines = [f"- ![{f['png']}]({f['png']})" if f.get("png") else
                 f"- figure in cell {f['cell']}: not exported ({f['error']})" for f in figs]
    figures = ("<details><summary>Figures</summary>\n\n" + "\n".join(fig_lines)
               + "\n\n</details>\n\n") if figs else ""
    env = f"<details><summary>Environment (collect-env manifest)</summary>\n\n{manifest_md}\n</details>\n"
    log_body = "\n".join(f"[cell {ci}] {t.rstrip()}" for ci, t in cell_text(nb))
    # A readable paste: the log gets at most LOG_LIMIT characters even when the limit allows more.
    budget = min(LOG_LIMIT, limit - SAFETY - len(head) - len(figures) - len(env) - 200)
    env_budget = limit - SAFETY - len(head) - len(figures) - 400
    if budget < 0:  # the manifest alone is too long: cut it, keep a token log
        env = _cut(env, max(0, env_budget - 2000))
        budget = limit - SAFETY - len(head) - len(figures) - len(env) - 200
    log = ("<details><summary>Cell output log</summary>\n\n```text\n"
           + _cut(log_body.replace("```", "'''"), max(0, budget)) + "\n```\n\n</details>\n\n")
    return head + figures + log + env
