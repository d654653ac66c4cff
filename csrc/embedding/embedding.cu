// embedding.cu: the array embedding of B models (hfkern::array_embedding) and its
// dense, deterministic weight gradient (hfkern::array_embedding_backward).
//
// The op contract is hfkern/ops/embedding.py; hfkern/cuda/embedding.py checks the
// tensors and lays them out (csrc/include/hfkern/embedding.h).
//
// Forward: one row copy per lookup, tx threads along the row, ty lookups per
// block. A lookup copies bits, so the row is moved in the widest word (2 to 16
// bytes) its alignment allows, whatever the dtype.
//
// Backward, with no atomics anywhere:
//   * the lookups' (key, position) pairs are sorted once, stably: keys are
//     b * V + index, so model b's hits of row v form one segment of the sorted
//     order, in input order; a shared index tensor is sorted once for all B
//     tables (embedding_sort: CUB on the GPU, std::stable_sort emulated; the
//     two give the same order, a stable sort's result being unique);
//   * bounds[r] = lower_bound(sorted keys, r) (one binary search per row, so
//     the work per thread does not depend on how the hits are distributed);
//   * embedding_bwd_rows_kernel: one row of the gradient per ty-slice of a
//     block; each thread owns `vec` columns and adds the row's hits in sorted
//     order, then divides by the hit count (scale_grad_by_freq). The padding
//     row and rows nobody hit are written as zeros: every row is written once.
// A frequent row (text is Zipf-like: its most common token can take a tenth of
// a batch) would make one thread add thousands of rows in sequence while the
// grid idles. So when more than `chunk` entries are sorted, the sorted order is
// cut into tiles of `chunk` entries and embedding_bwd_chunks_kernel sums the
// piece of the first (head) and the last (tail) row of each tile that has more
// than `chunk` hits: at most those two rows of a tile can be long. A long row's
// thread then adds its pieces' partials in tile order. Every addition's order is
// fixed by the sorted order and `chunk` alone, never by the launch shape, so two
// runs (and any tx, ty) give bitwise equal gradients.
//
// Offsets are int64: B * V * D passes 2**31 for large tables. Positions within
// a model and sorted entries are int32 (the glue checks models * n < 2**31).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "hfkern/dispatch.h"
#include "hfkern/dtypes.h"
#include "hfkern/embedding.h"
#include "hfkern_cuda.h"

#if HFKERN_EMULATED
#include <algorithm>
#include <numeric>
#include <vector>
#else
#include <cub/device/device_radix_sort.cuh>
#endif

namespace hfkern {
namespace {

constexpr int kMaxThreads = kEmbMaxThreads;
// Grad rows a thread loads before it adds them: independent loads in flight
// ahead of the chain of dependent adds (the order of the adds is unchanged).
constexpr int kUnroll = 4;

// ---- words and packs ---------------------------------------------------------------------

#if defined(__CUDACC__)
using Word16 = uint4;  // one 128-bit load / store
#else
struct alignas(16) Word16 {
  uint64_t lo, hi;
};
#endif

// VEC elements moved by one load or store (the glue checks the alignment).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// ---- forward ---------------------------------------------------------------------------------

template <typename W, typename I>
__global__ void __launch_bounds__(kMaxThreads)
    embedding_fwd_kernel(EmbForward a) {  // weight [B, V, Dw], idx [B, M, L], out [B, n, Dw] (words)
  const int64_t task = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;  // b * n + p
  if (task >= a.B * a.n) return;  // no barrier in this kernel
  const int64_t b = task / a.n, p = task - b * a.n;
  const int64_t m = p / a.idx.L, l = p - m * a.idx.L;
  const int64_t v = static_cast<int64_t>(
      static_cast<const I*>(a.idx.data)[b * a.idx.s_b + m * a.idx.s_m + l * a.idx.s_l]);
  const W* __restrict__ src = static_cast<const W*>(a.weight) + b * a.s_wb + v * a.s_wv;
  W* __restrict__ dst = static_cast<W*>(a.out) + task * a.Dw;
  for (int64_t k = threadIdx.x; k < a.Dw; k += blockDim.x) dst[k] = src[k * a.s_wd];
}

// ---- backward: keys, segments ----------------------------------------------------------------

template <typename I, typename K>
__global__ void __launch_bounds__(kMaxThreads)
    embedding_keys_kernel(EmbIndex idx,  // [models, M, L]
                          int64_t items, int64_t n, int64_t V,
                          K* __restrict__ keys,               // [items]
                          int32_t* __restrict__ positions) {  // [items]
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= items) return;
  const int64_t b = j / n, p = j - b * n;
  const int64_t m = p / idx.L, l = p - m * idx.L;
  const int64_t v = static_cast<int64_t>(static_cast<const I*>(idx.data)[b * idx.s_b + m * idx.s_m + l * idx.s_l]);
  keys[j] = static_cast<K>(b * V + v);
  positions[j] = static_cast<int32_t>(p);
}

template <typename K>
__global__ void __launch_bounds__(kMaxThreads)
    embedding_segments_kernel(const K* __restrict__ keys,  // [items] sorted
                              int64_t items, int64_t rows,
                              int32_t* __restrict__ bounds) {  // [rows + 1]
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r > rows) return;
  int64_t lo = 0, hi = items;  // the first key >= r lies in [lo, hi]
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (static_cast<int64_t>(keys[mid]) < r)
      lo = mid + 1;
    else
      hi = mid;
  }
  bounds[r] = static_cast<int32_t>(lo);
}

// ---- backward: sums --------------------------------------------------------------------------

// acc += grad rows of the sorted entries [lo, hi) in order; g: the model's grad_out
// at the thread's first column.
template <typename T, int VEC>
__device__ __forceinline__ void add_hits(const EmbBackward& a, const T* __restrict__ g, int32_t lo, int32_t hi,
                                         float (&acc)[VEC]) {
  const uint32_t L = static_cast<uint32_t>(a.L);
  int32_t j = lo;
  for (; j + kUnroll <= hi; j += kUnroll) {
    Pack<T, VEC> x[kUnroll];
HFKERN_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t pos = static_cast<uint32_t>(a.perm[j + u]);
      const uint32_t m = pos / L;
      x[u] = *reinterpret_cast<const Pack<T, VEC>*>(g + m * a.s_gm + (pos - m * L) * a.s_gl);
    }
HFKERN_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
HFKERN_UNROLL
      for (int k = 0; k < VEC; ++k) acc[k] += to_float(x[u].v[k]);
    }
  }
  for (; j < hi; ++j) {
    const uint32_t pos = static_cast<uint32_t>(a.perm[j]);
    const uint32_t m = pos / L;
    const Pack<T, VEC> x = *reinterpret_cast<const Pack<T, VEC>*>(g + m * a.s_gm + (pos - m * L) * a.s_gl);
HFKERN_UNROLL
    for (int k = 0; k < VEC; ++k) acc[k] += to_float(x.v[k]);
  }
}

// The sorted-key row whose segment holds sorted entry p: the last r with bounds[r] <= p.
__device__ __forceinline__ int64_t segment_of(const int32_t* __restrict__ bounds, int64_t rows, int64_t p) {
  int64_t lo = 0, hi = rows;  // bounds[0] = 0 <= p < items = bounds[rows]
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (bounds[mid] <= p)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Block (tile t, model slot pb); threadIdx.y 0: the tile's head piece (the row holding
// its first entry), 1: its tail piece (the row holding its last entry, if that row
// starts inside the tile). A piece is written only for a long row that is not the
// padding row; embedding_bwd_rows_kernel reads exactly those.
template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
    embedding_bwd_chunks_kernel(EmbBackward a) {  // part [tiles, 2, PB, D]
  const int64_t t = blockIdx.x, pb = blockIdx.y, PB = gridDim.y;
  const int slot = static_cast<int>(threadIdx.y);
  const int64_t first = t * a.chunk;
  const int64_t last = (first + a.chunk < a.items ? first + a.chunk : a.items) - 1;
  const int64_t rows = a.shared ? a.V : a.B * a.V;
  const int64_t seg = segment_of(a.bounds, rows, slot == 0 ? first : last);
  const int32_t start = a.bounds[seg], end = a.bounds[seg + 1];
  if (end - start <= a.chunk) return;    // a short row: its own thread adds its hits
  if (slot == 1 && start <= first) return;  // the head piece, already slot 0's
  const int64_t model = a.shared ? 0 : seg / a.V;
  if (seg - model * a.V == a.padding_idx) return;  // no gradient: never read
  const int64_t b = a.shared ? pb : model;
  // first, last < items <= 2**31 - 1
  const int32_t lo = start > first ? start : static_cast<int32_t>(first);
  const int32_t hi = end < last + 1 ? end : static_cast<int32_t>(last + 1);
  const T* __restrict__ g = static_cast<const T*>(a.grad) + b * a.s_gb;
  float* __restrict__ out = a.part + ((t * 2 + slot) * PB + pb) * a.D;
  for (int64_t dv = threadIdx.x; dv < a.D / VEC; dv += blockDim.x) {
    float acc[VEC];
HFKERN_UNROLL
    for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
    add_hits<T, VEC>(a, g + dv * VEC * a.s_gd, lo, hi, acc);
    Pack<float, VEC> y;
HFKERN_UNROLL
    for (int k = 0; k < VEC; ++k) y.v[k] = acc[k];
    *reinterpret_cast<Pack<float, VEC>*>(out + dv * VEC) = y;
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
    embedding_bwd_rows_kernel(EmbBackward a) {  // grad_w [B, V, D]
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;  // b * V + v
  if (row >= a.B * a.V) return;  // no barrier in this kernel
  const int64_t b = row / a.V, v = row - b * a.V;
  const int64_t seg = a.shared ? v : row;
  const int32_t start = a.bounds[seg], end = a.bounds[seg + 1];
  const bool pad = v == a.padding_idx;
  const bool chunked = a.part != nullptr && end - start > a.chunk;
  const T* __restrict__ g = static_cast<const T*>(a.grad) + b * a.s_gb;
  T* __restrict__ out = static_cast<T*>(a.grad_w) + row * a.D;
  // A long row's pieces: the tail piece of the tile it starts in (the head piece
  // when it starts the tile), then the head piece of every later tile.
  const int64_t t0 = start / a.chunk, t1 = chunked ? (end - 1) / a.chunk : t0 - 1;
  const int64_t PB = a.shared ? a.B : 1;
  const float* part = chunked ? a.part + (a.shared ? b : 0) * a.D : nullptr;
  for (int64_t dv = threadIdx.x; dv < a.D / VEC; dv += blockDim.x) {
    float acc[VEC];
HFKERN_UNROLL
    for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
    if (!pad && !chunked) {
      add_hits<T, VEC>(a, g + dv * VEC * a.s_gd, start, end, acc);
    } else if (!pad) {
      for (int64_t t = t0; t <= t1; ++t) {
        const int64_t slot = (t == t0 && start != t0 * a.chunk) ? 1 : 0;
        const float* q = part + (t * 2 + slot) * PB * a.D + dv * VEC;
HFKERN_UNROLL
        for (int k = 0; k < VEC; ++k) acc[k] += q[k];
      }
    }
    if (a.scale && !pad && end > start) {
      const float count = static_cast<float>(end - start);
HFKERN_UNROLL
      for (int k = 0; k < VEC; ++k) acc[k] /= count;
    }
    Pack<T, VEC> y;
HFKERN_UNROLL
    for (int k = 0; k < VEC; ++k) y.v[k] = from_float<T>(acc[k]);
    *reinterpret_cast<Pack<T, VEC>*>(out + dv * VEC) = y;
  }
}

// ---- launch checks and dispatch ----------------------------------------------------------


int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

unsigned grid_of(const char* what, int64_t blocks) {
  if (blocks > 0x7fffffff) fail(what, "the grid needs " + str(blocks) + " blocks, more than 2**31 - 1");
  return static_cast<unsigned>(blocks);
}

void check_block(const char* what, int tx, int ty) {
  if (tx < 1 || ty < 1 || int64_t(tx) * ty > kMaxThreads)
    fail(what, "expected a block of tx x ty >= 1 threads, at most " + str(kMaxThreads) + ", got " + str(tx) + " x " +
                   str(ty));
}

void check_items(const char* what, int64_t items) {
  if (items < 0 || items > 0x7fffffff)
    fail(what, "expected 0 to 2**31 - 1 sorted entries, got " + str(items));
}

void check_index(const char* what, const EmbIndex& idx) {
  if (idx.index_bytes != 4 && idx.index_bytes != 8)
    fail(what, "expected int32 or int64 indices (4 or 8 bytes), got " + str(idx.index_bytes) + " bytes");
  if (idx.L < 1) fail(what, "expected L >= 1, got " + str(idx.L));
}

// Calls f(K{}) with the key type of key_bytes.
template <typename F>
void dispatch_key(const char* what, int key_bytes, F&& f) {
  switch (key_bytes) {
    case 4: f(uint32_t{}); break;
    case 8: f(uint64_t{}); break;
    default: fail(what, "expected 4- or 8-byte keys, got " + str(key_bytes));
  }
}

template <typename F>
void dispatch_index(const char* what, int index_bytes, F&& f) {
  switch (index_bytes) {
    case 4: f(int32_t{}); break;
    case 8: f(int64_t{}); break;
    default: fail(what, "expected int32 or int64 indices, got " + str(index_bytes) + " bytes");
  }
}

// Calls f(T{}, std::integral_constant<int, VEC>{}) for a data dtype and a vector width
// of at most 16 bytes.
template <typename F>
void dispatch_pack(const char* what, DType dtype, int vec, F&& f) {
  auto with_vec = [&](auto tag) {
    using T = decltype(tag);
    switch (vec) {
      case 1: f(tag, std::integral_constant<int, 1>{}); return;
      case 2: f(tag, std::integral_constant<int, 2>{}); return;
      case 4: f(tag, std::integral_constant<int, 4>{}); return;
      case 8:
        if constexpr (sizeof(T) <= 2) {
          f(tag, std::integral_constant<int, 8>{});
          return;
        }
        break;
      default: break;
    }
    fail(what, "expected a vector of 1, 2, 4 or 8 elements of at most 16 bytes, got " + str(vec) + " x " +
                   str(static_cast<int64_t>(sizeof(T))) + " bytes");
  };
  dispatch_dtype(what, dtype, with_vec);
}

void check_backward(const char* what, const EmbBackward& a) {
  if (a.B < 0 || a.V < 0 || a.D < 0) fail(what, "expected B, V, D >= 0");
  check_items(what, a.items);
  if (a.L < 1) fail(what, "expected L >= 1, got " + str(a.L));
  if (a.chunk < 1) fail(what, "expected chunk >= 1, got " + str(a.chunk));
  if (a.vec < 1 || a.D % a.vec != 0) fail(what, "expected vec dividing D = " + str(a.D) + ", got " + str(a.vec));
  if (a.vec > 1 && a.s_gd != 1) fail(what, "vectors need grad_out's last dim contiguous");
  if (a.padding_idx < -1 || a.padding_idx >= a.V)
    fail(what, "expected padding_idx -1 or in [0, " + str(a.V) + "), got " + str(a.padding_idx));
  if (a.B * a.V > 0 && (a.perm == nullptr || a.bounds == nullptr)) fail(what, "expected perm and bounds");
}

#if HFKERN_EMULATED
// The emulator's sort step: the stable order CUB's radix sort produces, on host memory.
template <typename K>
void stable_sort_pairs(const K* keys_in, K* keys_out, const int32_t* values_in, int32_t* values_out,
                       int64_t items) {
  std::vector<int64_t> order(static_cast<size_t>(items));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return keys_in[x] < keys_in[y]; });
  for (int64_t j = 0; j < items; ++j) {
    keys_out[j] = keys_in[order[j]];
    values_out[j] = values_in[order[j]];
  }
}
#endif

}  // namespace

void embedding_forward(const EmbForward& a, int tx, int ty, void* stream) {
  const char* what = "embedding_forward";
  check_block(what, tx, ty);
  check_index(what, a.idx);
  if (a.B < 0 || a.n < 0 || a.Dw < 0) fail(what, "expected B, n, Dw >= 0");
  if (a.B * a.n == 0 || a.Dw == 0) return;
  const dim3 grid(grid_of(what, cdiv(a.B * a.n, ty))), block(static_cast<unsigned>(tx), static_cast<unsigned>(ty));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_index(what, a.idx.index_bytes, [&](auto itag) {
    using I = decltype(itag);
    switch (a.word_bytes) {
      case 2: HFKERN_LAUNCH((embedding_fwd_kernel<uint16_t, I>), grid, block, 0, st, a); break;
      case 4: HFKERN_LAUNCH((embedding_fwd_kernel<uint32_t, I>), grid, block, 0, st, a); break;
      case 8: HFKERN_LAUNCH((embedding_fwd_kernel<uint64_t, I>), grid, block, 0, st, a); break;
      case 16: HFKERN_LAUNCH((embedding_fwd_kernel<Word16, I>), grid, block, 0, st, a); break;
      default: fail(what, "expected words of 2, 4, 8 or 16 bytes, got " + str(a.word_bytes));
    }
  });
}

void embedding_sort_keys(const EmbIndex& idx, int64_t models, int64_t n, int64_t V, int key_bytes, void* keys,
                         int32_t* positions, int threads, void* stream) {
  const char* what = "embedding_sort_keys";
  check_index(what, idx);
  check_block(what, threads, 1);
  if (models < 0 || n < 0 || V < 0) fail(what, "expected models, n, V >= 0");
  const int64_t items = models * n;
  check_items(what, items);
  if (items == 0) return;
  const dim3 grid(grid_of(what, cdiv(items, threads))), block(static_cast<unsigned>(threads));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_index(what, idx.index_bytes, [&](auto itag) {
    dispatch_key(what, key_bytes, [&](auto ktag) {
      using I = decltype(itag);
      using K = decltype(ktag);
      HFKERN_LAUNCH((embedding_keys_kernel<I, K>), grid, block, 0, st, idx, items, n, V, static_cast<K*>(keys),
                    positions);
    });
  });
}

size_t embedding_sort_temp_bytes(int64_t items, int key_bytes, int end_bit) {
  const char* what = "embedding_sort_temp_bytes";
  check_items(what, items);
  if (end_bit < 1 || end_bit > 8 * key_bytes) fail(what, "expected end_bit in [1, key bits], got " + str(end_bit));
  size_t bytes = 0;
#if HFKERN_EMULATED
  dispatch_key(what, key_bytes, [](auto) {});
#else
  dispatch_key(what, key_bytes, [&](auto ktag) {
    using K = decltype(ktag);
    // A query: CUB only computes the size when the storage pointer is null.
    HFKERN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const K*>(nullptr),
                                                      static_cast<K*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                      static_cast<int32_t*>(nullptr), static_cast<int>(items), 0,
                                                      end_bit));
  });
#endif
  return bytes;
}

void embedding_sort(void* temp, size_t temp_bytes, const void* keys_in, void* keys_out, const int32_t* values_in,
                    int32_t* values_out, int64_t items, int key_bytes, int end_bit, void* stream) {
  const char* what = "embedding_sort";
  check_items(what, items);
  if (end_bit < 1 || end_bit > 8 * key_bytes) fail(what, "expected end_bit in [1, key bits], got " + str(end_bit));
  if (items == 0) return;
#if HFKERN_EMULATED
  (void)temp;
  (void)temp_bytes;
  (void)stream;
  // Every earlier launch has finished: the emulator runs them synchronously.
  dispatch_key(what, key_bytes, [&](auto ktag) {
    using K = decltype(ktag);
    stable_sort_pairs(static_cast<const K*>(keys_in), static_cast<K*>(keys_out), values_in, values_out, items);
  });
#else
  if (temp == nullptr) fail(what, "expected temporary storage (embedding_sort_temp_bytes)");
  dispatch_key(what, key_bytes, [&](auto ktag) {
    using K = decltype(ktag);
    size_t bytes = temp_bytes;
    HFKERN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, bytes, static_cast<const K*>(keys_in),
                                                      static_cast<K*>(keys_out), values_in, values_out,
                                                      static_cast<int>(items), 0, end_bit,
                                                      reinterpret_cast<cudaStream_t>(stream)));
  });
#endif
}

void embedding_segments(const void* sorted_keys, int key_bytes, int64_t items, int64_t rows, int32_t* bounds,
                        int threads, void* stream) {
  const char* what = "embedding_segments";
  check_items(what, items);
  check_block(what, threads, 1);
  if (rows < 0) fail(what, "expected rows >= 0, got " + str(rows));
  const dim3 grid(grid_of(what, cdiv(rows + 1, threads))), block(static_cast<unsigned>(threads));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_key(what, key_bytes, [&](auto ktag) {
    using K = decltype(ktag);
    HFKERN_LAUNCH((embedding_segments_kernel<K>), grid, block, 0, st, static_cast<const K*>(sorted_keys), items,
                  rows, bounds);
  });
}

void embedding_backward_chunks(const EmbBackward& a, int tx, void* stream) {
  const char* what = "embedding_backward_chunks";
  check_backward(what, a);
  check_block(what, tx, 2);
  if (a.part == nullptr) fail(what, "expected the partials buffer");
  const int64_t PB = a.shared ? a.B : 1;
  if (PB > 65535) fail(what, "expected at most 65535 models with shared indices, got " + str(PB));
  if (a.items <= a.chunk || a.B * a.V * a.D == 0) return;  // no row can be long
  const dim3 grid(grid_of(what, cdiv(a.items, a.chunk)), static_cast<unsigned>(PB)),
      block(static_cast<unsigned>(tx), 2);
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_pack(what, a.dtype, a.vec, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr int VEC = decltype(vec)::value;
    HFKERN_LAUNCH((embedding_bwd_chunks_kernel<T, VEC>), grid, block, 0, st, a);
  });
}

void embedding_backward_rows(const EmbBackward& a, int tx, int ty, void* stream) {
  const char* what = "embedding_backward_rows";
  check_backward(what, a);
  check_block(what, tx, ty);
  // The chunk pass runs exactly when a row can be long: it fixes the summation order.
  if ((a.part != nullptr) != (a.items > a.chunk))
    fail(what, "expected the partials of embedding_backward_chunks exactly when items (" + str(a.items) +
                   ") > chunk (" + str(a.chunk) + ")");
  if (a.B * a.V * a.D == 0) return;
  const dim3 grid(grid_of(what, cdiv(a.B * a.V, ty))), block(static_cast<unsigned>(tx), static_cast<unsigned>(ty));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_pack(what, a.dtype, a.vec, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr int VEC = decltype(vec)::value;
    HFKERN_LAUNCH((embedding_bwd_rows_kernel<T, VEC>), grid, block, 0, st, a);
  });
}

}  // namespace hfkern
