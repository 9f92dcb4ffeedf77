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
# # 00 · Quickstart: the reported failing configuration, on real vLLM
#
# The original report served a Qwen3.5 hybrid (Gated DeltaNet + attention + MTP head) with
# **prefix caching + `mamba_cache_mode=align` + MTP(2)** and saw a few answers turn into `!!!!`.
# This notebook starts that exact configuration on the machine you are on — by default the CPU
# build of real vLLM with the tiny Qwen3.5-architecture model in `data/models/` — runs a small
# multi-step workload whose prompts share a growing prefix, and shows what the engine *really*
# resolved and whether the two suspicious code paths were engaged (prefix-cache hits, accepted
# drafts).

# %%
from statescope.engine import EngineConfig, OfflineEngine
from statescope.workload import episodes as workload

config = EngineConfig()  # prefix caching + align + MTP(2), temperature 0
config

# %% [markdown]
# Start the engine (20–60 s on two cores). On a CPU build statescope first installs its CPU
# implementations of the two fused align-mode copy kernels, which the CPU build lacks.

# %%
engine = OfflineEngine(config)
engine.resolved_table()

# %% [markdown]
# Read the highlighted rows: the CPU platform turns async scheduling **off** whatever you ask, so
# the async accepted-count race (H-accept) cannot happen here — only on a GPU.
#
# Now a small shared-prefix workload: each step's prompt is the previous prompt, the previous
# answer and a new observation, so steps after the first can be served from the prefix cache.

# %%
episodes = workload.shared_prefix_episodes(n_episodes=4, n_steps=4)
rows = workload.run_episodes(engine, episodes, max_tokens=16)
workload.summarize_requests(rows)

# %% [markdown]
# vLLM's own counters: prefix-cache hits and accepted draft tokens must both be non-zero, or any
# "no corruption" verdict on this configuration would only mean "not exercised".

# %%
engine.metrics_table()

# %%
engine.close()
