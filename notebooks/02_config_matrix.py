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
# # 02 · Configuration matrix: which settings matter — and which ones really changed?
#
# The original report's evidence was a matrix: 16/288 corrupted with async scheduling, 0/288 with
# `--no-async-scheduling`, 0/288 with prefix caching but without MTP. Each cell here is a fresh real
# engine on the same trace, judged against one reference control run. Every cell shows its
# **resolved** configuration next to the requested one: two cells that resolve to the same engine
# are highlighted — on a CPU build every async setting resolves to *off*, so an "async on vs off"
# comparison here would compare an arm with itself.

# %%
from statescope.verdict import config_matrix
from statescope.builds import installed_brief
from statescope.workload import preset_trace
from statescope.records import new_run_id

axes = {"enable_prefix_caching": [True, False], "num_speculative_tokens": [0, 2],
        "async_scheduling": [True]}

# %%
matrix = config_matrix(axes, preset_trace("smoke"), store_root="runs", run_id=new_run_id("matrix"),
                       census=installed_brief())
matrix

# %% [markdown]
# Failure rate per cell (failed episodes / episodes, counted against the reference control):

# %%
matrix.heatmap("num_speculative_tokens", "enable_prefix_caching")

# %% [markdown]
# What to read: the cell with prefix caching **and** MTP is the only one that exercises the align
# copies with an accepted bias (non-zero `hits` and `accepted` in the same row). `async_scheduling`
# was requested on everywhere and resolved off everywhere — the warnings say so. Extend `axes` with
# `mamba_cache_mode`, `mamba_block_size` or more speculative tokens; each cell costs one engine start.

# %%
[(r["enable_prefix_caching"], r["num_speculative_tokens"], r["warnings"][:1]) for r in matrix.rows]
