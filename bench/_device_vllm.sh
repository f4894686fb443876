# Sourced by the bench runners on the GPU box (bench/run_*_on_device.sh): the environment
# vLLM runs in there, and `device_vllm_setup`, which installs the slim vLLM bundle
# (built by the project's device tooling; its parts copied to /tmp/parts by earlier commands or carried in
# .devbundle/) when absent, then this package so that vLLM finds the plugin's entry point,
# and records the machine in $OUT/env.txt. Returns 1 when the bundle will not install, 2
# when only this package did not (the caller decides whether it can go on without it).
export PYTHONPATH="/tmp/site:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
export XDG_CACHE_HOME=/tmp/ec-cache
# Every server group a runner starts is recorded here while it runs (by
# expertcache_cli/baseline/server.py, and by bench_mem_server below), with the process that
# started it: setup ends the groups a killed call left behind, by their process group,
# and nothing else (never by a name: a vLLM its user started beside the bench is not ours).
export EXPERTCACHE_SERVER_GROUPS="${EXPERTCACHE_SERVER_GROUPS:-/tmp/ec-bench-groups}"

# One bench arm per server, re-entrant: `bench_arm DIR RUNNER NAME [runner options] --
# server command` runs `RUNNER NAME --out DIR ...` unless DIR/NAME.json already says ok,
# then copies DIR's results (JSON whole, logs' last LOG_TAIL bytes) to $OUT.
bench_save() {
  cp "$1"/*.json "$OUT/" 2>/dev/null
  for f in "$1"/*.log; do tail -c "${LOG_TAIL:-400000}" "$f" > "$OUT/$(basename "$f")"; done
}
# An earlier session's records (BENCH ONLY): `bench_seed DIR NAME...` copies each NAME that
# $SEED holds and DIR lacks into DIR and $OUT, and lists it in DIR/seeded.txt (copied to $OUT
# too), which the reports print as not measured in this session. Nothing without SEED.
bench_seed() {
  local dir=$1 f; shift
  [ -n "${SEED:-}" ] || return 0
  for f in "$@"; do
    if [ -f "$SEED/$f" ] && [ ! -f "$dir/$f" ]; then
      cp "$SEED/$f" "$dir/$f" && cp "$SEED/$f" "$OUT/" && echo "$f" >> "$dir/seeded.txt"
    fi
  done
  if [ -f "$dir/seeded.txt" ]; then cp "$dir/seeded.txt" "$OUT/"; fi
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
# EC_BENCH_MEM=1) until vLLM reports its memory (or the start fails), ends its process
# group, and appends the memory lines of LOG to TXT under "== NAME".
bench_mem_server() {
  local name=$1 log=$2 txt=$3; shift 3
  local envs=(EC_BENCH_MEM=1)
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  # setsid: the server (and vLLM's engine, which it forks) in a process group of its own,
  # led by this PID, so that ending the group ends exactly what this function started
  env "${envs[@]}" PYTHONPATH="$PWD/bench/kernel_trial:$PYTHONPATH" setsid timeout 240 "$@" \
    > "$log" 2>&1 &
  local pid=$!
  bench_record_group "$pid" "$@"
  for _ in $(seq 240); do
    grep -q -E "Actual usage|Engine core initialization failed" "$log" && break
    kill -0 $pid 2>/dev/null || break; sleep 1
  done
  bench_end_group "$pid"
  echo "== $name"; grep -h -E \
    "EC_BENCH_MEM|Actual usage|Available KV|memory plan|Compiling a graph|Directly load the compiled" "$log" \
    | sed 's/.*\] //' | cut -c1-330 | tee -a "$txt"
}

# The process group of PID, from /proc (nothing when PID is gone).
bench_pgid() {
  local stat pgrp
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  read -r _ _ pgrp _ <<< "$stat"
  echo "$pgrp"
}

# `bench_record_group PID ARGV...`: once PID (a child of this shell, started with setsid)
# leads its own process group, record the group as this shell's (bench/groups.py).
bench_record_group() {
  local pid=$1; shift
  for _ in $(seq 50); do
    [ "$(bench_pgid "$pid")" = "$pid" ] && break
    kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1
  done
  "${PY:-python3}" bench/groups.py record "$pid" --owner $$ -- "$@"
}

# `bench_end_group PID`: end the process group PID leads (started by this shell with
# setsid, and not reaped yet, so the PID is still ours), reap it, drop its record.
bench_end_group() {
  local pid=$1
  if [ "$(bench_pgid "$pid")" = "$pid" ]; then
    kill -KILL -- "-$pid" 2>/dev/null
  else
    kill -KILL "$pid" 2>/dev/null
  fi
  wait "$pid" 2>/dev/null
  "${PY:-python3}" bench/groups.py forget "$pid"
}

# What a killed call left behind: the recorded server groups whose runner is gone
# (bench/groups.py end), and the ballast by the PID it recorded (bench/ballast.py stop).
bench_end_leftovers() {
  "${PY:-python3}" bench/groups.py end
  "${PY:-python3}" bench/ballast.py stop
}

device_vllm_setup() {
  local t0=$SECONDS rc=0
  # a call killed at its time limit can leave a vLLM engine and a ballast behind, holding
  # the GPU: every server of the next call would then fail to start (or measure a smaller
  # card). Only what a bench runner started and recorded is ended; a recorded server whose
  # runner still runs (a detached one, a neighbour) is kept.
  # EC_KEEP_SERVERS=1: a runner started beside another one (one per GPU of a 2-GPU box,
  # each with its own CUDA_VISIBLE_DEVICES) leaves the ballast and every record alone
  if [ -z "${EC_KEEP_SERVERS:-}" ]; then
    bench_end_leftovers
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
  if ! python3 -c "from expertcache_cli.planning.launch import plugin_installed as p; \
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
