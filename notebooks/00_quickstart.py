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
from statescope import quiet
quiet.in_notebook()  # known-benign library warnings (NUMA note, checkpoint bars) stay hidden
from statescope.progress import NotebookProgress  # the bar of the long cells below

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
bar = NotebookProgress(sum(len(e.observations) for e in episodes), "workload")
rows = workload.run_episodes(engine, episodes, max_tokens=16, progress=bar)
workload.summarize_requests(rows)

# %% [markdown]
# vLLM's own counters: prefix-cache hits and accepted draft tokens must both be non-zero, or any
# "no corruption" verdict on this configuration would only mean "not exercised".

# %%
engine.metrics_table()

# %% [markdown]
# ## What a clean baseline looks like
#
# Per request: the prompt tokens served from the prefix cache, and the MTP draft tokens the target
# model accepted. Step 0 of each episode has nothing cached; later steps reuse the growing shared
# prefix, and drafts are accepted throughout — both suspicious code paths run.

# %%
import plotly.graph_objects as go
x = [f"episode {r['episode']} · step {r['step']}" for r in rows]
go.Figure([go.Bar(name="prefix-cache hit tokens", x=x, y=[r["num_cached_tokens"] for r in rows]),
           go.Bar(name="accepted draft tokens", x=x, y=[r["spec_accepted_tokens"] or 0 for r in rows])],
          layout=dict(barmode="group", height=380, yaxis_title="tokens",
                      title="Clean baseline: both paths engaged, no corruption"))

# %% [markdown]
# **Why these answers are clean, even if they read oddly.** The tiny model has random-ish weights,
# so its answers are short run-on fragments; that is the model, not corruption. Nothing here
# triggers the failure: no planted fault, and on a CPU build async scheduling is off, so the
# accepted-count race cannot happen. The same prompts give the same tokens with prefix caching and
# MTP switched off (notebook 01 checks exactly that against a reference control). A *corrupted*
# answer differs from its control's: it degenerates into one repeated token (`!!!!`), or diverges
# from the control's tokens right after a cache hit or an accepted draft; notebook 01 plants such
# a fault and shows it being detected.

# %%
engine.close()
