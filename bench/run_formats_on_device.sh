#!/usr/bin/env bash
# The weight formats users download, served with experts offloaded on the GPU box: for each
# format an 8-layer checkpoint of the Qwen3-30B-A3B expert shape (bench/write_checkpoint.py,
# per-layer seeded routers), then one server without the cache (EXPERT_CACHE_DISABLE=1: the
# floor and the reference tokens) and one with 32 slots: the plugin's startup line (armed,
# with the tensors it mirrors, or declined with the reason), decode tok/s, greedy tokens.
#   FORMATS="w8a8 fp8-block w4a16 gptq awq nvfp4" bash bench/run_formats_on_device.sh
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT" /tmp/fm
source bench/_device_vllm.sh
PY=python3
COMMON=(--attention-backend TRITON_ATTN --seed 0 --host 127.0.0.1 --port "{port}"
        --shutdown-timeout 10 --max-model-len 1024 --max-num-seqs 4)
device_vllm_setup || { echo "setup failed"; exit 1; }
for fmt in ${FORMATS:-w8a8 fp8-block w4a16 gptq awq nvfp4}; do
  M=/tmp/fm/$fmt
  [ -f $M/model.safetensors.index.json ] || $PY bench/write_checkpoint.py $M --layers 8 \
    --format "$fmt" --vocab 151936 --context 40960 --head-dim 128 2>&1 | tail -1
  SERVE=(serve "$M" --vram 141 --slots 32 -- "${COMMON[@]}")
  ARMS="floor cache"
  # 4-bit formats run on Marlin in vLLM 0.26 (not yet among the kernels the plugin arms):
  # a third arm tries it through the bench-only hook (bench/kernel_trial), first-call
  # checked against the stock path like every armed layer
  case $fmt in w4a16|gptq|awq) ARMS="floor cache trial" ;; esac
  for arm in $ARMS; do
    name="$fmt-$arm"
    if [ -f "/tmp/fm/$name.json" ] && grep -q '"status": "ok"' "/tmp/fm/$name.json"; then
      continue
    fi
    env=(--env EXPERT_CACHE_STATS=400)
    [ $arm = floor ] && env=(--env EXPERT_CACHE_DISABLE=1)
    [ $arm = trial ] && env+=(--env EC_BENCH_TRY_KERNELS=MarlinExperts
                              --env "PYTHONPATH=$PWD/bench/kernel_trial:$PYTHONPATH")
    $PY bench/small_card.py "$name" --out /tmp/fm --runs 3 "${env[@]}" \
      -- "$PY" -m expertcache_cli "${SERVE[@]}" | tail -20
    cp /tmp/fm/"$name".json "$OUT/"; tail -c 200000 /tmp/fm/"$name".log > "$OUT/$name.log"
  done
  $PY - "$fmt" <<'EOF' | tee -a "$OUT/formats.txt"
import json, sys
sys.path.insert(0, "bench")
from small_card import compare_greedy, describe
fmt = sys.argv[1]
import os
f = json.load(open(f"/tmp/fm/{fmt}-floor.json"))
mean = lambda r: sum(r.get("tok_s") or [0]) / max(1, len(r.get("tok_s") or []))  # noqa: E731
for arm in ("cache", "trial"):
    if not os.path.exists(f"/tmp/fm/{fmt}-{arm}.json"):
        continue
    c = json.load(open(f"/tmp/fm/{fmt}-{arm}.json"))
    lg = c.get("log") or {}
    same = (describe(compare_greedy(f["greedy"], c["greedy"]))
            if f.get("greedy") and c.get("greedy") else "no greedy tokens")
    print(f"{fmt} {arm}: floor {mean(f):.1f} tok/s, {arm} {mean(c):.1f}; greedy {same}; "
          f"{lg.get('startup_line') or 'no startup line'}; {lg.get('check_line') or ''}; "
          f"declined: {(lg.get('declined') or ['-'])[0]}")
EOF
done
echo "done after $SECONDS s"
