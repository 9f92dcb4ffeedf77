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
# # 01 · Reproduce: does this configuration corrupt outputs, and how sure are we?
#
# Two arms run the same multi-step GUI-agent trace (a growing shared prefix, temperature 0):
#
# * **trigger** — the reported configuration: prefix caching + `mamba_cache_mode=align` + MTP(2);
# * **control** — the reference: no prefix caching, no speculation.
#
# Each output is labelled (degenerate: `!` runs, empty, loops, invalid action; or a *confident* flip
# against the control's answer — near-ties are bf16 noise, not corruption), failures are counted
# per **episode** (requests of one episode share cached state, so they are not independent), and
# the verdict is one of *corruption detected / no evidence / geometry not exercised / control
# broken / engine broken*. The engagement guards refuse to call an arm clean when it never hit the
# prefix cache or never accepted a draft.

# %%
from statescope import quiet
quiet.in_notebook()  # known-benign library warnings (NUMA note, checkpoint bars) stay hidden
from statescope.progress import NotebookProgress  # the bar of the long cells below

# %%
from statescope.verdict import Experiment
from statescope.verdict import reproduce as rp
from statescope.workload import preset_trace
from statescope.records import new_run_id

trace = preset_trace("smoke", geometry="mixed")  # prompt ends before/at/after align boundaries
trigger, control = Experiment(control="reference").arms()  # what `statescope reproduce` builds

# %% [markdown]
# Run both arms on real vLLM (one fresh engine each; records are appended to `runs/` as they
# complete, so an interrupted run resumes).

# %%
result = rp.reproduce(trigger, control, trace, store_root="runs", run_id=new_run_id("repro"),
                      progress=NotebookProgress(2 * len(trace), "reproduce"))  # both arms
result

# %% [markdown]
# On the CPU build the verdict is expected to be **no evidence**: the CPU copies state with
# `memmove` and runs synchronously, so neither H-copy nor H-accept can fire here. That is a
# statement about this machine, not about your GPU — the guards above show the paths *were*
# engaged. Any degenerate or confidently flipped outputs are listed here:

# %%
result.examples()

# %% [markdown]
# ## The same pipeline with a planted fault
#
# To show that the detector can fail the arm, plant ground truth: NaN in the first GDN layer's
# conv window of every request after its first output token — the reported `!!!!` symptom (NaN logits →
# argmax token 0 = `!`). The control run is reused, and requests are counted as the unit (four
# episodes alone could not reach p < 0.01 — the verdict would honestly say "no evidence"). The
# result is labelled **PLANTED**.

# %%
from statescope.patches import FaultSpec

trigger.fault = FaultSpec(kind="nan_conv", rate=1.0, at_output_token=1, layers=[0])
planted = rp.reproduce(trigger, control, trace, store_root="runs", run_id=new_run_id("planted"),
                       control_run=result.control, unit="request",
                       progress=NotebookProgress(len(trace), "planted"))  # the trigger arm only
planted

# %%
planted.examples(5)
