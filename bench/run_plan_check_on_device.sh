#!/usr/bin/env bash
# `expertcache plan` predicted vs `expertcache baseline` measured, on the GPU box: the
# served model's routing is replayed from a trace (bench/trace_routing.py, bench only), so
# the measured tok/s and the prediction see the same workload.
#
# For each trace (two synthetic ones with different locality, 8 layers of the
# Qwen3-30B-A3B expert shape: tasks = phases of hot experts, zipf = one skewed popularity):
# one baseline over resident, offload and three cache budgets (one server per arm and
# trace: device time), then `plan` on the same trace with the saved probe and that
# baseline's resident arm. Results and a comparison table in $OUT. Re-entrant: a trace
# whose baseline file is complete is not run again (--resume continues a partial one).
#   TRACES="tasks zipf" ARMS=... RUNS=3 bash bench/run_plan_check_on_device.sh
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT" /tmp/pc
source bench/_device_vllm.sh
PY=python3
LAYERS=8
SLOTS="${SLOTS:-16,32,64}"
ARMS="${ARMS:-resident,offload,cache:16,cache:32,cache:64}"

device_vllm_setup || { echo "setup failed"; exit 1; }
[ -f /tmp/model/model.safetensors.index.json ] || \
  $PY bench/write_checkpoint.py /tmp/model --layers $LAYERS 2>&1 | tail -1
[ -f /tmp/pc/probe.json ] || $PY -m expertcache_cli probe-link --model /tmp/model \
  --save /tmp/pc/probe.json > "$OUT/probe.txt" 2>&1
cp /tmp/pc/probe.json "$OUT/"

for kind in ${TRACES:-tasks zipf}; do
  T=/tmp/pc/$kind.npz
  [ -f "$T" ] || $PY -m expertcache_cli trace synth "$T" --kind "$kind" --steps 4000 \
    --layers $LAYERS --experts 128 --top-k 8 --seed 7 --expert-bytes 9437184 \
    --model "qwen3-30b-a3b shape, 8 layers" > /dev/null
  RESUME=()
  [ -s "/tmp/pc/bl-$kind.jsonl" ] && RESUME=(--resume)
  EC_BENCH_TRACE_ROUTING="$T" PYTHONPATH="$PWD/bench/trace_hook:$PYTHONPATH" \
    timeout -s INT -k 60 "${BL_SECONDS:-540}" $PY -m expertcache_cli baseline /tmp/model \
      --arms "$ARMS" --restarts 1 --runs "${RUNS:-3}" --max-tokens 200 --cpu-offload-gb 10 \
      --start-timeout 400 --stop-grace 20 --out "/tmp/pc/bl-$kind.jsonl" "${RESUME[@]}" \
      -- --attention-backend TRITON_ATTN --max-num-seqs 4 --max-model-len 1024 --seed 0 \
      2>&1 | tail -30
  cp "/tmp/pc/bl-$kind.jsonl" "$OUT/"
  $PY -m expertcache_cli plan "$T" --model /tmp/model --probe /tmp/pc/probe.json \
    --baseline "/tmp/pc/bl-$kind.jsonl" --slots "$SLOTS" --policy lru --json \
    > "$OUT/plan-$kind.json" 2> "$OUT/plan-$kind.err"
  $PY - "$OUT/plan-$kind.json" "/tmp/pc/bl-$kind.jsonl" <<'EOF' | tee "$OUT/compare-$kind.txt"
import json, sys
from expertcache_cli.baseline.runner import load_summary
plan = json.load(open(sys.argv[1]))
summary, _ = load_summary(sys.argv[2])
for row in plan["rows"]:
    arm = next((a for a in summary.arms if a.arm == f"cache:{row['slots']}"), None)
    if arm is None or arm.restarts == 0:
        continue
    ratio = arm.mean_tok_s / row["predicted_tok_s"]
    live = (arm.counters or {}).get("hit_rate")
    print(f"{row['policy']} {row['slots']:>3} slots: predicted {row['predicted_tok_s']:.1f} "
          f"tok/s, measured {arm.mean_tok_s:.1f} ({ratio:.3f}); hit rate live "
          f"{live if live is not None else float('nan'):.3f}, replayed "
          f"{1 - row['miss_rate']:.3f}")
EOF
done
echo "done after $SECONDS s"
