#!/usr/bin/env bash
# On the GPU box: wide steps (prefill chunks, decode batches past the slots) in place vs
# staged through the scratch, against the offload floor and the resident ceiling.
# The Qwen3-30B-A3B-shaped bf16 model, LAYERS layers (default 24, as issue 15 asks: at 8 the
# host paces decoding; dummy weights, 16k context), 64 slots, --max-num-seqs 32. One server per arm (bench/wide_steps.py): TTFT at 512/2048/8192
# fresh tokens, decode at 1/4/8/16/32 distinct streams, greedy texts of 8 streams.
#
#   STEPS="setup ckpt plan floor inplace staged resident trace predict" bash bench/run_wide_on_device.sh
#
# mem: in place and staged (MEM_ARMS, default "inplace staged") started only for vLLM's
# memory report, with the bench memory hook (bench_mem_server), to find the staged
# servers' extra profile peak.
# trace/predict: `plan --batch N` against the measured N-stream decode (under TRACE, `trace`
# is skipped and `predict` is bench/wide_served.py: plan's formula on the ids the hook handed
# each server, each round's misses in the cache state the earlier ones left). `trace` records one
# stream's routing (a cache server with EXPERT_CACHE_TRACE) over TRACE_REQUESTS (default 48)
# requests in turn, each of the decode rounds' shape (a fresh 32-word prompt, DECODE_TOKENS
# tokens), so that the re-batched streams are in different requests as the N measured
# streams are (one long request re-batched prices N users as one:
# bench/results/wide-steps.md);
# `predict` runs `plan` on it re-batched to 16 and 32 streams, in place and staged-install
# (and staged without installs where the staged0 arm ran), with
# the resident arm's N-stream rate and this run's probe, and prints each prediction
# beside the inplace/staged arms' measured rate (the issue's bar: within 15%).
#
# TRACE=T.npz (a recording of 128 experts, e.g. traces/real-qwen3-30b-a3b-k6.npz): every
# server's decode steps routed by it (bench/trace_routing.py through the bench's hook, fitted
# to LAYERS by bench/trace_fit.py; up to 32 tokens a step is decode, each stream at its own
# point of the recording), on a checkpoint of the recording's top-k (m<LAYERS>w-k<K>), so
# that the decode rates have a real model's locality. Prefills wider than a recorded row keep
# the dummy routers' ids: a chunk of 512 tokens or more routes every expert of a layer either
# way, so the TTFT columns do not depend on it. Without TRACE: the dummy checkpoint's own
# routers (synthetic routing). The routing goes into wide.md's first line. WSD holds one
# routing's run: another TRACE given to it is refused (exit 2), as is a TRACE that is not a
# file or not of 128 experts, before anything starts.
# An arm whose JSON says ok is not run again; results go to $OUT after every arm. Detached
# past a call's limit: bash bench/detach.sh wide env OUT=/tmp/ow bash bench/run_wide_on_device.sh
# PY, WSD (arm records: /tmp/ws) and MODEL_DIR (/tmp) are overridable: the flow is tested
# on CPU with stubbed GPU steps (tests/bench/test_bench_wide_runner.py).
set -uo pipefail
OUT="${OUT:-out}"
export WSD="${WSD:-/tmp/ws}"
mkdir -p "$OUT" "$WSD"
source bench/_device_vllm.sh
STEPS="${STEPS:-setup ckpt plan floor inplace staged resident trace predict}"
LAYERS="${LAYERS:-24}"
MODEL="${MODEL_DIR:-/tmp}/m${LAYERS}w"
PY="${PY:-python3}"
TRACE="${TRACE:-}"
ROUTE=() K=""
if [ -n "$TRACE" ]; then
  [ -f "$TRACE" ] || { echo "TRACE=$TRACE: no such file (a routing trace .npz)" >&2; exit 2; }
  case $TRACE in /*) ;; *) TRACE=$PWD/$TRACE ;; esac
  read -r K E _ <<< "$($PY bench/trace_fit.py --shape "$TRACE")"
  [ -n "$K" ] || exit 2
  if [ "$E" != 128 ]; then
    echo "TRACE=$TRACE: top-$K of $E experts; the wide steps' shape has 128 experts" >&2
    exit 2
  fi
  MODEL=$MODEL-k$K
  FIT=$WSD/route-$LAYERS.npz
  ROUTE=(--env "EC_BENCH_TRACE_ROUTING=$FIT" --env EC_BENCH_TRACE_STREAMS=32
         --env "PYTHONPATH=$PWD/bench/trace_hook:${PYTHONPATH:-}")
fi
# WSD names the trace as typed in the checkout (traces/NAME.npz), not by this copy's path,
# so a later job from another copy of the tree (a second detached job) goes on with the run
TRACE_ID=${TRACE#"$PWD"/}
if [ -f "$WSD/trace.src" ] && [ "$(cat "$WSD/trace.src")" != "${TRACE_ID:-none}" ]; then
  echo "WSD=$WSD holds a run routed by $(cat "$WSD/trace.src"), not TRACE=${TRACE_ID:-none}:" \
    "give another WSD" >&2
  exit 2
fi
VLLM=("$PY" -m vllm.entrypoints.cli.main)
# one step takes a whole 8,192-token prompt: one chunk, so the TTFT link bound is known
FLAGS=(--load-format dummy --max-model-len 10240 --max-num-seqs 32 --max-num-batched-tokens 8192
       --attention-backend TRITON_ATTN --seed 0 --host 127.0.0.1 --port "{port}"
       --shutdown-timeout 10)
# every expert offloaded: 128 x 9.44 MB = 1.21 GB a layer, and some room
OFFLOAD=(--cpu-offload-gb "${OFFLOAD_GB:-$(( LAYERS * 5 / 4 + 1 ))}" --cpu-offload-params experts)
# DECODE_TOKENS (default 64) a stream in each decode round: at 24 layers the floor and the
# in-place arm decode 32 streams at ~0.5 s a step, and 128 tokens a round would double
# the decode rounds' share of the run
WS=(--vocab 8192 --max-tokens "${DECODE_TOKENS:-64}" ${WS_ARGS:-})

LOG_TAIL=300000
save() { bench_save "$WSD"; }
arm() {
  local name=$1; shift
  bench_arm "$WSD" bench/wide_steps.py "$name" "${WS[@]}" "${ROUTE[@]}" "$@"
}

for step in $STEPS; do
  case $step in
    setup) device_vllm_setup || { echo "setup failed"; exit 1; } ;;
    ckpt)
      [ -f $MODEL/config.json ] || $PY -c "import sys; sys.path.insert(0, 'bench'); \
import e2e_vllm as e; from pathlib import Path; \
e.write_model(Path('$MODEL'), $LAYERS, context=16384, top_k=${K:-None})"
      if [ -n "$TRACE" ]; then
        [ -f "$FIT" ] || $PY bench/trace_fit.py "$TRACE" "$FIT" --layers "$LAYERS" \
          > "$OUT/trace.txt" || exit 1
        $PY bench/trace_fit.py --source "$FIT" > "$WSD/routing.txt"
      else
        echo "the dummy checkpoint's own routers (synthetic routing)" > "$WSD/routing.txt"
      fi
      echo "${TRACE_ID:-none}" > "$WSD/trace.src"
      cp "$WSD/routing.txt" "$OUT/" ;;
    plan)  # what the tools predict for this shape, before the servers say
      COLUMNS=160 $PY -m expertcache_cli size --model $MODEL --vram 141 --slots 64 \
        --wide staged-install -- --max-model-len 10240 --max-num-seqs 32 \
        --max-num-batched-tokens 8192 > "$OUT/size.txt" 2>&1
      $PY -m expertcache_cli size --model $MODEL --vram 141 --slots 64 --json -- \
        --max-model-len 10240 --max-num-seqs 32 --max-num-batched-tokens 8192 \
        > "$WSD/size.json" 2> "$OUT/size.err"
      cp "$WSD/size.json" "$OUT/" 2>/dev/null
      [ -f "$WSD/probe.json" ] || $PY -m expertcache_cli probe-link --only gather,step,stage \
        --model $MODEL --save "$WSD/probe.json" > "$OUT/probe.txt" 2>&1
      tail -5 "$OUT/size.txt" ;;
    floor)
      arm floor --env EXPERT_CACHE_DISABLE=1 -- "${VLLM[@]}" serve $MODEL "${OFFLOAD[@]}" "${FLAGS[@]}" ;;
    inplace)
      arm inplace --env EXPERT_CACHE_SLOTS=64 --env EXPERT_CACHE_STATS=0 \
        -- "${VLLM[@]}" serve $MODEL "${OFFLOAD[@]}" "${FLAGS[@]}" ;;
    staged)
      arm staged --env EXPERT_CACHE_SLOTS=64 --env EXPERT_CACHE_WIDE=staged-install \
        -- "${VLLM[@]}" serve $MODEL "${OFFLOAD[@]}" "${FLAGS[@]}" ;;
    staged0)
      arm staged0 --env EXPERT_CACHE_SLOTS=64 --env EXPERT_CACHE_WIDE=staged \
        -- "${VLLM[@]}" serve $MODEL "${OFFLOAD[@]}" "${FLAGS[@]}" ;;
    mem)  # where the staged servers' extra profile peak goes (bench/results/wide-steps.md:
      # KV up to 0.82 GiB below slots + scratch at 8,192 batched tokens, none at 2,048): in place and staged,
      # each stopped after vLLM's memory report, with the bench memory hook's history
      MF=("${FLAGS[@]/"{port}"/8712}")
      for name in ${MEM_ARMS:-inplace staged}; do
        wide=(); [ $name = staged ] && wide=(EXPERT_CACHE_WIDE=staged-install)
        bench_mem_server "mem$name" "$WSD/mem$name.log" "$OUT/mem.txt" EXPERT_CACHE_SLOTS=64 \
          "${wide[@]}" -- "${VLLM[@]}" serve $MODEL "${OFFLOAD[@]}" "${MF[@]}"
      done
      cp "$WSD"/mem*.log "$OUT/" 2>/dev/null ;;
    resident)
      arm resident --env EXPERT_CACHE_DISABLE=1 -- "${VLLM[@]}" serve $MODEL "${FLAGS[@]}" ;;
    trace)
      if [ -n "$TRACE" ]; then  # the hook replays every request from the same rows
        echo "trace: not recorded under TRACE (predict replays the hook's own ids)"
        continue
      fi
      arm trace1 --env EXPERT_CACHE_SLOTS=64 --env "EXPERT_CACHE_TRACE=$WSD/one.npz" \
        --streams --requests "${TRACE_REQUESTS:-48}" --greedy-streams 0 --prompt-tokens \
        -- "${VLLM[@]}" serve $MODEL "${OFFLOAD[@]}" "${FLAGS[@]}"
      cp "$WSD/one.npz" "$OUT/" 2>/dev/null ;;
    predict)
      if [ -n "$TRACE" ]; then  # plan's formula on the ids the hook handed the servers
        $PY bench/wide_served.py "$FIT" "$WSD" --slots 64 --hook-streams 32 \
          --tokens "${DECODE_TOKENS:-64}" 2> "$OUT/predict.err" | tee "$OUT/predict.txt"
        continue
      fi
      for n in 16 32; do
        R=$($PY -c "import json; print(json.load(open('$WSD/resident.json'))['decode']['$n']['tok_s'])")
        for mode in in-place staged-install staged; do
          [ $mode = staged ] && [ ! -f "$WSD/staged0.json" ] && continue  # not measured
          $PY -m expertcache_cli plan "$WSD/one.npz" --model $MODEL --probe "$WSD/probe.json" \
            --resident-tok-s "$R" --slots 64 --policy lru --batch $n --wide $mode --json \
            > "$OUT/plan-b$n-$mode.json" 2> "$OUT/plan-b$n-$mode.err"
        done
      done
      $PY - <<'PY' | tee "$OUT/predict.txt"
import json, os
out = os.environ.get("OUT", "out")
for n in (16, 32):
    for mode, arm in (("in-place", "inplace"), ("staged-install", "staged"),
                      ("staged", "staged0")):
        if mode == "staged" and not os.path.exists(f"{os.environ['WSD']}/staged0.json"):
            continue
        try:
            plan = json.load(open(f"{out}/plan-b{n}-{mode}.json"))
            pred = plan["rows"][0]["predicted_tok_s"]  # aggregate: R was the aggregate
            meas = json.load(open(f"{os.environ['WSD']}/{arm}.json"))["decode"][str(n)]["tok_s"]
        except (OSError, KeyError, IndexError, ValueError) as exc:
            print(f"{n} streams {mode}: no comparison ({exc})")
            continue
        print(f"{n} streams {mode}: plan --batch {n} predicts {pred:.1f} tok/s, measured "
              f"{meas:.1f} ({meas / pred:.3f})")
PY
      ;;
  esac
done
save
$PY - <<'PY'
import json, os, pathlib
rows = {}
for p in sorted(pathlib.Path(os.environ["WSD"]).glob("*.json")):
    r = json.loads(p.read_text())
    if isinstance(r, dict) and "arm" in r:  # an arm's record (probe.json lies there too)
        rows[r["arm"]] = r
for name, r in rows.items():
    ttft = {n: (round(1000 * v["median_s"], 1) if v.get("median_s") else None)
            for n, v in (r.get("ttft") or {}).items()}
    dec = {n: round(v["tok_s"], 1) for n, v in (r.get("decode") or {}).items()}
    print(name, r.get("status"), "TTFT ms", ttft, "decode tok/s", dec)
    print("   final:", (r.get("log") or {}).get("final"))
if "inplace" in rows and "staged" in rows:
    same = rows["inplace"].get("greedy") == rows["staged"].get("greedy")
    print("greedy texts, 16 streams (decode wider than the slots): in place == staged:", same)
PY
# issue 15's tables and goals (TTFT against the link bound, decode against the floor)
if [ -f "$WSD/size.json" ] && [ -f "$WSD/probe.json" ]; then
  { echo "Routing of every server's decode: $(cat "$WSD/routing.txt" 2>/dev/null || echo unknown)"
    echo
    $PY bench/wide_report.py "$WSD" --size "$WSD/size.json" --probe "$WSD/probe.json" \
      --slots 64 2>&1; } | tee "$OUT/wide.md"
fi
echo "steps '$STEPS' done after $SECONDS s"
