#!/usr/bin/env bash
# Build libexpertcache.so ahead of time with nvcc (the alternative to the default NVRTC
# path, for users who prefer a shared library; select it with EXPERT_CACHE_LIB=path).
#
#   kernels/build.sh [OUT.so] [ARCHS]
#
# ARCHS defaults to "80 86 89 90 100 120": SASS for each, plus PTX of the last one so
# newer GPUs can JIT it. The export check at the end fails the build when an entry point
# is missing: that otherwise surfaces much later as a confusing symbol lookup error.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/libexpertcache.so}"
archs="${2:-${EXPERT_CACHE_ARCHS:-80 86 89 90 100 120}}"
nvcc="${NVCC:-nvcc}"
command -v "$nvcc" >/dev/null || { echo "build.sh: nvcc not found (set NVCC or install the CUDA toolkit); the default NVRTC path needs no toolkit" >&2; exit 1; }

gencode=()
last=""
for a in $archs; do
    gencode+=("-gencode=arch=compute_${a},code=sm_${a}")
    last="$a"
done
gencode+=("-gencode=arch=compute_${last},code=compute_${last}")

"$nvcc" -O3 -std=c++17 -shared -Xcompiler -fPIC -cudart static \
    "${gencode[@]}" -o "$out" "$here/expert_cache.cu"

missing=0
for sym in expert_cache_manage expert_cache_gather expert_cache_set_pdl; do
    if ! nm -D --defined-only "$out" | awk '{print $NF}' | grep -qx "$sym"; then
        echo "build.sh: export check FAILED: $sym is not exported by $out" >&2
        missing=1
    fi
done
[ "$missing" = 0 ] || exit 1
echo "built $out (sm_${archs// /, sm_} + compute_${last} PTX); exports expert_cache_manage, expert_cache_gather, expert_cache_set_pdl"
