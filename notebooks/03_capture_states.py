# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · Capture: what the Gated DeltaNet states look like inside vLLM, step by step
#
# The hypotheses of this bug family (CONTEXT §2) predict *different* signatures in the recurrent
# state: H-copy corrupts the **conv window** of one request right after an in-place shift, and the
# **recurrent state** one step later; H-accept hits every GDN layer of a request at once; H-drop /
# H-midblock show from the first decode step after a prefix-cache hit. Output text cannot tell
# these apart. This notebook records the states themselves.
#
# **How it hooks.** No PyTorch module hooks (they vanish under CUDA graphs and torch.compile).
# statescope wraps the V1 model runner's `execute_model` / `sample_tokens` and vLLM's Mamba copy
# entry points (`collect_mamba_copy_meta`, `do_mamba_copy_block`, `run_fused_precopy`,
# `run_fused_postprocess`). After each step it reads each selected request's **running block**
# of every GDN layer straight from the KV-cache tensors. The same hooks load through the vLLM
# plugin (`STATESCOPE_CAPTURE=spec.json`) in whichever process holds the model.
#
# **Digest vs full.** A *digest* is a short row of numbers per (request, step, layer, state):
# sum, sum of squares, abs max, NaN/Inf counts, seeded random projections, and an exact
# checksum of the raw words. It is computed on the state's own device with no host
# synchronization, so it does not serialize async scheduling. *Full* mode also stores whole
# snapshots for chosen (request, step) pairs.

# %% [markdown]
# ## 1 · How big is a full snapshot for the reported model?
#
# The arithmetic comes straight from the Qwen3.5-27B config. The model has 48 GDN layers. Each
# has a conv window of (kernel − 1 + drafts) rows × 10,240 channels in bf16, and a recurrent
# state of 48 heads × 128 × 128 in float32.

# %%
from statescope.capture import QWEN35_27B, gdn_geometry, snapshot_bytes
geo = gdn_geometry(QWEN35_27B, num_speculative_tokens=2)
geo, round(snapshot_bytes(geo) / 2**20, 1)

# %% [markdown]
# That is about 149 MiB per sequence per snapshot, or 147 MiB without the two draft rows. Take
# the whole 288-request reproduction set at about 40 steps per request. Digests of every step
# come to a few hundred MB before parquet compression. Full snapshots of every step would come
# to terabytes. That is why full mode takes a (request, step) selection and a byte budget.

# %%
from statescope.capture import estimate_capture_bytes
digest = estimate_capture_bytes(geo, requests=288, steps_per_request=40, mode="digest")
full = estimate_capture_bytes(geo, 288, 40, mode="full", snapshot_pairs=288 * 40)
digest["total_bytes"] / 1e9, full["total_bytes"] / 1e12  # GB, TB

# %% [markdown]
# ## 2 · Capture on the embedded default
#
# Start the trigger configuration (prefix caching + align + MTP(2)) on the CPU build. Then build
# prompts that end a few tokens before a Mamba block boundary: decoding crosses the boundary at
# different offsets, so every align-mode copy path runs, in-place conv shifts included.

# %%
from statescope.engine import EngineConfig, OfflineEngine
from statescope.capture import boundary_prompts, record
engine = OfflineEngine(EngineConfig())
prompts = boundary_prompts(engine.resolved()["mamba_block_size"], 12)

# %%
import tempfile
out = tempfile.mkdtemp(prefix="statescope-capture-")
clean, _ = record(engine, {"output_dir": out, "run_id": "memmove", "mode": "digest"}, prompts)
clean

# %% [markdown]
# Every run carries a perturbation report. It says which mode ran, whether capturing forced any
# synchronization or eager mode, what vLLM really resolved (on CPU async scheduling is off
# whatever you ask), what host work the capture adds to each step, and the overhead that
# `benchmarks/bench_capture.py` measured for this mode.

# %%
from statescope.capture import perturbation_report
perturbation_report(clean)

# %%
{k: clean.manifest[k] for k in ("mode", "vllm_version", "runner_class", "block_size",
                                "conv_window", "sizes")}

# %% [markdown]
# One row per (request, step): computed tokens at schedule time, drafts scheduled, running column
# and block ids, the prefix-cache hit of a newly scheduled request, and two accepted counts:
# `num_accepted_sampled` (what the rejection sampler produced) and `num_accepted_used` (what the
# align-mode post-process, which moves the state, was given for that request). H-accept predicts
# steps where they differ; with async scheduling forced off on CPU they cannot.

# %%
steps = clean.steps()
steps[["req_id", "req_step", "num_computed_tokens", "num_scheduled_tokens", "num_drafts",
       "num_accepted_sampled", "num_accepted_used", "running_col", "prefix_hit_tokens"]].head(12)

# %%
(steps["num_accepted_sampled"] != steps["num_accepted_used"]).sum()  # steps where they differ

# %% [markdown]
# ### Why are the prefix-cache hits 0?
#
# The scheduler (engine-core side) logs each prefix-cache lookup: how long a hit the attention
# group and the Mamba groups could each serve on their own, every step of the coordinator's
# fixed-point search (`kind:max_length->hit`, `+drop` when the MTP last-block drop applied), and
# the hit the request got. Here the prompts are fresh and shorter than one Mamba block (the
# resolved `mamba_block_size` above), so there is no full block to hit: every group reports 0.

# %%
clean.prefix_hits()[["req_id", "num_prompt_tokens", "num_block_hashes", "attention_hit_tokens",
                     "mamba_hit_tokens", "hit_tokens", "lookups"]].head(6)

# %%
clean.digests()[["req_id", "req_step", "layer", "kind", "block_id", "checksum", "sum", "sumsq",
                 "nan", "proj0"]].head(12)

# %% [markdown]
# ## 3 · The copy census
#
# Every Mamba state copy the steps issued, decoded from the launch inputs (on GPU these stay on
# the device until flush). Each copy is classified against the other copies of the same launch.
# `left_shift_same_block` is the H-copy shape: source and destination overlap in one physical
# block. On CPU the decoded census is checked against the copies statescope's CPU kernels
# report doing (`census_crosscheck`).

# %%
from statescope.capture import census_report
report = census_report(clean.path)
report["counts"], report["by_launch_and_state"], report["crosscheck"]

# %% [markdown]
# ## 4 · Plant the H-copy fault and watch it land
#
# The CPU kernels can copy like a parallel tiled copy with no barrier (`barrierless_tiles`, with
# the 8 KiB tile of 0.28.0's fused conv copy). We run the same workload again and line the two
# runs up by prompt and request-local step. For the conv window, only the rows the next step
# reads are compared; the other rows hold bytes left by the block's previous user.

# %%
from statescope.patches import cpu_kernels
cpu_kernels.set_copy_semantics("barrierless_tiles", 8192)
faulty, _ = record(engine, {"output_dir": out, "run_id": "barrierless", "mode": "digest",
                            "draft_columns": True}, prompts)
cpu_kernels.set_copy_semantics("memmove")

# %% [markdown]
# Which requests shifted a conv window in place, and at which of their steps? And where did
# their digests first differ from the clean run?

# %%
from statescope.diverge import first_divergence, shifts_by_request
shifts_by_request(faulty)

# %%
first_divergence(clean, faulty)[["req_id_b", "steps_compared", "first_step", "kinds"]]

# %% [markdown]
# That run also digested the draft columns (`draft_columns`): the candidate states after each
# draft token, in the blocks after the running column (`column_offset` 1 and 2). Every capture
# also digests, for each request with drafts, the column its next step resumes from (`resume`:
# the recurrent state after the accepted tokens). Comparisons use that column by default, or
# every column when both runs digested them all; `first_divergence(...).attrs["columns"]` says
# which.

# %%
d = faulty.digests()
d[d.layer_index == 0].groupby(["column_offset", "kind"]).size()

# %% [markdown]
# Only the requests with an in-place shift diverge. Each diverges at exactly the step of its
# shift, and in the conv window first. That is the H-copy signature. On the 0.28.0 CPU build it
# appears only because we planted it. Whether a real GPU kernel produces it depends on the shift
# size against the copy tile (CONTEXT §2).

# %% [markdown]
# ## 5 · A full snapshot after prefill
#
# Full mode stores content-addressed tensors (sha256 of the bytes) for the chosen pairs, here
# the first step (the prefill) of each request.

# %%
snap_run, _ = record(engine, {"output_dir": out, "run_id": "full", "mode": "full",
                              "full": {"first_steps": 1}}, prompts[:2], max_tokens=4)
snaps = snap_run.snapshots()
snaps[["req_id", "req_step", "kind", "shape", "dtype", "nbytes", "sha256"]]

# %%
conv = snap_run.snapshot(snaps.req_id[0], 0, "conv")
conv.shape, conv.float().abs().sum(-1)  # prefill writes the first kernel-1 rows of the window

# %%
engine.close()

# %% [markdown]
# ## 6 · Does the failure still fire with capture on?
#
# An instrument that hides the failure it observes is worse than none. Plant a NaN conv-window
# fault in the trigger arm, run the reproduce verdict against the reference arm twice, capture
# off then capture on (one engine per arm, the control arm shared), and compare.

# %%
from statescope.verdict import reproduce_with_capture
from statescope.patches import FaultSpec
from statescope.verdict import Experiment
from statescope.workload import preset_trace
planted = FaultSpec(kind="nan_conv", rate=1.0, at_output_token=1, layers=[0])
trigger, control = Experiment(control="reference", fault=planted).arms()

# %%
both = reproduce_with_capture(trigger, control, preset_trace("smoke"), store_root=out,
                              spec={"mode": "digest", "run_id": "reproduce-on"})
{k: both[k].verdict.outcome for k in ("off", "on")}, both["same_failures"]

# %%
nan = both["run"].digests()
nan[nan["nan"] > 0].groupby(["layer", "kind"]).size()  # the planted NaN, seen by the capture

# %% [markdown]
# **What has and has not been checked.** The same hooks ran on a GPU: vLLM 0.26.0 on an H200,
# with CUDA graphs and async scheduling on. There, two identical runs gave identical digests,
# outputs with and without capture were identical, and the scalar pre-copy census was decoded.
# The fused post-process census has not run on a GPU with accepted drafts, and the CPU
# host-path changes (in-step reduction, draft columns, the scheduler's hit log) have not run
# on a GPU yet. Its decision mirror
# is unit-tested on CUDA, including a check that it never synchronizes. vLLM 0.32.0 is
# recognised but refused, because its V2 model runner is not wrapped. Runs are lined up by
# prompt, so a workload that repeats a prompt cannot be compared row for row yet.
