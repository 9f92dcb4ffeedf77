"""Census signatures of the model runner: default runner, H-accept on V1, H-reorder.

What it does: four small functions over a build's sources (``SourceTree``), each returning one
``CensusCheck``:

- ``default_runner``: which runner ``VllmConfig.use_v2_model_runner`` picks for a hybrid model
  with MTP, align mode and async scheduling, read statement by statement: a gate that sends
  hybrid models (or every architecture not on an allow-list) to V1 decides V1; so does an entry of
  the V2 "unsupported features" list that names hybrid/Mamba align mode. Otherwise V2 (the shape
  #53183 gave it). ``extra["forces_v1"]`` lists every setting that sends a build to V1 anyway
  (``VLLM_USE_V2_MODEL_RUNNER=0``, no Triton -- the CPU builds --, each unsupported feature);
- ``v1_waits_for_accepted_counts``: the V1 runner copies accepted-token counts device -> host
  without waiting, into ``InputBatch``'s row-indexed buffer, and ``_update_states`` then moves rows
  (``add_request``/``condense``/reorder) before ``_prepare_inputs`` waits for the copy: a request
  can read another request's count (H-accept). Present = the fix's shape: a wait on the copy
  before the first row move (#53919), or the copy landing in a buffer rows do not move (#51599);
- ``non_align_async_skips_counts``: under async scheduling outside align mode, ``_prepare_inputs``
  must not read the host copy at all (#45100): present when the guard of that wait tests
  ``use_async_scheduling`` together with ``mamba_cache_mode != "align"``;
- ``reorder_threshold_keeps_decode_ordering``: ``calculate_reorder_batch_threshold`` takes the
  minimum threshold over all attention groups, the drafter's included, so a drafter backend with a
  lower threshold sends multi-token decode rows of a stateful (GDN) backend through prefill
  kernels (H-reorder). Present = a builder's required ordering is honoured (#55898's shape).

What it deliberately does not do: evaluate vLLM code (the runner choice is read, not run), cover
the V2 runner's own accepted-count handling (it keeps the counts on the device), or know a
model's architecture beyond ``REPORTED_ARCHITECTURES`` (the report's Qwen3.5 family) unless told.
"""
from __future__ import annotations

import ast
from functools import partial

from statescope.builds.census_ast import (ABSENT, PRESENT, UNKNOWN, CensusCheck, SourceTree,
                                          assigned_values, attrs_read, call_name, calls,
                                          find_function, names_read, receiver,
                                          string_constants)

VLLM_CONFIG = "vllm/config/vllm.py"
RUNNER = "vllm/v1/worker/gpu_model_runner.py"
INPUT_BATCH = "vllm/v1/worker/gpu_input_batch.py"
REPORTED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                          "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
ROW_MOVES = ("add_request", "condense", "swap_states")


def _returns(stmts: list[ast.stmt]) -> bool | None:
    """The constant a branch returns directly (``return True``/``False``), else None."""
    for s in stmts:
        if isinstance(s, ast.Return) and isinstance(s.value, ast.Constant) \
                and isinstance(s.value.value, bool):
            return s.value.value
    return None


def _text(node: ast.AST) -> str:
    """A string literal's text; an f-string's template with ``{expr}`` placeholders."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                       for v in node.values)
    return ast.unparse(node)


def _allow_listed(mod: ast.Module, architectures: tuple[str, ...]) -> bool:
    """Whether one of ``architectures`` is in a module-level V2 architecture allow-list."""
    for node in mod.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and "V2_MODEL_RUNNER" in t.id and "ARCH" in t.id
                for t in node.targets):
            if set(string_constants(node.value)) & set(architectures):
                return True
    return False


def _hybrid_gate(helper: ast.FunctionDef) -> str | None:
    """How a ``_is_default_v2...`` helper treats a hybrid model whose architecture is not listed:
    a reason it returns False, or None when it lets it through."""
    for node in (n for n in ast.walk(helper) if isinstance(n, ast.If)):
        if "is_hybrid" in attrs_read(node.test) | set(string_constants(node.test)) \
                and _returns(node.body) is False:
            return "hybrid models default to V1 unless their architecture is listed"
    last = helper.body[-1] if helper.body else None
    if isinstance(last, ast.Return) and last.value is not None and not isinstance(last.value, ast.BoolOp) \
            and any(call_name(c) == "any" for c in calls(last.value)):
        return "only allow-listed architectures default to V2"
    return None


def _unsupported(mod: ast.Module, fn: ast.FunctionDef) -> tuple[list[tuple[str, int]], str | None]:
    """The V2 "unsupported features" entries ``(text, line)`` and the first one that applies to a
    hybrid model with MTP + align (None when none does)."""
    helper = find_function(mod, "_get_v2_model_runner_unsupported_features", "*")
    if helper is None:
        return [], None
    entries, applies = [], None
    for c in calls(helper):
        if call_name(c) == "append" and c.args:
            text = _text(c.args[0])
            entries.append((str(text), c.lineno))
            t = str(text).lower()
            if applies is None and ("hybrid" in t or "mamba" in t) and "'all'" not in t \
                    and "'none'" not in t:
                applies = f"V2 lists {text!r} as unsupported (line {c.lineno})"
    # The branch that rejects speculative methods: ``method not in (kept...)`` or ``method in
    # (rejected...)`` guarding an append of "speculative method ...".
    for node in (n for n in ast.walk(helper) if isinstance(n, ast.If)):
        rejects = any(call_name(c) == "append" and "speculative method" in ast.unparse(c)
                      for s in node.body for c in calls(s))
        cmp = node.test
        if not rejects or not isinstance(cmp, ast.Compare) or "method" not in ast.unparse(cmp.left):
            continue
        methods = set(string_constants(cmp.comparators[0]))
        kept_out = ("mtp" not in methods) if isinstance(cmp.ops[0], ast.NotIn) else \
            ("mtp" in methods) if isinstance(cmp.ops[0], ast.In) else False
        if kept_out and applies is None:
            applies = f"MTP is among the speculative methods V2 rejects (line {node.lineno})"
    return entries, applies


def default_runner(tree: SourceTree, architectures: tuple[str, ...] = REPORTED_ARCHITECTURES
                   ) -> CensusCheck:
    """``value`` V1 or V2 for hybrid + MTP + align + async; present = V2 (#53183's shape)."""
    mk = partial(CensusCheck, "runner", "default_runner", ("#53183",), file=VLLM_CONFIG,
                 function="VllmConfig.use_v2_model_runner")
    mod = tree.module(VLLM_CONFIG)
    fn = find_function(mod, "use_v2_model_runner", "*") if mod else None
    if fn is None:
        return mk(verdict=UNKNOWN, function=None, detail="no VllmConfig.use_v2_model_runner"
                  if mod else tree.missing_reason(VLLM_CONFIG))
    forces: list[str] = []
    decision: tuple[str, int, str] | None = None
    env_names = {a.targets[0].id for a in assigned_values(fn, "use_v2_model_runner")
                 if "VLLM_USE_V2_MODEL_RUNNER" in ast.unparse(a.value)}
    for stmt in (s for s in fn.body if isinstance(s, ast.If)):
        test, ret = ast.unparse(stmt.test), _returns(stmt.body)
        if "VLLM_USE_V2_MODEL_RUNNER" in test or names_read(stmt.test) & env_names:
            forces.append(f"VLLM_USE_V2_MODEL_RUNNER=0 (line {stmt.lineno})")
            continue
        if ret is None and any(isinstance(n, ast.Return) and isinstance(n.value, ast.Constant)
                               and n.value.value is False for n in ast.walk(stmt)):
            where = "ROCm" if "is_rocm" in test else test[:60]
            forces.append(f"{where} for the architectures it lists (line {stmt.lineno})")
            continue  # a nested V1 branch (ROCm's architecture list): platform-specific
        if ret is not False:
            continue  # branches forcing V2 for special configurations (PCP, DSpark, diffusion)
        helpers = [call_name(c) for c in calls(stmt.test) if receiver(c) == "self"]
        unsupported_from = [call_name(c) for a in (assigned_values(fn, n) for n in names_read(stmt.test))
                            for x in a for c in calls(x.value)]
        if any("default_v2" in h for h in helpers):
            helper = find_function(mod, next(h for h in helpers if "default_v2" in h), "*")
            gate = _hybrid_gate(helper) if helper else None
            if gate and not _allow_listed(mod, architectures) and decision is None:
                decision = ("V1", stmt.lineno, gate)
        elif "HAS_TRITON" in test:
            forces.append(f"no Triton (the CPU builds) (line {stmt.lineno})")
        elif any("unsupported" in h for h in unsupported_from + helpers):
            entries, applies = _unsupported(mod, fn)
            forces += [f"unsupported by V2: {t} (line {n})" for t, n in entries]
            if applies and decision is None:
                decision = ("V1", stmt.lineno, applies)
        else:
            forces.append(f"{test[:70]} (line {stmt.lineno})")
    if decision is None:
        return mk(verdict=PRESENT, value="V2", line=fn.lineno, extra={"forces_v1": forces},
                  detail="V2 by default: no gate sends a hybrid model with MTP + align to V1")
    value, line, why = decision
    return mk(verdict=ABSENT, value=value, line=line, extra={"forces_v1": forces},
              detail=f"V1 by default: {why}")


def _waits_on_accepted(c: ast.Call, mod: ast.Module) -> bool:
    """``...accepted...event.synchronize()``, or a ``self`` method named for accepted counts whose
    body does that."""
    if call_name(c) == "synchronize" and "accepted" in receiver(c):
        return True
    if receiver(c) == "self" and "accepted" in call_name(c):
        helper = find_function(mod, call_name(c), "*")
        return helper is not None and any(_waits_on_accepted(x, mod) for x in calls(helper))
    return False


def _copies_into_input_batch(tree: SourceTree) -> list[int]:
    """Lines where accepted counts are written into ``self.input_batch``'s buffer: a ``copy_``
    into it, or the buffer handed to a call (the align path's post-process writes it)."""
    lines = []
    for _, fn in tree.functions_mentioning(RUNNER, "input_batch.num_accepted_tokens_cpu"):
        for c in calls(fn):
            if call_name(c) == "copy_" and "input_batch.num_accepted_tokens_cpu" in receiver(c):
                lines.append(c.lineno)
            elif any("input_batch.num_accepted_tokens_cpu" in ast.unparse(k.value)
                     for k in c.keywords if k.arg and "accepted" in k.arg):
                lines.append(c.lineno)
    return sorted(set(lines))


def v1_waits_for_accepted_counts(tree: SourceTree) -> CensusCheck:
    """Present: ``_update_states`` waits on the accepted-count copy before its first row move, or
    the copy lands outside ``InputBatch``; absent: it lands in ``InputBatch`` and rows move first."""
    mk = partial(CensusCheck, "H-accept", "v1_waits_for_accepted_counts",
                 ("#53919", "#51599", "#53613"), file=RUNNER, function="GPUModelRunner._update_states")
    mod = tree.module(RUNNER)
    upd = find_function(mod, "_update_states", "GPUModelRunner") if mod else None
    if upd is None:
        return mk(verdict=UNKNOWN, function=None, detail="GPUModelRunner._update_states not found"
                  if mod else tree.missing_reason(RUNNER))
    moves = [c for c in calls(upd) if (call_name(c) in ROW_MOVES and "input_batch" in receiver(c))
             or (receiver(c) == "self" and "reorder" in call_name(c))]
    if not moves:
        return mk(verdict=UNKNOWN, line=upd.lineno, detail="_update_states moves no InputBatch rows")
    first = moves[0]
    waits = [c for c in calls(upd) if _waits_on_accepted(c, mod) and c.lineno < first.lineno]
    if waits:
        return mk(verdict=PRESENT, line=waits[0].lineno,
                  detail=f"waits for the accepted-count copy before the first row move "
                         f"({call_name(first)}, line {first.lineno})")
    into_batch = _copies_into_input_batch(tree)
    if not into_batch:
        return mk(verdict=PRESENT, line=first.lineno,
                  detail="accepted counts land in a runner-owned buffer that row moves do not touch")
    condense = find_function(tree.module(INPUT_BATCH), "condense", "*")
    if condense is not None and not any("num_accepted" in a for a in attrs_read(condense)):
        return mk(verdict=PRESENT, line=first.lineno,
                  detail="InputBatch.condense does not move accepted counts")
    prep = find_function(mod, "_prepare_inputs", "GPUModelRunner")
    later = [c.lineno for c in calls(prep) if _waits_on_accepted(c, mod)] if prep else []
    return mk(verdict=ABSENT, line=first.lineno,
              detail=f"accepted counts are copied into InputBatch rows without waiting (line "
                     f"{into_batch[0]}); _update_states moves rows ({call_name(first)}) before "
                     f"the wait" + (f" in _prepare_inputs (line {later[0]})" if later else ""))


def _enclosing_if(fn: ast.FunctionDef, target: ast.AST) -> ast.If | None:
    best = None
    for node in (n for n in ast.walk(fn) if isinstance(n, ast.If)):
        if any(x is target for s in node.body for x in ast.walk(s)):
            if best is None or node.lineno > best.lineno:
                best = node
    return best


def non_align_async_skips_counts(tree: SourceTree) -> CensusCheck:
    """Present: the guard of ``_prepare_inputs``' accepted-count wait tests async scheduling and
    ``mamba_cache_mode != "align"``; absent: the guard ignores async scheduling."""
    mk = partial(CensusCheck, "H-accept", "non_align_async_skips_counts", ("#45100",), file=RUNNER,
                 function="GPUModelRunner._prepare_inputs")
    mod = tree.module(RUNNER)
    prep = find_function(mod, "_prepare_inputs", "GPUModelRunner") if mod else None
    if prep is None:
        return mk(verdict=UNKNOWN, function=None, detail="GPUModelRunner._prepare_inputs not found"
                  if mod else tree.missing_reason(RUNNER))
    wait = next((c for c in calls(prep) if _waits_on_accepted(c, mod)), None)
    guard = _enclosing_if(prep, wait) if wait is not None else None
    if guard is None:
        return mk(verdict=UNKNOWN, line=prep.lineno, detail="no guarded wait for accepted counts")
    cond = guard.test
    if isinstance(cond, ast.Name) and assigned_values(prep, cond.id):
        cond = assigned_values(prep, cond.id)[0].value
    text = ast.unparse(cond)
    if "use_async_scheduling" in text and "mamba_cache_mode" in text and "align" in text:
        return mk(verdict=PRESENT, line=guard.lineno,
                  detail="under async scheduling outside align mode the host copy is not read")
    return mk(verdict=ABSENT, line=guard.lineno,
              detail=f"the wait's guard ({text[:70]}) reads the host copy under async outside align")


def reorder_threshold_keeps_decode_ordering(tree: SourceTree) -> CensusCheck:
    """Present: the threshold honours a builder's required decode ordering (or takes a max);
    absent: it is the minimum over all attention groups."""
    mk = partial(CensusCheck, "H-reorder", "reorder_threshold_keeps_decode_ordering", ("#55898",),
                 file=RUNNER, function="GPUModelRunner.calculate_reorder_batch_threshold")
    mod = tree.module(RUNNER)
    fn = find_function(mod, "calculate_reorder_batch_threshold", "GPUModelRunner") if mod else None
    if fn is None:
        return mk(verdict=UNKNOWN, function=None, detail="calculate_reorder_batch_threshold not "
                  "found" if mod else tree.missing_reason(RUNNER))
    called = {call_name(c) for c in calls(fn)}
    if any("decode_ordering" in a for a in attrs_read(fn)) or "max" in called:
        return mk(verdict=PRESENT, value="required ordering kept", line=fn.lineno,
                  detail="a stateful backend's required threshold is kept when another is lower")
    if "min" in called:
        line = next(c.lineno for c in calls(fn) if call_name(c) == "min")
        return mk(verdict=ABSENT, value="min over groups", line=line,
                  detail="the minimum threshold over all attention groups (the drafter's too)")
    return mk(verdict=UNKNOWN, line=fn.lineno, detail="neither a min nor a kept ordering found")
