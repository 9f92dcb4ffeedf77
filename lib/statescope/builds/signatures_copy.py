"""Census signatures of the state-copy family: H-copy's two kernels (#50729) and H-empty (#53077).

What it does: three small functions over a build's sources (``SourceTree``), each returning one
``CensusCheck``:

- ``raw_copy_orders_left_overlap``: does the raw byte-copy kernel ``batch_memcpy_kernel`` put a
  barrier between each tile's load and store? Without one, a copy whose destination starts below
  its source inside the same range (a left shift) lets a lane store over bytes another lane has
  not loaded yet -- the H-copy race of the scalar copy path;
- ``fused_conv_copy_ordered``: does the fused align-mode copy move a conv window's left shift
  token by token (a loop over ``conv_width - bias`` tokens around the copy)? One tile-parallel
  memcpy of the whole shifted window has no order, so inside one physical block it races the same
  way; copying token by token, low to high, keeps every token's source and destination apart;
- ``empty_draft_count_reset``: when GDN attention metadata falls back from the speculative path
  because no row drafted a token, is ``num_spec_decodes`` reset to 0 together with the masks? A
  count left behind says "speculative rows" while the masks say none (the #52078 -> #53077 bug).

What it deliberately does not do: judge whether the race is reachable for a model (that depends on
the shift size against the tile size: ``statescope.teach.inplace_shift``), or read CUDA/C++ code.
"""
from __future__ import annotations

import ast
from functools import partial

from statescope.builds.census_ast import (ABSENT, NOT_APPLICABLE, PRESENT, UNKNOWN, CensusCheck,
                                          SourceTree, call_name, calls, find_function, functions,
                                          names_read)

MAMBA_UTILS = "vllm/v1/worker/mamba_utils.py"
GDN_ATTN = "vllm/v1/attention/backends/gdn_attn.py"
_COPY_CALLS = ("store",)  # tl.store; and any helper whose name starts with _memcpy


def _is_copy(call: ast.Call) -> bool:
    name = call_name(call)
    return name in _COPY_CALLS or name.startswith("_memcpy") or name.startswith("memcpy")


def _no_module(tree: SourceTree, rel: str, mk) -> CensusCheck:
    if tree.text(rel) is None and not tree.has_align_mode():
        return mk(verdict=NOT_APPLICABLE, line=None,
                  detail="no Mamba state-copy code in this build (no align mode)")
    return mk(verdict=UNKNOWN, line=None, detail=tree.missing_reason(rel))


def raw_copy_orders_left_overlap(tree: SourceTree) -> CensusCheck:
    """Present: ``batch_memcpy_kernel`` calls a barrier (``tl.debug_barrier``) inside its tile loop
    before the store; absent: the loop loads and stores with no barrier."""
    mk = partial(CensusCheck, "H-copy", "raw_copy_orders_left_overlap", ("#50729",),
                 file=MAMBA_UTILS, function="batch_memcpy_kernel")
    mod = tree.module(MAMBA_UTILS)
    if mod is None:
        return _no_module(tree, MAMBA_UTILS, mk)
    fn = find_function(mod, "batch_memcpy_kernel")
    if fn is None:
        return mk(verdict=UNKNOWN, line=None, function=None,
                  detail="batch_memcpy_kernel not found: the raw copy kernel moved or was renamed")
    for loop in (n for n in ast.walk(fn) if isinstance(n, ast.For)):
        inside = calls(loop)
        stores = [c for c in inside if call_name(c) == "store"]
        if not stores:
            continue
        barriers = [c for c in inside if "barrier" in call_name(c) and c.lineno < stores[-1].lineno]
        if barriers:
            guarded = any(isinstance(n, ast.If) and barriers[0] in list(ast.walk(n))
                          for n in ast.walk(loop))
            return mk(verdict=PRESENT, line=barriers[0].lineno,
                      detail="a barrier between each tile's load and store" +
                             (" when the copy overlaps to the left" if guarded else ""))
        return mk(verdict=ABSENT, line=stores[-1].lineno,
                  detail="each tile is loaded and stored with no barrier: an in-place left shift "
                         "can store over bytes not yet loaded")
    return mk(verdict=UNKNOWN, line=fn.lineno, detail="no load/store tile loop in batch_memcpy_kernel")


def _conv_copy_function(mod: ast.Module) -> tuple[str, ast.FunctionDef] | None:
    """The function doing the fused conv-window copy: ``_copy_mamba_state_block`` when it exists
    (0.25.0 on), else the first function that reads ``conv_width`` and copies (0.24.0's fused
    post-process kernel did it inline)."""
    preferred = find_function(mod, "_copy_mamba_state_block")
    if preferred is not None:
        return "_copy_mamba_state_block", preferred
    for name, fn in functions(mod):
        if "conv_width" in names_read(fn) and any(_is_copy(c) for c in calls(fn)):
            return name, fn
    return None


def _counts_tokens(bound: ast.AST, fn: ast.FunctionDef) -> bool:
    """Is ``bound`` a token count ``conv_width - bias`` (directly or through one name)? A byte
    count (``(conv_width - bias) * elem_size``) is not: looping over bytes is the unordered copy."""
    def is_token_count(e: ast.AST) -> bool:
        return (isinstance(e, ast.BinOp) and isinstance(e.op, ast.Sub)
                and "conv_width" in names_read(e.left))

    if is_token_count(bound):
        return True
    if isinstance(bound, ast.Name):
        return any(is_token_count(a.value) for a in ast.walk(fn) if isinstance(a, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == bound.id for t in a.targets))
    return False


def fused_conv_copy_ordered(tree: SourceTree) -> CensusCheck:
    """Present: a ``for ... in range(..., conv_width - bias)`` loop around a copy in the fused
    conv copy; absent: the conv window is copied as one run of bytes/words."""
    mk = partial(CensusCheck, "H-copy", "fused_conv_copy_ordered", ("#50729",), file=MAMBA_UTILS)
    mod = tree.module(MAMBA_UTILS)
    if mod is None:
        return _no_module(tree, MAMBA_UTILS, mk)
    found = _conv_copy_function(mod)
    if found is None:
        return mk(verdict=UNKNOWN, function=None, line=None,
                  detail="no function copies a conv window (reads conv_width and stores)")
    name, fn = found
    for loop in (n for n in ast.walk(fn) if isinstance(n, ast.For)):
        it = loop.iter
        if isinstance(it, ast.Call) and call_name(it) == "range" and it.args \
                and _counts_tokens(it.args[1] if len(it.args) > 1 else it.args[0], fn) \
                and any(_is_copy(c) for c in calls(loop)):
            same_block = [n for n in ast.walk(fn) if isinstance(n, ast.Compare)
                          and any("src_block" in x for x in names_read(n))
                          and any(("dst_block" in x or "dest_block" in x) for x in names_read(n))]
            return mk(verdict=PRESENT, function=name, line=loop.lineno,
                      detail="the shifted conv window is copied token by token, low to high" +
                             (f"; same-block test at line {same_block[0].lineno}" if same_block else ""))
    sizes = [a for a in ast.walk(fn) if isinstance(a, ast.Assign) and any(  # shifted-window sizes
        isinstance(b, ast.BinOp) and isinstance(b.op, ast.Sub) and "conv_width" in names_read(b.left)
        for b in ast.walk(a.value))]
    line = min((a.lineno for a in sizes), default=fn.lineno)
    return mk(verdict=ABSENT, function=name, line=line,
              detail="the shifted conv window is copied as one tile-parallel run of bytes: an "
                     "in-block left shift has no order")


def _clearing_blocks(fn: ast.FunctionDef) -> list[tuple[ast.If, bool]]:
    """``(if node, resets count)`` for each ``if`` whose body sets ``spec_sequence_masks = None``."""
    def sets(stmts, name, value_is):
        return any(isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)
                   and s.value.value == value_is
                   and any(isinstance(t, ast.Name) and t.id == name for t in s.targets)
                   for s in stmts)

    return [(n, sets(n.body, "num_spec_decodes", 0)) for n in ast.walk(fn)
            if isinstance(n, ast.If) and sets(n.body, "spec_sequence_masks", None)]


def _tests_empty_drafts(test: ast.AST) -> bool:
    """A ``<draft-token counts>.sum() ... == 0`` comparison: "no row drafted a token"."""
    for cmp in (n for n in ast.walk(test) if isinstance(n, ast.Compare)):
        if any(isinstance(op, ast.Eq) for op in cmp.ops) and any(
                isinstance(c, ast.Constant) and c.value == 0 for c in cmp.comparators):
            left = cmp.left
            if any(call_name(c) == "sum" for c in calls(left)) and "draft" in ast.unparse(left):
                return True
    return False


def empty_draft_count_reset(tree: SourceTree) -> CensusCheck:
    """Present: every empty-draft fallback that clears the speculative masks also sets
    ``num_spec_decodes = 0``; absent: one clears the masks and keeps the count; not applicable:
    no empty-draft fallback exists (rows that drafted nothing stay on the speculative path, so the
    count and the masks agree)."""
    mk = partial(CensusCheck, "H-empty", "empty_draft_count_reset", ("#53077",), file=GDN_ATTN)
    mod = tree.module(GDN_ATTN)
    if mod is None:
        return mk(verdict=UNKNOWN, function=None, line=None, detail=tree.missing_reason(GDN_ATTN))
    fn = find_function(mod, "build", "GDNAttentionMetadataBuilder") or find_function(mod, "build", "*")
    if fn is None or not _clearing_blocks(fn):
        return mk(verdict=UNKNOWN, function=None, line=None,
                  detail="no GDN metadata build() that clears spec_sequence_masks")
    name = "GDNAttentionMetadataBuilder.build"
    fallbacks = [(n, resets) for n, resets in _clearing_blocks(fn) if _tests_empty_drafts(n.test)]
    if not fallbacks:
        return mk(verdict=NOT_APPLICABLE, function=name, line=fn.lineno,
                  detail="no empty-draft fallback: a batch whose rows drafted nothing keeps the "
                         "speculative path, so masks and count agree")
    bad = [n for n, resets in fallbacks if not resets]
    if bad:
        return mk(verdict=ABSENT, function=name, line=bad[0].lineno,
                  detail="the empty-draft fallback clears the masks but leaves num_spec_decodes "
                         "non-zero")
    return mk(verdict=PRESENT, function=name, line=fallbacks[0][0].lineno,
              detail="the empty-draft fallback clears the masks and sets num_spec_decodes = 0")
