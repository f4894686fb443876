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
# where the GPU sets the pace, cannot be judged there.
# On a 2-GPU box the traces run side by side after the resident arm:
#   TRACES=none bash ...;  then  CUDA_VISIBLE_DEVICES=0 TRACES=tasks EC_KEEP_SERVERS=1 bash ... &
#   CUDA_VISIBLE_DEVICES=1 TRACES=zipf EC_KEEP_SERVERS=1 OUT=out2 bash ...
# Detached past a caller's time limit (bench/detach.sh), with no per-baseline limit:
#   bash bench/detach.sh plan env OUT=/tmp/opc BL_SECONDS=7200 bash bench/run_plan_check_on_device.sh
#   RESULTS=/tmp/opc bash bench/detach.sh --poll plan 540
# PLAN_ARM=0 leaves the saved plan's arm out (one server fewer a trace: the per-layer plan
# against uniform needs measuring once, not per trace). A resident baseline file already in
# $PC (say, copied from an earlier run, as tests/data/plan-check-resident-24.jsonl is) is not
# run again.
# POLICY=lfu plans and serves that policy (arms cache:S:lfu; files named -lfu): on a trace
# whose LRU hit rates equal another's (tasks and zipf do, to 0.003), the other policy is
# where their locality differs (zipf: LFU misses 35% at 16 slots, LRU 41%).
# PY, PC (traces, plans, baselines: /tmp/pc) and MODEL_DIR (/tmp) are overridable (the flow
# is tested on CPU with stubbed GPU steps: tests/bench/test_bench_plan_check_runner.py).
set -uo pipefail
OUT="${OUT:-out}"
PC="${PC:-/tmp/pc}"  # traces, plans and baselines, kept on the box across calls
mkdir -p "$OUT" "$PC"
source bench/_device_vllm.sh
PY="${PY:-python3}"
LAYERS="${LAYERS:-24}"
MODEL="${MODEL_DIR:-/tmp}/model$LAYERS"
# every expert offloaded: 128 x 9.44 MB = 1.21 GB a layer, and some room
OFFLOAD_GB=$(( LAYERS * 5 / 4 + 1 ))
SLOTS="${SLOTS:-16,32,64}"
POLICY="${POLICY:-lru}"
SFX=""; [ "$POLICY" = lru ] || SFX="-$POLICY"  # LRU keeps the first run's file names
VLLM_ARGS=(--attention-backend TRITON_ATTN --max-num-seqs 4 --max-model-len 1024 --seed 0)

baseline() {  # baseline OUT.jsonl ARMS [env...]: one server per arm, resumable
  local out=$1 arms=$2; shift 2
  local resume=()
  [ -s "$out" ] && resume=(--resume)
  env "$@" timeout -s INT -k 60 "${BL_SECONDS:-540}" $PY -m expertcache_cli baseline \
    "$MODEL" --arms "$arms" --restarts 1 --runs "${RUNS:-3}" --max-tokens 200 \
    --cpu-offload-gb "$OFFLOAD_GB" --start-timeout 400 --stop-grace 20 --out "$out" "${resume[@]}" \
    -- "${VLLM_ARGS[@]}" 2>&1 | tail -12
  cp "$out" "$OUT/"
}

device_vllm_setup || { echo "setup failed"; exit 1; }
[ -f "$MODEL/model.safetensors.index.json" ] || \
  $PY bench/write_checkpoint.py "$MODEL" --layers "$LAYERS" 2>&1 | tail -1
[ -f $PC/probe.json ] || $PY -m expertcache_cli probe-link --only gather,step --model "$MODEL" \
  --save $PC/probe.json > "$OUT/probe.txt" 2>&1
cp $PC/probe.json "$OUT/"
baseline "$PC/bl-resident-$LAYERS.jsonl" resident

for kind in ${TRACES:-tasks zipf}; do
  [ "$kind" = none ] && continue
  T=$PC/$kind-$LAYERS.npz
  [ -f "$T" ] || $PY -m expertcache_cli trace synth "$T" --kind "$kind" --steps 4000 \
    --layers "$LAYERS" --experts 128 --top-k 8 --seed 7 --expert-bytes 9437184 \
    --model "qwen3-30b-a3b shape, $LAYERS layers" > /dev/null
  P=$PC/plan-$kind$SFX-$LAYERS.json
  J=$PC/plan-$kind$SFX-$LAYERS.out.json  # kept on the box: $OUT is emptied every call
  B=$PC/bl-$kind$SFX-$LAYERS.jsonl
  [ -f "$P" ] || $PY -m expertcache_cli plan "$T" --model "$MODEL" --probe $PC/probe.json \
    --baseline "$PC/bl-resident-$LAYERS.jsonl" --slots "$SLOTS" --policy "$POLICY" --save "$P" --json \
    > "$J" 2> "$OUT/plan-$kind$SFX.err"
  cp "$J" "$OUT/plan-$kind$SFX.json"; cp "$P" "$OUT/plan-$kind$SFX.saved.json" 2>/dev/null
  ARMS=$(echo "$SLOTS" | sed "s/\([0-9]\+\)/cache:\1${SFX/-/:}/g")
  [ "${PLAN_ARM:-1}" = 0 ] || ARMS="$ARMS,plan:$P"
  baseline "$B" "$ARMS" EC_BENCH_TRACE_ROUTING="$T" \
    PYTHONPATH="$PWD/bench/trace_hook:$PYTHONPATH"
  $PY bench/plan_check.py "$J" "$B" "$P" | tee "$OUT/compare-$kind$SFX.txt"
done
echo "done after $SECONDS s"
