"""Census signatures of the scheduler and KV-cache managers: H-split, H-drop, async + align.

What it does: four small functions over a build's sources (``SourceTree``), each returning one
``CensusCheck``:

- ``align_split_uses_mamba_block_size``: which block size ``Scheduler._mamba_block_aligned_split``
  cuts align-mode prefill chunks with. ``cache_config.block_size`` is the attention block size;
  when the Mamba group's block size differs, chunks end off the Mamba block grid and a state is
  cached under a boundary it does not belong to (H-split). The fix reads the Mamba group's size;
- ``mamba_hit_honours_drop_eagle_block``: does ``MambaManager.find_longest_cache_hit`` read its
  ``drop_eagle_block`` parameter? Every other manager drops the last matched block for EAGLE/MTP;
  a Mamba finder that accepts the flag and never reads it can hand back a state written over
  rejected draft positions (H-drop);
- ``async_allowed_with_align``: does the async-scheduling resolution in ``config/vllm.py`` turn
  async off (or refuse it) because of Mamba prefix caching? #33352 did; #33997 made align mode work
  with async scheduling and removed that branch. Present = no such branch;
- ``cpu_platform_turns_async_off``: does ``platforms/cpu.py`` set ``async_scheduling = False``?
  On the CPU platform every async setting then resolves to off, so async-only mechanisms
  (H-accept) cannot happen there, whatever the build's runner does.

What it deliberately does not do: read the hybrid coordinator's own EAGLE handling (the
coordinator of 0.28.0 avoids the overrun for Mamba groups by other means; the census reports the
flag the PRs are about), or decide whether block sizes differ for a model (a runtime fact the
resolved configuration records).
"""
from __future__ import annotations

import ast
from functools import partial

from statescope.builds.census_ast import (ABSENT, NOT_APPLICABLE, PRESENT, UNKNOWN, CensusCheck,
                                          SourceTree, arg_names, assigned_values, attrs_read,
                                          find_function, names_read, string_constants)

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
MANAGERS = "vllm/v1/core/single_type_kv_cache_manager.py"
VLLM_CONFIG = "vllm/config/vllm.py"
CPU_PLATFORM = "vllm/platforms/cpu.py"
_MAMBA_WORDS = ("mamba", "has_inner_state", "is_hybrid")


def align_split_uses_mamba_block_size(tree: SourceTree) -> CensusCheck:
    """Present: the split's ``block_size`` comes from something Mamba (``mamba_block_size``, the
    Mamba group's spec); absent: from ``cache_config.block_size``; unknown: anything else."""
    mk = partial(CensusCheck, "H-split", "align_split_uses_mamba_block_size", ("#54076",),
                 file=SCHEDULER, function="Scheduler._mamba_block_aligned_split")
    mod = tree.module(SCHEDULER)
    if mod is None:
        return mk(verdict=UNKNOWN, function=None, detail=tree.missing_reason(SCHEDULER))
    fn = find_function(mod, "_mamba_block_aligned_split", "*")
    if fn is None:
        verdict = UNKNOWN if tree.has_align_mode() else NOT_APPLICABLE
        return mk(verdict=verdict, function=None,
                  detail="no _mamba_block_aligned_split in the scheduler")
    sizes = assigned_values(fn, "block_size")
    if not sizes:
        return mk(verdict=UNKNOWN, line=fn.lineno, detail="the split assigns no block_size")
    value = ast.unparse(sizes[0].value)
    if "mamba" in value.lower():
        return mk(verdict=PRESENT, line=sizes[0].lineno,
                  detail=f"chunks are cut on the Mamba group's grid (block_size = {value})")
    if value.endswith("cache_config.block_size"):
        return mk(verdict=ABSENT, line=sizes[0].lineno,
                  detail=f"chunks are cut with block_size = {value}, the attention block size "
                         "(wrong only when the Mamba block size differs)")
    return mk(verdict=UNKNOWN, line=sizes[0].lineno, detail=f"block_size = {value}: not recognised")


def mamba_hit_honours_drop_eagle_block(tree: SourceTree) -> CensusCheck:
    """Present: ``MambaManager.find_longest_cache_hit`` reads ``drop_eagle_block``; absent: takes
    it and never reads it; unknown: no such method or no such parameter."""
    mk = partial(CensusCheck, "H-drop", "mamba_hit_honours_drop_eagle_block",
                 ("#48375", "#57128"), file=MANAGERS, function="MambaManager.find_longest_cache_hit")
    mod = tree.module(MANAGERS)
    if mod is None:
        return mk(verdict=UNKNOWN, function=None, detail=tree.missing_reason(MANAGERS))
    fn = find_function(mod, "find_longest_cache_hit", "MambaManager")
    if fn is None:
        return mk(verdict=UNKNOWN, function=None,
                  detail="MambaManager.find_longest_cache_hit not found")
    if "drop_eagle_block" not in arg_names(fn):
        return mk(verdict=UNKNOWN, line=fn.lineno,
                  detail="find_longest_cache_hit takes no drop_eagle_block parameter")
    if "drop_eagle_block" in names_read(fn):
        return mk(verdict=PRESENT, line=fn.lineno,
                  detail="the Mamba cache-hit search reads drop_eagle_block")
    return mk(verdict=ABSENT, line=fn.lineno,
              detail="drop_eagle_block is accepted and never read: the Mamba hit keeps the "
                     "last matched block under EAGLE/MTP")


def _async_off_branches(fn: ast.FunctionDef) -> list[ast.If]:
    """``if`` nodes whose own body turns async scheduling off or refuses it."""
    out = []
    for node in (n for n in ast.walk(fn) if isinstance(n, ast.If)):
        for stmt in node.body:
            off = isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) \
                and stmt.value.value is False \
                and any(ast.unparse(t).endswith("async_scheduling") for t in stmt.targets)
            refuse = isinstance(stmt, ast.Raise) and any(
                "async" in s.lower() for s in string_constants(stmt))
            if off or refuse:
                out.append(node)
                break
    return out


def async_allowed_with_align(tree: SourceTree) -> CensusCheck:
    """Present: no branch of the async-scheduling resolution in ``config/vllm.py`` tests the
    Mamba cache mode / prefix caching of a Mamba model; absent: one does (line of its test)."""
    mk = partial(CensusCheck, "async+align", "async_allowed_with_align", ("#33997",), file=VLLM_CONFIG)
    mod = tree.module(VLLM_CONFIG)
    if mod is None:
        return mk(verdict=UNKNOWN, detail=tree.missing_reason(VLLM_CONFIG))
    resolvers = [(name, fn, _async_off_branches(fn))
                 for name, fn in tree.functions_mentioning(VLLM_CONFIG, "async")]
    resolvers = [r for r in resolvers if r[2]]
    if not resolvers:
        return mk(verdict=UNKNOWN, detail="no code in config/vllm.py turns async scheduling off")
    for name, fn, branches in resolvers:
        for node in branches:
            words = {w.lower() for w in names_read(node.test) | attrs_read(node.test)}
            if any(m in w for w in words for m in _MAMBA_WORDS) or "enable_prefix_caching" in words:
                return mk(verdict=ABSENT, function=name, line=node.lineno,
                          detail="async scheduling is turned off for Mamba prefix caching "
                                 f"({ast.unparse(node.test)[:80]})")
    name, fn, branches = resolvers[0]
    return mk(verdict=PRESENT, function=name, line=branches[0].lineno,
              detail=f"none of the {sum(len(r[2]) for r in resolvers)} branches that turn async "
                     "scheduling off depends on Mamba prefix caching")


def cpu_platform_turns_async_off(tree: SourceTree) -> CensusCheck:
    """Present: ``platforms/cpu.py`` assigns ``async_scheduling = False``; absent: it does not."""
    mk = partial(CensusCheck, "async+align", "cpu_platform_turns_async_off", (), file=CPU_PLATFORM)
    mod = tree.module(CPU_PLATFORM)
    if mod is None:
        return mk(verdict=UNKNOWN, detail=tree.missing_reason(CPU_PLATFORM))
    for name, fn in tree.functions_mentioning(CPU_PLATFORM, "async_scheduling"):
        for stmt in (n for n in ast.walk(fn) if isinstance(n, ast.Assign)):
            if isinstance(stmt.value, ast.Constant) and stmt.value.value is False and any(
                    ast.unparse(t).endswith("async_scheduling") for t in stmt.targets):
                return mk(verdict=PRESENT, function=name, line=stmt.lineno,
                          detail="on the CPU platform async scheduling always resolves to off")
    return mk(verdict=ABSENT, detail="the CPU platform leaves async scheduling as configured")
