# Sourced by the bench runners on the GPU box (bench/run_*_on_device.sh): the environment
# vLLM runs in there, and `device_vllm_setup`, which installs the slim vLLM bundle
# (built by the project's device tooling; its parts copied to /tmp/parts by earlier commands or carried in
# .devbundle/) when absent, then this package so that vLLM finds the plugin's entry point,
# and records the machine in $OUT/env.txt. Returns 1 when the bundle will not install, 2
# when only this package did not (the caller decides whether it can go on without it).
export PYTHONPATH="/tmp/site:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
export XDG_CACHE_HOME=/tmp/ec-cache

# One bench arm per server, re-entrant: `bench_arm DIR RUNNER NAME [runner options] --
# server command` runs `RUNNER NAME --out DIR ...` unless DIR/NAME.json already says ok,
# then copies DIR's results (JSON whole, logs' last LOG_TAIL bytes) to $OUT.
bench_save() {
  cp "$1"/*.json "$OUT/" 2>/dev/null
  for f in "$1"/*.log; do tail -c "${LOG_TAIL:-400000}" "$f" > "$OUT/$(basename "$f")"; done
}
bench_arm() {
  local dir=$1 runner=$2 name=$3; shift 3
  if [ -f "$dir/$name.json" ] && grep -q '"status": "ok"' "$dir/$name.json"; then
    echo "== $name: done before"; return 0
  fi
  echo "== $name ($((SECONDS)) s)"
  "${PY:-python3}" "$runner" "$name" --out "$dir" "$@"
  bench_save "$dir"
}

# A server started only for its memory plan (BENCH ONLY): `bench_mem_server NAME LOG TXT
# [ENV=V ...] -- server command` runs it with the bench memory hook (bench/kernel_trial,
# EC_BENCH_MEM=1) until vLLM reports its memory (or the start fails), kills it, and appends
# the memory lines of LOG to TXT under "== NAME".
bench_mem_server() {
  local name=$1 log=$2 txt=$3; shift 3
  local envs=(EC_BENCH_MEM=1)
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" PYTHONPATH="$PWD/bench/kernel_trial:$PYTHONPATH" timeout 240 "$@" \
    > "$log" 2>&1 &
  local pid=$!
  for _ in $(seq 240); do
    grep -q -E "Actual usage|Engine core initialization failed" "$log" && break
    kill -0 $pid 2>/dev/null || break; sleep 1
  done
  pkill -9 -f "[v]llm.entrypoints|[E]ngineCore"; wait $pid 2>/dev/null
  echo "== $name"; grep -h -E \
    "EC_BENCH_MEM|Actual usage|Available KV|memory plan|Compiling a graph|Directly load the compiled" "$log" \
    | sed 's/.*\] //' | cut -c1-330 | tee -a "$txt"
}

device_vllm_setup() {
  local t0=$SECONDS rc=0
  # a call killed at its time limit can leave a vLLM engine and a ballast behind, holding
  # the GPU: every server of the next call would then fail to start (or measure a smaller
  # card). The bracket keeps pkill from matching this shell's own command line.
  # EC_KEEP_SERVERS=1: a runner started beside another one (one per GPU of a 2-GPU box,
  # each with its own CUDA_VISIBLE_DEVICES) must not kill its neighbour's servers
  if [ -z "${EC_KEEP_SERVERS:-}" ]; then
    pkill -9 -f "[v]llm.entrypoints|[E]ngineCore|[b]allast.py hold" 2>/dev/null && sleep 3
    rm -f /tmp/expertcache-ballast.pid
  fi
  if [ ! -f /tmp/site/vllm/__init__.py ]; then
    mkdir -p /tmp/parts
    for p in .devbundle/p*; do cp "$p"/* /tmp/parts/ 2>/dev/null; done
    ls -la /tmp/parts > "$OUT/parts.txt"
    if ! (cd /tmp/parts && SKIP_SMOKE=1 bash install.sh) > "$OUT/install.log" 2>&1; then
      tail -30 "$OUT/install.log"
      return 1
    fi
  fi
  if ! python3 -c "from expertcache_cli.launch import plugin_installed as p; \
exit(not p())" 2>/dev/null; then
    python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || rc=2
  fi
  echo "setup: $((SECONDS - t0)) s"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    | tee "$OUT/env.txt"
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
    2>&1 | tail -1 | tee -a "$OUT/env.txt"
  return $rc
}
