#!/usr/bin/env bash
# One device run for the kernels: build (NVRTC + nvcc), every device test, every
# kernel benchmark; logs go to $OUT (or ./out). Usage on the GPU box, from the repo root:
#   bash tests/device/run_on_device.sh [tests|bench|all|sanitize]
set -uo pipefail
what="${1:-all}"
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-/tmp/ec-cache}"
python3 -c "import pytest" 2>/dev/null || pip install -q --no-index --find-links .whl pytest >/dev/null 2>&1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cuda-bindings', cuda.bindings.__version__)"
  python3 -m pip list 2>/dev/null | grep -i -E "nvrtc|cuda-bindings|pytest|packaging"
  python3 -c "import pytest, torch; print('import pytest then torch: ok', pytest.__version__)" 2>&1 | tail -1
  nvcc --version | tail -1
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout 120 python3 -m expertcache_cli build-kernels 2>&1 | tee "$OUT/build_kernels.log"
  timeout 60 python3 -m expertcache_cli build-kernels 2>&1 | tee -a "$OUT/build_kernels.log"
  { echo '$ expertcache build-kernels --library /tmp/libexpertcache.so --archs 90'
    timeout 120 python3 -m expertcache_cli build-kernels --library /tmp/libexpertcache.so --archs 90
    echo '$ EXPERT_CACHE_LIB=/tmp/libexpertcache.so expertcache build-kernels'
    EXPERT_CACHE_LIB=/tmp/libexpertcache.so timeout 60 python3 -m expertcache_cli build-kernels
  } 2>&1 | tee -a "$OUT/build_kernels.log"
  for tr in demo-qwen3-30b-a3b-tasks demo-qwen3-30b-a3b-batch4; do
    echo "\$ expertcache replay traces/$tr.npz --device cuda" >> "$OUT/replay_cuda.log"
    ( time timeout 200 python3 -m expertcache_cli replay "traces/$tr.npz" --device cuda ) \
        >> "$OUT/replay_cuda.log" 2>&1
    echo "exit $?" >> "$OUT/replay_cuda.log"
  done
  tail -30 "$OUT/replay_cuda.log"
  timeout 480 python3 -m pytest -q -ra -p no:cacheprovider tests/test_kernel_build.py tests/device \
      --durations=8 \
      2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [ "$what" = sanitize ]; then
  # compute-sanitizer over the manager and the gather: memcheck (out-of-bounds, misaligned
  # accesses) and racecheck (shared-memory hazards in the manager's block reductions)
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  # --report-api-errors no: cuda-bindings probes driver entry points that this driver
  # lacks (cuGetProcAddress -> CUDA_ERROR_INVALID_VALUE, 34 of them on the 580 driver);
  # those are API lookups, not kernel faults, and would fail the run on their own.
  # racecheck is ~20x slower than memcheck, so it runs the manager's shared-memory
  # reductions only (the gather and the wide-step copies use no shared memory).
  for tool in memcheck racecheck; do
    if [ "$tool" = memcheck ]; then
      files=(tests/device/test_manager.py tests/device/test_gather.py tests/device/test_wide_steps.py
             tests/device/test_small_and_block_order.py)
      sel="tiny-churn or padding or gather or wide or spread or side_row"; limit=240
    else
      files=(tests/device/test_manager.py); sel="tiny-churn or padding"; limit=330
    fi
    echo "\$ compute-sanitizer --tool $tool pytest ${files[*]} -k '$sel'" > "$OUT/sanitize_$tool.log"
    timeout "$limit" "$SAN" --tool "$tool" --report-api-errors no --error-exitcode 9 \
      --target-processes all python3 -m pytest -q -p no:cacheprovider "${files[@]}" \
      -k "$sel" >> "$OUT/sanitize_$tool.log" 2>&1
    echo "exit $?" >> "$OUT/sanitize_$tool.log"
    tail -6 "$OUT/sanitize_$tool.log"
  done
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  for b in bench_manager bench_layer_step bench_gather bench_wide_stage bench_trace_hook; do
    echo "\$ python bench/$b.py" > "$OUT/$b.log"
    timeout 150 python3 "bench/$b.py" >> "$OUT/$b.log" 2>&1
    echo "exit $?" >> "$OUT/$b.log"
    cat "$OUT/$b.log"
  done
fi
