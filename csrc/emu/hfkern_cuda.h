// hfkern_cuda.h: the one header every hfkern CUDA source includes instead of
// <cuda_runtime.h>.
//
// Our CI machines have nvcc but no GPU, so each .cu file must also build as
// plain host C++ (g++ -std=c++20 -pthread -x c++) and run its kernels on the
// CPU. Under nvcc this header is a thin layer over the CUDA runtime; under any
// other compiler it is a small grid emulator:
//
//   * a launch runs the grid's blocks one after another; the threads of one
//     block run concurrently as std::threads, so a block really is a group of
//     threads that can race, wait and deadlock like on the device;
//   * `__shared__` expands to `static`: since only one block (of one launch,
//     launches are serialised by a process-wide mutex) is alive at a time, a
//     function-local static array is exactly "memory shared by the threads of
//     the running block". Like device shared memory it is not reset between
//     blocks, so kernels must not rely on its initial contents;
//   * dynamic shared memory is a per-block buffer, filled with 0xFF bytes
//     (NaN for floats) so that reading it before writing shows up;
//   * `__syncthreads()` is a std::barrier over the block's threads; a thread
//     that returns from the kernel (or throws) drops out of it, which mirrors
//     the common `if (i >= n) return;` before a barrier;
//   * warps are the block's linear thread index / 32 (the last warp may be
//     partial); shuffles and votes exchange values through a per-warp slot
//     array and a per-warp barrier, so every live lane of the warp must take
//     part. Masks are NOT emulated beyond that: the mask only filters the
//     result of votes; shuffles ignore it. Divergent warp code (a shuffle
//     reached by only some lanes) deadlocks here instead of being undefined;
//   * reading a lane that does not exist (past a partial warp) or has exited
//     yields the caller's own value or a stale one; on the device it is
//     undefined, so do not depend on it;
//   * atomics go through std::atomic_ref, so they are real atomics for TSan.
//
// Launch through HFKERN_LAUNCH(kernel, grid, block, smem_bytes, stream, args...)
// under both compilers: nvcc gets `kernel<<<grid, block, smem, stream>>>` and
// a cudaGetLastError() check, the emulator validates the launch configuration
// the same way and rethrows the first exception a kernel thread threw. Wrap a
// template kernel in parentheses: HFKERN_LAUNCH((k<float, 4>), ...).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

#define HFKERN_LAUNCH(kernel, ...) \
  ::hfkern::launch(#kernel, __FILE__, __LINE__, kernel, __VA_ARGS__)

#if defined(__CUDACC__)
// ---------------------------------------------------------------- real CUDA
#include <cuda_runtime.h>

#define HFKERN_EMULATED 0

// `#pragma unroll` spelled so that the emulator build can drop it.
#define HFKERN_UNROLL _Pragma("unroll")

// extern __shared__ arrays share one symbol across all kernels of a
// translation unit, so it must have one type everywhere: raw bytes, 16-aligned
// so any element type up to float4/double2 can be placed at the start.
#define HFKERN_DYNAMIC_SMEM(type, name)                              \
  extern __shared__ __align__(16) unsigned char hfkern_dyn_smem_[]; \
  type* name = reinterpret_cast<type*>(hfkern_dyn_smem_)

#define HFKERN_CUDA_CHECK(expr)                                               \
  do {                                                                        \
    cudaError_t hfkern_err_ = (expr);                                         \
    if (hfkern_err_ != cudaSuccess)                                           \
      throw std::runtime_error(std::string("hfkern: ") + #expr + " failed at " \
                               + __FILE__ + ":" + std::to_string(__LINE__)   \
                               + ": " + cudaGetErrorString(hfkern_err_));    \
  } while (0)

namespace hfkern {

template <typename... KArgs, typename... Args>
void launch(const char* name, const char* file, int line, void (*kernel)(KArgs...),
            dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
            Args&&... args) {
  kernel<<<grid, block, smem_bytes, stream>>>(std::forward<Args>(args)...);
  // Only configuration errors surface here; faults inside the kernel show up
  // at the next synchronising call, which the caller checks.
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("hfkern: launch of ") + name + " at " + file + ":" +
                             std::to_string(line) + " failed: " + cudaGetErrorString(err));
}

}  // namespace hfkern

#else
// ---------------------------------------------------------------- emulator
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#define HFKERN_EMULATED 1

// nvcc's unroll hint; the host compiler has no use for it (and would warn).
#define HFKERN_UNROLL

#define __global__
#define __device__
#define __host__
#define __constant__
// `inline`, not nothing: device helpers are defined in headers.
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
// the GNU attribute, as in CUDA: it may sit among the decl-specifiers
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
// __restrict__ is left alone: g++ understands it natively.

#define HFKERN_DYNAMIC_SMEM(type, name) \
  type* name = reinterpret_cast<type*>(::hfkern::emu::dynamic_smem())

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

using cudaStream_t = struct CUstream_st*;

// Set per thread by the launcher; blockDim and gridDim are fixed for the whole
// launch and written before any kernel thread starts.
inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline dim3 blockDim;
inline dim3 gridDim;
constexpr int warpSize = 32;

namespace hfkern::emu {

struct Warp {
  explicit Warp(unsigned lanes) : n_lanes(lanes), bar(lanes) {}
  unsigned n_lanes;
  std::barrier<> bar;
  // Double-buffered so one barrier per exchange suffices: a lane can only
  // reuse a buffer after the next exchange's barrier, which every lane passes
  // only once it has finished reading this one.
  uint64_t slots[2][32] = {};
};

struct Block {
  explicit Block(unsigned threads) : bar(threads) {}
  std::barrier<> bar;
  std::vector<std::unique_ptr<Warp>> warps;
  unsigned char* smem = nullptr;
};

struct ThreadState {
  Block* block = nullptr;
  Warp* warp = nullptr;
  unsigned lane = 0;
  unsigned parity = 0;
};

inline thread_local ThreadState tls;

inline unsigned char* dynamic_smem() { return tls.block->smem; }

inline unsigned lane_mask_active() {
  unsigned n = tls.warp->n_lanes;
  return n == 32 ? 0xffffffffu : ((1u << n) - 1u);
}

// Every live lane publishes `value` and gets back the whole warp's slots.
inline const uint64_t* warp_exchange(uint64_t value) {
  Warp& w = *tls.warp;
  uint64_t* slots = w.slots[tls.parity];
  tls.parity ^= 1u;
  slots[tls.lane] = value;
  w.bar.arrive_and_wait();
  return slots;
}

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>,
                "warp shuffles move at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <typename T>
T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

inline void check_width(int width) {
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    throw std::invalid_argument("hfkern emulator: shuffle width must be a power of two <= 32");
}

template <typename T>
T shuffle_from(T var, int src, unsigned seg_end) {
  const uint64_t* slots = warp_exchange(to_bits(var));
  if (src < 0 || unsigned(src) >= seg_end || unsigned(src) >= tls.warp->n_lanes) return var;
  return from_bits<T>(slots[src]);
}

inline void check_launch(dim3 g, dim3 b) {
  const unsigned long long threads = 1ull * b.x * b.y * b.z;
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u || g.y > 65535 || g.z > 65535)
    throw std::invalid_argument("invalid grid dimensions");
  if (threads == 0 || threads > 1024 || b.x > 1024 || b.y > 1024 || b.z > 64)
    throw std::invalid_argument("invalid block dimensions");
}

// One launch at a time per process: blockDim, gridDim and __shared__ statics
// belong to the running launch.
inline std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace hfkern::emu

// ---------------------------------------------------------------- intrinsics

inline void __syncthreads() { hfkern::emu::tls.block->bar.arrive_and_wait(); }
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) { hfkern::emu::tls.warp->bar.arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned __activemask() { return hfkern::emu::lane_mask_active(); }

template <typename T>
T __ldg(const T* p) { return *p; }

// CUDA's device-side integer/float min and max (same-type overloads only).
#define HFKERN_MINMAX_(T)                                \
  inline T min(T a, T b) { return b < a ? b : a; }       \
  inline T max(T a, T b) { return a < b ? b : a; }
HFKERN_MINMAX_(int)
HFKERN_MINMAX_(unsigned)
HFKERN_MINMAX_(long long)
HFKERN_MINMAX_(unsigned long long)
HFKERN_MINMAX_(float)
HFKERN_MINMAX_(double)
#undef HFKERN_MINMAX_

template <typename T>
T __shfl_sync(unsigned, T var, int src_lane, int width = warpSize) {
  using namespace hfkern::emu;
  check_width(width);
  unsigned base = tls.lane & ~unsigned(width - 1);
  return shuffle_from(var, int(base + (unsigned(src_lane) & unsigned(width - 1))), base + width);
}

template <typename T>
T __shfl_up_sync(unsigned, T var, unsigned delta, int width = warpSize) {
  using namespace hfkern::emu;
  check_width(width);
  unsigned base = tls.lane & ~unsigned(width - 1);
  int src = int(tls.lane) - int(delta);
  return shuffle_from(var, src < int(base) ? int(tls.lane) : src, base + width);
}

template <typename T>
T __shfl_down_sync(unsigned, T var, unsigned delta, int width = warpSize) {
  using namespace hfkern::emu;
  check_width(width);
  unsigned base = tls.lane & ~unsigned(width - 1);
  unsigned src = tls.lane + delta;
  return shuffle_from(var, int(src >= base + width ? tls.lane : src), base + width);
}

// A lane may read from its own or an earlier group of `width` lanes, never a
// later one (it then keeps its own value), as the CUDA guide specifies.
template <typename T>
T __shfl_xor_sync(unsigned, T var, int lane_mask, int width = warpSize) {
  using namespace hfkern::emu;
  check_width(width);
  unsigned base = tls.lane & ~unsigned(width - 1);
  return shuffle_from(var, int(tls.lane ^ unsigned(lane_mask)), base + width);
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  using namespace hfkern::emu;
  const uint64_t* slots = warp_exchange(predicate != 0);
  unsigned bits = 0;
  for (unsigned l = 0; l < tls.warp->n_lanes; ++l) bits |= unsigned(slots[l] != 0) << l;
  return bits & mask;
}

inline int __any_sync(unsigned mask, int predicate) {
  return __ballot_sync(mask, predicate) != 0;
}

inline int __all_sync(unsigned mask, int predicate) {
  unsigned considered = mask & hfkern::emu::lane_mask_active();
  return (__ballot_sync(mask, predicate) & considered) == considered;
}

// ---------------------------------------------------------------- atomics

namespace hfkern::emu {
template <typename T>
T atomic_add(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }

template <typename T>
T atomic_max(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {}
  return old;
}

template <typename T>
T atomic_min(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {}
  return old;
}

template <typename T>
T atomic_cas(T* p, T compare, T v) {
  std::atomic_ref<T>(*p).compare_exchange_strong(compare, v);
  return compare;  // the old value, whether or not the swap happened
}

template <typename T>
T atomic_exch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
}  // namespace hfkern::emu

// Overloads, not templates, so that the accepted types match CUDA's.
inline int atomicAdd(int* p, int v) { return hfkern::emu::atomic_add(p, v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return hfkern::emu::atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return hfkern::emu::atomic_add(p, v); }
inline float atomicAdd(float* p, float v) { return hfkern::emu::atomic_add(p, v); }
inline double atomicAdd(double* p, double v) { return hfkern::emu::atomic_add(p, v); }
inline int atomicMax(int* p, int v) { return hfkern::emu::atomic_max(p, v); }
inline unsigned atomicMax(unsigned* p, unsigned v) { return hfkern::emu::atomic_max(p, v); }
inline int atomicMin(int* p, int v) { return hfkern::emu::atomic_min(p, v); }
inline unsigned atomicMin(unsigned* p, unsigned v) { return hfkern::emu::atomic_min(p, v); }
inline int atomicCAS(int* p, int c, int v) { return hfkern::emu::atomic_cas(p, c, v); }
inline unsigned atomicCAS(unsigned* p, unsigned c, unsigned v) { return hfkern::emu::atomic_cas(p, c, v); }
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long c, unsigned long long v) { return hfkern::emu::atomic_cas(p, c, v); }
inline int atomicExch(int* p, int v) { return hfkern::emu::atomic_exch(p, v); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return hfkern::emu::atomic_exch(p, v); }
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) { return hfkern::emu::atomic_exch(p, v); }
inline float atomicExch(float* p, float v) { return hfkern::emu::atomic_exch(p, v); }

// ---------------------------------------------------------------- launch

namespace hfkern {

template <typename... KArgs, typename... Args>
void launch(const char* name, const char* file, int line, void (*kernel)(KArgs...),
            dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t /*stream*/,
            Args&&... args) {
  using namespace emu;
  try {
    check_launch(grid, block);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("hfkern: launch of ") + name + " at " + file + ":" +
                             std::to_string(line) + " failed: " + e.what());
  }
  // Converted once, like the device's parameter buffer; every thread gets
  // its own copy when the kernel is called.
  const std::tuple<std::decay_t<KArgs>...> params(std::forward<Args>(args)...);
  const unsigned n_threads = block.x * block.y * block.z;
  const size_t smem_alloc = (smem_bytes + 15) / 16 * 16;
  std::unique_ptr<unsigned char[]> smem_store;
  unsigned char* smem = nullptr;
  if (smem_bytes) {
    smem_store.reset(new unsigned char[smem_alloc + 16]);
    // new[] only guarantees max_align_t; CUDA gives at least 16 bytes.
    smem = smem_store.get() + (16 - reinterpret_cast<uintptr_t>(smem_store.get()) % 16) % 16;
  }

  std::lock_guard<std::mutex> lock(launch_mutex());
  blockDim = block;
  gridDim = grid;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block blk(n_threads);
        for (unsigned w = 0; w < (n_threads + 31) / 32; ++w)
          blk.warps.push_back(std::make_unique<Warp>(std::min(32u, n_threads - 32 * w)));
        if (smem) std::memset(smem, 0xFF, smem_alloc);
        blk.smem = smem;

        std::mutex err_mutex;
        std::exception_ptr first_error;
        std::vector<std::thread> threads;
        threads.reserve(n_threads);
        for (unsigned t = 0; t < n_threads; ++t) {
          threads.emplace_back([&, t] {
            threadIdx = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
            blockIdx = {bx, by, bz};
            tls = ThreadState{&blk, blk.warps[t / 32].get(), t % 32, 0};
            try {
              std::apply(kernel, params);
            } catch (...) {
              std::lock_guard<std::mutex> g(err_mutex);
              if (!first_error) first_error = std::current_exception();
            }
            // Finished (or failed) threads stop counting toward barriers so
            // the rest of the block can still complete.
            tls.warp->bar.arrive_and_drop();
            blk.bar.arrive_and_drop();
            tls = ThreadState{};
          });
        }
        for (auto& th : threads) th.join();
        if (first_error) std::rethrow_exception(first_error);
      }
}

}  // namespace hfkern

#endif  // __CUDACC__
