#!/usr/bin/env bash
# The weight formats users download, served with experts offloaded on the GPU box (issue
# 11). For each format a LAYERS-layer checkpoint (default 24) of the Qwen3-30B-A3B expert
# shape (bench/write_checkpoint.py, per-layer seeded routers) and one server per arm. 24, not
# 8: an 8-layer model decodes at ~620 tok/s on the H200, where the host's per-token work,
# not the GPU, sets the pace (resident runs 588-655 tok/s in one server), installs hide in
# the GPU's idle time and neither the all-hit ratio nor the prediction can be judged:
#   floor     experts offloaded, EXPERT_CACHE_DISABLE=1: the floor and the reference tokens
#   cache     32 slots (16 of gpt-oss-20b's 32), routing over all experts (the missing
#             arm): the startup line
#             (armed with the tensors it mirrors, or declined with the reason), tok/s, live
#             installs a token, greedy tokens against the floor's
#   trial     TRIAL_FORMATS only (default gptq): the cache on vLLM 0.26's Marlin experts
#             through the bench-only hook (bench/kernel_trial), first-call checked like
#             every layer (H200: GPTQ's 8 layers all differed and went back to stock)
# and, where the cache (or the trial) armed, on a second checkpoint whose routers reach
# only the first 32 experts (`--hot 32`; 16 for mxfp4):
#   resident  every expert in VRAM, stock vLLM (plugin off)
#   hot       the cache at as many slots: every read a hit, compared with resident (goal 5%)
# then, per format, one line: floor, cache, resident and all-hit tok/s, the missing arm
# against the tok/s predicted from its live installs and the link (`probe-link --only
# gather --model` at the format's slab size; goal 10%), and whether the greedy tokens equal the floor's.
# PROFILE=1 adds, in the resident and all-hit servers, a torch-profiler record of one
# request's decode steps and `bench/profile_report.py`'s comparison ($OUT/FMT-profile.txt):
# where the all-hit cache's time a step goes, kernel by kernel.
# HOT_VARIANTS="stats:EXPERT_CACHE_STATS=400 nopdl:EXPERT_CACHE_PDL=0" adds, after the
# all-hit arm, one all-hit server per LABEL:K=V[,K=V] ($fmt-hot_LABEL, the hot arm's
# environment plus those variables), and RESIDENT_AGAIN=1 serves resident once more after
# them ($fmt-resident2): resident, all-hit variants, resident (A/B/A), so that a drift of
# the machine during the run shows instead of passing for a difference between arms.
# RUNS (default 5): measured runs a server.
# Re-entrant (an arm whose JSON says ok is not run again); split by FORMATS across calls:
#   FORMATS="w8a8 fp8-block" bash bench/run_formats_on_device.sh
set -uo pipefail
OUT="${OUT:-out}"
FM="${FM:-/tmp/fm}"  # checkpoints (removed when their arms are done) and records
mkdir -p "$OUT" "$FM"
source bench/_device_vllm.sh
PY="${PY:-python3}"
COMMON=(--attention-backend TRITON_ATTN --seed 0 --host 127.0.0.1 --port "{port}"
        --shutdown-timeout 10 --max-model-len 1024 --max-num-seqs 4)
device_vllm_setup || { echo "setup failed"; exit 1; }

# ARMS="resident hot" runs only those arms of each format (the others count as done): the
# all-hit pair again, say, without the floor and cache servers and their checkpoint
# (the variants and the second resident are asked for by their own variables)
want_arm() {
  case ${1##*-} in hot_*|resident2) return 0 ;; esac
  [ -z "${ARMS:-}" ] || [[ " $ARMS " == *" ${1##*-} "* ]]
}
done_arm() { ! want_arm "$1" || { [ -f "$FM/$1.json" ] && grep -q '"status": "ok"' "$FM/$1.json"; }; }
run_arm() {  # run_arm NAME [small_card options] -- server command
  local name=$1; shift
  done_arm "$name" && return 0
  echo "== $name ($SECONDS s)"
  $PY bench/small_card.py "$name" --out "$FM" --runs "${RUNS:-5}" "$@" | tail -5
  cp "$FM/$name.json" "$OUT/"; tail -c 200000 "$FM/$name.log" > "$OUT/$name.log"
}
served() { $PY bench/formats_report.py --served "$FM/$1.json"; }  # served NAME
# every arm of this format's all-hit pair (the array `pair`, set per format) done
pair_done() { local a; for a in "${pair[@]}"; do done_arm "$a" || return 1; done; }
ckpt() {  # ckpt DIR HOT: written when missing (a LAYERS-layer checkpoint is 8-31 GB)
  [ -f "$1/model.safetensors.index.json" ] || $PY bench/write_checkpoint.py "$1" \
    --layers "${LAYERS:-24}" --format "$fmt" "${shape[@]}" --hot "$2" 2>&1 | tail -1
}

for fmt in ${FORMATS:-w8a8 fp8-block w4a16 gptq awq nvfp4 mxfp4}; do
  M=$FM/$fmt H=$FM/$fmt-hot
  # 32 of 128 slots; gpt-oss-20b (mxfp4) has 32 experts a layer: 16 of them
  S=32 shape=(--vocab 151936 --context 40960 --head-dim 128)
  [ "$fmt" = mxfp4 ] && S=16 shape=(--vocab 201088 --context 131072)
  # the all-hit pair and what HOT_VARIANTS / RESIDENT_AGAIN add to it
  pair=("$fmt-resident" "$fmt-hot")
  for v in ${HOT_VARIANTS:-}; do pair+=("$fmt-hot_${v%%:*}"); done
  [ "${RESIDENT_AGAIN:-0}" = 1 ] && pair+=("$fmt-resident2")
  trial_fmt=0
  [[ " w4a16 gptq awq " == *" $fmt "* && " ${TRIAL_FORMATS:-gptq} " == *" $fmt "* ]] && trial_fmt=1
  if ! done_arm "$fmt-floor" || ! done_arm "$fmt-cache" || \
     { [ $trial_fmt = 1 ] && ! done_arm "$fmt-trial"; }; then
    ckpt "$M" 0
    $PY -m expertcache_cli size --model "$M" --vram 141 --json > "$FM/$fmt-size.json" 2>&1
    # the gather rate at this format's expert slabs (4-bit experts are a quarter of int8's)
    [ -f "$FM/$fmt-probe.json" ] || $PY -m expertcache_cli probe-link --only gather,step \
      --model "$M" --save "$FM/$fmt-probe.json" 2>&1 | tail -2
    cp "$FM/$fmt-probe.json" "$FM/$fmt-size.json" "$OUT/" 2>/dev/null
  fi
  stats=(--env EXPERT_CACHE_STATS=400)
  trial=(--env EC_BENCH_TRY_KERNELS=MarlinExperts --env "PYTHONPATH=$PWD/bench/kernel_trial:$PYTHONPATH")
  run_arm "$fmt-floor" --env EXPERT_CACHE_DISABLE=1 \
    -- "$PY" -m expertcache_cli serve "$M" --vram 141 --slots "$S" -- "${COMMON[@]}"
  run_arm "$fmt-cache" "${stats[@]}" \
    -- "$PY" -m expertcache_cli serve "$M" --vram 141 --slots "$S" -- "${COMMON[@]}"
  # the all-hit server as users run it: no periodic report (its hit rate comes from the
  # final line at shutdown); stop 16's 0.886 had EXPERT_CACHE_STATS=400, now a variant
  # EXPERT_CACHE_AUDIT=1: at shutdown the slots are compared with their experts' bytes, so
  # an all-hit server whose tokens differ from resident's says whether its slots were sound
  hot_env=(--env EXPERT_CACHE_AUDIT=1)
  if [ $trial_fmt = 1 ]; then
    run_arm "$fmt-trial" "${stats[@]}" "${trial[@]}" \
      -- "$PY" -m expertcache_cli serve "$M" --vram 141 --slots "$S" -- "${COMMON[@]}"
    served "$fmt-cache" || hot_env+=("${trial[@]}")
  fi
  # resident and all-hit only where some layer served from its slots (past its first-call check)
  if served "$fmt-cache" || served "$fmt-trial" || ! want_arm "$fmt-cache"; then
    pair_done || ckpt "$H" "$S"
    # PROFILE=1: both arms also record one request's decode steps (bench/profile_report.py)
    prof_r=() prof_h=() vprof_r=() vprof_h=()
    if [ "${PROFILE:-0}" = 1 ]; then
      prof_r=(--profile "$FM/prof-$fmt-resident") prof_h=(--profile "$FM/prof-$fmt-hot")
      vprof_r=(--profiler-config "$($PY bench/small_card.py --print-profiler-config "${prof_r[1]}")")
      vprof_h=(--profiler-config "$($PY bench/small_card.py --print-profiler-config "${prof_h[1]}")")
    fi
    run_arm "$fmt-resident" --env EXPERT_CACHE_DISABLE=1 "${prof_r[@]}" \
      -- "$PY" -m vllm.entrypoints.cli.main serve "$H" "${COMMON[@]}" "${vprof_r[@]}"
    run_arm "$fmt-hot" "${hot_env[@]}" "${prof_h[@]}" \
      -- "$PY" -m expertcache_cli serve "$H" --vram 141 --slots "$S" -- "${COMMON[@]}" "${vprof_h[@]}"
    for v in ${HOT_VARIANTS:-}; do
      venv=(); IFS=, read -ra kvs <<< "${v#*:}"
      for kv in "${kvs[@]}"; do venv+=(--env "$kv"); done
      run_arm "$fmt-hot_${v%%:*}" "${hot_env[@]}" "${venv[@]}" \
        -- "$PY" -m expertcache_cli serve "$H" --vram 141 --slots "$S" -- "${COMMON[@]}"
    done
    if [ "${RESIDENT_AGAIN:-0}" = 1 ]; then
      run_arm "$fmt-resident2" --env EXPERT_CACHE_DISABLE=1 \
        -- "$PY" -m vllm.entrypoints.cli.main serve "$H" "${COMMON[@]}"
    fi
    if [ "${PROFILE:-0}" = 1 ]; then
      $PY bench/profile_report.py "$FM/prof-$fmt-resident" "$FM/prof-$fmt-hot" \
        --labels resident,all-hit 2>&1 | tee "$OUT/$fmt-profile.txt"
    fi
  fi
  $PY bench/formats_report.py "$fmt" "$FM" | tee -a "$OUT/formats.txt"
  # the disk holds two or three formats' checkpoints at a time, not seven
  if done_arm "$fmt-floor" && done_arm "$fmt-cache"; then rm -rf "$M"; fi
  if pair_done; then rm -rf "$H"; fi
done
# issue 11's table, every format run so far
$PY bench/formats_report.py --table "$FM" ${FORMATS:-w8a8 fp8-block w4a16 gptq awq nvfp4 mxfp4} \
  > "$OUT/table.md"
echo "done after $SECONDS s"
