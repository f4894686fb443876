// Independent check for `expertcache probe-link`: the same figures measured with nothing
// but the CUDA runtime (no torch, no expertcache code): a plain cudaMemcpyAsync loop for
// the copy engine and a plain 16-byte copy kernel for the SM zero-copy read of mapped
// pinned memory. bench/probe_link_check.py compiles this with nvcc, runs it on the same
// CPUs as the probe, and compares. Output: one JSON object on stdout, rates in GB/s.
//
//   nvcc -O3 -arch=sm_90 -o probe_check bench/probe_check.cu && ./probe_check [device]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                     \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_));        \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

static const size_t MiB = size_t(1) << 20;

__global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}

static cudaStream_t g_stream;
static cudaEvent_t g_a, g_b;

// Median seconds per call of `fn` over `reps` samples of `iters` calls, after `warm` calls.
template <class F>
static double per_call(F fn, int iters, int reps = 7, int warm = 2) {
  for (int i = 0; i < warm; ++i) fn();
  CK(cudaStreamSynchronize(g_stream));
  std::vector<double> s;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(g_a, g_stream));
    for (int i = 0; i < iters; ++i) fn();
    CK(cudaEventRecord(g_b, g_stream));
    CK(cudaEventSynchronize(g_b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, g_a, g_b));
    s.push_back(ms / 1e3 / iters);
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

static int iters_for(size_t n) { return int(std::max<size_t>(1, std::min<size_t>(256, 128 * MiB / n))); }

int main(int argc, char** argv) {
  int dev = argc > 1 ? std::atoi(argv[1]) : 0;
  CK(cudaSetDevice(dev));
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, dev));
  const size_t big = 1024 * MiB;
  void *h = nullptr, *d = nullptr, *d2 = nullptr;
  CK(cudaHostAlloc(&h, big, cudaHostAllocMapped | cudaHostAllocPortable));
  CK(cudaMalloc(&d, big));
  CK(cudaMalloc(&d2, big));
  std::memset(h, 1, big);
  CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  CK(cudaEventCreate(&g_a));
  CK(cudaEventCreate(&g_b));

  std::printf("{\"device\": \"%s\"", p.name);
  const size_t sizes[] = {1 * MiB, 256 * MiB, 1024 * MiB};
  for (size_t n : sizes) {
    double t = per_call([&] { CK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, g_stream)); }, iters_for(n));
    std::printf(", \"h2d_pinned_%zuMiB\": %.3f", n / MiB, n / t / 1e9);
    t = per_call([&] { CK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, g_stream)); }, iters_for(n));
    std::printf(", \"d2h_pinned_%zuMiB\": %.3f", n / MiB, n / t / 1e9);
  }
  // SM zero-copy read: the device pointer of the mapped pinned buffer, read by a kernel.
  void* hd = nullptr;
  CK(cudaHostGetDevicePointer(&hd, h, 0));
  const size_t zn = 256 * MiB;
  const int threads = 256, blocks = p.multiProcessorCount * 8;
  double t = per_call([&] {
    copy16<<<blocks, threads, 0, g_stream>>>((const uint4*)hd, (uint4*)d, zn / 16);
  }, 1);
  CK(cudaGetLastError());
  std::printf(", \"zero_copy_read_256MiB\": %.3f", zn / t / 1e9);
  t = per_call([&] { CK(cudaMemcpyAsync(d2, d, big, cudaMemcpyDeviceToDevice, g_stream)); }, 4);
  std::printf(", \"d2d_copy_1024MiB\": %.3f", big / t / 1e9);
  unsigned char probe = 0;
  CK(cudaMemcpy(&probe, d, 1, cudaMemcpyDeviceToHost));
  std::printf(", \"data_ok\": %s}\n", probe == 1 ? "true" : "false");
  return 0;
}
