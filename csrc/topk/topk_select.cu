// topk_select.cu: the passes over the data of hfkern::topk_select.
//
// The threshold search itself (the sample, the candidates of each pass, the
// bracket updates) is hfkern/_topk.py, shared by every backend; these kernels
// count and compact, on integer magnitude keys: the bit pattern with the sign
// bit cleared, every NaN clamped to one key (nan_key). Nothing here does float
// arithmetic, so every float dtype is a bit-pattern type (uint16/32/64) and
// values are copied bit for bit.
//
//   * topk_count_kernel: each thread compares its keys with the pass's
//     kTopkCandidates thresholds (in shared memory) and counts in registers;
//     warp shuffles and one shared row per warp reduce the counts, and the
//     block writes its partial counts, which the host sums (integers: exact).
//   * topk_block_counts_kernel: each block's keys above and at the threshold.
//   * topk_write_kernel: the stable compaction. The host turns the block counts
//     into exclusive scans (where each block's ties and its output start); the
//     block walks its tiles in order, and two block-wide exclusive scans per tile
//     give each kept entry its rank among the row's ties and its output slot.
//     No atomics, so the output is the same whatever order blocks run in.
#include <stdexcept>
#include <string>

#include "hfkern/topk.h"
#include "hfkern_cuda.h"

namespace hfkern {
namespace {

// 256, not more: the counting kernel keeps kTopkCandidates counters per thread,
// and a 512-thread bound leaves too few registers for 64-bit keys (spills).
constexpr int kMaxThreads = 256;
constexpr int kMaxWarps = kMaxThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

// The magnitude key of a bit pattern (hfkern/_topk.py's keys_of).
template <typename Bits, typename Key>
__device__ __forceinline__ Key magnitude_key(Bits bits, Key mag_mask, Key nan_key) {
  const Key key = static_cast<Key>(bits) & mag_mask;
  return key > nan_key ? nan_key : key;
}

__device__ __forceinline__ int warp_sum(int v) {
  for (int d = 16; d > 0; d >>= 1) v += __shfl_down_sync(kFullMask, v, d);
  return v;  // lane 0 holds the warp's sum
}

// Exclusive scan of v over the block's threads in thread order (blockDim.x a
// multiple of 32, every thread calls it); *total gets the block's sum.
// warp_sums: kMaxWarps ints of shared memory, free again when it returns.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(kFullMask, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  int before = 0, all = 0;
  const int warps = static_cast<int>(blockDim.x >> 5);
  for (int w = 0; w < warps; ++w) {
    before += w < warp ? warp_sums[w] : 0;
    all += warp_sums[w];
  }
  __syncthreads();
  *total = all;
  return before + x - v;
}

template <typename Bits, typename Key>
__global__ void __launch_bounds__(kMaxThreads)
    topk_count_kernel(const Bits* __restrict__ bits,  // [R, n]
                      int64_t n,
                      const int64_t* __restrict__ candidates,  // [R, kTopkCandidates]
                      int32_t* __restrict__ partial,  // [R, P, kTopkCandidates]
                      int64_t P, int64_t tiles, Key mag_mask, Key nan_key) {
  __shared__ Key s_cand[kTopkCandidates];
  __shared__ int s_warp[kMaxWarps][kTopkCandidates];
  const int64_t p = blockIdx.x, r = blockIdx.y;
  if (threadIdx.x < kTopkCandidates)
    s_cand[threadIdx.x] = static_cast<Key>(candidates[r * kTopkCandidates + threadIdx.x]);
  __syncthreads();

  int count[kTopkCandidates];
HFKERN_UNROLL
  for (int c = 0; c < kTopkCandidates; ++c) count[c] = 0;
  const Bits* row = bits + r * n;
  const int64_t begin = p * tiles * blockDim.x;
  const int64_t end = begin + tiles * blockDim.x < n ? begin + tiles * blockDim.x : n;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const Key key = magnitude_key(row[i], mag_mask, nan_key);
HFKERN_UNROLL
    for (int c = 0; c < kTopkCandidates; ++c) count[c] += key >= s_cand[c] ? 1 : 0;
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int c = 0; c < kTopkCandidates; ++c) {
    const int s = warp_sum(count[c]);
    if (lane == 0) s_warp[warp][c] = s;
  }
  __syncthreads();
  if (threadIdx.x < kTopkCandidates) {
    int total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += s_warp[w][threadIdx.x];
    partial[(r * P + p) * kTopkCandidates + threadIdx.x] = total;
  }
}

template <typename Bits, typename Key>
__global__ void __launch_bounds__(kMaxThreads)
    topk_block_counts_kernel(const Bits* __restrict__ bits,  // [R, n]
                             int64_t n,
                             const int64_t* __restrict__ threshold,  // [R]
                             int32_t* __restrict__ gt_out,  // [R, P]
                             int32_t* __restrict__ eq_out,  // [R, P]
                             int64_t P, int64_t tiles, Key mag_mask, Key nan_key) {
  __shared__ int s_gt[kMaxWarps], s_eq[kMaxWarps];
  const int64_t p = blockIdx.x, r = blockIdx.y;
  const Key t = static_cast<Key>(threshold[r]);
  const Bits* row = bits + r * n;
  const int64_t begin = p * tiles * blockDim.x;
  const int64_t end = begin + tiles * blockDim.x < n ? begin + tiles * blockDim.x : n;
  int gt = 0, eq = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const Key key = magnitude_key(row[i], mag_mask, nan_key);
    gt += key > t ? 1 : 0;
    eq += key == t ? 1 : 0;
  }
  gt = warp_sum(gt);
  eq = warp_sum(eq);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    s_gt[warp] = gt;
    s_eq[warp] = eq;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int g = 0, e = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
      g += s_gt[w];
      e += s_eq[w];
    }
    gt_out[r * P + p] = g;
    eq_out[r * P + p] = e;
  }
}

template <typename Bits, typename Key>
__global__ void __launch_bounds__(kMaxThreads)
    topk_write_kernel(const Bits* __restrict__ bits,  // [R, n]
                      int64_t n,
                      const int64_t* __restrict__ threshold,  // [R]
                      const int64_t* __restrict__ quota,  // [R]
                      const int64_t* __restrict__ tie_offset,  // [R, P]
                      const int64_t* __restrict__ out_offset,  // [R, P]
                      Bits* __restrict__ values,  // [R, cap]
                      int32_t* __restrict__ indices,  // [R, cap]
                      int64_t cap, int64_t P, int64_t tiles, Key mag_mask, Key nan_key) {
  __shared__ int s_scan[kMaxWarps];
  const int64_t p = blockIdx.x, r = blockIdx.y;
  const Key t = static_cast<Key>(threshold[r]);
  const int64_t q = quota[r];
  int64_t ties = tie_offset[r * P + p];
  int64_t taken = out_offset[r * P + p];
  const Bits* row = bits + r * n;
  const int64_t begin = p * tiles * blockDim.x;
  const int64_t end = begin + tiles * blockDim.x < n ? begin + tiles * blockDim.x : n;
  // Every thread runs every tile (the loop bound is uniform): the scans are block-wide.
  for (int64_t base = begin; base < end; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    Bits b = 0;
    int gt = 0, eq = 0;
    if (i < end) {
      b = row[i];
      const Key key = magnitude_key(b, mag_mask, nan_key);
      gt = key > t ? 1 : 0;
      eq = key == t ? 1 : 0;
    }
    int tile_ties = 0, tile_kept = 0;
    // The lowest-index `quota` ties of the row are kept.
    const int tie_rank = block_exclusive_scan(eq, s_scan, &tile_ties);
    const int keep = (gt != 0 || (eq != 0 && ties + tie_rank < q)) ? 1 : 0;
    const int slot = block_exclusive_scan(keep, s_scan, &tile_kept);
    if (keep) {
      values[r * cap + taken + slot] = b;
      indices[r * cap + taken + slot] = static_cast<int32_t>(i);
    }
    ties += tile_ties;
    taken += tile_kept;
  }
}

void check_launch(const char* what, int elem_bytes, int64_t R, int64_t n, int64_t P, int64_t tiles, int threads) {
  const std::string name = std::string("hfkern: ") + what + ": ";
  if (threads < 32 || threads > kMaxThreads || threads % 32 != 0)
    throw std::invalid_argument(name + "expected threads per block a multiple of 32 in [32, " +
                                std::to_string(kMaxThreads) + "], got " + std::to_string(threads));
  if (elem_bytes != 2 && elem_bytes != 4 && elem_bytes != 8)
    throw std::invalid_argument(name + "expected elem_bytes 2, 4 or 8, got " + std::to_string(elem_bytes));
  if (R < 0 || R > 65535) throw std::invalid_argument(name + "expected 0 <= R <= 65535 rows, got " + std::to_string(R));
  if (n < 1 || n > 0x7fffffff)
    throw std::invalid_argument(name + "expected 1 <= n < 2**31 entries per row, got " + std::to_string(n));
  if (P < 1 || P > 0x7fffffff || tiles < 1 || P * tiles * threads < n)
    throw std::invalid_argument(name + "expected P >= 1 blocks of tiles >= 1 tiles covering n = " +
                                std::to_string(n) + ", got P = " + std::to_string(P) +
                                ", tiles = " + std::to_string(tiles) + ", threads = " + std::to_string(threads));
}

// Calls f(Bits{}, Key{}) with the bit-pattern and key types of elem_bytes.
template <typename F>
void dispatch_bits(int elem_bytes, F&& f) {
  switch (elem_bytes) {
    case 2: f(uint16_t{}, int32_t{}); break;
    case 4: f(uint32_t{}, int32_t{}); break;
    default: f(uint64_t{}, int64_t{}); break;
  }
}

}  // namespace

void topk_count(const void* bits, int elem_bytes, int64_t R, int64_t n, const int64_t* candidates,
                int32_t* partial, int64_t P, int64_t tiles, int64_t mag_mask, int64_t nan_key, int threads,
                void* stream) {
  check_launch("topk_count", elem_bytes, R, n, P, tiles, threads);
  if (R == 0) return;
  const dim3 grid(static_cast<unsigned>(P), static_cast<unsigned>(R)), block(static_cast<unsigned>(threads));
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  dispatch_bits(elem_bytes, [&](auto b, auto k) {
    using Bits = decltype(b);
    using Key = decltype(k);
    HFKERN_LAUNCH((topk_count_kernel<Bits, Key>), grid, block, 0, s, static_cast<const Bits*>(bits), n,
                  candidates, partial, P, tiles, static_cast<Key>(mag_mask), static_cast<Key>(nan_key));
  });
}

void topk_block_counts(const void* bits, int elem_bytes, int64_t R, int64_t n, const int64_t* threshold,
                       int32_t* gt, int32_t* eq, int64_t P, int64_t tiles, int64_t mag_mask, int64_t nan_key,
                       int threads, void* stream) {
  check_launch("topk_block_counts", elem_bytes, R, n, P, tiles, threads);
  if (R == 0) return;
  const dim3 grid(static_cast<unsigned>(P), static_cast<unsigned>(R)), block(static_cast<unsigned>(threads));
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  dispatch_bits(elem_bytes, [&](auto b, auto k) {
    using Bits = decltype(b);
    using Key = decltype(k);
    HFKERN_LAUNCH((topk_block_counts_kernel<Bits, Key>), grid, block, 0, s, static_cast<const Bits*>(bits), n,
                  threshold, gt, eq, P, tiles, static_cast<Key>(mag_mask), static_cast<Key>(nan_key));
  });
}

void topk_write(const void* bits, int elem_bytes, int64_t R, int64_t n, const int64_t* threshold,
                const int64_t* quota, const int64_t* tie_offset, const int64_t* out_offset, void* values,
                int32_t* indices, int64_t cap, int64_t P, int64_t tiles, int64_t mag_mask, int64_t nan_key,
                int threads, void* stream) {
  check_launch("topk_write", elem_bytes, R, n, P, tiles, threads);
  if (cap < 1) throw std::invalid_argument("hfkern: topk_write: expected cap >= 1, got " + std::to_string(cap));
  if (R == 0) return;
  const dim3 grid(static_cast<unsigned>(P), static_cast<unsigned>(R)), block(static_cast<unsigned>(threads));
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  dispatch_bits(elem_bytes, [&](auto b, auto k) {
    using Bits = decltype(b);
    using Key = decltype(k);
    HFKERN_LAUNCH((topk_write_kernel<Bits, Key>), grid, block, 0, s, static_cast<const Bits*>(bits), n, threshold,
                  quota, tie_offset, out_offset, static_cast<Bits*>(values), indices, cap, P, tiles,
                  static_cast<Key>(mag_mask), static_cast<Key>(nan_key));
  });
}

}  // namespace hfkern
