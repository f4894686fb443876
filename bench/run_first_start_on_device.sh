#!/usr/bin/env bash
# On the GPU box: a user's first start on a small card, emulated on the H200 (bench/ballast.py
# holds all but the card), with every compile cache empty: `expertcache serve MODEL --vram N`
# as typed (no batch flags; the bundle's attention backend and a port are the only extras),
# in place and `--wide staged-install`, at the model's context and at --max-model-len 8192.
# Per start: what `size --json` and `serve --dry-run` planned (slots, the KV handed to vLLM),
# then one server through bench/small_card.py (healthy?, seconds to start, vLLM's KV, the
# armed slots, a short greedy run), then the report (bench/first_start_report.py).
#
#   STEPS   setup ckpt starts report (default: all four)
#   STARTS  the starts, CARD:MODE:CONTEXT each, MODE in-place|staged-install, CONTEXT
#           default|N (default: the 24 GiB card's four, then the 16 GiB card's four)
#   FORMAT, LAYERS  the checkpoint (default w8a8 and 48: the Qwen3-30B-A3B shape); another
#           format of bench/write_checkpoint.py starts the same way, e.g. the 4-bit NVFP4
#           on Marlin on a card its 24 layers do not fit (7.6 GiB of experts):
#             FORMAT=nvfp4 LAYERS=24 STARTS="8:in-place:8192 8:in-place:default" bash ...
#   ARCH    instead of FORMAT: a real architecture's config cut to LAYERS layers (default 8),
#           config only, served with --load-format dummy (bench/write_arch_config.py):
#           llama4-scout (chunked local attention) or qwen3-next (linear attention), e.g.
#             ARCH=llama4-scout STARTS="24:in-place:131072 24:in-place:8192" bash ...
#             ARCH=qwen3-next STARTS="16:in-place:default 16:in-place:8192" bash ...
#
# Cold means cold: each start gets its own empty vLLM cache root, Inductor and Triton
# caches and expertcache kernel cache (XDG_CACHE_HOME), as on a machine that never served.
# Re-entrant: a start whose JSON says ok is not run again; results go to $OUT after each.
# PY, FS (records: /tmp/fs) and MODEL_DIR (checkpoints: /tmp) are overridable; the flow is
# tested on CPU with the GPU steps stubbed (tests/bench/test_bench_first_start_runner.py).
set -uo pipefail
OUT="${OUT:-out}"
# an architecture's starts keep records of their own: a start's record is named by its card,
# mode and context only
export FS="${FS:-/tmp/fs${ARCH:+-$ARCH}}"
mkdir -p "$OUT" "$FS"
source bench/_device_vllm.sh
STEPS="${STEPS:-setup ckpt starts report}"
STARTS="${STARTS:-24:in-place:default 24:staged-install:8192 24:in-place:8192 \
24:staged-install:default 16:in-place:default 16:staged-install:8192 16:in-place:8192 \
16:staged-install:default}"
MD="${MODEL_DIR:-/tmp}"
FORMAT="${FORMAT:-w8a8}"
ARCH="${ARCH:-}"
PY="${PY:-python3}"
EXTRA=(--attention-backend TRITON_ATTN --seed 0 --host 127.0.0.1 --port "{port}")
if [ -n "$ARCH" ]; then
  LAYERS="${LAYERS:-8}"
  MODEL=$MD/$ARCH-$LAYERS
  EXTRA+=(--load-format dummy)
else
  LAYERS="${LAYERS:-48}"
  MODEL=$MD/$FORMAT
  [ "$FORMAT-$LAYERS" = w8a8-48 ] || MODEL=$MD/$FORMAT-$LAYERS
fi

held=""
ballast() {  # ballast GiB: hold all but GiB of the GPU (kept while the card stays the same)
  [ "$held" = "$1" ] && return
  $PY bench/ballast.py stop >/dev/null
  $PY bench/ballast.py start --leave "$1" > "$OUT/ballast$1.json" && held=$1
}

for step in $STEPS; do
  case $step in
    setup)
      device_vllm_setup || { echo "setup failed"; exit 1; } ;;
    ckpt)
      if [ -n "$ARCH" ]; then
        [ -f "$MODEL/config.json" ] || $PY bench/write_arch_config.py "$MODEL" --arch "$ARCH" \
          --layers "$LAYERS" | tee "$OUT/checkpoint.txt"
        continue
      fi
      [ -f "$MODEL/model.safetensors.index.json" ] || \
        $PY bench/write_checkpoint.py "$MODEL" --layers "$LAYERS" --format "$FORMAT" \
          --vocab 151936 --context 40960 --head-dim 128 2>&1 | tail -2 \
          | tee "$OUT/checkpoint.txt" ;;
    starts)
      for start in $STARTS; do
        IFS=: read -r card mode ctx <<< "$start"
        name="fs${card}-${mode}-${ctx}"
        if [ -f "$FS/$name.json" ] && grep -q '"status": "ok"' "$FS/$name.json"; then
          echo "== $name: done before"; continue
        fi
        wide=(); [ "$mode" = in-place ] || wide=(--wide "$mode")
        vargs=(); [ "$ctx" = default ] || vargs=(--max-model-len "$ctx")
        ballast "$card"
        $PY -m expertcache_cli size --model "$MODEL" --vram "$card" "${wide[@]}" --json \
          -- "${vargs[@]}" > "$FS/$name.size.json"
        COLUMNS=200 $PY -m expertcache_cli serve "$MODEL" --vram "$card" "${wide[@]}" \
          --dry-run -- "${vargs[@]}" > "$FS/$name.dry.txt" 2>&1
        cold="$FS/cache-$name"
        rm -rf "$cold"; mkdir -p "$cold"
        echo "== $name ($SECONDS s)"
        bench_arm "$FS" bench/small_card.py "$name" --runs 1 --max-tokens 64 \
          --greedy-tokens 16 --start-timeout 540 \
          --env "VLLM_CACHE_ROOT=$cold/vllm" --env "TORCHINDUCTOR_CACHE_DIR=$cold/inductor" \
          --env "TRITON_CACHE_DIR=$cold/triton" --env "XDG_CACHE_HOME=$cold/xdg" \
          -- "$PY" -m expertcache_cli serve "$MODEL" --vram "$card" "${wide[@]}" \
          -- "${vargs[@]}" "${EXTRA[@]}"
        cp "$FS/$name.size.json" "$FS/$name.dry.txt" "$OUT/" 2>/dev/null
        rm -rf "$cold"
      done
      $PY bench/ballast.py stop >/dev/null; held="" ;;
    report)
      $PY bench/first_start_report.py "$FS" | tee "$OUT/first_start.md" ;;
  esac
done
