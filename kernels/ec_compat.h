// ec_compat.h: the whole vendor-specific surface of expert_cache.cu.
//
// The kernels are written in the subset of C++ that CUDA and HIP share (__global__,
// __shared__, __syncthreads, block-level shared-memory reductions, no warp intrinsics),
// so porting between vendors means editing this header only: the runtime include, the
// stream type, the last-error query, the launch macro, and the 16-byte copy unit.
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
#else
#  include <cuda_runtime.h>
typedef cudaStream_t ec_stream_t;
typedef uint4 ec_vec16;
#  define ec_get_last_error() ((int)cudaGetLastError())
#  define EC_LAUNCH(kernel, grid, block, shmem, stream, ...) \
      kernel<<<(grid), (block), (shmem), (stream)>>>(__VA_ARGS__)
#endif

// 16 bytes, the unit every gather lane moves (a slab must be a multiple of it).
static_assert(sizeof(ec_vec16) == 16, "ec_vec16 must be 16 bytes");
