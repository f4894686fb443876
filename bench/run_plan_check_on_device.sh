#!/usr/bin/env bash
# `expertcache plan` predicted vs `expertcache baseline` measured, on the GPU box: the
# served model's routing is replayed from a trace (bench/trace_routing.py, bench only), so
# the measured tok/s and the prediction see the same workload.
#
# Two synthetic traces with different locality (LAYERS layers of the Qwen3-30B-A3B expert
# shape: tasks = phases of hot experts, zipf = one skewed popularity). Once: the resident
# rate (a baseline of the resident arm; routing does not change it) and the probe. Per
# trace: `plan` with them (--save: the per-layer split of the best budget), then one
# baseline over three uniform budgets and the saved plan (`plan:FILE`: the per-layer split
# at the uniform budget's bytes), one server per arm (device time), and the table of
# predicted vs measured. Re-entrant: a baseline file that is complete is not run again
# (--resume continues a partial one), so a second call finishes the work.
#   TRACES="tasks zipf" SLOTS=16,32,64 RUNS=3 bash bench/run_plan_check_on_device.sh
# LAYERS (default 24): at 8 layers the resident model decodes at ~650 tok/s, paced by the
# host's per-token work rather than the GPU (resident runs of 588-655 tok/s in one
# server), and installs hide in GPU idle time: the planner's additive model, which holds
# where the GPU sets the pace, cannot be judged there. RES_RUNS (default 3 x RUNS): the
# resident arm's runs, whose mean is plan's input (its runs can spread far more than the
# cache arms': 12-18% on some hosts, bench/results/plan-check-recorded.md).
# On a 2-GPU box the traces run side by side after the resident arm:
#   TRACES=none bash ...;  then  CUDA_VISIBLE_DEVICES=0 TRACES=tasks EC_KEEP_SERVERS=1 bash ... &
#   CUDA_VISIBLE_DEVICES=1 TRACES=zipf EC_KEEP_SERVERS=1 OUT=out2 bash ...
# Detached past a caller's time limit (bench/detach.sh), with no per-baseline limit:
#   bash bench/detach.sh plan env OUT=/tmp/opc BL_SECONDS=7200 bash bench/run_plan_check_on_device.sh
#   RESULTS=/tmp/opc bash bench/detach.sh --poll plan 280
# PLAN_ARM=0 leaves the saved plan's arm out (one server fewer a trace: the per-layer plan
# against uniform needs measuring once, not per trace). A resident baseline file already in
# $PC (say, copied from an earlier run, as tests/data/plan-check-resident-24.jsonl is) is not
# run again.
# OFFLOAD_ARM=1 also serves the offload floor on the trace's routing (one server more a
# trace): the cache's gain over it on real routing, beside plan's rows (plan_check.py).
# POLICY=lfu plans and serves that policy (arms cache:S:lfu; files named -lfu): on a trace
# whose LRU hit rates equal another's (tasks and zipf do, to 0.003), the other policy is
# where their locality differs (zipf: LFU misses 35% at 16 slots, LRU 41%).
# Recorded traces (issue 30: `plan` holds on real routing): TRACES also takes the name of a
# recording in traces/ (or a path to one), beside the synthetic kinds:
#   TRACES="real-qwen3-30b-a3b-k6 real-gemma-4-26b-a4b-k6 real-gpt-oss-120b-k2" PLAN_ARM=0 \
#     bash bench/run_plan_check_on_device.sh
# A recording is served on a checkpoint of its own width and expert count: LAYERS layers of
# the Qwen3-30B-A3B expert shape, the trace's experts and top-k (6 of 128 for Qwen3 and
# Gemma 4 as recorded, 2 of 128 for gpt-oss-120b, 8 of 64 for OLMoE, 4 of 32 for
# gpt-oss-20b: the hook replaces a router's ids only where the widths agree, so each
# token's experts are exactly the recorded ones), a model directory per shape (model24-k6,
# model24-k8-e64; top-8 of 128 shares model24), and per model its own probe (probe-k6.json)
# and resident rate (bl-resident-24-k6.jsonl: resident tok/s depends on the experts a
# token; served under the trace hook, as the cache arms are, so that plan's baseline pays
# the hook's per-layer cost as they do). SLOTS are counted for 128 experts: a recording of
# E experts is served at SLOTS x E / 128 (16,32,64 -> 8,16,32 of OLMoE's 64). The servers
# route by the recording fitted to LAYERS (bench/trace_fit.py --layers: model layer i
# routes as trace layer i mod L); `plan
# --model` (the checkpoint's bytes an expert, its top-k checked against the trace's) is
# given the ids the hook handed each server: a warm-up and RUNS requests of 200 tokens
# (`expertcache baseline`'s protocol), each from the trace's row 0 with a 16-token prefill
# (trace_fit --streams 1 --steps (RUNS+1)*200 --request-steps 200 --prefill-tokens 16).
# A recording of several requests (four prompts, each decoded in turn: OLMoE, gpt-oss-20b)
# is served a different prompt a request, so that no run replays the one before it: the
# warm-up and the runs send prompts of 16, 24, 32, ... words (baseline --prompt, given once
# a request), and the hook replays recorded request (words // 8) mod R for each
# (bench/trace_routing.py; trace_fit --prompt-tokens 16,24,... gives plan the same ids).
# Every request of a recorded trace's servers (resident too) sends the bench's 16-word
# prompt (bench/small_card.py's PROMPT), not `baseline`'s 25-word default: vLLM's prefix
# cache would serve a later request's first 16 tokens of that one from its first request's
# blocks (16 tokens a block) and prefill only 9, while a prompt of one block is never
# cached (vLLM computes a fully cached prompt's last token again), so every request
# prefills the 16 tokens plan is given. plan_check.py then sets each arm beside plan's
# prediction and beside plan's formula over the steps the runs timed (the warm-up and the
# prefills are not in a run's decode rate); the table of every trace run, with the command,
# goes to $OUT/plan-check-table.md. A name that is no trace is refused (one line, exit 2)
# before anything starts.
# Only recorded traces in TRACES: the top-8 model, its probe and resident rate are skipped.
# Device minutes (H200, 24 layers): a checkpoint 0.3, a probe 1.5, a server 1-2.7 to start
# and <1 to serve 3 runs; so per top-k ~4.5 (checkpoint, probe, resident), per trace ~6-10
# (three budgets; the saved plan's arm one server more: PLAN_ARM=0 leaves it out).
# PY, PC (traces, plans, baselines: /tmp/pc) and MODEL_DIR (/tmp) are overridable (the flow
# is tested on CPU with stubbed GPU steps: tests/bench/test_bench_plan_check_runner.py).
set -uo pipefail
OUT="${OUT:-out}"
PC="${PC:-/tmp/pc}"  # traces, plans and baselines, kept on the box across calls
PY="${PY:-python3}"
LAYERS="${LAYERS:-24}"
MD="${MODEL_DIR:-/tmp}"
# every expert offloaded: 128 x 9.44 MB = 1.21 GB a layer, and some room
OFFLOAD_GB=$(( LAYERS * 5 / 4 + 1 ))
SLOTS="${SLOTS:-16,32,64}"
POLICY="${POLICY:-lru}"
RUNS="${RUNS:-3}"
# the resident's runs (see above); a run costs it under half a second
RES_RUNS="${RES_RUNS:-$(( RUNS * 3 ))}"
TOKENS=200  # a request's tokens (baseline --max-tokens): its prefill and 199 decode steps
PREFILL=16  # the recorded traces' prompt, in tokens (one word a token)
PROMPT16="w17 w923 w4410 w88 w5120 w3 w777 w2048 w60 w1999 w4096 w31 w8000 w12 w640 w5"
prompt_of() {  # prompt_of Q WORDS: request Q's prompt, its own words (no prefix shared)
  local i out=()
  for ((i = 0; i < $2; i++)); do out+=("w$(( (Q_SALT + $1 * 1009 + i * 7919) % 9970 + 3 ))"); done
  echo "${out[*]}"
}
Q_SALT=31
SFX=""; [ "$POLICY" = lru ] || SFX="-$POLICY"  # LRU keeps the first run's file names
VLLM_ARGS=(--attention-backend TRITON_ATTN --max-num-seqs 4 --max-model-len 1024 --seed 0)
TRACES="${TRACES:-tasks zipf}"

# The recorded traces in TRACES: a name in traces/ (or a path), checked before anything
# starts; their top-k and experts (what checkpoint serves them) once python's numpy is set up
declare -A REC_SRC REC_K REC_E REC_R
synthetic=0
for kind in $TRACES; do
  case $kind in
    none|tasks|zipf) synthetic=1; continue ;;
  esac
  src=""
  for c in "$kind" "traces/$kind" "traces/$kind.npz"; do [ -f "$c" ] && { src=$c; break; }; done
  if [ -z "$src" ]; then
    echo "TRACES: $kind: no such trace (tasks, zipf, none, or a recording in traces/: $(
      cd traces 2>/dev/null && ls -- *.npz 2>/dev/null | sed 's/\.npz$//' | tr '\n' ' '))" >&2
    exit 2
  fi
  case $src in /*) ;; *) src=$PWD/$src ;; esac
  REC_SRC[$kind]=$src
done

mkdir -p "$OUT" "$PC"
source bench/_device_vllm.sh
device_vllm_setup || { echo "setup failed"; exit 1; }
for kind in "${!REC_SRC[@]}"; do
  shape=$($PY bench/trace_fit.py --shape "${REC_SRC[$kind]}") || exit 2
  read -r k e _ r <<< "$shape"
  REC_K[$kind]=$k REC_E[$kind]=$e REC_R[$kind]=${r:-1}
done

baseline() {  # baseline [--runs N] MODEL OUT.jsonl ARMS [env...]: one server an arm, resumable
  local runs=$RUNS
  [ "$1" = --runs ] && { runs=$2; shift 2; }
  local model=$1 out=$2 arms=$3; shift 3
  local resume=()
  [ -s "$out" ] && resume=(--resume)
  env "$@" timeout -s INT -k 60 "${BL_SECONDS:-540}" $PY -m expertcache_cli baseline \
    "$model" --arms "$arms" --restarts 1 --runs "$runs" --max-tokens "$TOKENS" "${prompt[@]}" \
    --cpu-offload-gb "$OFFLOAD_GB" --start-timeout 400 --stop-grace 20 --out "$out" "${resume[@]}" \
    -- "${VLLM_ARGS[@]}" 2>&1 | tail -12
  cp "$out" "$OUT/"
}
model_of() {  # model_of K [E]: the checkpoint of top-K of E experts (8 of 128: the
  # shape's own), written when missing
  local dir=$MD/model$LAYERS topk=() e=${2:-128}
  [ "$1" = 8 ] && [ "$e" = 128 ] || { dir=$MD/model$LAYERS-k$1; topk=(--top-k "$1"); }
  [ "$e" = 128 ] || { dir=$dir-e$e; topk+=(--experts "$e"); }
  [ -f "$dir/model.safetensors.index.json" ] || \
    $PY bench/write_checkpoint.py "$dir" --layers "$LAYERS" "${topk[@]}" 2>&1 | tail -1 >&2
  echo "$dir"
}
slots_of() {  # slots_of E: SLOTS (counted for 128 experts) for a model of E experts
  local s out=()
  for s in ${SLOTS//,/ }; do out+=("$(( s * $1 / 128 > 0 ? s * $1 / 128 : 1 ))"); done
  (IFS=,; echo "${out[*]}")
}
probe_of() {  # probe_of MODEL FILE: the link and the cache step at the model's experts, once
  [ -f "$2" ] || $PY -m expertcache_cli probe-link --only gather,step --model "$1" \
    --save "$2" > "$OUT/$(basename "$2" .json).txt" 2>&1
  cp "$2" "$OUT/" 2>/dev/null
}
# plan, the budgets' (and the saved plan's) servers routed by trace T, the comparison:
# check NAME T PLAN_TRACE MODEL PROBE RESIDENT [SLOTS]
check() {
  local name=$1 t=$2 pt=$3 model=$4 probe=$5 res=$6 slots=${7:-$SLOTS}
  local p=$PC/plan-$name$SFX-$LAYERS.json
  local j=$PC/plan-$name$SFX-$LAYERS.out.json  # kept on the box: $OUT is emptied every call
  local b=$PC/bl-$name$SFX-$LAYERS.jsonl
  [ -f "$p" ] || $PY -m expertcache_cli plan "$pt" --model "$model" --probe "$probe" \
    --baseline "$res" --slots "$slots" --policy "$POLICY" --save "$p" --json \
    > "$j" 2> "$OUT/plan-$name$SFX.err"
  cp "$j" "$OUT/plan-$name$SFX.json"; cp "$p" "$OUT/plan-$name$SFX.saved.json" 2>/dev/null
  local arms
  arms=$(echo "$slots" | sed "s/\([0-9]\+\)/cache:\1${SFX/-/:}/g")
  [ "${PLAN_ARM:-1}" = 0 ] || arms="$arms,plan:$p"
  [ "${OFFLOAD_ARM:-0}" = 0 ] || arms="offload,$arms"
  baseline "$model" "$b" "$arms" EC_BENCH_TRACE_ROUTING="$t" \
    EC_BENCH_TRACE_RESTART="$RESTART" PYTHONPATH="$PWD/bench/trace_hook:${PYTHONPATH:-}"
  $PY bench/plan_check.py "$j" "$b" "$p" | tee "$OUT/compare-$name$SFX.txt"
  TABLE+=("$j" "$b" "$p")
}

TABLE=()
prompt=()
if [ "$synthetic" = 1 ]; then  # the top-8 model's resident rate (synthetic traces, none)
  MODEL=$(model_of 8)
  probe_of "$MODEL" "$PC/probe.json"
  baseline --runs "$RES_RUNS" "$MODEL" "$PC/bl-resident-$LAYERS.jsonl" resident
fi

for kind in $TRACES; do
  case $kind in
    none) continue ;;
    tasks|zipf)
      # one hook counter across requests: plan replays the long synthetic trace whole
      prompt=() RESTART=0
      T=$PC/$kind-$LAYERS.npz
      [ -f "$T" ] || $PY -m expertcache_cli trace synth "$T" --kind "$kind" --steps 4000 \
        --layers "$LAYERS" --experts 128 --top-k 8 --seed 7 --expert-bytes 9437184 \
        --model "qwen3-30b-a3b shape, $LAYERS layers" > /dev/null
      check "$kind" "$T" "$T" "$MODEL" "$PC/probe.json" "$PC/bl-resident-$LAYERS.jsonl" ;;
    *)
      # each request from the first row of a recorded request, as plan is given it: of
      # several, the one the prompt's length picks, a different one a request
      prompt=(--prompt "$PROMPT16") RESTART=1 lengths=()
      k=${REC_K[$kind]} e=${REC_E[$kind]} name=$(basename "$kind" .npz)
      if [ "${REC_R[$kind]}" -gt 1 ]; then
        prompt=()
        for ((q = 0; q <= RUNS; q++)); do
          lengths+=($(( PREFILL + 8 * q ))); prompt+=(--prompt "$(prompt_of "$q" "${lengths[-1]}")")
        done
      fi
      M=$(model_of "$k" "$e")
      tag=k$k; [ "$e" = 128 ] || tag=k$k-e$e
      probe=$PC/probe.json; [ "$tag" = k8 ] || probe=$PC/probe-$tag.json
      probe_of "$M" "$probe"
      # the servers' routing: the recording at LAYERS layers; plan's: the ids it handed them
      T=$PC/$name-$LAYERS.npz
      steps=$(( (RUNS + 1) * TOKENS ))
      S=$PC/$name-$LAYERS-served$steps.npz
      [ -f "$T" ] || $PY bench/trace_fit.py "${REC_SRC[$kind]}" "$T" --layers "$LAYERS" \
        > /dev/null || { echo "$kind: trace_fit failed: trace skipped"; continue; }
      # resident under the same bench hook as the arms it is the baseline of: the hook's
      # per-layer substitution (a few small kernels a layer, in the captured step) is in
      # every cache server's token, so plan's resident rate carries it too (routed by the
      # first recording of this shape; the ids do not change resident's time, the width does)
      res=$PC/bl-resident-$LAYERS-$tag.jsonl
      baseline --runs "$RES_RUNS" "$M" "$res" resident EC_BENCH_TRACE_ROUTING="$T" \
        EC_BENCH_TRACE_RESTART="$RESTART" PYTHONPATH="$PWD/bench/trace_hook:${PYTHONPATH:-}"
      served=()
      [ "${#lengths[@]}" = 0 ] || served=(--prompt-tokens "$(IFS=,; echo "${lengths[*]}")")
      [ -f "$S" ] || $PY bench/trace_fit.py "$T" "$S" --layers "$LAYERS" --streams 1 \
        --steps "$steps" --request-steps "$TOKENS" --prefill-tokens "$PREFILL" "${served[@]}" \
        > "$PC/$name-$LAYERS-served$steps.txt" || { echo "$kind: trace_fit failed"; continue; }
      # beside plan's JSON in $OUT, so that plan_check.py runs on the files copied off the box
      cp "$S" "$PC/$name-$LAYERS-served$steps.txt" "$OUT/" 2>/dev/null
      check "$name" "$T" "$S" "$M" "$probe" "$res" "$(slots_of "$e")" ;;
  esac
done
if [ "${#TABLE[@]}" -gt 0 ]; then  # one table over the traces run, with its command
  CMD="TRACES=\"$TRACES\" LAYERS=$LAYERS SLOTS=$SLOTS RUNS=$RUNS POLICY=$POLICY"
  CMD="$CMD PLAN_ARM=${PLAN_ARM:-1}"
  [ "${OFFLOAD_ARM:-0}" = 0 ] || CMD="$CMD OFFLOAD_ARM=1"
  CMD="$CMD bash bench/run_plan_check_on_device.sh"
  $PY bench/plan_check.py --table --command "$CMD" "${TABLE[@]}" \
    > "$PC/plan-check-table$SFX.md" 2>&1
  cp "$PC/plan-check-table$SFX.md" "$OUT/plan-check-table$SFX.md"
  cat "$OUT/plan-check-table$SFX.md"
fi
echo "done after $SECONDS s"
