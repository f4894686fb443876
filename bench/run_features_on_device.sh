#!/usr/bin/env bash
# On the GPU box: the plugin under the vLLM features that change what the slots stand for
# (issue 31; docs/plugin.md "vLLM features that change what the slots stand for"), on the
# box's vLLM (0.26): weight updates (reload_weights and the weight-transfer API), sleep mode (levels 1 and 2) and
# n-gram speculative decoding, each a floor engine (EXPERT_CACHE_DISABLE=1) against a cache
# engine (EXPERT_CACHE_SLOTS=32), every expert offloaded, greedy. bench/features_check.py
# runs one engine a process and says met / NOT met per check.
#
# The model: the bench checkpoint (bf16, Qwen3-30B-A3B's expert shape) at 8 layers, written
# twice (seed 0 served, seed 1 reloaded into it). Why 8 and not 24: these checks are about
# correctness (tokens against the floor, the slots' GiB in and out of the sleep pool, the
# TRAP's arithmetic), which every MoE layer shows alike, while each engine start, each
# reload and each checkpoint grow with the layers: two 24-layer checkpoints are ~59 GB of
# the box's 64 GiB disk, and eight 24-layer starts alone take 8-20 minutes. LAYERS=24
# runs the same checks where the disk allows it.
#
# Steps (STEPS, re-entrant: an arm whose JSON says ok is not run again; a checkpoint with
# its index written is not written again), with the minutes each is expected to take on
# the H200 (a 24-layer bf16 engine starts in ~1-2.5 min there, an 8-layer one in ~1-1.5,
# the first start compiling and the later ones reusing vLLM's compile cache; a 24-layer
# bf16 checkpoint is written in ~15-25 s):
#   setup   the vLLM bundle, this package (0.5)
#   model   the two 8-layer checkpoints, 9.9 GB each (0.5)
#   update  floor and cache: generate, reload_weights the seed-1 checkpoint, generate,
#           reload the seed-0 one, generate, the seed-1 one through start/update/
#           finish_weight_update, generate (3)
#   sleep   floor and cache under enable_sleep_mode: level 1 and a plain wake_up; level 2,
#           wake the weights, reload_weights, wake the KV cache; memory and tokens; the
#           cache with EXPERT_CACHE_WIDE=staged-install, so that its wide-step scratch
#           (one layer's experts) is in the pool beside the slots (3)
#   spec    `expertcache size` for 32 slots and the spec flags, then cache and floor at
#           --max-num-seqs 8, then at the safe value the cache's TRAP line names (5)
#   report  bench/features_check.py report: one line a check, to $OUT/features.txt
# Each pair runs after a warm-up start of its configuration (CHECK_floor_warm*): vLLM's
# first start of a configuration compiles the model and later ones load it, and a cold
# start and a warm one part at near-ties, so both arms compared must be warm (~1 min each).
# About 17 device minutes in all (twelve starts of ~35-80 s, each arm's stages ~30-50 s),
# plus the bundle's install; one detached job:
#   bash bench/detach.sh features env OUT=/tmp/ofe bash bench/run_features_on_device.sh
#   RESULTS=/tmp/ofe bash bench/detach.sh --poll features 280      (4-6 polls)
# PY, FE (arm records: /tmp/fe), MODEL_DIR (checkpoints: /tmp), LAYERS (8), SLOTS (32),
# TOKENS (64 greedy tokens a prompt), ABOVE (8) and ARM_TIMEOUT (600 s an arm) are
# overridable: the flow is tested on CPU with vLLM stubbed
# (tests/bench/test_bench_features_check.py).
set -uo pipefail
OUT="${OUT:-out}"
FE="${FE:-/tmp/fe}"
STEPS="${STEPS:-setup model update sleep spec report}"
for step in $STEPS; do
  case $step in
    setup|model|update|sleep|spec|report) ;;
    *) echo "run_features_on_device.sh: unknown step '$step' (steps: setup model update" \
         "sleep spec report)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT" "$FE"
source bench/_device_vllm.sh
PY="${PY:-python3}"
LAYERS="${LAYERS:-8}"
SLOTS="${SLOTS:-32}"
ABOVE="${ABOVE:-8}"
MD="${MODEL_DIR:-/tmp}"
MA=$MD/fe${LAYERS}a
MB=$MD/fe${LAYERS}b
ARM=(--model "$MA" --layers "$LAYERS" --tokens "${TOKENS:-64}" --slots "$SLOTS"
     --timeout-s "${ARM_TIMEOUT:-600}")

arm() { bench_arm "$FE" bench/features_check.py "$@"; }  # arm NAME [options]

for step in $STEPS; do
  case $step in
    setup)
      device_vllm_setup
      case $? in
        1) echo "setup failed"; exit 1 ;;
        2) echo "pip install -e . failed: each arm registers the plugin itself" ;;
      esac ;;
    model)
      for seed in 0 1; do
        dir=$MA; [ "$seed" = 1 ] && dir=$MB
        [ -f "$dir/model.safetensors.index.json" ] && continue
        $PY bench/write_checkpoint.py "$dir" --layers "$LAYERS" --seed "$seed" 2>&1 \
          | tail -1 | tee -a "$OUT/checkpoint.txt"
      done
      df -h "$MD" | tail -1 ;;
    update)
      # a warm-up start first: the pair compared must load one compiled model
      arm update_floor_warm "${ARM[@]}"
      arm update_floor "${ARM[@]}" --model-b "$MB"
      arm update_cache "${ARM[@]}" --model-b "$MB" ;;
    sleep)
      arm sleep_floor_warm "${ARM[@]}"
      arm sleep_floor "${ARM[@]}"
      # staged wide steps: the scratch sleeps and wakes with the slots, so it is checked too
      arm sleep_cache "${ARM[@]}" --env EXPERT_CACHE_WIDE=staged-install ;;
    spec)
      [ -f "$FE/size_spec.json" ] || $PY bench/features_check.py size --out "$FE" \
        --model "$MA" --slots "$SLOTS" --max-num-seqs "$ABOVE"
      cp "$FE"/size_spec.* "$OUT/" 2>/dev/null
      # the cache first: its startup TRAP line names the safe value the next pair runs at
      arm spec_floor_warmabove "${ARM[@]}" --max-num-seqs "$ABOVE"
      arm spec_cache_above "${ARM[@]}" --max-num-seqs "$ABOVE"
      arm spec_floor_above "${ARM[@]}" --max-num-seqs "$ABOVE"
      if SAFE=$($PY bench/features_check.py safe "$FE"); then
        arm spec_floor_warmsafe "${ARM[@]}" --max-num-seqs "$SAFE"
        arm spec_cache_safe "${ARM[@]}" --max-num-seqs "$SAFE"
        arm spec_floor_safe "${ARM[@]}" --max-num-seqs "$SAFE"
      else
        echo "spec: no safe --max-num-seqs; the safe pair is not run"
      fi ;;
    report)
      $PY bench/features_check.py report "$FE" | tee "$OUT/features.txt" ;;
  esac
done
bench_save "$FE"
echo "steps '$STEPS' done after $SECONDS s"
