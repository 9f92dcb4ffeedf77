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
# # 04 · Where the state diverges, and which hypothesis that fits
#
# Notebook 03 recorded GDN states step by step. This notebook compares a captured run against a
# captured **reference** run of the same prompts. For each request it finds the first step where
# any state digest differs, and reports:
#
# - which GDN layers and which state kind differ (conv window or recurrent state);
# - which live conv rows differ. Row 0 is the window's leading (oldest) row; the last row is the
#   newest.
# - how large the difference is, and whether NaN/Inf appeared;
# - what happened at that step and the one before it: a prefix-cache hit, a block-boundary
#   crossing, the drafts scheduled and tokens accepted, or a same-block left-shift copy.
#
# Each hypothesis of CONTEXT §2 predicts a different signature. Each one is then scored against
# this evidence as *supports*, *contradicts* or *not exercised*.
#
# **The fault here is planted.** The vLLM 0.28.0 CPU build copies with `memmove`, so H-copy
# cannot happen on it. We make the CPU kernels copy like a parallel tiled copy with no barrier
# (`barrierless_tiles`). The mechanism then shows up labelled **EMULATED**. This demonstrates the
# instrument; it is not a finding about a GPU build. On a GPU there is nothing to plant into
# (`emulated` is False): the second run is the trigger configuration again, unlabelled, and any
# divergence it shows is real.

# %% [markdown]
# ## 1 · Two runs of the same prompts
#
# Start the trigger configuration: prefix caching, align mode and MTP(2). The prompts end just
# before a Mamba block boundary, so decoding crosses it at different offsets.

# %%
from statescope.engine import EngineConfig, OfflineEngine
from statescope.capture import boundary_prompts, record
engine = OfflineEngine(EngineConfig())
prompts = boundary_prompts(engine.resolved()["mamba_block_size"], 12)

# %% [markdown]
# The reference uses `memmove` copies, which are correct for any overlap. The second run plants
# the barrier-less copy with the 8 KiB tile of 0.28.0's fused conv copy. It also takes the
# accelerator's packed launch path (`accelerator_path`), as a GPU run does.

# %%
import tempfile
from statescope.patches import cpu_kernels
out = tempfile.mkdtemp(prefix="statescope-diverge-")
reference, _ = record(engine, {"output_dir": out, "run_id": "memmove"}, prompts)
emulated = cpu_kernels.is_installed()  # False on a GPU: the real kernels copy, nothing is planted
emulated

# %%
cpu_kernels.set_copy_semantics("barrierless_tiles", 8192)
planted, _ = record(engine, {"output_dir": out, "run_id": "barrierless", "accelerator_path": True}, prompts)
cpu_kernels.set_copy_semantics("memmove")

# %% [markdown]
# ## 2 · The divergence report
#
# The conv window is compared only on the rows the next step will read. The other rows hold
# bytes left behind by the block's previous user.

# %%
from statescope.diverge import divergence_report
report = divergence_report(planted.path, reference.path)
report

# %% [markdown]
# The first diverged request in full, including the events at its first divergent step and the
# step before:

# %%
report.diverged[0] if report.diverged else "no request diverged: on a GPU the barrier-less copy is not emulated (the real kernels copy)"

# %% [markdown]
# The same comparison as a heatmap: layer and state kind against request step, on a log10 scale
# of the relative difference. Dark cells agree. The conv window lights up first; the recurrent
# state follows one step later.

# %%
report.heatmap()

# %% [markdown]
# From the command line: `statescope diverge RUN --reference REF --json`.

# %% [markdown]
# ## 3 · Which hypothesis fits?
#
# The run context matters. The CPU build never schedules asynchronously, so H-accept is *not
# exercised* here: this run can neither support it nor refute it. The prompts share no prefix,
# so the prefix-cache hypotheses are not exercised either.

# %%
from statescope.diverge import hypothesis_table, run_context
context = run_context(planted, planted="barrierless_tiles" if emulated else None)
context

# %%
hypothesis_table(report, context)

# %% [markdown]
# H-copy ranks first, labelled EMULATED, because we planted it. Every diverged request matches its
# signature: the leading conv row changes in the step of a same-block left shift, and the
# recurrent state follows one step later. On a real GPU capture, the same table with
# `planted=None` is the evidence. The shift-size arithmetic in CONTEXT §2 suggests H-copy is
# unreachable at TP=1–2 for the reported model; such a capture would show whether that holds.

# %% [markdown]
# ## 4 · Control: no planted fault, no divergence

# %%
again, _ = record(engine, {"output_dir": out, "run_id": "memmove-again"}, prompts)
len(divergence_report(again.path, reference.path).diverged)

# %%
engine.close()

# %% [markdown]
# ## 5 · Beyond step-by-step digests
#
# This notebook compares two runs of the *same* configuration step by step. The digests must
# then match exactly. To compare configurations whose steps differ (MTP against no MTP, a
# prefix hit against a cold prefill), compare **by token position** instead. Use a replay of the
# run's own tokens through a clean configuration (`statescope.diverge.replay`), or the float64 oracle.
# Measure the tolerance from re-batched clean runs (`statescope.diverge.noise`). Then report the first
# divergence in tolerance units (`statescope.diverge.by_position`). Notebook
# `06_hypotheses` does all of this, with one numbered check per hypothesis. From the command line:
# `statescope diverge RUN --reference REF --by-position --noise CLEAN_RUN`.
