#!/usr/bin/env bash
# `expertcache baseline` on the GPU box: resident vs offload vs the cache at two budgets,
# 3 restarts, on an 8-layer Qwen3-30B-A3B-shaped random-weight checkpoint.
#
# 12 server starts can outlast a caller's time limit, so this script is re-entrant: run it again (same machine, still warm) and it goes on with
# `--resume` from the results file in /tmp/bl. Each call: write the checkpoint if absent,
# install the vLLM bundle if absent (parts p0..p3 copied to /tmp/parts by earlier calls or
# carried with this one, see bench/_device_vllm.sh), run baseline until BL_SECONDS, stop it
# with SIGINT (it stops its server and keeps every finished run), copy results to $OUT.
# BL_NAME (default h200) names the results file; BL_PLAN replaces the arms/rounds, e.g. the
# shutdown check of bench/results/baseline.md:
#   BL_NAME=stopcheck BL_PLAN="--arms cache:32 --restarts 3 --runs 1 --max-tokens 50"
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT" /tmp/bl
T0=$SECONDS
source bench/_device_vllm.sh

if [ ! -f /tmp/model/model.safetensors.index.json ]; then
  python3 bench/write_checkpoint.py /tmp/model --layers "${LAYERS:-8}" 2>&1 | tail -3 \
    | tee "$OUT/checkpoint.txt"
fi
[ -n "${CKPT_ONLY:-}" ] && exit 0

device_vllm_setup
case $? in
  1) exit 1 ;;
  2) echo "pip install -e . failed: vLLM would not find the plugin"; exit 1 ;;
esac

NAME="${BL_NAME:-h200}"
read -r -a PLAN <<< "${BL_PLAN:---arms resident,offload,cache:32,cache:64 --restarts 3 --runs 5 --max-tokens 200}"
RESUME=()
[ -s "/tmp/bl/$NAME.jsonl" ] && RESUME=(--resume)
LEFT=$(( ${BL_SECONDS:-550} - (SECONDS - T0) ))
timeout -s INT -k 60 "$LEFT" python3 -m expertcache_cli baseline run /tmp/model \
  "${PLAN[@]}" --cpu-offload-gb 10 --stats 2000 --start-timeout 400 --stop-grace 20 \
  --out "/tmp/bl/$NAME.jsonl" "${RESUME[@]}" \
  -- --attention-backend TRITON_ATTN --max-num-seqs 4 --max-model-len 1024 --seed 0 \
  2>&1 | tail -60
echo "rc=${PIPESTATUS[0]} after $((SECONDS - T0)) s"
cp "/tmp/bl/$NAME.jsonl" "$OUT/"
tar czf "$OUT/logs.tgz" -C /tmp/bl "$NAME-logs" 2>/dev/null || true
