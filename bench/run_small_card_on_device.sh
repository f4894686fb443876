#!/usr/bin/env bash
# On the GPU box: the cache on cards that really are too small, emulated on the
# H200 with bench/ballast.py, for the brief's own model (Qwen3-30B-A3B shape, 48 layers,
# W8A8 INT8 as compressed-tensors, per-layer seeded routers, real vocabulary). The headline
# table (floor, cache, resident on both cards) with a real model's routing replayed into
# every server is bench/run_headline_on_device.sh's.
#
# Re-entrant and split in steps so that each call stays under a caller's time limit
# (STEPS="setup ckpt probe acct" then "card24" then "resident card16"); an arm whose JSON
# already says ok is not run again. Results are copied to $OUT after every arm.
# Warm-ups: where a floor (EXPERT_CACHE_DISABLE=1) and a cache server of one command are
# compared (greedy tokens, KV), the floor's command and environment is started once before
# them (bench/small_card.py --warm-only, one 4-token request; acct_warm, warm24) while
# either is still to run: vLLM's first start of a configuration compiles the model, which
# parts from later starts at near-ties (and a cold start's compile can take room from the
# KV cache), so neither server compared may be it.
#
#   acct      the memory-plan check on the whole GPU: the 8-layer bf16 shape (dummy
#             weights) at --gpu-memory-utilization 0.3, 120 slots vs the same server
#             with EXPERT_CACHE_DISABLE=1: KV smaller by the slot bytes, used memory
#             near 0.3 x total (after the warm-up acct_warm, ~1 min)
#   card24    ballast leaves 24 GiB; `expertcache size` and `serve --dry-run` for the
#             flags; the warm-up warm24 (a 48-layer start more, ~2 min), the floor (serve
#             with EXPERT_CACHE_DISABLE=1) and the cache (serve as planned, 5 concurrent
#             streams at the end: the padding check)
#   resident  the ceiling: every expert in VRAM on the whole H200 (no ballast)
#   card16    ballast leaves 16 GiB: what size and serve say, and that it serves as said
#   pad       what CUDA-graph padding costs where vLLM does not mark padded rows (0.26's
#             V1 runner): the 8-layer random-router checkpoint, 64 slots, 5 streams of 200
#             tokens, once as vLLM runs them (padded to its 8-graph: 3 rows of dummy
#             tokens route and install like real ones) and once with an exact 5-graph
#             (--cudagraph-capture-sizes 1 2 4 5 8); requests, installs and tok/s compared
#   wide24    the 24 GiB card's prefill: TTFT at 512/2048/4096 tokens and 1-8 stream decode,
#             cache in place vs `serve --wide staged-install` (scratch in the plan)
#   predict   the prediction on one checkpoint: resident, cache24's live installs a token
#             and the probed gather rate against cache24q's tok/s (needs probe, card24,
#             resident, card24b)
#   mem24     where a staged W8A8 server's profile-run memory goes: vLLM's breakdown and
#             per-call CUDA memory peaks (bench/kernel_trial EC_BENCH_MEM), in place, staged,
#             and in place again with vLLM's compile cache warm (does compiling in the
#             profile step cost KV?); MEM24="inplace staged nocheck inplace2" adds staged
#             without the first-call check (EC_BENCH_NO_CHECK)
#   card24b   the 24 GiB card again: a second floor server (are its greedy tokens its own
#             from run to run?), the cache without EXPERT_CACHE_STATS (tok/s with no
#             periodic reports at all, for the prediction), and the cache on vLLM's V2 model
#             runner refused by serve on a vLLM whose V2 runner cannot offload (0.26); card24's
#             command, so its warm-up warm24 serves here too (run here where card24's did not)
# PY, SC (arm records: /tmp/sc) and MODEL_DIR (checkpoints: /tmp) are overridable: the
# flow is tested on CPU with stubbed GPU steps (tests/bench/test_bench_small_card_runner.py).
set -uo pipefail
OUT="${OUT:-out}"
export SC="${SC:-/tmp/sc}"
mkdir -p "$OUT" "$SC"
source bench/_device_vllm.sh
STEPS="${STEPS:-setup ckpt probe acct card24 resident card16}"
MD="${MODEL_DIR:-/tmp}"
MODEL=$MD/w8a8
PY="${PY:-python3}"
VLLM=("$PY" -m vllm.entrypoints.cli.main)
COMMON=(--attention-backend TRITON_ATTN --seed 0 --host 127.0.0.1 --port "{port}"
        --shutdown-timeout 10)

save() { bench_save "$SC"; }
arm() { bench_arm "$SC" bench/small_card.py "$@"; }  # arm NAME [options] -- server command
arm_done() { [ -f "$SC/$1.json" ] && grep -q '"status": "ok"' "$SC/$1.json"; }
ballast() {  # ballast GiB | ballast stop
  if [ "$1" = stop ]; then $PY bench/ballast.py stop; return; fi
  $PY bench/ballast.py stop >/dev/null
  $PY bench/ballast.py start --leave "$1" | tee "$OUT/ballast$1.json"
  nvidia-smi --query-gpu=memory.used,memory.free,memory.total --format=csv | tee -a "$OUT/ballast$1.smi"
}
plan_card() {  # plan_card GiB: size and serve's dry run for the card, to $OUT
  $PY -m expertcache_cli size --model "$MODEL" --vram "$1" --json -- --max-model-len 8192 \
    > "$OUT/size$1.json"
  cp "$OUT/size$1.json" "$SC/"  # (a later call's predict step reads it there)
  SAFE=$($PY -c "import json;print(json.load(open('$OUT/size$1.json'))['safe_max_num_seqs'])")
  COLUMNS=200 $PY -m expertcache_cli size --model "$MODEL" --vram "$1" -- --max-model-len 8192 \
    --max-num-seqs "$SAFE" > "$OUT/size$1.txt" 2>&1
  $PY -m expertcache_cli serve "$MODEL" --vram "$1" --dry-run -- --max-model-len 8192 \
    --max-num-seqs "$SAFE" "${COMMON[@]}" > "$OUT/serve$1.txt" 2>&1
  echo "card $1 GiB: safe --max-num-seqs $SAFE; serve said:"; cat "$OUT/serve$1.txt"
}

for step in $STEPS; do
  case $step in
    setup)
      device_vllm_setup || { echo "setup failed"; exit 1; } ;;
    ckpt)
      if [ ! -f $MODEL/model.safetensors.index.json ]; then
        $PY bench/write_checkpoint.py $MODEL --layers 48 --format w8a8 --vocab 151936 \
          --context 40960 --head-dim 128 2>&1 \
          | tail -3 | tee "$OUT/checkpoint.txt"
      fi
      [ -f $MD/m8/config.json ] || $PY -c "import sys; sys.path.insert(0, 'bench'); \
import e2e_vllm as e; from pathlib import Path; e.write_model(Path('$MD/m8'), 8)"
      df -h /tmp | tail -1 ;;
    probe)
      [ -f "$SC/probe.json" ] || $PY -m expertcache_cli probe-link --only gather,step --model "$MODEL" --save "$SC/probe.json" \
        2>&1 | tail -25 ;;
    acct)
      ACCT=(serve $MD/m8 --vram 141 --slots 120 -- --gpu-memory-utilization 0.3
            --load-format dummy --max-model-len 1024 --max-num-seqs 4 "${COMMON[@]}")
      # the floor's start once first: a configuration's first start compiles the model (its
      # tokens part from warm starts' at near-ties, its KV can be smaller), so neither
      # compared server may be it
      if ! arm_done acct_cache || ! arm_done acct_off; then
        arm acct_warm --warm-only --env EXPERT_CACHE_DISABLE=1 \
          -- "$PY" -m expertcache_cli "${ACCT[@]}"
      fi
      arm acct_cache --runs 1 --max-tokens 32 -- "$PY" -m expertcache_cli "${ACCT[@]}"
      arm acct_off --runs 1 --max-tokens 32 --env EXPERT_CACHE_DISABLE=1 \
        -- "$PY" -m expertcache_cli "${ACCT[@]}" ;;
    card24|card16)
      GIB=${step#card}
      ballast "$GIB"
      plan_card "$GIB"
      SERVE=(serve "$MODEL" --vram "$GIB" -- --max-model-len 8192 --max-num-seqs "$SAFE"
             "${COMMON[@]}")
      if [ "$GIB" = 24 ]; then
        # the floor's start once first: a configuration's first start compiles the model
        # and parts from warm ones at near-ties, so neither compared server may be it
        if ! arm_done floor24 || ! arm_done cache24; then
          arm warm24 --warm-only --env EXPERT_CACHE_DISABLE=1 \
            -- "$PY" -m expertcache_cli "${SERVE[@]}"
        fi
        arm floor24 --runs "${FLOOR_RUNS:-5}" --env EXPERT_CACHE_DISABLE=1 \
          -- "$PY" -m expertcache_cli "${SERVE[@]}"
      fi
      arm "cache$GIB" --streams 5 --env EXPERT_CACHE_STATS=480 \
        -- "$PY" -m expertcache_cli "${SERVE[@]}"
      ballast stop ;;
    wide24)  # prefill on the small card: in place vs staged through the scratch
      ballast 24
      plan_card 24
      VARGS=(-- --max-model-len 8192 --max-num-seqs "$SAFE" "${COMMON[@]}")
      WS=(--prompt-tokens 512 2048 4096 --streams 1 4 8 --greedy-streams 4)
      bench_arm "$SC" bench/wide_steps.py w24in "${WS[@]}" \
        -- "$PY" -m expertcache_cli serve "$MODEL" --vram 24 "${VARGS[@]}"
      bench_arm "$SC" bench/wide_steps.py w24st "${WS[@]}" \
        -- "$PY" -m expertcache_cli serve "$MODEL" --vram 24 --wide staged-install "${VARGS[@]}"
      ballast stop ;;
    mem24)  # where a W8A8 server's profile peak goes on the 24 GiB card
      # (bench/results/memory.md): vLLM's own breakdown and the bench memory hook's
      # per-call peaks, in place / staged / staged without the first-call check; a
      # 4,096-token context so that the staged server starts
      ballast 24
      # inplace2: in place again, last: the first server compiles (torch.compile runs
      # inside vLLM's profile step) and the later ones load vLLM's compile cache; a cold
      # first server peaks ~0.5 GiB above allocated before any MoE call
      # MEM24 picks the servers (the check's cost is measured, 0.02 GiB: nocheck is left
      # out unless asked for)
      declare -A m24=([inplace]=- [staged]=--wide=staged-install
                      [nocheck]=--wide=staged-install [inplace2]=-)
      for name in ${MEM24:-inplace staged inplace2}; do
        wide=${m24[$name]:-}; [ -z "$wide" ] && { echo "mem24: no server $name"; continue; }
        [ "$wide" = - ] && wide=""
        extra=(); [ "$name" = nocheck ] && extra+=(EC_BENCH_NO_CHECK=1)
        bench_mem_server "$name" "$SC/mem24$name.log" "$OUT/mem24.txt" "${extra[@]}" -- \
          $PY -m expertcache_cli serve "$MODEL" --vram 24 ${wide/=/ } -- \
          --max-model-len 4096 --max-num-seqs 8 --attention-backend TRITON_ATTN --seed 0 \
          --host 127.0.0.1 --port 8711
      done
      cp "$SC"/mem24*.log "$OUT/" 2>/dev/null
      ballast stop ;;
    card24b)
      ballast 24
      plan_card 24
      SERVE=(serve "$MODEL" --vram 24 -- --max-model-len 8192 --max-num-seqs "$SAFE"
             "${COMMON[@]}")
      # card24's command: its warm-up (done there, or here first) keeps both starts warm
      if ! arm_done floor24b || ! arm_done cache24q; then
        arm warm24 --warm-only --env EXPERT_CACHE_DISABLE=1 \
          -- "$PY" -m expertcache_cli "${SERVE[@]}"
      fi
      arm floor24b --runs 2 --env EXPERT_CACHE_DISABLE=1 -- "$PY" -m expertcache_cli "${SERVE[@]}"
      arm cache24q --runs 5 -- "$PY" -m expertcache_cli "${SERVE[@]}"
      # vLLM 0.26's V2 runner ignores --cpu-offload-gb (died at load, 2026-12-01): serve
      # must pin V1 by itself and refuse a forced V2, before any server starts
      DRY=("${SERVE[@]:0:4}" --dry-run "${SERVE[@]:4}")
      { $PY -m expertcache_cli "${DRY[@]}" 2>&1 | grep -o "VLLM_USE_V2_MODEL_RUNNER=0"
        VLLM_USE_V2_MODEL_RUNNER=1 $PY -m expertcache_cli "${DRY[@]}"; echo "exit $?"
      } > "$OUT/v2runner.txt" 2>&1
      cat "$OUT/v2runner.txt"
      ballast stop ;;
    pad)
      [ -f $MD/model/model.safetensors.index.json ] || \
        $PY bench/write_checkpoint.py $MD/model --layers 8 2>&1 | tail -1
      PAD=(serve $MD/model --vram 141 --slots 64 -- --max-num-seqs 8 --max-model-len 1024
           "${COMMON[@]}")
      arm pad8 --runs 1 --streams 5 --max-tokens 400 --env EXPERT_CACHE_STATS=40 \
        -- "$PY" -m expertcache_cli "${PAD[@]}"
      arm pad5 --runs 1 --streams 5 --max-tokens 400 --env EXPERT_CACHE_STATS=40 \
        -- "$PY" -m expertcache_cli "${PAD[@]}" --cudagraph-capture-sizes 1 2 4 5 8
      $PY - <<'PY' | tee "$OUT/padding.txt"
import json, os
for name in ("pad8", "pad5"):
    try:
        st = json.load(open(f"{os.environ['SC']}/{name}.json"))["streams"]
        b, a = st["counters_before"], st["counters_after"]
        toks = st["tokens"]
        print(f"{name}: 5 streams {st['tok_s']:.1f} tok/s; per decoded token "
              f"{(a['requests'] - b['requests']) / toks:.1f} requests, "
              f"{(a['installs'] - b['installs']) / toks:.2f} installs (over {toks} tokens)")
    except (OSError, KeyError, TypeError, ZeroDivisionError) as exc:
        print(f"{name}: no numbers ({exc!r})")
PY
      ;;
    predict)  # the issue's check on one checkpoint: tok/s from live installs and the link
      # (plan's own formula: resident time, the all-hit cache step in every layer where
      # the probe measured it, the installs over the link)
      $PY - "$SC/probe.json" <<'PY' | tee "$OUT/predict.txt"
import json, os, sys
from expertcache_cli.planning import planner
def load(name):
    return json.load(open(f"{os.environ['SC']}/{name}.json"))
mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
res, stats, quiet = load("resident"), load("cache24"), load("cache24q")
gbps, src, step = planner.read_probe(sys.argv[1])
step = step or (0.0, "not measured")
b, a = stats["counters_before"], stats["counters_after"]
per_token = (a["installs"] - b["installs"]) / stats["decode_tokens"]
size = json.load(open(sys.argv[1].replace("probe.json", "size24.json")))
layers = a["layers"]
got = mean(quiet["tok_s"])
for name, us in (("without the cache step", 0.0), (f"with the cache step {step[0]:.2f} us",
                                                   step[0])):
    inputs = planner.Inputs(size["bytes_per_expert"], "size", gbps, src, mean(res["tok_s"]),
                            "resident", step_us=us)
    ms = planner.predict_ms(per_token, inputs, float(layers))
    print(f"resident {mean(res['tok_s']):.2f} tok/s; {per_token:.2f} installs a token "
          f"(cache24, live); link {gbps:.1f} GB/s ({src}); {name} x {layers} layers: "
          f"predicted {1000 / ms:.1f} tok/s; measured without stats {got:.2f} "
          f"({got * ms / 1000:.3f} of predicted)")
PY
      ;;
    resident)
      arm resident --env EXPERT_CACHE_DISABLE=1 -- "${VLLM[@]}" serve "$MODEL" \
        --max-model-len 8192 --max-num-seqs 8 --max-num-batched-tokens 2048 "${COMMON[@]}" ;;
  esac
done
save
ls "$SC"/*.json > /dev/null 2>&1 && $PY bench/small_card.py --greedy-report "$SC"/*.json | tee "$OUT/greedy.txt"
echo "steps '$STEPS' done after $SECONDS s"
