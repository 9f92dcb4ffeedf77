#!/usr/bin/env bash
# Device glue: run the workbook's own command line on the lent H200, as a user would (issues 19, 21).
# Nothing here decides anything: every number comes from `statescope ...` commands; this script only
# activates a release's environment (the kit of scripts/gpu_kit.sh), starts the commands side by
# side on the one GPU, and packs what they wrote into $OUT (at most 8 files come back).
#
#   bash scripts/gpu_cli.sh env VERSION                  # print the shell lines that activate a release
#   bash scripts/gpu_cli.sh setup VERSION                # bin/setup --here into that release's Python
#   bash scripts/gpu_cli.sh doctor VERSION...            # statescope doctor per release (warms JIT caches)
#   bash scripts/gpu_cli.sh issue19 [BUDGET_S]           # 0.26.0: the README's commands (below)
#   bash scripts/gpu_cli.sh releases VERSION...          # release x runner x async cells (+ AMPLIFIED)
#   bash scripts/gpu_cli.sh bisect_live [MAX_S]          # live bisections over the kit's releases
#                                                        # (default / V1 forced / V1 AMPLIFIED), packed
#   bash scripts/gpu_cli.sh v2capture VERSION            # capture on Model Runner V2: trigger vs
#                                                        # async-off reference, census, continuity,
#                                                        # diverge, V2 capture overhead; packed
#   bash scripts/gpu_cli.sh minimal [VERSION]            # issue 30 on a V1 release (default 0.28.0;
#                                                        #   0.26.0 is V1 + async too, on the image's
#                                                        #   torch): pooled verdict, shrink + plain-
#                                                        #   vLLM script, capture + continuity, nb 04 06
#   bash scripts/gpu_cli.sh shrink_alone VERSION [DIR]   # only minimal's shrink chain, resumed from a
#                                                        #   committed shrink folder DIR; CUDA checks
#                                                        #   beside it (SS_NO_CUDA=1: not)
#   bash scripts/gpu_cli.sh pack_minimal [VERSION]       # pack what `minimal` wrote so far (default:
#                                                        #   the release `minimal` last started)
#   bash scripts/gpu_cli.sh localise                    # 0.26.0 + 0.32.0: captures of failing and clean
#                                                        #   pairs on V1 and V2, diverge + continuity,
#                                                        #   the shrink's batch phase, nb 06, CUDA checks
#   bash scripts/gpu_cli.sh pack_localise               # pack what `localise` wrote so far
#   bash scripts/gpu_cli.sh pack NAME DIR...             # compact + tar what a part wrote into $OUT
#   bash scripts/gpu_cli.sh collect PACK_CMD [MAX_S]     # wait for a detached campaign, packing every
#                                                        #   40 s; exits 3 at once on a bare machine
#   bash scripts/gpu_cli.sh shrink_cost_and_overhead     # the shrink's cost at its defaults (0.32.0, V1),
#                                                        #   the 3-request script's controls, 0.33.0,
#                                                        #   then capture overhead alone; pack_cost packs
#                                                        #   (SS_RELEASE, SS_PARTS, SS_V033_FIRST=1: a
#                                                        #   0.33.0-only lease, its cells first)
#   bash scripts/gpu_cli.sh gallery [DEADLINE_S]         # 0.26.0: notebooks 00 01 03 04 06 rendered on
#                                                        #   the GPU (two renders side by side) + the
#                                                        #   CUDA tests and digest benchmark (issue 20)
#
# Runs live under /tmp/ss (the machine's /tmp is gone when it is given back); each command's stdout
# (its --json report) and stderr are kept beside its run, and `commands.txt` lists every command as
# run. Set SS_MODEL (default tiny-gui) and SS_SEEDS (seed sets, default "0:12 12:24 24:36 36:48").
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SS=${SS_ROOT:-/tmp/ss}
OUT=${OUT:-$SS/out}
MODEL=${SS_MODEL:-tiny-gui}
SEEDS=${SS_SEEDS:-"0:12 12:24 24:36"}
PRESET=${SS_PRESET:-long}
PY=${SS_PY:-python3}  # the interpreter that holds the release (python3 with the kit's env.sh)
mkdir -p "$SS" "$OUT"
export PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
# several engines side by side on the one GPU: each asks for a small share (the device profile
# applies it where a config leaves it open; vLLM refuses a start whose share exceeds free memory)
export STATESCOPE_GPU_MEMORY_UTILIZATION=${STATESCOPE_GPU_MEMORY_UTILIZATION:-0.04}

activate() {  # VERSION: the release's env.sh from the kit, then this checkout's statescope first
  local v=$1
  [ -f "/tmp/vllm-$v/env.sh" ] || { echo "gpu_cli: /tmp/vllm-$v/env.sh missing: install the kit first" >&2; return 3; }
  # shellcheck disable=SC1090
  . "/tmp/vllm-$v/env.sh"
  export PYTHONPATH="$REPO/lib:$PYTHONPATH"
}

ss() {  # NAME VERSION ARGS...: one statescope command, logged; its stdout is its report
  local name=$1 v=$2; shift 2
  local dir="${SS_JOBDIR:-$SS/$v}/$name"
  mkdir -p "$dir"
  printf '%s\tvllm %s\tstatescope %s\n' "$name" "$v" "$*" >> "$SS/commands.txt"
  ( activate "$v" && cd "$REPO" && timeout "${SS_TIMEOUT:-560}" \
      "$PY" -m statescope.cli.main "$@" > "$dir/stdout.json" 2> "$dir/stderr.log" )
  local rc=$?
  echo "$rc" > "$dir/rc"
  printf '[%s] %s (vllm %s): rc=%s %s\n' "$(date +%H:%M:%S)" "$name" "$v" "$rc" \
    "$(tail -1 "$dir/stderr.log" 2>/dev/null | cut -c1-160)"
  return 0
}

repro_run() {  # VERSION SCRIPT LOG LIMIT_S [ENV=VALUE...] [-- ARGS...]: one run of an exported
  # plain-vLLM script as a maintainer runs it (in LOG's folder, the release's Python, ENV set),
  # the command in commands.txt (this checkout written <checkout>), its exit status at LOG's end
  local v=$1 script=$2 log=$3 limit=$4; shift 4
  local envs=(PYTHONUNBUFFERED=1)
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  local shown="${envs[*]:1} python $(basename "$script") $*"
  ( activate "$v" && cd "$(dirname "$log")" &&
    printf 'repro\tvllm %s\t%s\n' "$v" "${shown//$REPO/<checkout>}" >> "$SS/commands.txt" &&
    env "${envs[@]}" timeout "$limit" "$PY" "$script" "$@" > "$log" 2>&1
    echo "rc=$?" >> "$log" )
}

has() {  # PART: whether PART is in $parts (the caller's list of parts to run)
  case " ${parts:-} " in *" $1 "*) return 0 ;; esac; return 1
}

bg() {  # run a job in the background (on the GPU, side by side), or in turn with SS_SERIAL=1
  if [ "${SS_SERIAL:-0}" = 1 ]; then "$@"; else "$@" & fi
}

doctor_all() {
  for v in "$@"; do ss doctor "$v" doctor --model "$MODEL" --json & done
  wait
}

issue19() {  # the README's own commands on 0.26.0, side by side on the one GPU
  local v=${SS_RELEASE:-0.26.0}; local R="$SS/$v/runs" C="$SS/$v/captures"
  mkdir -p "$R" "$C"
  bg ss doctor "$v" doctor --model "$MODEL" --json
  local first=${SEEDS%% *}
  for ctl in no_async no_prefix_cache no_mtp; do
    bg ss "repro_${first/:/-}_$ctl" "$v" reproduce --model "$MODEL" --preset "$PRESET" --seeds "$first" \
      --control "$ctl" --runs "$R" --run-id "s${first/:/-}_$ctl" --json
  done
  for s in $(echo "$SEEDS" | cut -s -d' ' -f2-); do  # more seed sets: the rate depends on them
    bg ss "repro_${s/:/-}_no_async" "$v" reproduce --model "$MODEL" --preset "$PRESET" --seeds "$s" \
      --control no_async --runs "$R" --run-id "s${s/:/-}_no_async" --json
  done
  capture_chain() {
    ss capture_trigger "$v" capture --model "$MODEL" --episodes 8 --steps 6 --max-tokens 24 \
        --out "$C/trigger" --json
    ss capture_reference "$v" capture --model "$MODEL" --episodes 8 --steps 6 --max-tokens 24 \
        --set async_scheduling=false --out "$C/reference" --json
    t=$(ls -d "$C"/trigger/*/ 2>/dev/null | head -1); r=$(ls -d "$C"/reference/*/ 2>/dev/null | head -1)
    ss census "$v" census "$t" --json
    ss continuity "$v" continuity "$t" --json
    ss diverge "$v" diverge "$t" --reference "$r" --json
  }
  bg capture_chain
  wait
  for s in $SEEDS; do  # patched triggers against the same control runs (like with like)
    bg ss "repro_${s/:/-}_accept_sync" "$v" reproduce --model "$MODEL" --preset "$PRESET" --seeds "$s" \
      --control no_async --trigger-patch accept_sync --runs "$R" --run-id "s${s/:/-}_accept_sync" \
      --control-run "$R/s${s/:/-}_no_async" --json
  done
  wait
}

render19() {  # notebooks executed on the GPU (papermill); PNGs need a browser the device lacks
  local v=${SS_RELEASE:-0.26.0}
  ss render "$v" render 00_quickstart 01_reproduce 03_capture_states 04_where_state_diverges \
    06_hypotheses --out "$SS/$v/gallery-gpu" --no-png --json
}

cuda_checks() {  # the CUDA-only tests and the digest benchmark, in a release's Python; pytest from
  # .gk-pytest/site when the image has none (appended: the image's own packages win)
  local v=${SS_RELEASE:-0.26.0} dir="$SS/${SS_RELEASE:-0.26.0}/cuda"
  mkdir -p "$dir"
  ( activate "$v" && cd "$REPO" && export PYTHONPATH="$PYTHONPATH:${SS_PYTEST_SITE:-$REPO/.gk-pytest/site}" &&
    printf 'cuda_tests\tvllm %s\tpytest tests/test_digest_triton.py tests/test_digest.py tests/test_digest_graph.py\n' "$v" >> "$SS/commands.txt" &&
    timeout 420 "$PY" -m pytest -q -p no:cacheprovider -rA tests/test_digest_triton.py tests/test_digest.py \
      tests/test_digest_graph.py > "$dir/pytest.log" 2>&1; echo "rc=$?" >> "$dir/pytest.log" )
  ( activate "$v" && cd "$REPO" &&
    printf 'bench_digest_gpu\tvllm %s\tpython benchmarks/bench_digest_gpu.py --layers 18 --requests 32\n' "$v" >> "$SS/commands.txt" &&
    timeout 300 "$PY" benchmarks/bench_digest_gpu.py --layers 18 --requests 32 > "$dir/bench_digest_gpu.json" \
      2> "$dir/bench_digest_gpu.err"; echo "rc=$?" >> "$dir/bench_digest_gpu.err" )
  tail -3 "$dir/pytest.log"; tail -c 600 "$dir/bench_digest_gpu.json"
}

gallery() {  # DEADLINE_S: the notebooks on the GPU, split in two renders side by side, + cuda_checks
  local v=${SS_RELEASE:-0.26.0} deadline=$(( $(date +%s) + ${1:-420} ))
  mkdir -p "$SS/logs"
  ( bash "$0" setup "$v" > "$SS/logs/setup.log" 2>&1
    ( SS_TIMEOUT=${SS_RENDER_TIMEOUT:-400} ss render_a "$v" render 00_quickstart 01_reproduce \
        03_capture_states --out "$SS/$v/gallery-gpu" --no-png --json ) &
    ( SS_TIMEOUT=${SS_RENDER_TIMEOUT:-400} ss render_b "$v" render 04_where_state_diverges \
        06_hypotheses --out "$SS/$v/gallery-gpu" --no-png --json ) &
    cuda_checks > "$SS/logs/cuda.log" 2>&1 &
    wait ) > "$SS/logs/gallery.log" 2>&1 &
  while [ -n "$(jobs -rp)" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
  echo "gallery: $(jobs -rp | wc -w) job(s) still running at the deadline"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$SS/logs/nvidia-smi.txt"
  tar czf "$OUT/gallery.tar.gz" -C "$SS" "$v" logs commands.txt
  ls -la "$OUT"; tail -n 30 "$SS"/logs/*.log | cut -c1-220
}

releases() {  # VERSION...: per release and runner, the trigger vs its async-off control; on V1 the
  # AMPLIFIED triggers (both orderings, and the amplifier under accept_sync), on V2 the amplifier
  # alone (nothing to amplify there: it must change nothing) -- each vs that same control run
  for v in "$@"; do
    local R="$SS/$v/runs"; mkdir -p "$R"
    for runner in v1 v2; do
      local s=${SEEDS%% *} id="${runner}_${SEEDS%% *}"; id=${id/:/-}
      local amps="amplify_accept_race"
      [ "$runner" = v1 ] && amps="amplify_accept_race amplify_accept_race=delay"
      ( ss "cell_$id" "$v" reproduce --model "$MODEL" --preset "$PRESET" --seeds "$s" --control no_async \
          --trigger-set model_runner=$runner --control-set model_runner=$runner --runs "$R" \
          --run-id "$id" --json
        for amp in $amps; do
          ss "cell_${id}_${amp/=/-}" "$v" reproduce --model "$MODEL" --preset "$PRESET" --seeds "$s" \
            --control no_async --trigger-set model_runner=$runner --trigger-patch "$amp" \
            --control-run "$R/$id" --runs "$R" --run-id "${id}_${amp/=/-}" --json
        done
        [ "$runner" = v1 ] && ss "cell_${id}_amplified_accept_sync" "$v" reproduce --model "$MODEL" \
          --preset "$PRESET" --seeds "$s" --control no_async --trigger-set model_runner=$runner \
          --trigger-patch amplify_accept_race --trigger-patch accept_sync --control-run "$R/$id" \
          --runs "$R" --run-id "${id}_amplified_accept_sync" --json ) &
    done
  done
  wait
}

bisect_live() {  # [MAX_S]: live Bayesian bisections (find-fix) over the kit's releases, side by
  # side: (a) the default setting, (b) V1 forced on both arms, (c) (b) AMPLIFIED. One driver per
  # bisection runs in one release's Python (SS_BISECT_DRIVER); every cell runs in its own release
  # (env:/tmp/vllm-X: env.sh sourced for the cell). Each starts no probe that would end past MAX_S
  # (default 270); reports and cells under $SS/bisect, packed into $OUT/bisect.tar.gz.
  local max_s=${1:-270} drv=${SS_BISECT_DRIVER:-0.32.0} B="$SS/bisect"
  local envs="" v
  for v in ${SS_BISECT_RELEASES:-0.26.0 0.28.0 0.30.0 0.32.0}; do envs="$envs env:/tmp/vllm-$v"; done
  mkdir -p "$B/runs"
  # 3 seeds x 8 episodes = 24 units a cell; the confirmed search (docs/bisect.md): the first seed
  # set SS_BISECT_SEEDS, the next ones drawn from the pool 0:48, never repeated on a build
  # shellcheck disable=SC2086
  local common="--builds $envs --mode fix --model $MODEL --preset $PRESET --control no_async
    --seeds ${SS_BISECT_SEEDS:-0:3} --budget ${SS_BISECT_BUDGET:-480} --max-seconds $max_s
    --runs $B/runs --json"
  [ "${SS_WARM:-0}" = 1 ] && SS_JOBDIR="$B/warm" doctor_all ${SS_BISECT_RELEASES:-0.26.0 0.28.0 0.30.0 0.32.0}
  # shellcheck disable=SC2086
  SS_JOBDIR="$B" bg ss default "$drv" bisect $common
  # shellcheck disable=SC2086
  SS_JOBDIR="$B" bg ss v1_forced "$drv" bisect $common --both-set model_runner=v1
  # shellcheck disable=SC2086
  SS_JOBDIR="$B" bg ss v1_amplified "$drv" bisect $common --both-set model_runner=v1 \
    --trigger-patch amplify_accept_race
  wait
  for v in default v1_forced v1_amplified; do  # the human-readable answer of each, from its JSON
    PYTHONPATH="$REPO/lib" "$PY" - "$B/$v/stdout.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
c, k = d.get("cost", {}), d.get("check", {})
print(sys.argv[1].split("/")[-2], "|", " ".join(m.split(" ")[0] for m in d.get("marks", [])) or "-",
      "|", d.get("answer") if d.get("outcome") else k.get("verdict"),
      "| probes", [(p["label"], f"{p['k']}/{p['n']}", p.get("seeds")) for p in d["probes"]],
      "| engine starts", c.get("engine_starts"), "| wall s", c.get("wall_seconds"),
      "| stopped", d.get("stopped"))
PY
  done
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$B/nvidia-smi.txt" 2>/dev/null
  pack bisect "$B"
}

v2capture() {  # VERSION: the capture on Model Runner V2 (issue 21): trigger (async on) and its async-off
  # reference side by side with the overhead rounds, then census / continuity / diverge of the pair;
  # model_runner=v2 is an EngineConfig field (VLLM_USE_V2_MODEL_RUNNER=1 set by the engine, not by
  # the capture, which only records the runner it finds: manifest runner_version/coverage)
  local v=${1:-0.32.0}; local C="$SS/$v/v2capture"
  mkdir -p "$C"
  local common=(--model "$MODEL" --episodes 8 --steps 6 --max-tokens 24)
  bg ss v2_capture_trigger "$v" capture "${common[@]}" --set model_runner=v2 --out "$C/trigger" --json
  bg ss v2_capture_reference "$v" capture "${common[@]}" --set async_scheduling=false \
    --set model_runner=v2 --out "$C/reference" --json
  # the overhead's rounds pair off/hooks/digest in one engine, so the two capture engines beside it
  # load both sides alike; SS_OVERHEAD_ALONE=1 runs it after them instead (about 4 minutes more)
  overhead() { ss v2_capture_overhead "$v" capture-overhead --model "$MODEL" --modes off,hooks,digest \
    --rounds 6 --workloads gui --set model_runner=v2 --budget-s "${SS_OVERHEAD_BUDGET_S:-240}" \
    --capture-dir "$C/overhead" --json; }
  [ "${SS_OVERHEAD_ALONE:-0}" = 1 ] || bg overhead
  wait
  [ "${SS_OVERHEAD_ALONE:-0}" = 1 ] && overhead
  local t r
  t=$(ls -d "$C"/trigger/*/ 2>/dev/null | head -1); r=$(ls -d "$C"/reference/*/ 2>/dev/null | head -1)
  [ -n "$t" ] && [ -n "$r" ] || { echo "v2capture: a capture run is missing (trigger '$t', reference '$r')"; return 0; }
  bg ss v2_census "$v" census "$t" --json
  bg ss v2_continuity "$v" continuity "$t" --json
  bg ss v2_diverge "$v" diverge "$t" --reference "$r" --json
  wait
  # what says the V2 hooks worked: the runner each run found, what it covers, and the host/device
  # running columns (they differ only where the scheduler's count ran ahead under async)
  ( activate "$v" && "$PY" - "$t" "$r" > "$C/v2_check.json" 2>> "$C/v2_check.err" ) <<'PY'
import json, sys
from statescope.capture.store import CaptureRun
out = {}
for path in sys.argv[1:]:
    run = CaptureRun(path); m = run.manifest; st = run.steps(); cp = run.copies()
    both = st.dropna(subset=["running_col_device"]) if "running_col_device" in st else st.iloc[:0]
    out[path] = {
        "runner_version": m.get("runner_version"), "runner_module": m.get("runner_module"),
        "adapter": m.get("adapter"), "coverage": m.get("coverage"), "status": m.get("status"),
        "errors": m.get("error_count", 0), "steps": len(st),
        "accepted_seen": int(st["num_accepted_sampled"].notna().sum()) if len(st) else 0,
        "used_seen": int(st["num_accepted_used"].notna().sum()) if len(st) else 0,
        "running_col_rows": len(both),
        "running_col_mismatch": int((both["running_col"] != both["running_col_device"]).sum()),
        "copies_by_launch": cp.groupby("launch_kind").size().to_dict() if len(cp) else {},
        "copy_kinds": cp.groupby("kind").size().to_dict() if len(cp) else {},
        "prefix_hit_requests": int(st.groupby("req_id")["prefix_hit_tokens"].max().fillna(0)
                                   .gt(0).sum()) if len(st) else 0}
print(json.dumps(out, indent=2, default=str))
PY
  cat "$C/v2_check.json" 2>/dev/null | head -80
  pack "v2capture-$v" "$SS/$v"
}

pack() {  # NAME DIR...: records compacted (the fields a verdict reads), reports, logs -> $OUT/NAME.tar.gz
  local name=$1; shift
  local stage="$SS/pack-$name"
  rm -rf "$stage" && mkdir -p "$stage"
  for d in "$@"; do cp -r "$d" "$stage/" 2>/dev/null; done
  cp "$SS/commands.txt" "$stage/" 2>/dev/null
  PYTHONPATH="$REPO/lib" "$PY" - "$stage" <<'PY'
import json, pathlib, sys
from statescope.results.files import compact_record
for f in pathlib.Path(sys.argv[1]).rglob("records.jsonl"):
    rows = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    f.write_text("".join(json.dumps(dict(compact_record(r), runner=r.get("runner"),
                 spec_draft_tokens=r.get("spec_draft_tokens"),
                 spec_accepted_tokens=r.get("spec_accepted_tokens"))) + "\n" for r in rows))
PY
  tar czf "$OUT/$name.tar.gz" -C "$stage" .
  ls -la "$OUT/$name.tar.gz"
}

campaign() {  # DEADLINE_S: everything of one device call side by side, then pack what finished
  local deadline=$(( $(date +%s) + ${1:-500} ))
  mkdir -p "$SS/logs"
  ( GK_DIR=/tmp/gk bash /tmp/gk/install_v0.30.0.sh > "$SS/logs/install-0.30.0.log" 2>&1
    releases 0.30.0 > "$SS/logs/releases-0.30.0.log" 2>&1 ) &
  ( bash "$0" setup 0.26.0 > "$SS/logs/setup.log" 2>&1 ) &
  ( issue19 > "$SS/logs/issue19.log" 2>&1 ) &
  ( releases 0.26.0 0.28.0 0.32.0 > "$SS/logs/releases.log" 2>&1 ) &
  ( SS_TIMEOUT=${SS_RENDER_TIMEOUT:-480} render19 > "$SS/logs/render.log" 2>&1 ) &
  while [ -n "$(jobs -rp)" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
  echo "campaign: $(jobs -rp | wc -w) job(s) still running at the deadline"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$SS/logs/nvidia-smi.txt"
  pack issue19 "$SS/0.26.0"
  pack releases "$SS/0.28.0" "$SS/0.30.0" "$SS/0.32.0"
  tar czf "$OUT/logs.tar.gz" -C "$SS" logs commands.txt
  tail -n 40 "$SS"/logs/*.log | cut -c1-220
}

minimal() {  # [VERSION]: issue 30 on a V1 release at its default settings (0.28.0 and 0.26.0
  # resolve Model Runner V1 for the hybrid tiny-gui and async scheduling on with MTP, so the
  # async-off control isolates async): the pooled verdict over three seed sets, the shrink of seeds
  # 48:60 to a minimal workload, its plain-vLLM script run as the maintainer would (3x as exported,
  # async off, V2), the capture of the failing seed set with continuity; notebooks 04 06 and the
  # CUDA checks beside them
  local v=${1:-0.28.0}; local M="$SS/$v/minimal"
  # seeds: 48:60 failed 6/96 on 0.28.0; 0.26.0's recorded runs (data/results/gpu/cli/runs) fail
  # in seeds 0-3 (4 of 192 requests): SS_MIN_SEEDS=0:6 SS_POOLED_SEEDS=0:36 there
  local seeds=${SS_MIN_SEEDS:-48:60} pooled=${SS_POOLED_SEEDS:-48:84}
  mkdir -p "$M" "$SS/logs"
  echo "$v" > "$SS/minimal.version"  # pack_minimal's default
  ( bash "$0" setup "$v" > "$SS/logs/setup.log" 2>&1
    [ "${SS_NO_RENDER:-0}" = 1 ] || SS_TIMEOUT=1200 ss render_gpu "$v" render 04_where_state_diverges 06_hypotheses \
      --out "$SS/$v/gallery-gpu" --no-png --json
    SS_RELEASE=$v cuda_checks > "$SS/logs/cuda.log" 2>&1 ) &
  SS_JOBDIR="$M" bg ss pooled "$v" reproduce --model "$MODEL" --preset "$PRESET" --seeds "$pooled" \
    --seed-sets 3 --control no_async --runs "$M/runs" --run-id pooled --json
  capture_pair() {
    SS_JOBDIR="$M" ss capture_trigger "$v" capture --model "$MODEL" --preset "$PRESET" --seeds "$seeds" \
      --out "$M/cap/trigger" --json
    SS_JOBDIR="$M" ss capture_reference "$v" capture --model "$MODEL" --preset "$PRESET" --seeds "$seeds" \
      --set async_scheduling=false --out "$M/cap/reference" --json
    local t r  # the capture run folder (OUT/records/ holds the answers, not a capture)
    t=$(dirname "$(ls "$M"/cap/trigger/*/manifest.json | head -1)")
    r=$(dirname "$(ls "$M"/cap/reference/*/manifest.json | head -1)")
    SS_JOBDIR="$M" ss continuity "$v" continuity "$t" --json
    SS_JOBDIR="$M" ss census "$v" census "$t" --json
    SS_JOBDIR="$M" ss diverge "$v" diverge "$t" --reference "$r" --json
  }
  bg capture_pair
  [ "${SS_NO_SHRINK:-0}" = 1 ] || bg shrink_chain "$v" "$M" "$seeds"
  wait
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$SS/logs/nvidia-smi.txt"
}

shrink_chain() {  # VERSION DIR SEEDS: the shrink of SEEDS (resumes from DIR/shrink's candidate
  # log), its plain-vLLM script exported, then run as the maintainer would: 3x as exported, async
  # off, Model Runner V2 -- the five side by side (each its own engine at a small memory share)
  local v=$1 M=$2 seeds=$3
  SS_TIMEOUT=${SS_SHRINK_TIMEOUT:-1500} SS_JOBDIR="$M" ss shrink "$v" shrink --model "$MODEL" \
    --preset "$PRESET" --seeds "$seeds" --control no_async --keep-failing 3 \
    ${SS_SHRINK_PHASES:+--phases "$SS_SHRINK_PHASES"} --out "$M/shrink" --json
  SS_JOBDIR="$M" ss export "$v" export-repro "$M/shrink" --out "$M/repro" --json
  [ -f "$M/repro/repro.py" ] || return 0
  local i R="$M/repro/repro.py"
  for i in 1 2 3; do repro_run "$v" "$R" "$M/repro/as_exported_$i.log" 600 & done
  repro_run "$v" "$R" "$M/repro/async_off.log" 600 -- --set async_scheduling=false &
  repro_run "$v" "$R" "$M/repro/v2.log" 600 VLLM_USE_V2_MODEL_RUNNER=1 &
  wait
}

shrink_alone() {  # VERSION [FROM_DIR]: only the shrink chain (issue 30), resumed from a committed
  # shrink folder FROM_DIR (its candidate log: candidates already run are read, not re-run);
  # notebooks 04 06 rendered and the CUDA checks beside it unless SS_NO_RENDER=1 / SS_NO_CUDA=1. Seeds: SS_MIN_SEEDS (default 48:60)
  local v=${1:-0.26.0} from=${2:-}; local M="$SS/$v/minimal"
  mkdir -p "$M" "$SS/logs"
  echo "$v" > "$SS/minimal.version"
  [ -z "$from" ] || { mkdir -p "$M/shrink" && cp -r "$from"/. "$M/shrink/" && rm -f "$M/shrink/stdout.json" "$M/shrink/stderr.log"; }
  bash "$0" setup "$v" > "$SS/logs/setup.log" 2>&1
  [ "${SS_NO_CUDA:-0}" = 1 ] || ( SS_RELEASE=$v cuda_checks > "$SS/logs/cuda.log" 2>&1 ) &
  [ "${SS_NO_RENDER:-0}" = 1 ] || ( SS_TIMEOUT=1200 ss render_gpu "$v" render 04_where_state_diverges \
    06_hypotheses --out "$SS/$v/gallery-gpu" --no-png --json ) &
  shrink_chain "$v" "$M" "${SS_MIN_SEEDS:-48:60}"
  wait
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$SS/logs/nvidia-smi.txt"
}

cap_pair() {  # VERSION NAME ARGS...: trigger (as given) and its async-off reference, then
  # continuity, census and diverge of the pair (diverge at its defaults)
  local v=$1 name=$2; shift 2; local C="$SS/$v/caps/$name"
  mkdir -p "$C"
  SS_JOBDIR="$C" bg ss trigger "$v" capture "$@" --out "$C/trigger" --json
  SS_JOBDIR="$C" bg ss reference "$v" capture "$@" --set async_scheduling=false --out "$C/reference" --json
  wait
  local t r
  t=$(dirname "$(ls "$C"/trigger/*/manifest.json 2>/dev/null | head -1)")
  r=$(dirname "$(ls "$C"/reference/*/manifest.json 2>/dev/null | head -1)")
  [ "$t" != . ] && [ "$r" != . ] || { echo "localise: $v/$name: a capture is missing"; return 0; }
  SS_JOBDIR="$C" ss continuity "$v" continuity "$t" --json
  SS_JOBDIR="$C" ss census "$v" census "$t" --json
  SS_JOBDIR="$C" ss diverge "$v" diverge "$t" --reference "$r" --json
}

localise() {  # 0.26.0 (image torch) + 0.32.0 (torch 2.13), side by side: the captures that decide
  # whether diverge names exactly the corrupted requests (V1 on both releases) and nothing on a clean
  # async on/off pair (V1 one request at a time; V2), the shrunk workload captured with continuity,
  # the shrink's batch phase (resumed from SS_RESUME), notebook 06 and the CUDA checks; each capture
  # folder comes back (caps-*.tar.gz). SS_LOCALISE_ONLY="a b": only those parts (default: all).
  # the shrunk trace and its script: SS_MIN_TRACE / SS_REPRO (default: the committed ones)
  local trace=${SS_MIN_TRACE:-$REPO/data/results/gpu/minimal_reproducer_0.26.0/shrink/minimal.jsonl}
  local repro=${SS_REPRO:-$REPO/data/results/gpu/minimal_reproducer_0.26.0/repro/repro.py}
  local parts=${SS_LOCALISE_ONLY:-"min26 clean26 shrink26 gallery26 v1_32 v2_32 repro32"}
  mkdir -p "$SS/logs"
  bash "$0" setup 0.26.0 > "$SS/logs/setup-0.26.0.log" 2>&1
  bash "$0" setup 0.32.0 > "$SS/logs/setup-0.32.0.log" 2>&1
  has min26 && ( cap_pair 0.26.0 minimal --model "$MODEL" --trace "$trace" ) > "$SS/logs/min26.log" 2>&1 &
  has clean26 && ( cap_pair 0.26.0 one_at_a_time --model "$MODEL" --trace "$trace" --set max_num_seqs=1 ) \
    > "$SS/logs/clean26.log" 2>&1 &
  has v1_32 && ( cap_pair 0.32.0 v1_forced --model "$MODEL" --preset "$PRESET" --seeds 48:60 \
    --set model_runner=v1 ) > "$SS/logs/v1_32.log" 2>&1 &
  has v2_32 && ( cap_pair 0.32.0 v2_default --model "$MODEL" --preset "$PRESET" --seeds 48:60 ) \
    > "$SS/logs/v2_32.log" 2>&1 &
  if has shrink26; then
    ( local M="$SS/0.26.0/minimal"; mkdir -p "$M/shrink"
      [ -n "${SS_RESUME:-}" ] && cp -r "$SS_RESUME"/. "$M/shrink/"
      SS_SHRINK_PHASES=${SS_SHRINK_PHASES:-episodes,batch} SS_SHRINK_TIMEOUT=${SS_SHRINK_TIMEOUT:-900} \
        shrink_chain 0.26.0 "$M" "${SS_MIN_SEEDS:-0:6}" ) > "$SS/logs/shrink26.log" 2>&1 &
  fi
  has gallery26 && ( SS_TIMEOUT=900 ss render_gpu 0.26.0 render 06_hypotheses --out "$SS/0.26.0/gallery-gpu" \
    --no-png --json; SS_RELEASE=0.26.0 cuda_checks ) > "$SS/logs/gallery26.log" 2>&1 &
  if has repro32; then  # the 0.26.0 reproducer, unchanged, on 0.32.0: V1 forced (twice) and the default
    ( local D="$SS/0.32.0/repro26"; mkdir -p "$D"; cp "$repro" "$D/"
      local m=(-- --model "$REPO/data/models/$MODEL")
      repro_run 0.32.0 "$D/repro.py" "$D/v1_1.log" 900 VLLM_USE_V2_MODEL_RUNNER=0 "${m[@]}" &
      repro_run 0.32.0 "$D/repro.py" "$D/v1_2.log" 900 VLLM_USE_V2_MODEL_RUNNER=0 "${m[@]}" &
      repro_run 0.32.0 "$D/repro.py" "$D/default.log" 900 "${m[@]}" & wait ) > "$SS/logs/repro32.log" 2>&1 &
  fi
  wait
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$SS/logs/nvidia-smi.txt"
}

bisect_releases() {  # [MAX_S]: the seed's question in one command per setting (issue 29 item 4):
  # three confirmed find-fix bisections over env: releases 0.26.0 0.28.0 0.29.0 0.30.0 0.32.0,
  # side by side -- (a) the default settings, (b) Model Runner V1 forced on both arms, (c) (b) with
  # the accept_sync patch on the trigger. Seeds: the first set 0:12 (the known-bad end's calibrated
  # set: 11/96 there on V1), the rest drawn from the pool 0:48, 12 seeds a set. No probe starts
  # that would end past MAX_S (default 1200). Reports and cells under $SS/bisect_releases.
  local max_s=${1:-1200} drv=${SS_BISECT_DRIVER:-0.32.0} B="$SS/bisect_releases" v envs=""
  for v in ${SS_BISECT_RELEASES:-0.26.0 0.28.0 0.29.0 0.30.0 0.32.0}; do envs="$envs env:/tmp/vllm-$v"; done
  mkdir -p "$B/runs"
  # shellcheck disable=SC2086
  local common="--builds $envs --mode fix --model $MODEL --preset $PRESET --control no_async
    --seeds ${SS_BISECT_SEEDS:-0:12} --seed-pool ${SS_BISECT_POOL:-0:48} --max-seconds $max_s
    --runs $B/runs --json"
  # shellcheck disable=SC2086
  SS_TIMEOUT=$((max_s + 240)) SS_JOBDIR="$B" bg ss default "$drv" bisect $common
  # shellcheck disable=SC2086
  SS_TIMEOUT=$((max_s + 240)) SS_JOBDIR="$B" bg ss v1_forced "$drv" bisect $common --both-set model_runner=v1
  # shellcheck disable=SC2086
  SS_TIMEOUT=$((max_s + 240)) SS_JOBDIR="$B" bg ss v1_accept_sync "$drv" bisect $common \
    --both-set model_runner=v1 --trigger-patch accept_sync
  wait
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$B/nvidia-smi.txt" 2>/dev/null
}

minimal_at_two_seqs() {  # issue 30 items 3 and 5 on 0.26.0: the shrink at a batch of two resumed
  # from its committed candidate log (SS_RESUME_DIR, default .gk-resume: two_seqs/ = the log
  # un-scrubbed, shrink/minimal.jsonl = the 198-request trace), its script exported and
  # run as a maintainer would (3x as exported, async off, Model Runner V2, --patch accept_sync),
  # and the shrunk workload captured (trigger + async-off reference) with continuity/census/diverge
  local v=0.26.0 M="$SS/0.26.0/minimal_two" R="${SS_RESUME_DIR:-$REPO/.gk-resume}"
  mkdir -p "$M/shrink"
  cp "$R"/two_seqs/* "$M/shrink/"
  SS_TIMEOUT=${SS_SHRINK_TIMEOUT:-600} SS_JOBDIR="$M" ss shrink "$v" shrink "$R/shrink/minimal.jsonl" \
    --model "$MODEL" --control no_async --keep-failing 3 --both-set max_num_seqs=2 \
    --both-set max_num_batched_tokens=4096 --phases episodes,steps --out "$M/shrink" --json
  SS_JOBDIR="$M" ss export "$v" export-repro "$M/shrink" --out "$M/repro" --json
  [ -f "$M/repro/repro.py" ] || return 0
  local i R="$M/repro/repro.py" m=(--model "$REPO/data/models/$MODEL")
  for i in 1 2 3; do repro_run "$v" "$R" "$M/repro/as_exported_$i.log" 400 -- "${m[@]}" & done
  repro_run "$v" "$R" "$M/repro/async_off.log" 400 -- "${m[@]}" --set async_scheduling=false &
  repro_run "$v" "$R" "$M/repro/v2.log" 400 VLLM_USE_V2_MODEL_RUNNER=1 -- "${m[@]}" &
  repro_run "$v" "$R" "$M/repro/accept_sync.log" 400 -- "${m[@]}" --patch accept_sync &
  ( cap_pair "$v" minimal_two --model "$MODEL" --trace "$M/shrink/minimal.jsonl" --set max_num_seqs=2 \
    --set max_num_batched_tokens=4096 ) &
  wait
}

release_answers() {  # everything of one lease side by side: setups, then bisect_releases,
  # minimal_at_two_seqs, V1-forced capture pairs on 0.29.0 and 0.30.0 (issue 29 item 2), notebooks
  # 04 and 06 + the CUDA checks on 0.26.0 (item 6), the 3-request script and a V1-forced shrink on
  # 0.32.0 (issue 30 item 5); pack with pack_release_answers.
  # SS_PARTS="a b": only those parts (default: bisect minimal v1caps gallery on32)
  local parts=${SS_PARTS:-"bisect minimal v1caps gallery on32"}
  mkdir -p "$SS/logs"
  # one editable install serves every release: it lands in the image venv, and activate puts this
  # checkout's lib first on PYTHONPATH for each release
  bash "$0" setup 0.32.0 > "$SS/logs/setup-0.32.0.log" 2>&1
  has bisect && ( bisect_releases "${SS_BISECT_MAX_S:-1200}" ) > "$SS/logs/bisect.log" 2>&1 &
  has minimal && ( minimal_at_two_seqs ) > "$SS/logs/minimal_two.log" 2>&1 &
  has v1caps && ( cap_pair 0.29.0 v1_forced --model "$MODEL" --preset "$PRESET" --seeds 0:12 \
      --set model_runner=v1 ) > "$SS/logs/v1_29.log" 2>&1 &
  has v1caps && ( cap_pair 0.30.0 v1_forced --model "$MODEL" --preset "$PRESET" --seeds 0:12 \
      --set model_runner=v1 ) > "$SS/logs/v1_30.log" 2>&1 &
  has gallery && ( SS_TIMEOUT=900 ss render_gpu 0.26.0 render 04_where_state_diverges 06_hypotheses \
      --out "$SS/0.26.0/gallery-gpu" --no-png --json
      [ "${SS_NO_CUDA:-0}" = 1 ] || SS_RELEASE=0.26.0 cuda_checks ) > "$SS/logs/gallery26.log" 2>&1 &
  has on32 && ( on_current 0.32.0 ) > "$SS/logs/on32.log" 2>&1 &
  wait
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$SS/logs/nvidia-smi.txt"
  echo done > "$SS/logs/DONE"
}

on_current() {  # VERSION: issue 30 item 5 on a current release, Model Runner V1 forced: the committed
  # 3-request script (from 0.26.0) run 3x with VLLM_USE_V2_MODEL_RUNNER=0 and once at the release
  # default, beside a shrink of the 198-request trace at a batch of two (V1 forced, episodes+steps)
  local v=$1 D="$SS/$1/on_current" R="${SS_RESUME_DIR:-$REPO/.gk-resume}"
  mkdir -p "$D/shrink"
  local repro="$R/at_two_seqs_repro.py"
  local m=(-- --model "$REPO/data/models/$MODEL") i
  if [ -f "$repro" ]; then
    for i in 1 2 3; do repro_run "$v" "$repro" "$D/v1_$i.log" 400 VLLM_USE_V2_MODEL_RUNNER=0 "${m[@]}" & done
    repro_run "$v" "$repro" "$D/default.log" 400 "${m[@]}" &
  fi
  SS_TIMEOUT=${SS_SHRINK_TIMEOUT:-900} SS_JOBDIR="$D" ss shrink "$v" shrink "$R/shrink/minimal.jsonl" \
    --model "$MODEL" --control no_async --keep-failing 3 --both-set model_runner=v1 \
    --both-set max_num_seqs=2 --both-set max_num_batched_tokens=4096 --phases episodes,steps \
    --out "$D/shrink" --json
  wait
}

reproducer_answers() {  # the 0.26.0-only part of release_answers (4 kit calls instead of 32): the
  # shrink at a batch of two, its script and capture (minimal_at_two_seqs) beside notebooks 04 and 06
  # and the CUDA checks; pack with pack_release_answers
  mkdir -p "$SS/logs"
  bash "$0" setup 0.26.0 > "$SS/logs/setup-0.26.0.log" 2>&1
  ( minimal_at_two_seqs ) > "$SS/logs/minimal_two.log" 2>&1 &
  ( SS_TIMEOUT=900 ss render_gpu 0.26.0 render 04_where_state_diverges 06_hypotheses \
      --out "$SS/0.26.0/gallery-gpu" --no-png --json; SS_RELEASE=0.26.0 cuda_checks ) \
    > "$SS/logs/gallery26.log" 2>&1 &
  wait
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$SS/logs/nvidia-smi.txt"
  echo done > "$SS/logs/DONE"
}
gallery_checks() {  # [VERSION [NOTEBOOK ...]]: one release set up, the notebooks (default 06) rendered
  # on the GPU beside the CUDA checks; DONE when both finished (pack with pack_release_answers)
  local v=${1:-0.26.0}; shift || true
  mkdir -p "$SS/logs"
  bash "$0" setup "$v" > "$SS/logs/setup-$v.log" 2>&1
  ( SS_TIMEOUT=900 ss render_gpu "$v" render "${@:-06_hypotheses}" --out "$SS/$v/gallery-gpu" \
      --no-png --json ) > "$SS/logs/gallery26.log" 2>&1 &
  ( SS_RELEASE=$v cuda_checks ) > "$SS/logs/cuda.log" 2>&1 &
  wait
  echo done > "$SS/logs/DONE"
}
pack_release_answers() {  # what release_answers wrote so far -> $OUT (safe while it runs): the
  # bisections (records compacted), the minimal folder without its captures, each capture folder
  [ -d "$SS/bisect_releases" ] && pack bisect "$SS/bisect_releases"
  local stage="$SS/pack-minimal_two"; rm -rf "$stage"; mkdir -p "$stage"
  [ -d "$SS/0.26.0/minimal_two" ] && ( cd "$SS/0.26.0" && find minimal_two -not -path '*/caps/*' \
      -type f -print0 | tar czf "$OUT/minimal_two.tar.gz" --null -T - )
  for v in 0.26.0 0.29.0 0.30.0; do [ -d "$SS/$v/caps" ] && tar czf "$OUT/caps-$v.tar.gz" -C "$SS/$v" caps; done
  [ -d "$SS/0.32.0/on_current" ] && tar czf "$OUT/on_current-0.32.0.tar.gz" -C "$SS/0.32.0" on_current
  tar czf "$OUT/gallery.tar.gz" -C "$SS" 0.26.0/gallery-gpu 0.26.0/cuda 2>/dev/null
  tar czf "$OUT/logs.tar.gz" -C "$SS" logs commands.txt 2>/dev/null
  ls -la "$OUT"; tail -n 3 "$SS"/logs/*.log 2>/dev/null | cut -c1-220
  find "$SS" -name rc -not -path '*/runs/*' -exec sh -c 'echo "$1: $(cat "$1")"' _ {} \; | sed "s#$SS/##"
}

pack_localise() {  # what `localise` wrote so far -> $OUT: reports + logs (one archive), the capture
  # folders per release (safe to call while it runs)
  local stage="$SS/pack-localise"; rm -rf "$stage"; mkdir -p "$stage"
  for v in 0.26.0 0.32.0; do
    [ -d "$SS/$v" ] || continue
    ( cd "$SS" && find "$v" \( -name stdout.json -o -name stderr.log -o -name rc -o -name '*.log' \
        -o -name 'result.json' -o -name 'minimal.jsonl' -o -name 'candidates.jsonl' -o -name 'repro.py' \
        -o -name 'README.md' -o -path '*gallery-gpu*' -o -path '*/cuda/*' \) -not -path '*/caps/*/trigger/*' \
        -not -path '*/caps/*/reference/*' -print0 | tar czf "$OUT/reports-$v.tar.gz" --null -T - )
    [ -d "$SS/$v/caps" ] && tar czf "$OUT/caps-$v.tar.gz" -C "$SS/$v" caps
  done
  tar czf "$OUT/logs.tar.gz" -C "$SS" logs commands.txt 2>/dev/null
  ls -la "$OUT"; tail -n 4 "$SS"/logs/*.log 2>/dev/null | cut -c1-220
  find "$SS" -name rc -path '*caps*' -exec sh -c 'echo "$1: $(cat "$1")"' _ {} \;
}

pack_minimal() {  # [VERSION]: what `minimal` wrote so far -> $OUT (safe to call while it runs);
  # default: the release `minimal` last started (then 0.28.0)
  local v=${1:-$(cat "$SS/minimal.version" 2>/dev/null || echo 0.28.0)}
  pack minimal "$SS/$v/minimal"
  tar czf "$OUT/gallery.tar.gz" -C "$SS" "$v/gallery-gpu" "$v/cuda" logs commands.txt 2>/dev/null
  ls -la "$OUT"; tail -n 5 "$SS"/logs/*.log 2>/dev/null | cut -c1-200
  for f in "$SS/$v"/minimal/*/rc; do echo "$f: $(cat "$f")"; done
}

overhead_alone() {  # VERSION DIR: capture-overhead on V2 then V1, nothing else on the GPU; a fixed
  # time budget per runner (SS_OVERHEAD_BUDGET_S, default 200), so a short lease can still plan it
  local v=$1 D=$2 runner
  for runner in v2 v1; do
    SS_TIMEOUT=$(( ${SS_OVERHEAD_BUDGET_S:-200} + 200 )) SS_JOBDIR="$D" ss "overhead_$runner" "$v" \
      capture-overhead --model "$MODEL" --modes off,digest --rounds 60 --workloads gui \
      --gui-max-tokens 256 --set model_runner=$runner --budget-s "${SS_OVERHEAD_BUDGET_S:-200}" \
      --capture-dir "$D/overhead_$runner/cap" --json
  done
  echo "overhead $v done $(date +%H:%M:%S)" >> "$SS/logs/cost.log"
}

newest_cells() {  # VERSION: doctor, the V2 and V1 cells vs async off, a V1 capture pair, side by side
  local v=$1 R="$SS/$1/runs" runner
  mkdir -p "$R"
  ss doctor "$v" doctor --model "$MODEL" --json
  for runner in v2 v1; do
    ss "cell_$runner" "$v" reproduce --model "$MODEL" --preset "$PRESET" --seeds 48:60 \
      --control no_async --trigger-set model_runner=$runner --control-set model_runner=$runner \
      --runs "$R" --run-id "$runner" --json &
  done
  # V1 capture on the newest release (issue 29 item 2): trigger vs async off, then the reports
  cap_pair "$v" v1_forced --model "$MODEL" --preset "$PRESET" --seeds 48:60 --set model_runner=v1 &
  wait
}

shrink_cost_and_overhead() {  # one lease (issue 30's cost goal, issue 29 items 3, 5 and 7):
  # side by side, (a) `shrink` at its defaults (narrow first) of the 96-episode V1-forced failing
  # run on SS_RELEASE (default 0.32.0; seeds 48:60), capped at the goal's 12 minutes; (b) the
  # committed 3-request script there with V1 forced, async off and --patch accept_sync; (c) 0.33.0
  # (torch 2.14 kit, when installed): newest_cells. First, alone on the GPU: overhead_alone on
  # SS_RELEASE. SS_PARTS picks parts (default: shrink scripts v033 overhead); SS_V033_FIRST=1 runs
  # (c) alone before the overhead and the rest (a lease holding only the 0.33.0 kit: SS_RELEASE=0.33.0
  # SS_PARTS="v033 overhead" SS_V033_FIRST=1). Pack with pack_cost.
  local parts=${SS_PARTS:-"shrink scripts v033 overhead"} D="$SS/cost" rel=${SS_RELEASE:-0.32.0}
  mkdir -p "$SS/logs" "$D"
  local v
  for v in $(printf '%s\n' "$rel" $(has v033 && echo 0.33.0) | sort -u); do
    [ -f "/tmp/vllm-$v/env.sh" ] && bash "$0" setup "$v" > "$SS/logs/setup-$v.log" 2>&1
  done
  if has v033 && [ ! -f /tmp/vllm-0.33.0/env.sh ]; then
    echo "v033: /tmp/vllm-0.33.0/env.sh missing (the torch 2.14 kit was not installed)" > "$SS/logs/v033.log"
  elif has v033 && [ "${SS_V033_FIRST:-0}" = 1 ]; then
    newest_cells 0.33.0 > "$SS/logs/v033.log" 2>&1
    echo "v033 done $(date +%H:%M:%S)" >> "$SS/logs/cost.log"
  fi
  has overhead && overhead_alone "$rel" "$D"
  local script="$REPO/data/results/gpu/minimal_reproducer_0.26.0/at_two_seqs/repro/repro.py"
  local m=(--model "$REPO/data/models/$MODEL")
  if has shrink; then
    # the shrink, then (issue 30 item 5) its exported script run as a maintainer would: twice as
    # exported (V1 + async), async off, V2, the accept_sync patch -- side by side
    # SS_SHRINK_FROM: a shrink folder a lost lease left (its candidates answer again at no cost);
    # SS_SHRINK_PHASES: --phases for the resumed search (e.g. narrow,episodes: stop before steps)
    if [ -n "${SS_SHRINK_FROM:-}" ] && [ ! -d "$D/shrink" ]; then cp -r "$SS_SHRINK_FROM" "$D/shrink"; fi
    ( SS_TIMEOUT=${SS_SHRINK_TIMEOUT:-720} SS_JOBDIR="$D" ss shrink "$rel" shrink --model "$MODEL" \
        --preset "$PRESET" --seeds 48:60 --control no_async --keep-failing 3 \
        --both-set model_runner=v1 ${SS_SHRINK_PHASES:+--phases "$SS_SHRINK_PHASES"} \
        --out "$D/shrink" --json
      SS_JOBDIR="$D" ss export "$rel" export-repro "$D/shrink" --out "$D/repro" --json
      if [ -f "$D/repro/repro.py" ]; then
        R="$D/repro/repro.py"; lim=${SS_SCRIPT_TIMEOUT:-300}
        for i in 1 2; do repro_run "$rel" "$R" "$D/repro/as_exported_$i.log" "$lim" & done
        repro_run "$rel" "$R" "$D/repro/async_off.log" "$lim" -- --set async_scheduling=false &
        repro_run "$rel" "$R" "$D/repro/v2.log" "$lim" VLLM_USE_V2_MODEL_RUNNER=1 &
        repro_run "$rel" "$R" "$D/repro/accept_sync.log" "$lim" -- --patch accept_sync &
        wait
      fi
      echo "shrink chain done $(date +%H:%M:%S)" >> "$SS/logs/cost.log"
    ) > "$SS/logs/shrink.log" 2>&1 &
  fi
  if has scripts; then
    mkdir -p "$D/scripts"
    local i
    for i in 1 2; do repro_run "$rel" "$script" "$D/scripts/v1_$i.log" 400 VLLM_USE_V2_MODEL_RUNNER=0 -- "${m[@]}" & done
    repro_run "$rel" "$script" "$D/scripts/v1_async_off.log" 400 VLLM_USE_V2_MODEL_RUNNER=0 -- \
      "${m[@]}" --set async_scheduling=false &
    repro_run "$rel" "$script" "$D/scripts/v1_accept_sync.log" 400 VLLM_USE_V2_MODEL_RUNNER=0 -- \
      "${m[@]}" --patch accept_sync &
    repro_run "$rel" "$script" "$D/scripts/v2.log" 400 VLLM_USE_V2_MODEL_RUNNER=1 -- "${m[@]}" &
  fi
  if has v033 && [ -f /tmp/vllm-0.33.0/env.sh ] && [ "${SS_V033_FIRST:-0}" != 1 ]; then
    newest_cells 0.33.0 > "$SS/logs/v033.log" 2>&1 &
  fi
  wait
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$SS/logs/nvidia-smi.txt"
  echo done > "$SS/logs/DONE"
}

pack_cost() {  # what shrink_cost_and_overhead wrote so far -> $OUT (safe while it runs)
  local D="$SS/cost"
  [ -d "$D" ] || { echo "pack_cost: nothing under $D yet"; return 0; }
  tar czf "$OUT/cost.tar.gz" --exclude='*/cap/*' -C "$SS" cost logs commands.txt 2>/dev/null
  [ -d "$SS/0.33.0" ] && tar czf "$OUT/v033.tar.gz" -C "$SS" 0.33.0 2>/dev/null
  ls -la "$OUT"; tail -n 3 "$SS"/logs/*.log 2>/dev/null | cut -c1-200
  for f in $(find "$SS" -name rc 2>/dev/null); do echo "$f: $(cat "$f")"; done
  grep -h '^rc=' "$D"/scripts/*.log 2>/dev/null | sort | uniq -c
  for f in "$D"/repro/*.log; do [ -f "$f" ] && echo "$(basename "$f"): $(grep -c CORRUPTED "$f") CORRUPTED, $(tail -1 "$f")"; done
}

collect() {  # PACK_CMD [MAX_S]: wait for a detached campaign, packing with PACK_CMD every 40 s,
  # until $SS/logs/DONE or MAX_S (default 500). On a bare machine (no $SS/logs: the lease was lost
  # between calls and /tmp with it) it exits 3 at once: a collect call that sleeps there anyway
  # spends the session's device time on nothing (2026-12-04: 532 s).
  local pack_cmd=${1:?usage: gpu_cli.sh collect PACK_CMD [MAX_S]} max=${2:-500} t0=$SECONDS
  [ -d "$SS/logs" ] || { echo "collect: $SS/logs missing: this machine is bare (the campaign is gone); nothing to wait for" >&2; exit 3; }
  while [ ! -f "$SS/logs/DONE" ] && [ $(( SECONDS - t0 + 40 )) -lt "$max" ]; do
    sleep 40; bash "$0" "$pack_cmd" > "$SS/logs/collect.log" 2>&1
  done
  bash "$0" "$pack_cmd"
}

case "${1:-}" in
  collect) shift; collect "$@" ;;
  campaign) shift; campaign "$@" ;;
  env) shift; echo ". /tmp/vllm-$1/env.sh; export PYTHONPATH=$REPO/lib:\$PYTHONPATH" ;;
  setup) shift; ( . "/tmp/vllm-$1/env.sh" && STATESCOPE_WHEELS=${STATESCOPE_WHEELS:-/tmp/gk/work-tools/whl} \
             STATESCOPE_EXTRAS=${STATESCOPE_EXTRAS:-none} STATESCOPE_PYTHON=python3 bin/setup --here ) ;;
  doctor) shift; doctor_all "$@" ;;
  issue19) issue19 ;;
  render19) render19 ;;
  gallery) shift; gallery "$@" ;;
  cuda_checks) cuda_checks ;;
  releases) shift; releases "$@" ;;
  bisect_live) shift; bisect_live "$@" ;;
  v2capture) shift; v2capture "$@" ;;
  pack) shift; pack "$@" ;;
  minimal) shift; minimal "$@" ;;
  shrink_alone) shift; shrink_alone "$@" ;;
  pack_minimal) shift; pack_minimal "$@" ;;
  localise) shift; localise "$@" ;;
  pack_localise) pack_localise ;;
  bisect_releases) shift; bisect_releases "$@" ;;
  minimal_at_two_seqs) minimal_at_two_seqs ;;
  release_answers) release_answers ;;
  on_current) shift; on_current "$@" ;;
  reproducer_answers) reproducer_answers ;;
  pack_release_answers) pack_release_answers ;;
  gallery_checks) shift; gallery_checks "$@" ;;
  shrink_cost_and_overhead) shrink_cost_and_overhead ;;
  pack_cost) pack_cost ;;
  *) sed -n 2,26p "$0"; exit 2 ;;
esac
