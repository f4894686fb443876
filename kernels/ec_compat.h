// ec_compat.h: the whole vendor-specific surface of expert_cache.cu.
//
// The kernels are written in the subset of C++ that CUDA and HIP share (__global__,
// __shared__, __syncthreads, block-level shared-memory reductions, and one warp shuffle
// whose width comes from here), so porting between vendors means editing this header
// only: the runtime include, the stream type, the last-error query, the launch macros,
// the warp width and shuffle, the 16-byte copy unit, and the two NVIDIA-only latency
// hints (programmatic dependent launch, L2 prefetch), which are no-ops wherever they do
// not exist.
//
// Three ways this header is compiled:
//   * nvcc (shared library, host wrappers included)          -> CUDA runtime
//   * NVRTC (kernels only; EC_KERNELS_ONLY, no host headers) -> __CUDACC_RTC__
//   * hipcc (not built by this project, kept possible)       -> __HIP_PLATFORM_AMD__
#pragma once

#if defined(__CUDACC_RTC__)
// NVRTC: no system headers. Only the kernels are compiled; host wrappers are excluded.
#  ifndef EC_KERNELS_ONLY
#    define EC_KERNELS_ONLY 1
#  endif
typedef uint4 ec_vec16;
#elif defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#  include <hip/hip_runtime.h>
typedef hipStream_t ec_stream_t;
typedef uint4 ec_vec16;
#  define ec_get_last_error() ((int)hipGetLastError())
#  define EC_LAUNCH(kernel, grid, block, shmem, stream, ...) \
      hipLaunchKernelGGL(kernel, grid, block, shmem, stream, __VA_ARGS__)
#  define EC_LAUNCH_PDL(pdl, kernel, grid, block, shmem, stream, ...) \
      hipLaunchKernelGGL(kernel, grid, block, shmem, stream, __VA_ARGS__)
#else
#  include <cuda_runtime.h>
typedef cudaStream_t ec_stream_t;
typedef uint4 ec_vec16;
#  define ec_get_last_error() ((int)cudaGetLastError())
#  define EC_LAUNCH(kernel, grid, block, shmem, stream, ...) \
      kernel<<<(grid), (block), (shmem), (stream)>>>(__VA_ARGS__)
// The launch with programmatic stream serialization when `pdl` is nonzero (the kernel may
// start while the one before it in the stream finishes, and waits in ec_grid_wait()).
#  define EC_LAUNCH_PDL(pdl, kernel, grid, block, shmem, strm, ...)                     \
      do {                                                                             \
          cudaLaunchAttribute ec_attr[1];                                              \
          ec_attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;          \
          ec_attr[0].val.programmaticStreamSerializationAllowed = 1;                   \
          cudaLaunchConfig_t ec_cfg = {};                                              \
          ec_cfg.gridDim = dim3(grid);                                                 \
          ec_cfg.blockDim = dim3(block);                                               \
          ec_cfg.dynamicSmemBytes = (shmem);                                           \
          ec_cfg.stream = (strm);                                                      \
          ec_cfg.attrs = ec_attr;                                                      \
          ec_cfg.numAttrs = (pdl) ? 1 : 0;                                             \
          (void)cudaLaunchKernelEx(&ec_cfg, kernel, __VA_ARGS__);                      \
      } while (0)
#endif

// Programmatic dependent launch (sm_90 and newer). A kernel launched with it may begin
// while the kernel before it in the stream is still finishing: ec_grid_wait() blocks until
// that kernel has completed and its memory is visible, so nothing before it may read what
// an earlier kernel writes. ec_grid_release_dependents() lets the next kernel, if it was
// launched with PDL, begin now (it still waits for this one in its own ec_grid_wait()).
// Both do nothing in a launch without PDL and on other architectures or vendors.
// ec_prefetch_l2(p) asks for p's line in L2 and reads no value: safe before the wait,
// because L2 is where every SM's writes meet, so a line fetched early is not stale.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && !defined(__HIP_PLATFORM_AMD__)
#  define ec_grid_wait() asm volatile("griddepcontrol.wait;" ::: "memory")
#  define ec_grid_release_dependents() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#  define ec_grid_wait() ((void)0)
#  define ec_grid_release_dependents() ((void)0)
#endif
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800) && !defined(__HIP_PLATFORM_AMD__)
#  define ec_prefetch_l2(p) asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p))
#elif defined(__CUDA_ARCH__) && !defined(__HIP_PLATFORM_AMD__)
#  define ec_prefetch_l2(p) asm volatile("prefetch.global.L2 [%0];" ::"l"(p))
#else
#  define ec_prefetch_l2(p) ((void)(p))
#endif

// The cache's own state (a few hundred bytes a layer: table, slot map, priorities, step,
// counters) is read and written with L2 priority evict_last (sm_80 and newer): served,
// a whole decode step of other layers streams tens of MB through L2 between two calls of
// a layer, and with normal priority the state's lines go with it, so every manager call
// would begin with DRAM reads. evict_last lines are evicted only after normal ones: the
// state stays in L2 across the step, at a cost of a few KB of L2 for a whole model. Only
// a hint: loads and stores mean what plain ones do, and elsewhere they are plain.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800) && !defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ unsigned long long ec_keep_policy() {
    unsigned long long pol;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ int ec_ld(const int* a) {
    int v;
    asm volatile("ld.global.L2::cache_hint.b32 %0, [%1], %2;"
                 : "=r"(v) : "l"(a), "l"(ec_keep_policy()) : "memory");
    return v;
}
__device__ __forceinline__ long long ec_ld(const long long* a) {
    long long v;
    asm volatile("ld.global.L2::cache_hint.b64 %0, [%1], %2;"
                 : "=l"(v) : "l"(a), "l"(ec_keep_policy()) : "memory");
    return v;
}
__device__ __forceinline__ void ec_st(int* a, int v) {
    asm volatile("st.global.L2::cache_hint.b32 [%0], %1, %2;"
                 :: "l"(a), "r"(v), "l"(ec_keep_policy()) : "memory");
}
__device__ __forceinline__ void ec_st(long long* a, long long v) {
    asm volatile("st.global.L2::cache_hint.b64 [%0], %1, %2;"
                 :: "l"(a), "l"(v), "l"(ec_keep_policy()) : "memory");
}
#else
template <typename T> __device__ __forceinline__ T ec_ld(const T* a) { return *a; }
template <typename T> __device__ __forceinline__ void ec_st(T* a, T v) { *a = v; }
#endif

// 16 bytes, the unit every gather lane moves (a slab must be a multiple of it).
static_assert(sizeof(ec_vec16) == 16, "ec_vec16 must be 16 bytes");

// The warp: its width and an up-shuffle of an int across all its lanes (every lane of the
// warp calls it). The manager's scan is warp-synchronous within a warp and shared-memory
// between warps, so one block barrier replaces a barrier per scan round.
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#  define EC_WARP 64
#  define ec_shfl_up(v, d) __shfl_up((v), (d))
#else
#  define EC_WARP 32
#  define ec_shfl_up(v, d) __shfl_up_sync(0xffffffffu, (v), (d))
#endif
