"""The minimal reproducer beside a rendered notebook: ``statescope render ... --repro DIR``.

What it does: ``check_repro_dir`` accepts the folder ``statescope export-repro`` wrote (its
``repro.py`` and ``README.md``, each bounded in size) before anything executes; ``attach_repro``
copies both, scrubbed and leak-checked like every render file, into the notebook's render folder
(``repro/``) and puts a "Minimal reproducer" block into its ``summary.md`` right under the verdict
table: what the script runs (the README's settings, workload and expected-output lines) and the
command a maintainer types. The summary stays under the issue-comment limit (the block is cut
first if it would not fit).

What it deliberately does not do: run the script or judge it (its own output says CORRUPTED /
CLEAN), or accept any other folder layout.
"""
from __future__ import annotations

from pathlib import Path

from statescope.errors import InputError

FILES = ("repro.py", "README.md")
MAX_BYTES = {"repro.py": 4_000_000, "README.md": 64_000}  # a 198-request script is ~150 kB
BLOCK_LIMIT = 3_000  # characters of the summary block (the README's lines are a few hundred)


def check_repro_dir(path: str | Path) -> Path:
    """The export-repro folder, or one ``InputError`` naming what is missing or too large."""
    d = Path(path)
    for name in FILES:
        f = d / name
        if not f.is_file():
            raise InputError(f"--repro {d}: expected a folder written by `statescope export-repro` "
                             f"(no {name})")
        if f.stat().st_size > MAX_BYTES[name]:
            raise InputError(f"--repro {f}: {f.stat().st_size} bytes, more than the "
                             f"{MAX_BYTES[name]} a reproducer's {name} may have")
    return d


def _block(readme: str) -> str:
    keep = [line for line in readme.splitlines() if line.startswith(("- vLLM", "- settings",
                                                                      "- workload", "- needs"))]
    expected = next((line for line in readme.splitlines() if line.startswith("Run:")), "")
    text = ("#### Minimal reproducer (plain vLLM, no statescope import)\n\n" + "\n".join(keep)
            + "\n\n" + expected + "\n\nScript: [`repro/repro.py`](repro/repro.py), its "
            "[`README.md`](repro/README.md): `python repro.py` (exit 1 when it reproduces).\n\n")
    return text if len(text) <= BLOCK_LIMIT else text[:BLOCK_LIMIT - 40] + "\n\n[... cut]\n\n"


def attach_repro(result: dict, repro_dir: str | Path, environ: dict | None = None) -> dict:
    """Copy the reproducer into ``result['dir']/repro`` and link it in ``summary.md``."""
    import os

    from statescope.share import leakcheck
    from statescope.share.scrub import Scrubber
    from statescope.share.summary import COMMENT_LIMIT, SAFETY

    src = check_repro_dir(repro_dir)
    out = Path(result["dir"])
    scrubber = Scrubber.for_environment(dict(os.environ if environ is None else environ))
    texts = {name: scrubber.scrub((src / name).read_text(errors="replace")) for name in FILES}
    for name, text in texts.items():
        leakcheck.check_text(text, f"--repro {src / name}", scrubber)
    (out / "repro").mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (out / "repro" / name).write_text(text)
    summary = out / "summary.md"
    body = summary.read_text()
    block = _block(texts["README.md"])
    at = body.find("Full render:")
    body = body[:at] + block + body[at:] if at >= 0 else body + "\n" + block
    if len(body) > COMMENT_LIMIT - SAFETY:  # the cell log goes first, as summary_markdown cuts
        over = len(body) - (COMMENT_LIMIT - SAFETY)
        log_end = body.rfind("\n```\n\n</details>")
        if log_end > over:
            body = body[:log_end - over] + "\n[... cut]" + body[log_end:]
    summary.write_text(body)
    return {**result, "repro": str(out / "repro"), "summary_chars": len(body)}
