#!/usr/bin/env bash
# The weight formats users download, served with experts offloaded on the GPU box (issues
# 11 and 29). For each format a LAYERS-layer checkpoint (default 24) of the Qwen3-30B-A3B
# expert shape (bench/write_checkpoint.py, per-layer seeded routers; mxfp4: gpt-oss's shape
# with MXFP4_EXPERTS experts, default 128 as gpt-oss-120b) and one server per arm. 24, not
# 8: an 8-layer model decodes at ~620 tok/s on an H200, where the host's per-token work,
# not the GPU, sets the pace (resident runs 588-655 tok/s in one server), installs hide in
# the GPU's idle time and neither the all-hit ratio nor the prediction can be judged.
# Formats: w8a8, fp8-block (Triton), and the 4-bit ones on vLLM's Marlin experts (issue
# 29): gptq, gptq-act (act order: vLLM 0.26 only), awq, w4a16 (compressed-tensors), nvfp4,
# mxfp4 (gpt-oss, offloaded with --moe-backend marlin).
#   warm      the floor's command and environment, started once (bench/small_card.py
#             --warm-only: one 4-token request): vLLM's first start of a configuration
#             compiles the model and parts from later starts at near-ties, so the floor and
#             the cache both load what it compiled; run while floor, cache or trial are owed
#   floor     experts offloaded, EXPERT_CACHE_DISABLE=1: the floor and the reference tokens
#   cache     SLOTS slots (default 32 of 128; 16 where a layer has 32 experts) (the missing
#             arm): the startup line
#             (armed with the tensors it mirrors, or declined with the reason), tok/s, live
#             installs a token, greedy tokens against the floor's
#   trial     TRIAL_FORMATS only (default none): the cache on a kernel not yet known
#             through the bench-only hook (bench/kernel_trial, TRIAL_KERNELS), first-call
#             checked like every layer
# Floor and cache route from a trace (ROUTING=trace, the default; bench/trace_routing.py):
# TRACE, default the recorded traces/real-qwen3-30b-a3b-k6.npz (Qwen3-30B-A3B's decode at 6
# experts a token). The Qwen3-shaped checkpoints are written at QWEN_TOPK experts a token
# (default 6, the recording's width, so that every token routes to exactly its recorded
# experts); gpt-oss's top-4 (mxfp4) takes each token's first 4 of the 6, by its router's
# rank. QWEN_TOPK=8 keeps Qwen3's own top-8, routed by TRACE8 (default the synthetic
# traces/demo-qwen3-30b-a3b-tasks.npz: no bundled recording is routed at top-8 of 128; its
# numbers then say "synthetic"). A trace recorded wider than the model's top-k is narrowed
# (bench/trace_fit.py --top-k, in FM) and the servers replay the narrowed copy.
# ROUTING=random: the checkpoints' own random routers (issue 11's runs).
# And, where the cache (or the trial) armed, on a second checkpoint whose routers reach
# only the first SLOTS experts (`--hot`), routed by its routers:
#   resident  every expert in VRAM, stock vLLM (plugin off); mxfp4 on Marlin too
#             (--moe-backend marlin), so that the all-hit ratio compares one kernel
#   hot       the cache at as many slots: every read a hit, compared with resident (goal 5%)
# then, per format, one line: floor, cache, resident and all-hit tok/s, the missing arm
# against the tok/s predicted from its live installs and the link (`probe-link --only
# gather --model` at the format's slab size; goal 10%), and whether the greedy tokens equal the floor's.
# And `plan`'s own prediction (issue 29), once the resident arm has its rate: the routing
# trace fitted to the LAYERS the checkpoint has, at the format's bytes an expert
# (bench/trace_fit.py: model layer i routes as trace layer i mod L, the hook's rule), then
# `expertcache plan FITTED --probe FMT-probe.json --resident-tok-s R --slots S --policy lru
# --json` > $FM/FMT-plan.json; the report sets the cache arm's tok/s beside it and prints the
# trace's `source` (what routing produced the numbers: the demo traces say "synthetic").
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
# Minutes a format on an H200 at 24 layers: each checkpoint 0.3 (mxfp4's 41 GB: 0.7),
# size and probe 1.5, a server 1.0-2.7 to start (the first start of a configuration, which
# compiles, the longest; a warm one 1-1.5) and 0.2-0.8 to serve its runs, plan 0.1: ~12 with
# the warm-up and all four arms (mxfp4 ~13.5; a declined one ~7.5: no all-hit pair).
# Issue 29's table (the 4-bit formats on Marlin), two formats a run, detached (a server
# start can outlast a caller's time limit; bench/detach.sh polls it); bench/PLAN-4bit.md
# has the runs in order with the minutes each step is expected to take:
#   bash bench/detach.sh formats env OUT=/tmp/of RUNS=3 FORMATS="mxfp4" \
#     bash bench/run_formats_on_device.sh
#   RESULTS=/tmp/of bash bench/detach.sh --poll formats 280
# then FORMATS="gptq-act awq", "w4a16 w8a8" and "nvfp4 fp8-block" (fp8-block's row again);
#   python bench/formats_report.py --table DIR gptq-act awq w4a16 nvfp4 mxfp4 fp8-block w8a8
set -uo pipefail
OUT="${OUT:-out}"
FM="${FM:-/tmp/fm}"  # checkpoints (removed when their arms are done) and records
MXFP4_EXPERTS="${MXFP4_EXPERTS:-128}"
mkdir -p "$OUT" "$FM"
source bench/_device_vllm.sh
# the 4-bit formats run on Marlin, which the plugin arms by default in the formats served
# from slots (config.MARLIN_SERVED: every 4-bit format, each by its row in formats.md);
# EXPERT_CACHE_MARLIN=0 reruns them with Marlin declined
export EXPERT_CACHE_MARLIN="${EXPERT_CACHE_MARLIN:-1}"
PY="${PY:-python3}"
# --max-cudagraph-capture-size 8: vLLM's own ceiling at --max-num-seqs 4 (2 x 4), said
# aloud because gpt-oss's model config raises it to 1024 otherwise: 83 graphs, each
# capture reading the offloaded experts, ~50 s of every MXFP4 server's start at 24 layers
COMMON=(--attention-backend TRITON_ATTN --seed 0 --host 127.0.0.1 --port "{port}"
        --shutdown-timeout 10 --max-model-len 1024 --max-num-seqs 4
        --max-cudagraph-capture-size 8)
device_vllm_setup || { echo "setup failed"; exit 1; }
# SEED=DIR (a folder in the carried tree): an earlier session's records (FMT-ARM.json and
# .log, FMT-size.json, FMT-probe.json, from its results.tgz), copied into FM where FM lacks
# them: the box keeps nothing between sessions, so a format's floor and cache measured in one
# session and its resident and all-hit pair in the next still make one row, with `plan`
# from the seeded size and probe; the report names what came so (seeded.txt)
if [ -n "${SEED:-}" ]; then
  bench_seed "$FM" $(cd "$SEED" && ls -- *.json *.log 2>/dev/null)
fi

# ARMS="resident hot" runs only those arms of each format (the others count as done): the
# all-hit pair again, say, without the floor and cache servers and their checkpoint
# (the variants and the second resident are asked for by their own variables, the warm-up
# by the floor, cache or trial arm it runs for)
want_arm() {
  case ${1##*-} in hot_*|resident2|warm) return 0 ;; esac
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
ckpt() {  # ckpt DIR HOT: written when missing (a LAYERS-layer checkpoint is 8-41 GB)
  [ -f "$1/model.safetensors.index.json" ] || $PY bench/write_checkpoint.py "$1" \
    --layers "${LAYERS:-24}" --format "$fmt" "${shape[@]}" --hot "$2" 2>&1 | tail -1
}
# the routing trace of a format's floor and cache servers (none: their own routers)
routing() {  # routing TOPK EXPERTS -> sets `route` (small_card options) and `trace_path`
  route=() trace_path=""
  [ "${ROUTING:-trace}" = random ] && return 0
  local t
  if [ "$1" = 8 ]; then
    t=${TRACE8:-traces/demo-qwen3-30b-a3b-tasks.npz}
  else
    t=${TRACE:-traces/real-qwen3-30b-a3b-k6.npz}
  fi
  case $t in /*) ;; *) t=$PWD/$t ;; esac
  # the servers replay the trace at the model's top-k and layers: a recording made wider is
  # narrowed to each token's first $1 ids, by rank (trace_fit refuses a narrower one)
  local n=$FM/route-top$1-$(basename "$t")
  [ -f "$n" ] || $PY bench/trace_fit.py "$t" "$n" --layers "${LAYERS:-24}" --top-k "$1" \
    > /dev/null || return 1
  t=$n
  trace_path=$t
  route=(--env "EC_BENCH_TRACE_ROUTING=$t"
         --env "PYTHONPATH=$PWD/bench/trace_hook:${PYTHONPATH:-}")
}
# `plan`'s prediction for this format's cache arm (issue 29), once: the trace as the server
# replayed it (its layers, this format's bytes an expert), the format's probe, the resident
# arm's median rate; nothing where the routing was random or an input is missing (the
# report then says no plan)
plan_fmt() {
  [ -n "$trace_path" ] && [ ! -s "$FM/$fmt-plan.json" ] || return 0
  [ -f "$FM/$fmt-size.json" ] && [ -f "$FM/$fmt-probe.json" ] || return 0
  local r
  r=$($PY bench/formats_report.py --median "$FM/$fmt-resident.json") || return 0
  # the ids the servers replayed: one stream, a warm-up and RUNS requests of 200 tokens,
  # each from the trace's row 0 (the hook restarts a layer at a prefill; the bench prompt's
  # 16 words), a recording shorter than a request cycled as the hook cycles it
  $PY bench/trace_fit.py "$trace_path" "$FM/$fmt-route.npz" --layers "${LAYERS:-24}" \
    --size "$FM/$fmt-size.json" --streams 1 --steps $(( (${RUNS:-5} + 1) * 200 )) \
    --request-steps 200 --decode-only > /dev/null || return 0
  if $PY -m expertcache_cli plan "$FM/$fmt-route.npz" --probe "$FM/$fmt-probe.json" \
      --resident-tok-s "$r" --slots "$S" --policy lru --json > "$FM/$fmt-plan.json.part" \
      2> "$FM/$fmt-plan.err"; then
    mv "$FM/$fmt-plan.json.part" "$FM/$fmt-plan.json"
    cp "$FM/$fmt-plan.json" "$OUT/"
  else
    echo "$fmt: plan failed: $(tail -1 "$FM/$fmt-plan.err")"
  fi
}

for fmt in ${FORMATS:-w8a8 fp8-block gptq gptq-act awq w4a16 nvfp4 mxfp4}; do
  M=$FM/$fmt H=$FM/$fmt-hot
  # SLOTS of 128 (default 32); gpt-oss (mxfp4) has MXFP4_EXPERTS experts a layer: at 32
  # (gpt-oss-20b), 16 of them
  K=${QWEN_TOPK:-6}
  S=${SLOTS:-32} shape=(--vocab 151936 --context 40960 --head-dim 128 --top-k "$K") E=128
  res_args=()
  if [ "$fmt" = mxfp4 ]; then
    shape=(--vocab 201088 --context 131072 --experts "$MXFP4_EXPERTS") E=$MXFP4_EXPERTS K=4
    [ "$E" -le 32 ] && S=16
    res_args=(--moe-backend marlin)  # resident on the kernel the cache serves from
  fi
  if ! routing "$K" "$E"; then
    echo "$fmt: the routing trace does not fit top-$K of $E experts: format skipped"
    continue
  fi
  # the all-hit pair and what HOT_VARIANTS / RESIDENT_AGAIN add to it
  pair=("$fmt-resident" "$fmt-hot")
  for v in ${HOT_VARIANTS:-}; do pair+=("$fmt-hot_${v%%:*}"); done
  [ "${RESIDENT_AGAIN:-0}" = 1 ] && pair+=("$fmt-resident2")
  trial_fmt=0
  [[ " ${TRIAL_FORMATS:-} " == *" $fmt "* ]] && trial_fmt=1
  # an arm on this format's checkpoint still to run: floor, cache or the trial
  owed=0
  if ! done_arm "$fmt-floor" || ! done_arm "$fmt-cache" || \
     { [ $trial_fmt = 1 ] && ! done_arm "$fmt-trial"; }; then owed=1; fi
  if [ $owed = 1 ]; then
    ckpt "$M" 0
    $PY -m expertcache_cli size --model "$M" --vram 141 --json > "$FM/$fmt-size.json" 2>&1
    # the gather rate at this format's expert slabs (4-bit experts are a quarter of int8's)
    [ -f "$FM/$fmt-probe.json" ] || $PY -m expertcache_cli probe-link --only gather,step \
      --model "$M" --save "$FM/$fmt-probe.json" 2>&1 | tail -2
    cp "$FM/$fmt-probe.json" "$FM/$fmt-size.json" "$OUT/" 2>/dev/null
  fi
  stats=(--env EXPERT_CACHE_STATS=400)
  trial=(--env "EC_BENCH_TRY_KERNELS=${TRIAL_KERNELS:-BatchedMarlinExperts}"
         --env "PYTHONPATH=$PWD/bench/kernel_trial:${PYTHONPATH:-}")
  # the floor's start once before the compared arms: the first start of a configuration
  # compiles the model and parts from warm ones at near-ties, so none of them may be it
  if [ $owed = 1 ]; then
    run_arm "$fmt-warm" --warm-only --env EXPERT_CACHE_DISABLE=1 "${route[@]}" \
      -- "$PY" -m expertcache_cli serve "$M" --vram 141 --slots "$S" -- "${COMMON[@]}"
  fi
  run_arm "$fmt-floor" --env EXPERT_CACHE_DISABLE=1 "${route[@]}" \
    -- "$PY" -m expertcache_cli serve "$M" --vram 141 --slots "$S" -- "${COMMON[@]}"
  run_arm "$fmt-cache" "${stats[@]}" "${route[@]}" \
    -- "$PY" -m expertcache_cli serve "$M" --vram 141 --slots "$S" -- "${COMMON[@]}"
  # the all-hit server as users run it: no periodic report (its hit rate comes from the
  # final line at shutdown); EXPERT_CACHE_STATS=400 is a HOT_VARIANTS variant
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
    # the disk holds one of a format's checkpoints at a time (gpt-oss-120b's experts at 24
    # layers are 41 GB each): the floor and cache's goes before the all-hit pair's is written
    if done_arm "$fmt-floor" && done_arm "$fmt-cache" && \
       { [ $trial_fmt = 0 ] || done_arm "$fmt-trial"; }; then rm -rf "$M"; fi
    pair_done || ckpt "$H" "$S"
    # PROFILE=1: both arms also record one request's decode steps (bench/profile_report.py)
    prof_r=() prof_h=() vprof_r=() vprof_h=()
    if [ "${PROFILE:-0}" = 1 ]; then
      prof_r=(--profile "$FM/prof-$fmt-resident") prof_h=(--profile "$FM/prof-$fmt-hot")
      vprof_r=(--profiler-config "$($PY bench/small_card.py --print-profiler-config "${prof_r[1]}")")
      vprof_h=(--profiler-config "$($PY bench/small_card.py --print-profiler-config "${prof_h[1]}")")
    fi
    run_arm "$fmt-resident" --env EXPERT_CACHE_DISABLE=1 "${prof_r[@]}" \
      -- "$PY" -m vllm.entrypoints.cli.main serve "$H" "${COMMON[@]}" "${res_args[@]}" \
      "${vprof_r[@]}"
    plan_fmt  # as soon as resident's rate is known, so that a job cut short keeps it
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
        -- "$PY" -m vllm.entrypoints.cli.main serve "$H" "${COMMON[@]}" "${res_args[@]}"
    fi
    if [ "${PROFILE:-0}" = 1 ]; then
      $PY bench/profile_report.py "$FM/prof-$fmt-resident" "$FM/prof-$fmt-hot" \
        --labels resident,all-hit 2>&1 | tee "$OUT/$fmt-profile.txt"
    fi
  fi
  plan_fmt
  $PY bench/formats_report.py "$fmt" "$FM" | tee -a "$OUT/formats.txt"
  # the disk holds a format's checkpoints, not every format's
  if done_arm "$fmt-floor" && done_arm "$fmt-cache" && \
     { [ $trial_fmt = 0 ] || done_arm "$fmt-trial"; }; then rm -rf "$M"; fi
  if pair_done; then rm -rf "$H"; fi
done
# the formats table (issues 11 and 29), every format run so far
$PY bench/formats_report.py --table "$FM" \
  ${FORMATS:-w8a8 fp8-block gptq gptq-act awq w4a16 nvfp4 mxfp4} > "$OUT/table.md"
echo "done after $SECONDS s"
