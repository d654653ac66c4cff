// Self-checking kernels for hfkern_cuda.h, written once in CUDA style.
//
// Built two ways by tests/test_emulator.py:
//   g++ -std=c++20 -pthread -x c++   -> runs every case on the CPU emulator;
//   nvcc -arch=sm_90 -c              -> proves the same source is valid CUDA.
// On a GPU machine `nvcc -arch=sm_90 emu_kernels.cu` builds a binary that runs
// the same cases on the device (memory is cudaMallocManaged there).
//
// Prints one line "CASE <name> PASS|FAIL [detail]" per case and a final
// "SUMMARY <passed> <failed>"; exits non-zero if any case failed.
#include "../hfkern_cuda.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

// ------------------------------------------------------------------ kernels

// Sum of x[0:n] into partials[blockIdx.x]: grid-stride loads, warp shuffles,
// one __shared__ slot per warp, then the first warp finishes.
// x_ptr: [n], partials: [gridDim.x]; blockDim.x a multiple of 32.
__global__ void block_sum_kernel(const float* __restrict__ x, float* __restrict__ partials, int n) {
  __shared__ __align__(16) float warp_sums[32];
  float acc = 0.f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    acc += __ldg(x + i);
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    const int n_warps = blockDim.x / 32;
    acc = lane < n_warps ? warp_sums[lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) partials[blockIdx.x] = acc;
  }
}

// Every shuffle flavour, on 64 threads (two full warps).
// out: [9, 64]; out_ll: [64]; out_d: [64]
__global__ void shuffle_kernel(int* out, long long* out_ll, double* out_d) {
  const int t = threadIdx.x, lane = t % 32;
  const int v = lane * 10 + 1;
  const unsigned full = 0xffffffffu;
  const int n = blockDim.x;
  out[0 * n + t] = __shfl_sync(full, v, (lane + 3) % 32);
  out[1 * n + t] = __shfl_sync(full, v, 1, 8);     // lane 1 of each group of 8
  out[2 * n + t] = __shfl_up_sync(full, v, 5);
  out[3 * n + t] = __shfl_down_sync(full, v, 5);
  out[4 * n + t] = __shfl_down_sync(full, v, 3, 8);
  out[5 * n + t] = __shfl_up_sync(full, v, 2, 16);
  int s = v;  // xor butterfly: every lane ends with the warp's sum
  for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(full, s, m);
  out[6 * n + t] = s;
  out[7 * n + t] = __shfl_xor_sync(full, v, 1, 16);
  out[8 * n + t] = __shfl_sync(full, v, 40);       // out of range: taken modulo 32
  out_ll[t] = __shfl_sync(full, (long long)lane << 40, 31 - lane);
  out_d[t] = __shfl_xor_sync(full, 0.5 + lane, 7);
}

// Votes on a block of 48 threads: warp 1 has only 16 lanes, named in its mask.
// out: [6, blockDim.x]
__global__ void vote_kernel(unsigned* out) {
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const int live = min(32, int(blockDim.x) - warp * 32);
  const unsigned mask = live == 32 ? 0xffffffffu : (1u << live) - 1u;
  const int n = blockDim.x;
  out[0 * n + t] = __ballot_sync(mask, lane % 3 == 0);
  out[1 * n + t] = __any_sync(mask, t == 40);
  out[2 * n + t] = __all_sync(mask, t < 40);
  out[3 * n + t] = __all_sync(mask, t < 48);
  out[4 * n + t] = __any_sync(mask, 0);
  // lanes exchange through shared memory, ordered only by __syncwarp
  __shared__ unsigned scratch[64];
  scratch[t] = t * 7u;
  __syncwarp(mask);
  out[5 * n + t] = scratch[warp * 32 + (live - 1 - lane)];
}

// Atomics from every thread of a (3, 2, 1) x (5, 7, 1) grid, looping so that
// each thread adds several values: i = 1..n each contributes once.
// acc: [int sum, int max, int min, int cas-counter, int exch-count]
__global__ void atomics_kernel(int* acc, unsigned long long* sum_ull, float* sum_f,
                               double* sum_d, int* lock_flag, int* cas_count, int n) {
  const int threads_per_block = blockDim.x * blockDim.y * blockDim.z;
  const int block = blockIdx.x + gridDim.x * blockIdx.y;
  const int tid = threadIdx.x + blockDim.x * threadIdx.y + block * threads_per_block;
  const int stride = threads_per_block * gridDim.x * gridDim.y;
  for (int i = tid + 1; i <= n; i += stride) {
    atomicAdd(&acc[0], i);
    atomicMax(&acc[1], i * 3 % 1001);
    atomicMin(&acc[2], 5000 - i);
    atomicAdd(sum_ull, (unsigned long long)i * 1000000007ull);
    atomicAdd(sum_f, 1.0f);
    atomicAdd(sum_d, (double)i);
  }
  // a counter incremented only through a CAS loop
  // start from a guess: a plain (even volatile) read racing with the CAS
  // writes would be a data race in C++; the failed CAS returns the value
  int old = 0, seen;
  while ((seen = atomicCAS(cas_count, old, old + 1)) != old) old = seen;
  // one thread wins the flag
  if (atomicExch(lock_flag, 1) == 0) atomicAdd(&acc[4], 1);
}

// Dynamic shared memory: floats then ints carved from one buffer.
// in: [grid * blockDim], out: [grid * blockDim], ok: [grid]
__global__ void dyn_smem_kernel(const float* in, float* out, int* ok) {
  HFKERN_DYNAMIC_SMEM(float, smem);
  int* counts = reinterpret_cast<int*>(smem + blockDim.x);
  const int t = threadIdx.x, base = blockIdx.x * blockDim.x;
  smem[t] = in[base + t];
  if (t == 0) counts[0] = 0;
  __syncthreads();
  out[base + t] = smem[blockDim.x - 1 - t];
  atomicAdd(&counts[0], 1);
  __syncthreads();
  if (t == 0) ok[blockIdx.x] = (counts[0] == int(blockDim.x)) &&
                               (reinterpret_cast<unsigned long long>(smem) % 16 == 0);
}

// Records the builtins seen by each thread of an odd-shaped launch, and uses
// a partial warp (35 threads -> warps of 32 and 3).
// out: [n_blocks * n_threads, 13], count: [n_blocks * n_threads]
__global__ void shape_kernel(int* out, int* count) {
  const int nt = blockDim.x * blockDim.y * blockDim.z;
  const int lt = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int g = b * nt + lt;
  const int live = min(32, nt - lt / 32 * 32);
  const unsigned mask = live == 32 ? 0xffffffffu : (1u << live) - 1u;
  int s = 0;  // sum of lt over the lanes that exist; `live` is warp-uniform
  for (int l = 0; l < live; ++l) s += __shfl_sync(mask, lt, l);
  int* o = out + g * 13;
  o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
  o[3] = blockIdx.x;  o[4] = blockIdx.y;  o[5] = blockIdx.z;
  o[6] = blockDim.x;  o[7] = blockDim.y;  o[8] = blockDim.z;
  o[9] = gridDim.x;   o[10] = gridDim.y;  o[11] = gridDim.z;
  o[12] = s;
  atomicAdd(&count[g], 1);
}

// Rotates a ring held in shared memory `rounds` times. Correct only if
// __syncthreads is a real barrier; thread 0 is slowed down under the emulator
// so that a missing barrier shows up as wrong values rather than by luck.
// out: [blockDim.x]
__global__ void barrier_kernel(int* out, int rounds) {
  __shared__ int ring[256];
  const int t = threadIdx.x, n = blockDim.x;
  ring[t] = t * t;
  __syncthreads();
  for (int r = 0; r < rounds; ++r) {
#if HFKERN_EMULATED
    if (t == 0 && r % 8 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
#endif
    const int v = ring[(t + 1) % n] + 1;
    __syncthreads();
    ring[t] = v;
    __syncthreads();
  }
  out[t] = ring[t];
}

// Threads past n return early, before the block's barriers.
// x: [n]
__global__ void early_exit_kernel(int* x, int n) {
  __shared__ int total;
  const int t = threadIdx.x;
  if (t >= n) return;
  if (t == 0) total = 0;
  __syncthreads();
  atomicAdd(&total, x[t]);
  __syncthreads();
  x[t] = total;
}

#if HFKERN_EMULATED
// Device code cannot throw; the emulator must still not hang when a kernel
// thread fails while the rest of its block waits at a barrier.
__global__ void throwing_kernel(int* x) {
  if (blockIdx.x == 1 && threadIdx.x == 7) throw std::runtime_error("kernel failure");
  __syncthreads();
  x[blockIdx.x * blockDim.x + threadIdx.x] = 1;
  __syncthreads();
}
#endif

template <typename T, int kScale>
__global__ void scale_kernel(T* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= T(kScale);
}

// ------------------------------------------------------------------ harness

// Host-visible memory for both builds; on a GPU it is managed memory.
template <typename T>
struct Buf {
  T* p = nullptr;
  size_t n = 0;
  explicit Buf(size_t n_, T fill = T()) : n(n_) {
#if HFKERN_EMULATED
    p = new T[n];
#else
    HFKERN_CUDA_CHECK(cudaMallocManaged(&p, n * sizeof(T)));
#endif
    for (size_t i = 0; i < n; ++i) p[i] = fill;
  }
  ~Buf() {
#if HFKERN_EMULATED
    delete[] p;
#else
    cudaFree(p);
#endif
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  T& operator[](size_t i) { return p[i]; }
};

static void device_sync() {
#if !HFKERN_EMULATED
  HFKERN_CUDA_CHECK(cudaDeviceSynchronize());
#endif
}

static const cudaStream_t kDefaultStream = 0;

// Each case returns "" when it passed, or what went wrong.
static std::string mismatch(const char* what, size_t i, long long got, long long want) {
  return std::string(what) + "[" + std::to_string(i) + "]: got " + std::to_string(got) +
         ", want " + std::to_string(want);
}

static std::string case_block_reduction() {
  const int n = 1000, blocks = 4, threads = 160;
  Buf<float> x(n), partials(blocks, -1.f);
  for (int i = 0; i < n; ++i) x[i] = float(i % 17 + 1);
  HFKERN_LAUNCH(block_sum_kernel, dim3(blocks), dim3(threads), 0, kDefaultStream, x.p, partials.p, n);
  device_sync();
  for (int b = 0; b < blocks; ++b) {
    float want = 0.f;  // integers: exact in any order
    for (int i = b * threads; i < n; i += blocks * threads)
      for (int j = i; j < i + threads && j < n; ++j) want += x[j];
    if (partials[b] != want) return mismatch("partials", b, (long long)partials[b], (long long)want);
  }
  return "";
}

static std::string case_shuffles() {
  const int n = 64;
  Buf<int> out(9 * n, -7);
  Buf<long long> out_ll(n);
  Buf<double> out_d(n);
  HFKERN_LAUNCH(shuffle_kernel, dim3(1), dim3(n), 0, kDefaultStream, out.p, out_ll.p, out_d.p);
  device_sync();
  auto val = [](int lane) { return lane * 10 + 1; };
  int warp_sum = 0;
  for (int l = 0; l < 32; ++l) warp_sum += val(l);
  for (int t = 0; t < n; ++t) {
    const int l = t % 32;
    const int want[9] = {
        val((l + 3) % 32),
        val(l / 8 * 8 + 1),
        l < 5 ? val(l) : val(l - 5),
        l + 5 >= 32 ? val(l) : val(l + 5),
        l % 8 + 3 >= 8 ? val(l) : val(l + 3),
        l % 16 < 2 ? val(l) : val(l - 2),
        warp_sum,
        val(l ^ 1),
        val(40 % 32),
    };
    for (int k = 0; k < 9; ++k)
      if (out[k * n + t] != want[k])
        return mismatch(("shuffle kind " + std::to_string(k)).c_str(), t, out[k * n + t], want[k]);
    if (out_ll[t] != ((long long)(31 - l) << 40)) return mismatch("int64 shuffle", t, out_ll[t], (long long)(31 - l) << 40);
    if (out_d[t] != 0.5 + (l ^ 7)) return "double xor shuffle at lane " + std::to_string(t);
  }
  return "";
}

static std::string case_votes_partial_warp() {
  const int n = 48;
  Buf<unsigned> out(6 * n, 12345u);
  HFKERN_LAUNCH(vote_kernel, dim3(1), dim3(n), 0, kDefaultStream, out.p);
  device_sync();
  for (int t = 0; t < n; ++t) {
    const int warp = t / 32, lane = t % 32, live = warp == 0 ? 32 : 16;
    unsigned ballot = 0;
    for (int l = 0; l < live; ++l) ballot |= unsigned(l % 3 == 0) << l;
    const unsigned want[6] = {ballot, unsigned(warp == 1), unsigned(warp == 0), 1u, 0u,
                              unsigned(warp * 32 + (live - 1 - lane)) * 7u};
    for (int k = 0; k < 6; ++k)
      if (out[k * n + t] != want[k])
        return mismatch(("vote kind " + std::to_string(k)).c_str(), t, out[k * n + t], want[k]);
  }
  return "";
}

static std::string case_atomics() {
  const int n = 5000;
  Buf<int> acc(5, 0), lock_flag(1, 0), cas_count(1, 0);
  acc[2] = 1 << 30;
  Buf<unsigned long long> sum_ull(1, 0);
  Buf<float> sum_f(1, 0.f);
  Buf<double> sum_d(1, 0.0);
  HFKERN_LAUNCH(atomics_kernel, dim3(3, 2, 1), dim3(5, 7, 1), 0, kDefaultStream, acc.p, sum_ull.p,
                sum_f.p, sum_d.p, lock_flag.p, cas_count.p, n);
  device_sync();
  const long long tri = (long long)n * (n + 1) / 2;
  int max_want = 0;
  for (int i = 1; i <= n; ++i) max_want = std::max(max_want, i * 3 % 1001);
  if (acc[0] != tri) return mismatch("int sum", 0, acc[0], tri);
  if (acc[1] != max_want) return mismatch("max", 0, acc[1], max_want);
  if (acc[2] != 5000 - n) return mismatch("min", 0, acc[2], 5000 - n);
  if (sum_ull[0] != (unsigned long long)tri * 1000000007ull) return "unsigned long long sum";
  if (sum_f[0] != float(n)) return mismatch("float sum", 0, (long long)sum_f[0], n);
  if (sum_d[0] != double(tri)) return mismatch("double sum", 0, (long long)sum_d[0], tri);
  if (cas_count[0] != 6 * 35) return mismatch("cas counter", 0, cas_count[0], 6 * 35);
  if (acc[4] != 1 || lock_flag[0] != 1) return mismatch("exch winners", 0, acc[4], 1);
  return "";
}

static std::string case_dynamic_smem() {
  const int blocks = 3, threads = 64;
  Buf<float> in(blocks * threads), out(blocks * threads, -1.f);
  Buf<int> ok(blocks, 0);
  for (int i = 0; i < blocks * threads; ++i) in[i] = float(i) * 0.5f;
  const size_t smem = threads * sizeof(float) + sizeof(int);
  HFKERN_LAUNCH(dyn_smem_kernel, dim3(blocks), dim3(threads), smem, kDefaultStream, in.p, out.p, ok.p);
  device_sync();
  for (int b = 0; b < blocks; ++b) {
    if (!ok[b]) return "count or alignment wrong in block " + std::to_string(b);
    for (int t = 0; t < threads; ++t)
      if (out[b * threads + t] != in[b * threads + threads - 1 - t])
        return mismatch("reversed", b * threads + t, (long long)out[b * threads + t], 0);
  }
  return "";
}

static std::string check_shape(dim3 grid, dim3 block) {
  const int nt = block.x * block.y * block.z, nb = grid.x * grid.y * grid.z;
  Buf<int> out(nb * nt * 13, -1), count(nb * nt, 0);
  HFKERN_LAUNCH(shape_kernel, grid, block, 0, kDefaultStream, out.p, count.p);
  device_sync();
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx)
        for (unsigned tz = 0; tz < block.z; ++tz)
          for (unsigned ty = 0; ty < block.y; ++ty)
            for (unsigned tx = 0; tx < block.x; ++tx) {
              const int lt = tx + block.x * (ty + block.y * tz);
              const int b = bx + grid.x * (by + grid.y * bz);
              const int g = b * nt + lt;
              const int w0 = lt / 32 * 32, live = std::min(32, nt - w0);
              const int warp_sum = live * w0 + live * (live - 1) / 2;
              const int want[13] = {int(tx), int(ty), int(tz), int(bx), int(by), int(bz),
                                    int(block.x), int(block.y), int(block.z),
                                    int(grid.x), int(grid.y), int(grid.z), warp_sum};
              if (count[g] != 1) return mismatch("thread ran", g, count[g], 1);
              for (int k = 0; k < 13; ++k)
                if (out[g * 13 + k] != want[k])
                  return mismatch(("field " + std::to_string(k)).c_str(), g, out[g * 13 + k], want[k]);
            }
  return "";
}

static std::string case_odd_shapes() {
  std::string err = check_shape(dim3(3, 2, 1), dim3(5, 7, 1));
  if (err.empty()) err = check_shape(dim3(2, 1, 3), dim3(3, 4, 5));
  if (err.empty()) err = check_shape(dim3(1), dim3(1));
  return err;
}

static std::string case_barrier() {
  const int n = 96, rounds = 40;
  Buf<int> out(n, -1);
  HFKERN_LAUNCH(barrier_kernel, dim3(2), dim3(n), 0, kDefaultStream, out.p, rounds);
  device_sync();
  for (int t = 0; t < n; ++t) {
    const int src = (t + rounds) % n;
    if (out[t] != src * src + rounds) return mismatch("ring", t, out[t], src * src + rounds);
  }
  return "";
}

static std::string case_early_exit() {
  const int n = 50;
  Buf<int> x(64, 0);
  int want = 0;
  for (int i = 0; i < 64; ++i) x[i] = i + 1;
  for (int i = 0; i < n; ++i) want += i + 1;
  HFKERN_LAUNCH(early_exit_kernel, dim3(1), dim3(64), 0, kDefaultStream, x.p, n);
  device_sync();
  for (int i = 0; i < 64; ++i)
    if (x[i] != (i < n ? want : i + 1)) return mismatch("x", i, x[i], i < n ? want : i + 1);
  return "";
}

static std::string case_template_kernel() {
  const int n = 77;
  Buf<double> x(n, 1.5);
  HFKERN_LAUNCH((scale_kernel<double, 3>), dim3(2), dim3(64), 0, kDefaultStream, x.p, n);
  device_sync();
  for (int i = 0; i < n; ++i)
    if (x[i] != 4.5) return "x[" + std::to_string(i) + "] != 4.5";
  return "";
}

static std::string case_invalid_launch() {
  Buf<double> x(4, 1.0);
  try {
    HFKERN_LAUNCH((scale_kernel<double, 2>), dim3(1), dim3(1025), 0, kDefaultStream, x.p, 4);
  } catch (const std::runtime_error& e) {
    if (std::string(e.what()).find("scale_kernel") == std::string::npos)
      return std::string("message lacks the kernel name: ") + e.what();
    return "";
  }
  return "a block of 1025 threads was accepted";
}

#if HFKERN_EMULATED
static std::string case_kernel_exception() {
  Buf<int> x(4 * 32, 0);
  try {
    HFKERN_LAUNCH(throwing_kernel, dim3(4), dim3(32), 0, kDefaultStream, x.p);
  } catch (const std::runtime_error& e) {
    if (std::string(e.what()) != "kernel failure") return std::string("wrong exception: ") + e.what();
    // block 0 completed, blocks after the failing one never ran
    for (int i = 0; i < 32; ++i)
      if (x[i] != 1) return "block 0 did not complete";
    for (int i = 64; i < 128; ++i)
      if (x[i] != 0) return "a block after the failure ran";
    return "";
  }
  return "no exception reached the caller";
}
#endif

int main() {
  struct Case {
    const char* name;
    std::string (*fn)();
  };
  const Case cases[] = {
      {"block_reduction", case_block_reduction},
      {"shuffles", case_shuffles},
      {"votes_partial_warp", case_votes_partial_warp},
      {"atomics", case_atomics},
      {"dynamic_smem", case_dynamic_smem},
      {"odd_shapes", case_odd_shapes},
      {"barrier", case_barrier},
      {"early_exit", case_early_exit},
      {"template_kernel", case_template_kernel},
      {"invalid_launch", case_invalid_launch},
#if HFKERN_EMULATED
      {"kernel_exception", case_kernel_exception},
#endif
  };
  int passed = 0, failed = 0;
  for (const Case& c : cases) {
    std::string err;
    try {
      err = c.fn();
    } catch (const std::exception& e) {
      err = std::string("unexpected exception: ") + e.what();
    }
    if (err.empty()) {
      ++passed;
      std::printf("CASE %s PASS\n", c.name);
    } else {
      ++failed;
      std::printf("CASE %s FAIL %s\n", c.name, err.c_str());
    }
    std::fflush(stdout);
  }
  std::printf("SUMMARY %d %d\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
