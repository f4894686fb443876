#!/usr/bin/env bash
# On the GPU box: the flagship of issue 29, gpt-oss-120b's shape on the cards people own.
# 36 layers, 128 experts top-4, hidden 2880, MXFP4 as OpenAI ships it (attention with sinks,
# alternating sliding windows, biased router and experts), on an emulated 24 GiB and 32 GiB
# card (bench/ballast.py), `size`, `plan` and `serve` run as a new user runs them; floor vs
# cache vs resident (the whole H200); greedy tokens; measured tok/s against `plan`.
#
# The weights: vLLM's `--load-format dummy` on the real config (written by
# `bench/write_checkpoint.py --format mxfp4 --experts 128 --layers 36 --config-only`: config
# and tokenizer, no weights), filled in process by bench/synth_weights.py
# (EC_BENCH_SYNTH_WEIGHTS=1) with the weights bench/write_gpt_oss.py draws, through the
# model's own load_weights. Why not a checkpoint on disk: the experts are 63 GiB as vLLM
# holds them (66.5 GB) and the checkpoint ~65 GB with attention, embeddings and LM head,
# more than the box's 64 GiB disk beside vLLM. Why not fewer layers: a card's slots a layer
# are its room over the layers, so 18 layers would give a 24 GiB card twice gpt-oss-120b's
# slots a layer and answer another question. Why not plain dummy: it fills only float
# tensors, so MXFP4's uint8 codes and e8m0 scales stay as allocated (scales up to 2^128:
# infinities, NaN tokens). So every server holds real-shaped, really offloaded expert bytes
# (pinned host memory: 63 GiB of the box's 128) and the same seeded weights, so greedy
# tokens compare across servers; the report refuses a server whose log lacks the hook's line.
#
# Routing: every server replays TRACE (bench/trace_routing.py; default the recorded
# traces/real-qwen3-30b-a3b-k6.npz, each token narrowed to its router's first 4 ids), each
# request from the trace's row 0. TRACE=traces/real-gpt-oss-120b-k4.npz is gpt-oss-120b's
# own routing at its own top-4 over four prompts: a trace of several recorded requests is
# served prompts growing by 8 words a request (small_card.py --prompt-cycle), so that
# consecutive requests replay different recorded conversations.
# `plan` predicts on the ids the servers were handed (bench/trace_fit.py: the hook's layer
# rule, its restart a request). The report prints the trace's source.
#
# Steps (STEPS, re-entrant: an arm whose JSON says ok is not run again), with the minutes
# each is expected to take on the H200 (estimates from the 24-layer runs: a 24-layer server
# started in 1-2.5 min; 36 layers and 63 GiB to draw, pin and repack add ~1 min):
#   setup     the vLLM bundle, this package (0.5 min)
#   model     the config-only model directory, the trace, the trace fitted (0.5 min)
#   probe     probe-link --only gather,step at gpt-oss-120b's slab (1.5 min)
#   resident  every expert in VRAM on the whole H200, Marlin (--moe-backend marlin: the
#             kernel the cache serves from, so plan's resident rate is that kernel's) (3.5)
#   card24    ballast leaves 24 GiB; `size --vram 24`; `plan TRACE --model M --vram 24
#             --probe --resident-tok-s R --save plan24.json`; then the serve command plan
#             recommends, as printed, three times: a warm-up (bench/small_card.py
#             --warm-only with the floor's environment: vLLM's first start of a
#             configuration compiles the model and parts from later starts at near-ties, so
#             the two servers compared both load what it compiled; one start more, ~2.5),
#             floor (EXPERT_CACHE_DISABLE=1: the same vLLM flags, the cache off; ~21 tok/s,
#             4.7) and cache (EXPERT_CACHE_STATS=400 for its installs; 4) (12)
#   card32    the same on 32 GiB (11.5)
#   report    bench/flagship_report.py: the table and the goals, to $OUT/flagship.txt
# Every step: about 29 device minutes in all, more than a session leaves after the bundle:
# split it (below). One detached job, polled every ~4.5 minutes:
#   bash bench/detach.sh flagship env OUT=/tmp/ofs bash bench/run_flagship_on_device.sh
#   RESULTS=/tmp/ofs bash bench/detach.sh --poll flagship 280     (3-4 polls)
# Split over two sessions (the box keeps nothing between them, so each needs its resident
# rate): STEPS="setup model probe resident card24 report", then the same with card32.
# SEED=DIR (a folder in the carried tree): an earlier session's probe.json, resident.json
# and resident.log (from its results.tgz), copied into FS where FS lacks them, so that a
# card's session skips the probe and resident steps (~5 min); the report names what came so.
# A card's floorN.json/.log and the planN.json/.txt it served can be seeded too (a session
# whose cache arm did not finish): that card then runs its warm-up start and the cache only
# (~15 min instead of ~22), the cache serving the very plan the floor served; the report says
# whether the two commands were the same.
# PY, FS (records, model, plans: /tmp/fs), START_TIMEOUT (900 s), TRACE and RUNS (5 measured runs of 200 tokens
# after a warm-up, which plan's replay covers) are overridable:
# the flow is tested on CPU with the GPU steps stubbed (tests/bench/test_bench_flagship_runner.py).
set -uo pipefail
OUT="${OUT:-out}"
FS="${FS:-/tmp/fs}"
mkdir -p "$OUT" "$FS"
source bench/_device_vllm.sh
bench_seed "$FS" probe.json resident.json resident.log \
  floor24.json floor24.log plan24.json plan24.txt floor32.json floor32.log plan32.json plan32.txt
STEPS="${STEPS:-setup model probe resident card24 card32 report}"
PY="${PY:-python3}"
MODEL=$FS/gpt-oss-120b
# MXFP4 on Marlin is armed (and planned for) by default: nothing is set, as a new user
# sets nothing (EXPERT_CACHE_MARLIN in the caller's environment still reaches the servers)
# the vLLM flags a user on a small card gives (the context; the attention backend: the box's
# vLLM bundle has no FlashAttention binaries, and gpt-oss's sinks run on Triton's), and the
# bench's own: dummy weights, filled by the hook
USER_FLAGS=(--max-model-len 8192 --attention-backend TRITON_ATTN)
BENCH_FLAGS=(--load-format dummy)
SERVER_FLAGS=(--seed 0 --host 127.0.0.1 --port "{port}" --shutdown-timeout 10)
FIT=$FS/route-36.npz
hook_env=() cycle=()

save() { bench_save "$FS"; }
# every server: the weights synthesized, the routing replayed from the trace
hooks() {
  local t n
  t=$(cat "$FS/trace.path" 2>/dev/null) || { echo "no trace: run the model step" >&2; return 1; }
  hook_env=(--env EC_BENCH_SYNTH_WEIGHTS=1 --env "EC_BENCH_TRACE_ROUTING=$t"
            --env "PYTHONPATH=$PWD/bench/trace_hook:${PYTHONPATH:-}")
  # a recording of several requests: consecutive requests replay them in turn
  read -r _ _ _ n <<< "$($PY bench/trace_fit.py --shape "$t")"
  cycle=()
  [ "${n:-1}" -gt 1 ] && cycle=(--prompt-cycle "$n")
  return 0
}
arm_done() { [ -f "$FS/$1.json" ] && grep -q '"status": "ok"' "$FS/$1.json"; }
arm() {  # arm NAME [small_card options] -- server command
  local name=$1; shift
  # START_TIMEOUT: a 36-layer start pins 63 GiB, repacks for Marlin and, cold, compiles:
  # 300-350 s alone, 435 s and more beside a second bench on a 2-GPU host; a warm-up start
  # ended at small_card's default 480 s leaves its compile to the floor's start
  bench_arm "$FS" bench/small_card.py "$name" --runs "${RUNS:-5}" \
    --start-timeout "${START_TIMEOUT:-900}" "${hook_env[@]}" "${cycle[@]}" "$@"
}
ballast() {  # ballast GiB | ballast stop
  if [ "$1" = stop ]; then $PY bench/ballast.py stop; return; fi
  $PY bench/ballast.py stop >/dev/null
  $PY bench/ballast.py start --leave "$1" | tee "$OUT/ballast$1.json"
}

for step in $STEPS; do
  echo "== step $step ($SECONDS s)"
  case $step in
    setup)
      device_vllm_setup || { echo "setup failed"; exit 1; } ;;
    model)
      [ -f "$MODEL/config.json" ] || $PY bench/write_checkpoint.py "$MODEL" --format mxfp4 \
        --experts 128 --layers 36 --vocab 201088 --context 131072 --config-only | tail -1
      T=${TRACE:-traces/real-qwen3-30b-a3b-k6.npz}
      if [ ! -f "$T" ]; then echo "TRACE=$T: no such file"; exit 1; fi
      case $T in /*) ;; *) T=$PWD/$T ;; esac
      # the servers replay it at gpt-oss's top-4 and 36 layers (a recording made wider is
      # narrowed to each token's first 4 ids, by rank); plan replays what they were handed:
      # one stream, a warm-up and RUNS requests of 200 tokens, each from row 0
      $PY bench/trace_fit.py "$T" "$FS/route-top4.npz" --layers 36 --top-k 4 > /dev/null \
        || { echo "TRACE=$T does not fit top-4 of 128 experts"; exit 1; }
      echo "$FS/route-top4.npz" > "$FS/trace.path"
      # several recorded requests: the servers' prompts grow by 8 words a request
      # (small_card.py --prompt-cycle), so plan is told each request's prompt length
      read -r _ _ _ NREQ <<< "$($PY bench/trace_fit.py --shape "$FS/route-top4.npz")"
      served=()
      if [ "${NREQ:-1}" -gt 1 ]; then
        served=(--prompt-tokens "$($PY bench/small_card.py --print-prompt-tokens "$NREQ")")
      fi
      $PY bench/trace_fit.py "$FS/route-top4.npz" "$FIT" --layers 36 --streams 1 \
        --steps $(( (${RUNS:-5} + 1) * 200 )) --request-steps 200 --decode-only \
        "${served[@]}" | tee "$OUT/trace.txt" ;;
    probe)
      [ -f "$FS/probe.json" ] || $PY -m expertcache_cli probe-link --only gather,step \
        --model "$MODEL" --save "$FS/probe.json" 2>&1 | tail -4 | tee "$OUT/probe.txt"
      cp "$FS/probe.json" "$OUT/" 2>/dev/null ;;
    resident)
      hooks || exit 1
      arm resident --env EXPERT_CACHE_DISABLE=1 -- "$PY" -m vllm.entrypoints.cli.main serve \
        "$MODEL" --moe-backend marlin --max-num-seqs 4 "${USER_FLAGS[@]}" "${BENCH_FLAGS[@]}" \
        "${SERVER_FLAGS[@]}" ;;
    card24|card32)
      GIB=${step#card}
      if arm_done "floor$GIB" && arm_done "cache$GIB"; then echo "card$GIB: done before"; continue; fi
      hooks || exit 1
      R=$($PY bench/flagship_report.py --rate "$FS/resident.json") || {
        echo "card$GIB: no resident rate yet (run the resident step): plan needs it"; continue; }
      ballast "$GIB"
      # as a new user: what fits, then the plan on the workload's trace, then its command
      $PY -m expertcache_cli size --model "$MODEL" --vram "$GIB" --json -- "${USER_FLAGS[@]}" \
        "${BENCH_FLAGS[@]}" > "$FS/size$GIB.json" 2> "$FS/size$GIB.err"
      COLUMNS=200 $PY -m expertcache_cli size --model "$MODEL" --vram "$GIB" -- \
        "${USER_FLAGS[@]}" "${BENCH_FLAGS[@]}" > "$OUT/size$GIB.txt" 2>&1
      [ -f "$FS/plan$GIB.json" ] || COLUMNS=200 $PY -m expertcache_cli plan "$FIT" \
        --model "$MODEL" --vram "$GIB" --probe "$FS/probe.json" --resident-tok-s "$R" \
        --save "$FS/plan$GIB.json" -- "${USER_FLAGS[@]}" "${BENCH_FLAGS[@]}" \
        > "$FS/plan$GIB.txt" 2>&1
      cp "$FS/plan$GIB.txt" "$OUT/" 2>/dev/null; cat "$FS/plan$GIB.txt"
      if mapfile -t CMD < <($PY bench/flagship_report.py --serve-argv "$FS/plan$GIB.json") \
          && [ "${#CMD[@]}" -gt 0 ]; then
        SERVE=("$PY" -m expertcache_cli "${CMD[@]}" "${SERVER_FLAGS[@]}")
      else  # no budget fits (or no plan): serve's own choice, which the report says
        echo "card$GIB: plan recommended no command; serving as serve plans it"
        SERVE=("$PY" -m expertcache_cli serve "$MODEL" --vram "$GIB" -- "${USER_FLAGS[@]}"
               "${BENCH_FLAGS[@]}" "${SERVER_FLAGS[@]}")
      fi
      # the floor's start once first: a configuration's first start compiles the model and
      # parts from warm ones at near-ties, so neither compared server may be it; it measures
      # nothing else, so it logs what vLLM's "Model loading took" is made of
      # (bench/loaded_memory.py: the plan's weights beside vLLM's)
      arm "warm$GIB" --warm-only --env EXPERT_CACHE_DISABLE=1 --env EC_BENCH_LOADED=1 \
        -- "${SERVE[@]}"
      arm "floor$GIB" --env EXPERT_CACHE_DISABLE=1 -- "${SERVE[@]}"
      arm "cache$GIB" --env EXPERT_CACHE_STATS=400 -- "${SERVE[@]}"
      ballast stop ;;
    report)
      $PY bench/flagship_report.py "$FS" | tee "$OUT/flagship.txt" ;;
    *)
      echo "unknown step $step" ;;
  esac
done
save
cp "$FS"/plan*.json "$FS"/size*.json "$OUT/" 2>/dev/null
echo "steps '$STEPS' done after $SECONDS s"
