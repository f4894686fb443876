#!/usr/bin/env bash
# On the GPU box: the headline small-card table (issue 30) with a real model's routing.
# Qwen3-30B-A3B's shape (48 layers, its own attention, 128 experts, W8A8 INT8 as a
# compressed-tensors checkpoint, random weights, the real vocabulary) on an emulated 24 and
# 16 GiB card (bench/ballast.py holds the rest of the H200): the offload floor, the cache at
# the slots `serve` plans, and resident (every expert in VRAM on the whole H200).
#
# Routing: every server replays TRACE (bench/trace_routing.py; default the published table's,
# traces/real-gpt-oss-120b-k4.npz, gpt-oss-120b's own routers on four prompts; the
# one-recording table's is traces/real-qwen3-30b-a3b-k6.npz, Qwen3-30B-A3B's on one), fitted to
# the 48 layers (bench/trace_fit.py --layers 48: layer i routes as trace layer i mod L; the
# Qwen3 recording has 48), each request from the trace's row 0 (its prefill: the bench
# prompt's 16 tokens take row 0's first 16 tokens' experts), then a row a decoded token (a
# 200-token request replays the 128 recorded decode rows, then cycles from row 0 again).
# The checkpoint is written at the trace's top-k (bench/write_checkpoint.py --top-k): 6 for
# the Qwen3 recording, the width the model ran at when it was recorded (its config says 8;
# the recording used --n-expert-used 6), so each token's experts are exactly the recorded
# ones, not a narrowing of them (the hook replaces a router's ids only where the widths
# agree). The resident server replays it too, so that every server's greedy tokens compare.
# A trace of several recorded requests (traces/real-gpt-oss-120b-k4.npz: four prompts) is
# served prompts growing by 8 words a request (small_card.py --prompt-cycle), so that
# consecutive requests replay different recorded conversations, and plan is told so.
# TRACE=none: no trace, the checkpoint's own per-layer seeded routers at top-8 (synthetic
# routing: the earlier table's). The report prints the routing source and the width.
#
# The servers, as a user types them (bench/run_first_start_on_device.sh's way):
#   warm      the floor's command and environment, started once before floor and cache
#             (bench/small_card.py --warm-only: one 4-token request): vLLM's first start of
#             a configuration compiles the model and parts from later starts at near-ties,
#             so the two servers compared both load what it compiled
#   floor     `expertcache serve MODEL --vram N -- --max-model-len 8192` with
#             EXPERT_CACHE_DISABLE=1: the same command, the cache off (FLOOR_RUNS, default 3)
#   cache     the same command (serve plans the slots and the batch), EXPERT_CACHE_STATS=480
#             for the live hit rate over the runs (RUNS, default 5)
#   resident  `vllm serve MODEL` on the whole H200, the plugin off (RUNS)
# each with the bench's flags after them (the bundle's attention backend, a seed, the
# port); one server per arm (bench/small_card.py: a warm-up, the runs of 200 tokens, the
# greedy tokens twice), its JSON record and log kept in $HL and copied to $OUT.
#
# Steps (STEPS, default all; re-entrant: an arm whose JSON says ok is not run again, a card
# whose two arms are done is skipped), with the minutes each is expected to take on the H200:
#   setup     the vLLM bundle, this package (1-2)
#   model     the trace's shape (its top-k), the 48-layer W8A8 checkpoint at that top-k
#             (~0.7), the trace fitted to 48 layers
#   probe     probe-link --only gather,step at the checkpoint's slab (1.5), for plan
#   resident  every expert in VRAM (a 48-layer W8A8 first start 3.5-4.5, runs <0.5)
#   card24    ballast leaves 24 GiB; `size --json` and `serve --dry-run` (what serve plans),
#             then the warm-up, floor and cache (the warm-up's start compiles, 3-4.5; the
#             floor's and the cache's load the compiled model, ~2 each; the floor's runs ~1)
#             (10-12)
#   card16    the same on 16 GiB (10-12)
#   plan      CPU only: `plan` on the ids each card's cache server was handed, at the
#             slots it armed, with the probe and resident's rate (plan24.json, plan16.json)
#   report    bench/headline_report.py: the table, the routing, the greedy tokens, each
#             cache arm against plan's prediction, to $OUT/headline.md
# ~24-30 device minutes in all: one detached job, polled every ~4.5 minutes (or split, below):
#   bash bench/detach.sh headline env OUT=/tmp/ohl bash bench/run_headline_on_device.sh
#   RESULTS=/tmp/ohl bash bench/detach.sh --poll headline 280
# Split over two jobs on one box: the second, STEPS="card16 plan report" with the same TRACE
# (as typed in the checkout), goes on from the records HL kept, whatever copy it runs from.
# Split over two sessions (the box keeps nothing between them): STEPS="setup model probe
# resident card24 plan report", then SEED=DIR STEPS="setup model probe resident card16 plan
# report", where DIR (a folder in the carried tree) holds the first session's records (from
# its results.tgz: probe.json, resident.json and .log, and a card's floor, cache, size and
# serve records): copied into HL where HL lacks them, a seeded step is not run again
# (resident ~4-5 min, a card ~10), and the report names what came from the earlier session.
# Seed only records of the same GPU model: the report names this run's GPU.
# An unknown step or a TRACE that is not a file: one line, exit 2, before anything starts; a
# trace of other than 128 experts: one line, exit 2, at the model step. HL (records:
# /tmp/hl) holds one routing's run: another TRACE given to it is refused (exit 2).
# PY, HL, MODEL_DIR (checkpoints: /tmp), TRACE, RUNS and FLOOR_RUNS are overridable: the
# flow is tested on CPU with the GPU steps stubbed (tests/bench/test_bench_headline_runner.py).
set -uo pipefail
OUT="${OUT:-out}"
HL="${HL:-/tmp/hl}"
STEPS="${STEPS:-setup model probe resident card24 card16 plan report}"
PY="${PY:-python3}"
MD="${MODEL_DIR:-/tmp}"
TRACE="${TRACE-traces/real-gpt-oss-120b-k4.npz}"
LAYERS=48
for step in $STEPS; do
  case $step in
    setup|model|probe|resident|card24|card16|plan|report) ;;
    *) echo "STEPS: unknown step $step (setup model probe resident card24 card16 plan report)" >&2
       exit 2 ;;
  esac
done
if [ "$TRACE" != none ]; then
  if [ ! -f "$TRACE" ]; then
    echo "TRACE=$TRACE: no such file (a routing trace .npz, or none: the checkpoint's own" \
      "routers)" >&2
    exit 2
  fi
  case $TRACE in /*) ;; *) TRACE=$PWD/$TRACE ;; esac
fi
# HL names the trace as typed in the checkout (traces/NAME.npz), not by this copy's path, so
# a later job from another copy of the tree (a second detached job) goes on with the run
TRACE_ID=${TRACE#"$PWD"/}
if [ -f "$HL/trace.src" ] && [ "$(cat "$HL/trace.src")" != "$TRACE_ID" ]; then
  echo "HL=$HL holds a run routed by $(cat "$HL/trace.src"), not TRACE=$TRACE_ID: give another" \
    "HL" >&2
  exit 2
fi
mkdir -p "$OUT" "$HL"
source bench/_device_vllm.sh
bench_seed "$HL" resident.json resident.log probe.json \
  floor24.json floor24.log cache24.json cache24.log size24.json serve24.txt \
  floor16.json floor16.log cache16.json cache16.log size16.json serve16.txt
# what a user on a small card gives (a context that leaves room for slots), and the bench's
# own (the bundle has no FlashAttention binaries; the seed; the port the runner picks)
USER_FLAGS=(--max-model-len 8192)
SERVER_FLAGS=(--attention-backend TRITON_ATTN --seed 0 --host 127.0.0.1 --port "{port}"
              --shutdown-timeout 10)
FIT=$HL/route-$LAYERS.npz
route=()

save() { bench_save "$HL"; }
arm_done() { [ -f "$HL/$1.json" ] && grep -q '"status": "ok"' "$HL/$1.json"; }
arm() { bench_arm "$HL" bench/small_card.py "$@"; }  # arm NAME [options] -- server command
ballast() {  # ballast GiB | ballast stop
  if [ "$1" = stop ]; then $PY bench/ballast.py stop; return; fi
  $PY bench/ballast.py stop >/dev/null
  $PY bench/ballast.py start --leave "$1" | tee "$OUT/ballast$1.json"
}
# the model the model step wrote, and every server's routing: sets MODEL and `route`
served() {
  MODEL=$(cat "$HL/model.path" 2>/dev/null) || { echo "no model: run the model step"; return 1; }
  route=()
  [ "$TRACE" = none ] || route=(--env "EC_BENCH_TRACE_ROUTING=$FIT"
                                --env "PYTHONPATH=$PWD/bench/trace_hook:${PYTHONPATH:-}")
  # a recording of several requests: consecutive requests replay them in turn
  # (small_card.py --prompt-cycle)
  local n
  n=$(requests)
  [ "$n" -gt 1 ] && route+=(--prompt-cycle "$n")
  return 0
}
requests() {  # the recorded requests of the trace (the fitted one keeps them; 1 without)
  local n=1
  [ "$TRACE" = none ] || read -r _ _ _ n <<< "$($PY bench/trace_fit.py --shape "$TRACE")"
  echo "${n:-1}"
}

for step in $STEPS; do
  echo "== step $step ($SECONDS s)"
  case $step in
    setup)
      device_vllm_setup || { echo "setup failed"; exit 1; }
      # the GPU every server of this run shares (the report names it in the resident row)
      [ -f "$OUT/env.txt" ] && head -1 "$OUT/env.txt" | cut -d, -f1 > "$HL/gpu.txt"
      true ;;
    model)
      K=8
      if [ "$TRACE" != none ]; then
        shape=$($PY bench/trace_fit.py --shape "$TRACE") || exit 2
        read -r K E _ <<< "$shape"
        if [ "$E" != 128 ]; then
          echo "TRACE=$TRACE: top-$K of $E experts; the checkpoint has 128 experts" >&2
          exit 2
        fi
      fi
      M=$MD/w8a8; topk=()
      [ "$K" = 8 ] || { M=$MD/w8a8-k$K; topk=(--top-k "$K"); }
      [ -f "$M/model.safetensors.index.json" ] || \
        $PY bench/write_checkpoint.py "$M" --layers "$LAYERS" --format w8a8 --vocab 151936 \
          --context 40960 --head-dim 128 "${topk[@]}" 2>&1 | tail -2 | tee "$OUT/checkpoint.txt"
      if [ "$TRACE" != none ]; then
        [ -f "$FIT" ] || $PY bench/trace_fit.py "$TRACE" "$FIT" --layers "$LAYERS" \
          | tee "$OUT/trace.txt" || exit 1
        $PY bench/trace_fit.py --source "$FIT" > "$HL/routing.txt"
      else
        echo "no trace: the checkpoint's own per-layer seeded routers (synthetic routing)" \
          > "$HL/routing.txt"
      fi
      echo "$M" > "$HL/model.path"
      echo "$TRACE_ID" > "$HL/trace.src"
      df -h /tmp | tail -1 ;;
    probe)
      served || exit 1
      [ -f "$HL/probe.json" ] || $PY -m expertcache_cli probe-link --only gather,step \
        --model "$MODEL" --save "$HL/probe.json" 2>&1 | tail -4 | tee "$OUT/probe.txt"
      cp "$HL/probe.json" "$OUT/" 2>/dev/null ;;
    resident)
      served || exit 1
      arm resident --runs "${RUNS:-5}" --env EXPERT_CACHE_DISABLE=1 "${route[@]}" \
        -- "$PY" -m vllm.entrypoints.cli.main serve "$MODEL" --max-model-len 8192 \
        --max-num-seqs 8 --max-num-batched-tokens 2048 "${SERVER_FLAGS[@]}" ;;
    card24|card16)
      GIB=${step#card}
      if arm_done "floor$GIB" && arm_done "cache$GIB"; then echo "card$GIB: done before"; continue; fi
      served || exit 1
      ballast "$GIB"
      # what serve will plan on this card, as the user sees it
      $PY -m expertcache_cli size --model "$MODEL" --vram "$GIB" --json -- "${USER_FLAGS[@]}" \
        > "$HL/size$GIB.json" 2> "$HL/size$GIB.err"
      COLUMNS=200 $PY -m expertcache_cli serve "$MODEL" --vram "$GIB" --dry-run \
        -- "${USER_FLAGS[@]}" > "$HL/serve$GIB.txt" 2>&1
      cp "$HL/serve$GIB.txt" "$OUT/"; cat "$HL/serve$GIB.txt"
      SERVE=("$PY" -m expertcache_cli serve "$MODEL" --vram "$GIB" -- "${USER_FLAGS[@]}"
             "${SERVER_FLAGS[@]}")
      # the floor's start once first: a configuration's first start compiles the model and
      # parts from warm ones at near-ties, so neither compared server may be it
      arm "warm$GIB" --warm-only --env EXPERT_CACHE_DISABLE=1 "${route[@]}" -- "${SERVE[@]}"
      arm "floor$GIB" --runs "${FLOOR_RUNS:-3}" --env EXPERT_CACHE_DISABLE=1 "${route[@]}" \
        -- "${SERVE[@]}"
      arm "cache$GIB" --runs "${RUNS:-5}" --env EXPERT_CACHE_STATS=480 "${route[@]}" \
        -- "${SERVE[@]}"
      ballast stop ;;
    plan)
      # plan's prediction for each card's cache arm, on the ids its server was handed: one
      # stream, a warm-up and the arm's N runs of 200 tokens, each from the trace's row 0 (a
      # recording shorter than a request cycled as the hook cycles it); CPU only
      if [ "$TRACE" = none ]; then echo "plan: TRACE=none: plan predicts on a trace"; continue; fi
      [ -f "$HL/probe.json" ] || { echo "plan: no probe.json (the probe step)"; continue; }
      R=$($PY bench/flagship_report.py --rate "$HL/resident.json") || {
        echo "plan: no resident rate (the resident step)"; continue; }
      for GIB in 24 16; do
        arm_done "cache$GIB" && [ ! -s "$HL/plan$GIB.json" ] || continue
        read -r S N < <($PY bench/headline_report.py --served "$HL/cache$GIB.json") && \
          [ -n "${N:-}" ] || {
          echo "card$GIB: the cache arm armed no slots: nothing to predict"; continue; }
        NREQ=$(requests) prompts=()
        [ "$NREQ" -gt 1 ] && \
          prompts=(--prompt-tokens "$($PY bench/small_card.py --print-prompt-tokens "$NREQ")")
        $PY bench/trace_fit.py "$TRACE" "$HL/served$GIB.npz" --layers "$LAYERS" \
          --size "$HL/size$GIB.json" --streams 1 --steps $(( (N + 1) * 200 )) \
          --request-steps 200 --decode-only "${prompts[@]}" > /dev/null || {
          echo "card$GIB: trace_fit failed"; continue; }
        if $PY -m expertcache_cli plan "$HL/served$GIB.npz" --probe "$HL/probe.json" \
            --resident-tok-s "$R" --slots "$S" --policy lru --json \
            > "$HL/plan$GIB.json.part" 2> "$HL/plan$GIB.err"; then
          mv "$HL/plan$GIB.json.part" "$HL/plan$GIB.json"
        else
          echo "card$GIB: plan failed: $(tail -1 "$HL/plan$GIB.err")"
        fi
      done ;;
    report)
      $PY bench/headline_report.py "$HL" | tee "$OUT/headline.md" ;;
  esac
done
save
cp "$HL"/size*.json "$HL"/serve*.txt "$HL"/plan*.json "$HL"/routing.txt "$OUT/" 2>/dev/null
echo "steps '$STEPS' done after $SECONDS s"
