// layer_norm.cu: the array layer norm and RMS norm of B models
// (hfkern::array_layer_norm, array_rms_norm and their backward ops), with the
// layer norm's fused activation.
//
// The op contract is hfkern/ops/layer_norm.py; hfkern/cuda/layer_norm.py checks
// the tensors, reduces their layout and picks the launch configuration. The
// kernels see B x M rows of D elements through strides (LnTensor), so an array
// conv's [N, B, ...] memory, a strided slice, a shared input (stride 0 on B) and
// an expanded grad_y (stride 0 everywhere) are read where they lie.
//
// Threads (LnConfig). A row is reduced by row_threads threads: warp shuffles
// within groups of `lanes`, then shared memory across the groups of a row. Short
// rows run a warp (or a power-of-two part of one) each, several rows per block;
// long rows a block each. Shuffle reductions are butterflies, so every thread
// of a row ends with the same, bitwise equal, sum; the groups' sums are added
// in group order. Every thread of a block runs every reduction, also for rows
// past the end (with zeros), so the warp collectives are never divergent.
//
// A thread owns the packs lane, lane + row_threads, ... of its row (a pack:
// VEC = 16 / sizeof(T) consecutive columns, one 16-byte access where the layout
// allows). A row that fits (config.regs) is held in registers and read once;
// a longer one is swept: mean, centred sum of squares (as accurate as a
// two-pass variance), write. Statistics and arithmetic are float32.
//
// Backward: block (model b, chunk p) runs the chunk's rows. It writes grad_x
// and the chunk's float32 partial sums of gz * xhat and gz per column into its
// own row of the [B, P, D] partial buffers: from registers (the rows of a
// block combined through shared memory in row-slot order), or, for swept rows,
// added into that row in global memory by the thread that owns the column.
// ln_sum_partials_kernel then adds each column's P partials in chunk order. No
// atomics: the results do not depend on the order blocks run in.
//
// Offsets are int64: a model's slice of a large activation passes 2**31 elements.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "hfkern/activation.h"
#include "hfkern/dispatch.h"
#include "hfkern/dtypes.h"
#include "hfkern/layer_norm.h"
#include "hfkern_cuda.h"

// Loops over rows and swept packs stay rolled: unrolled copies would hold their
// rows' registers at once (and spill).
#if defined(__CUDACC__)
#define HFKERN_LN_ROLLED _Pragma("unroll 1")
#else
#define HFKERN_LN_ROLLED
#endif

namespace hfkern {
namespace {

constexpr int kMaxThreads = kLnMaxThreads;
constexpr int kNone = static_cast<int>(LnActivation::None);
constexpr int kRelu = static_cast<int>(LnActivation::Relu);
constexpr int kGelu = static_cast<int>(LnActivation::Gelu);

// ---- math --------------------------------------------------------------------------------

__device__ __forceinline__ float rsqrt_of(float v) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(v);
#else
  return 1.0f / std::sqrt(v);
#endif
}

// ---- addressing and packs ------------------------------------------------------------------

__device__ __forceinline__ int64_t row_offset(const LnTensor& t, int64_t b, int64_t m, int64_t M1) {
  return b * t.s_b + (m / M1) * t.s_m0 + (m % M1) * t.s_m1;
}

__device__ __forceinline__ int64_t col_offset(const LnTensor& t, int col, int D1, bool split) {
  return split ? int64_t(col / D1) * t.s_d0 + int64_t(col % D1) * t.s_d1 : int64_t(col) * t.s_d1;
}

// N values of U as one aligned access of at most 16 bytes.
template <typename U, int N>
struct alignas(sizeof(U) * N) Vec {
  static_assert(sizeof(U) * N <= 16, "one access moves at most 16 bytes");
  U v[N];
};

// N values of U at p (aligned to min(16, N * sizeof(U)) bytes) as float32, in
// accesses of at most 16 bytes (a 32-byte aggregate would go through the stack).
template <typename U, int N>
__device__ __forceinline__ void load_vec(const U* p, float (&out)[N]) {
  constexpr int kPer = sizeof(U) * N > 16 ? 16 / int(sizeof(U)) : N;
HFKERN_UNROLL
  for (int c = 0; c < N / kPer; ++c) {
    const Vec<U, kPer> pk = reinterpret_cast<const Vec<U, kPer>*>(p)[c];
HFKERN_UNROLL
    for (int j = 0; j < kPer; ++j) out[c * kPer + j] = to_float(pk.v[j]);
  }
}

template <typename U, int N>
__device__ __forceinline__ void store_vec(U* p, const float (&in)[N]) {
  constexpr int kPer = sizeof(U) * N > 16 ? 16 / int(sizeof(U)) : N;
HFKERN_UNROLL
  for (int c = 0; c < N / kPer; ++c) {
    Vec<U, kPer> pk;
HFKERN_UNROLL
    for (int j = 0; j < kPer; ++j) pk.v[j] = from_float<U>(in[c * kPer + j]);
    reinterpret_cast<Vec<U, kPer>*>(p)[c] = pk;
  }
}

// The columns of a row as the kernels address them (D < 2**31: checked at launch).
struct Cols {
  int D, D1;
  bool split;
};

// Columns [col0, col0 + N) of a data row as float32; columns past D read as 0.
template <typename U, int N>
__device__ __forceinline__ void load_pack(const U* row, const LnTensor& t, const Cols& c, int col0, bool vec,
                                          float (&out)[N]) {
  if (vec) {
    load_vec(row + col0, out);
  } else {
HFKERN_UNROLL
    for (int j = 0; j < N; ++j) {
      const int col = col0 + j;
      out[j] = col < c.D ? to_float(row[col_offset(t, col, c.D1, c.split)]) : 0.0f;
    }
  }
}

template <typename U, int N>
__device__ __forceinline__ void store_pack(U* row, const LnTensor& t, const Cols& c, int col0, bool vec,
                                           const float (&in)[N]) {
  if (vec) {
    store_vec(row + col0, in);
  } else {
HFKERN_UNROLL
    for (int j = 0; j < N; ++j) {
      const int col = col0 + j;
      if (col < c.D) row[col_offset(t, col, c.D1, c.split)] = from_float<U>(in[j]);
    }
  }
}

template <typename U, int N>
__device__ __forceinline__ void load_param_as(const LnParam& p, int64_t b, int col0, int D, bool vec,
                                              float (&out)[N]) {
  const U* row = static_cast<const U*>(p.data) + b * p.s_b;
  if (vec) {
    load_vec(row + col0, out);
  } else {
HFKERN_UNROLL
    for (int j = 0; j < N; ++j) {
      const int col = col0 + j;
      out[j] = col < D ? to_float(row[int64_t(col) * p.s_d]) : 0.0f;
    }
  }
}

// Columns [col0, col0 + N) of model b's parameter as float32, `fill` where it is absent.
template <int N>
__device__ __forceinline__ void load_param(const LnParam& p, int64_t b, int col0, int D, bool vec,
                                           float fill, float (&out)[N]) {
  if (p.data == nullptr) {
HFKERN_UNROLL
    for (int j = 0; j < N; ++j) out[j] = fill;
    return;
  }
  switch (p.dtype) {
    case DType::Float16: load_param_as<Half, N>(p, b, col0, D, vec, out); break;
    case DType::BFloat16: load_param_as<BFloat16, N>(p, b, col0, D, vec, out); break;
    default: load_param_as<float, N>(p, b, col0, D, vec, out); break;
  }
}

__device__ __forceinline__ void store_param(const LnParam& p, int64_t b, int64_t col, float v) {
  const int64_t i = b * p.s_b + col * p.s_d;
  switch (p.dtype) {
    case DType::Float16: static_cast<Half*>(p.data)[i] = from_float<Half>(v); break;
    case DType::BFloat16: static_cast<BFloat16*>(p.data)[i] = from_float<BFloat16>(v); break;
    default: static_cast<float*>(p.data)[i] = v; break;
  }
}

// ---- row reductions ------------------------------------------------------------------------

// A thread's place in its row: lane in the row, its shuffle group's width, the
// number of groups of the row and this thread's group.
struct RowLanes {
  int lane, width, groups, group;
};

__device__ __forceinline__ RowLanes row_lanes(const LnConfig& c, int tid) {
  RowLanes r;
  r.lane = tid % c.row_threads;
  r.width = c.lanes;
  r.groups = c.row_threads / c.lanes;
  r.group = r.lane / c.lanes;
  return r;
}

// The sums of a and b over the row's threads, in every thread of the row. Every
// thread of the block calls it (shuffles and barriers are block-wide collectives
// here); r.groups > 1 only with one row per block.
__device__ __forceinline__ void row_sum2(float& a, float& b, const RowLanes& r, float* red) {
  for (int o = r.width / 2; o > 0; o /= 2) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  if (r.groups > 1) {
    __syncthreads();  // the previous reduction's readers are done with red
    if (r.lane % r.width == 0) {
      red[r.group] = a;
      red[kMaxThreads + r.group] = b;
    }
    __syncthreads();
    a = 0.0f;
    b = 0.0f;
    for (int i = 0; i < r.groups; ++i) {  // in group order: the same sum in every thread
      a += red[i];
      b += red[kMaxThreads + i];
    }
  }
}

__device__ __forceinline__ float row_sum(float a, const RowLanes& r, float* red) {
  float unused = 0.0f;
  row_sum2(a, unused, r, red);
  return a;
}

// ---- forward -------------------------------------------------------------------------------

template <typename T, bool RMS, int ACT>
__global__ void __launch_bounds__(kMaxThreads, 1)
    ln_fwd_kernel(LnTensor x,  // [B, M, D] through strides, dtype T
                  LnTensor y,  // [B, M, D] through y's strides, dtype T
                  LnParam w,   // [B, D] or absent
                  LnParam bias,  // [B, D] or absent (layer norm only)
                  LnShape s, LnConfig c, float eps,
                  float* __restrict__ mean_out,   // [B, M] float32, contiguous (layer norm only)
                  float* __restrict__ rstd_out) {  // [B, M] float32, contiguous
  constexpr int VEC = 16 / sizeof(T);
  constexpr int PACKS = kLnFwdValues / VEC;
  __shared__ float red[2 * kMaxThreads];
  const int tid = static_cast<int>(threadIdx.x);
  const RowLanes rl = row_lanes(c, tid);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * c.rows + tid / c.row_threads;
  const bool ok = row < s.B * s.M;
  const int64_t b = ok ? row / s.M : 0, m = ok ? row % s.M : 0;
  const Cols cols{static_cast<int>(s.D), static_cast<int>(s.D1), s.D1 != s.D};
  const T* __restrict__ xr = static_cast<const T*>(x.data) + row_offset(x, b, m, s.M1);
  T* __restrict__ yr = static_cast<T*>(y.data) + row_offset(y, b, m, s.M1);
  const int n_packs = (cols.D + VEC - 1) / VEC;
  const float inv_d = 1.0f / static_cast<float>(s.D);
  const bool vec = c.vec, pvec = c.param_vec;
  float mean = 0.0f, rstd = 0.0f;

  // z = xhat * w + b, then the activation, stored into y's row
  auto write = [&](int p, const float (&v)[VEC]) {
    float wv[VEC], bv[VEC], out[VEC];
    load_param(w, b, p * VEC, cols.D, pvec, 1.0f, wv);
    load_param(bias, b, p * VEC, cols.D, pvec, 0.0f, bv);
HFKERN_UNROLL
    for (int j = 0; j < VEC; ++j) out[j] = activate((v[j] - mean) * rstd * wv[j] + bv[j], Activation(ACT));
    store_pack(yr, y, cols, p * VEC, vec, out);
  };

  if (c.regs) {
    float v[PACKS][VEC];
    float acc = 0.0f;
HFKERN_UNROLL
    for (int k = 0; k < PACKS; ++k) {
      const int p = rl.lane + k * c.row_threads;
      if (ok && p < n_packs) {
        load_pack(xr, x, cols, p * VEC, vec, v[k]);
      } else {
HFKERN_UNROLL
        for (int j = 0; j < VEC; ++j) v[k][j] = 0.0f;
      }
HFKERN_UNROLL
      for (int j = 0; j < VEC; ++j) acc += RMS ? v[k][j] * v[k][j] : v[k][j];  // padding is 0
    }
    if (!RMS) {
      mean = row_sum(acc, rl, red) * inv_d;
      acc = 0.0f;
HFKERN_UNROLL
      for (int k = 0; k < PACKS; ++k) {
        const int p = rl.lane + k * c.row_threads;
HFKERN_UNROLL
        for (int j = 0; j < VEC; ++j) {
          const float d = p * VEC + j < cols.D ? v[k][j] - mean : 0.0f;  // padding stays out of the variance
          acc += d * d;
        }
      }
    }
    rstd = rsqrt_of(row_sum(acc, rl, red) * inv_d + eps);
HFKERN_UNROLL
    for (int k = 0; k < PACKS; ++k) {
      const int p = rl.lane + k * c.row_threads;
      if (ok && p < n_packs) write(p, v[k]);
    }
  } else {
    // Swept: the row's re-reads mostly hit cache.
    float acc = 0.0f;
    if (!RMS) {
HFKERN_LN_ROLLED
      for (int p = rl.lane; ok && p < n_packs; p += c.row_threads) {
        float v[VEC];
        load_pack(xr, x, cols, p * VEC, vec, v);
HFKERN_UNROLL
        for (int j = 0; j < VEC; ++j) acc += v[j];
      }
      mean = row_sum(acc, rl, red) * inv_d;
      acc = 0.0f;
    }
HFKERN_LN_ROLLED
    for (int p = rl.lane; ok && p < n_packs; p += c.row_threads) {
      float v[VEC];
      load_pack(xr, x, cols, p * VEC, vec, v);
HFKERN_UNROLL
      for (int j = 0; j < VEC; ++j) {
        const float d = p * VEC + j < cols.D ? v[j] - mean : 0.0f;
        acc += d * d;
      }
    }
    rstd = rsqrt_of(row_sum(acc, rl, red) * inv_d + eps);
HFKERN_LN_ROLLED
    for (int p = rl.lane; ok && p < n_packs; p += c.row_threads) {
      float v[VEC];
      load_pack(xr, x, cols, p * VEC, vec, v);
      write(p, v);
    }
  }
  if (ok && rl.lane == 0) {
    if (!RMS) mean_out[row] = mean;  // row = b * M + m
    rstd_out[row] = rstd;
  }
}

// ---- backward ------------------------------------------------------------------------------

// What one pack of a row gives the backward: xhat, gz = grad_y * act'(z) and the
// weight (1 without one), 0 in columns past D.
template <typename T, typename G, bool RMS, int ACT, int VEC>
__device__ __forceinline__ void bwd_pack(const T* xr, const G* gr, const LnTensor& x, const LnTensor& gy,
                                         const LnParam& w, const LnParam& bias, const Cols& cols, int64_t b,
                                         int p, bool vec, bool pvec, float mean, float rstd, float (&xh)[VEC],
                                         float (&gz)[VEC], float (&wv)[VEC]) {
  const int col0 = p * VEC;
  load_pack(xr, x, cols, col0, vec, xh);
  load_pack(gr, gy, cols, col0, vec, gz);
  load_param(w, b, col0, cols.D, pvec, 1.0f, wv);
HFKERN_UNROLL
  for (int j = 0; j < VEC; ++j) xh[j] = col0 + j < cols.D ? (RMS ? xh[j] : xh[j] - mean) * rstd : 0.0f;
  if constexpr (ACT != kNone) {
    float bv[VEC];
    load_param(bias, b, col0, cols.D, pvec, 0.0f, bv);
HFKERN_UNROLL
    for (int j = 0; j < VEC; ++j) gz[j] = activation_grad(gz[j], xh[j] * wv[j] + bv[j], Activation(ACT));
  }
}

template <typename T, typename G, bool RMS, int ACT>
__global__ void __launch_bounds__(kLnMaxBwdThreads, 1)
    ln_bwd_kernel(LnTensor gy,  // [B, M, D] through strides, dtype G
                  LnTensor x,   // [B, M, D] through x's strides, dtype T
                  LnTensor gx,  // [B, M, D] through grad_x's strides, dtype T; data nullptr: not wanted
                  LnParam w,    // [B, D] or absent
                  LnParam bias,  // [B, D] or absent: read only for the activation's derivative
                  LnShape s, LnConfig c, int64_t chunk, int64_t P,
                  const float* __restrict__ mean,  // [B, M] float32, contiguous (layer norm only)
                  const float* __restrict__ rstd,  // [B, M] float32, contiguous
                  float* __restrict__ pw,   // [B, P, D] float32: per-chunk sums of gz * xhat, or nullptr
                  float* __restrict__ pb) {  // [B, P, D] float32: per-chunk sums of gz, or nullptr
  constexpr int VEC = 16 / sizeof(T);
  constexpr int PACKS = kLnBwdValues / VEC;
  __shared__ float red[2 * kMaxThreads];
  const int tid = static_cast<int>(threadIdx.x);
  const RowLanes rl = row_lanes(c, tid);
  const int slot = tid / c.row_threads;
  const int64_t b = blockIdx.x / P, part = blockIdx.x % P;
  const int64_t lo = part * chunk, hi = lo + chunk < s.M ? lo + chunk : s.M;
  const Cols cols{static_cast<int>(s.D), static_cast<int>(s.D1), s.D1 != s.D};
  const int n_packs = (cols.D + VEC - 1) / VEC;
  const float inv_d = 1.0f / static_cast<float>(s.D);
  const bool vec = c.vec, pvec = c.param_vec;
  const bool want_dx = gx.data != nullptr, want_dw = pw != nullptr, want_db = pb != nullptr;
  // this block's own row of the partial buffers: nobody else reads or writes it
  float* pw_row = want_dw ? pw + (b * P + part) * s.D : nullptr;
  float* pb_row = want_db ? pb + (b * P + part) * s.D : nullptr;

  auto stats = [&](int64_t m, float& mu, float& rs) {
    rs = rstd[b * s.M + m];
    mu = RMS ? 0.0f : mean[b * s.M + m];
  };
  // grad_x = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = gz * w (RMS: no mean(g))
  auto grad_x = [&](T* gxr, int p, const float (&xh)[VEC], const float (&gz)[VEC], const float (&wv)[VEC],
                    float c_xh, float c_g, float rs) {
    float out[VEC];
HFKERN_UNROLL
    for (int j = 0; j < VEC; ++j) out[j] = (gz[j] * wv[j] - c_g - xh[j] * c_xh) * rs;
    store_pack(gxr, gx, cols, p * VEC, vec, out);
  };

  if (c.regs) {
    float aw[PACKS][VEC], ab[PACKS][VEC];
HFKERN_UNROLL
    for (int k = 0; k < PACKS; ++k) {
HFKERN_UNROLL
      for (int j = 0; j < VEC; ++j) aw[k][j] = ab[k][j] = 0.0f;
    }
HFKERN_LN_ROLLED
    for (int64_t r0 = lo; r0 < hi; r0 += c.rows) {  // the same trip count in every thread
      const int64_t m = r0 + slot;
      const bool ok = m < hi;
      float mu = 0.0f, rs = 0.0f;
      if (ok) stats(m, mu, rs);
      const int64_t mm = ok ? m : lo;
      const T* xr = static_cast<const T*>(x.data) + row_offset(x, b, mm, s.M1);
      const G* gr = static_cast<const G*>(gy.data) + row_offset(gy, b, mm, s.M1);
      float xh[PACKS][VEC], gz[PACKS][VEC];
      float s_gxh = 0.0f, s_g = 0.0f;
HFKERN_UNROLL
      for (int k = 0; k < PACKS; ++k) {
        const int p = rl.lane + k * c.row_threads;
        float wv[VEC];
        if (ok && p < n_packs) {
          bwd_pack<T, G, RMS, ACT, VEC>(xr, gr, x, gy, w, bias, cols, b, p, vec, pvec, mu, rs, xh[k], gz[k], wv);
        } else {
HFKERN_UNROLL
          for (int j = 0; j < VEC; ++j) xh[k][j] = gz[k][j] = wv[j] = 0.0f;
        }
HFKERN_UNROLL
        for (int j = 0; j < VEC; ++j) {
          aw[k][j] += gz[k][j] * xh[k][j];
          ab[k][j] += gz[k][j];
          const float g = gz[k][j] * wv[j];
          s_gxh += g * xh[k][j];
          s_g += g;
        }
      }
      if (want_dx) {
        row_sum2(s_gxh, s_g, rl, red);
        const float c_xh = s_gxh * inv_d, c_g = RMS ? 0.0f : s_g * inv_d;
        T* gxr = static_cast<T*>(gx.data) + row_offset(gx, b, mm, s.M1);
HFKERN_UNROLL
        for (int k = 0; k < PACKS; ++k) {
          const int p = rl.lane + k * c.row_threads;
          if (ok && p < n_packs) {
            float wv[VEC];
            load_param(w, b, p * VEC, cols.D, pvec, 1.0f, wv);
            grad_x(gxr, p, xh[k], gz[k], wv, c_xh, c_g, rs);
          }
        }
      }
    }
    if (want_dw || want_db) {
      const int n_part = int(want_dw) + int(want_db);
      if (c.rows == 1) {
HFKERN_UNROLL
        for (int k = 0; k < PACKS; ++k) {
          const int p = rl.lane + k * c.row_threads;
HFKERN_UNROLL
          for (int j = 0; j < VEC; ++j) {
            const int col = p * VEC + j;
            if (p >= n_packs || col >= cols.D) continue;
            if (want_dw) pw_row[col] = aw[k][j];
            if (want_db) pb_row[col] = ab[k][j];
          }
        }
      } else {
        // the block's row slots, combined in slot order: [rows, n_part, D]
        HFKERN_DYNAMIC_SMEM(float, part_sums);
HFKERN_UNROLL
        for (int k = 0; k < PACKS; ++k) {
          const int p = rl.lane + k * c.row_threads;
HFKERN_UNROLL
          for (int j = 0; j < VEC; ++j) {
            const int col = p * VEC + j;
            if (p >= n_packs || col >= cols.D) continue;
            float* mine = part_sums + static_cast<int64_t>(slot) * n_part * s.D + col;
            if (want_dw) mine[0] = aw[k][j];
            if (want_db) mine[(n_part - 1) * s.D] = ab[k][j];
          }
        }
        __syncthreads();
HFKERN_LN_ROLLED
        for (int col = tid; col < cols.D; col += static_cast<int>(blockDim.x)) {
          float sw = 0.0f, sb = 0.0f;
          for (int r = 0; r < c.rows; ++r) {
            const float* theirs = part_sums + static_cast<int64_t>(r) * n_part * s.D + col;
            sw += theirs[0];
            sb += theirs[(n_part - 1) * s.D];
          }
          if (want_dw) pw_row[col] = sw;
          if (want_db) pb_row[col] = sb;
        }
      }
    }
  } else {
    // Swept, one row per block: the row is read twice when grad_x is wanted (its
    // row sums come first), and the chunk's partial sums of each column are kept
    // in this block's partial row by the thread that owns the column.
HFKERN_LN_ROLLED
    for (int64_t m = lo; m < hi; ++m) {
      float mu, rs;
      stats(m, mu, rs);
      const T* xr = static_cast<const T*>(x.data) + row_offset(x, b, m, s.M1);
      const G* gr = static_cast<const G*>(gy.data) + row_offset(gy, b, m, s.M1);
      float c_xh = 0.0f, c_g = 0.0f;
      if (want_dx) {
        float s_gxh = 0.0f, s_g = 0.0f;
HFKERN_LN_ROLLED
        for (int p = rl.lane; p < n_packs; p += c.row_threads) {
          float xh[VEC], gz[VEC], wv[VEC];
          bwd_pack<T, G, RMS, ACT, VEC>(xr, gr, x, gy, w, bias, cols, b, p, vec, pvec, mu, rs, xh, gz, wv);
HFKERN_UNROLL
          for (int j = 0; j < VEC; ++j) {
            const float g = gz[j] * wv[j];
            s_gxh += g * xh[j];
            s_g += g;
          }
        }
        row_sum2(s_gxh, s_g, rl, red);
        c_xh = s_gxh * inv_d;
        c_g = RMS ? 0.0f : s_g * inv_d;
      }
      T* gxr = want_dx ? static_cast<T*>(gx.data) + row_offset(gx, b, m, s.M1) : nullptr;
HFKERN_LN_ROLLED
      for (int p = rl.lane; p < n_packs; p += c.row_threads) {
        float xh[VEC], gz[VEC], wv[VEC];
        bwd_pack<T, G, RMS, ACT, VEC>(xr, gr, x, gy, w, bias, cols, b, p, vec, pvec, mu, rs, xh, gz, wv);
        if (want_dx) grad_x(gxr, p, xh, gz, wv, c_xh, c_g, rs);
HFKERN_UNROLL
        for (int j = 0; j < VEC; ++j) {
          const int col = p * VEC + j;
          if (col >= cols.D) continue;
          // the chunk's first row starts the sums: no memset of the buffers
          if (want_dw) pw_row[col] = (m == lo ? 0.0f : pw_row[col]) + gz[j] * xh[j];
          if (want_db) pb_row[col] = (m == lo ? 0.0f : pb_row[col]) + gz[j];
        }
      }
    }
  }
}

__global__ void __launch_bounds__(kMaxThreads)
    ln_sum_partials_kernel(const float* __restrict__ pw,  // [B, P, D] or nullptr
                           const float* __restrict__ pb,  // [B, P, D] or nullptr
                           int64_t B, int64_t P, int64_t D,
                           LnParam gw,   // [B, D], or absent
                           LnParam gb) {  // [B, D], or absent
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B * D) return;
  const int64_t b = i / D, col = i % D;
  float sw = 0.0f, sb = 0.0f;
  // one column's partials are added one after another in chunk order
  for (int64_t p = 0; p < P; ++p) {
    if (pw != nullptr) sw += pw[(b * P + p) * D + col];
    if (pb != nullptr) sb += pb[(b * P + p) * D + col];
  }
  if (gw.data != nullptr) store_param(gw, b, col, sw);
  if (gb.data != nullptr) store_param(gb, b, col, sb);
}

// ---- launch checks and dispatch ------------------------------------------------------------


int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

int dtype_size(DType t) { return t == DType::Float32 ? 4 : t == DType::Float64 ? 8 : 2; }

bool kernel_dtype(DType t) { return t == DType::Float32 || t == DType::Float16 || t == DType::BFloat16; }

void check_shape(const char* what, const LnShape& s) {
  if (s.B < 0 || s.M < 0 || s.D < 0 || s.M1 < 1 || s.D1 < 1 || (s.M > 0 && s.M % s.M1 != 0) ||
      (s.D > 0 && s.D % s.D1 != 0))
    fail(what, "expected B, M, D >= 0 with M1 dividing M and D1 dividing D, got B = " + str(s.B) + ", M = " +
                   str(s.M) + ", M1 = " + str(s.M1) + ", D = " + str(s.D) + ", D1 = " + str(s.D1));
  // column indices are 32-bit (a row's packs, a thread's offsets within its row)
  if (s.D > 0x7fffff00) fail(what, "expected rows of fewer than 2**31 - 256 elements, got D = " + str(s.D));
}

// The config's thread mapping, and that a row held in registers fits them.
void check_config(const char* what, const LnConfig& c, const LnShape& s, DType x_dtype, int values, bool backward) {
  const int64_t threads = int64_t(c.row_threads) * c.rows;
  const int max_threads = backward ? kLnMaxBwdThreads : kMaxThreads;
  if (!pow2(c.row_threads) || !pow2(c.lanes) || c.lanes > 32 || c.lanes > c.row_threads || c.rows < 1 ||
      threads > max_threads || (c.row_threads > c.lanes && c.rows != 1))
    fail(what, "expected row_threads and lanes powers of two, lanes <= 32 and <= row_threads, rows >= 1 (1 when "
               "row_threads > lanes), at most " + str(max_threads) + " threads, got row_threads = " +
                   str(c.row_threads) + ", lanes = " + str(c.lanes) + ", rows = " + str(c.rows));
  const int vec = 16 / dtype_size(x_dtype);
  const int64_t per_thread = cdiv(cdiv(s.D, vec), c.row_threads);
  if (c.regs && per_thread > values / vec)
    fail(what, "a row of D = " + str(s.D) + " needs " + str(per_thread) + " packs per thread in registers, at most " +
                   str(values / vec));
  if (backward && !c.regs && c.rows != 1) fail(what, "a swept backward runs one row per block, got rows = " +
                                                         str(c.rows));
}

// A data tensor read or written a pack at a time: columns contiguous, every row
// and the address aligned to a pack.
void check_vec_tensor(const char* what, const char* name, const LnTensor& t, const LnShape& s, int vec) {
  const bool ok = s.D1 == s.D && t.s_d1 == 1 && s.D % vec == 0 && t.s_b % vec == 0 && t.s_m0 % vec == 0 &&
                  t.s_m1 % vec == 0 && reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
  if (!ok) fail(what, std::string("vector access asked for, but ") + name + " is not pack-aligned");
}

void check_vec_param(const char* what, const char* name, const LnParam& p, const LnShape& s, int vec) {
  if (p.data == nullptr) return;
  const int bytes = vec * dtype_size(p.dtype);
  const bool ok = p.s_d == 1 && s.D % vec == 0 && p.s_b % vec == 0 &&
                  reinterpret_cast<uintptr_t>(p.data) % (bytes < 16 ? bytes : 16) == 0;
  if (!ok) fail(what, std::string("vector access asked for, but ") + name + " is not pack-aligned");
}

void check_param(const char* what, const char* name, const LnParam& p) {
  if (p.data != nullptr && !kernel_dtype(p.dtype))
    fail(what, std::string("expected ") + name + " of float32, float16 or bfloat16, got dtype code " +
                   str(static_cast<int>(p.dtype)));
}

unsigned grid_of(const char* what, int64_t blocks) {
  if (blocks > 0x7fffffff) fail(what, "the grid needs " + str(blocks) + " blocks, more than 2**31 - 1");
  return static_cast<unsigned>(blocks);
}


// Calls f(std::integral_constant<int, ACT>{}) for the activation (RMS norm: none only).
template <typename F>
void dispatch_act(const char* what, LnActivation act, bool rms, F&& f) {
  if (rms && act != LnActivation::None) fail(what, "RMS norm has no fused activation");
  switch (act) {
    case LnActivation::None: f(std::integral_constant<int, kNone>{}); break;
    case LnActivation::Relu: f(std::integral_constant<int, kRelu>{}); break;
    case LnActivation::Gelu: f(std::integral_constant<int, kGelu>{}); break;
    default: fail(what, "unknown activation code " + str(static_cast<int>(act)));
  }
}

}  // namespace

void layer_norm_forward(const LnTensor& x, const LnTensor& y, const LnParam& w, const LnParam& bias,
                        const LnShape& s, const LnConfig& c, double eps, bool rms, LnActivation act, float* mean,
                        float* rstd, void* stream) {
  const char* what = rms ? "rms_norm_forward" : "layer_norm_forward";
  check_shape(what, s);
  if (!kernel_dtype(x.dtype)) fail(what, "expected x of float32, float16 or bfloat16, got dtype code " +
                                             str(static_cast<int>(x.dtype)));
  if (y.dtype != x.dtype) fail(what, "expected y of x's dtype");
  check_config(what, c, s, x.dtype, kLnFwdValues, false);
  check_param(what, "weight", w);
  check_param(what, "bias", bias);
  if (rms && bias.data != nullptr) fail(what, "RMS norm has no bias");
  if (rstd == nullptr || (!rms && mean == nullptr)) fail(what, "expected the statistics' outputs");
  if (s.B * s.M == 0 || s.D == 0) return;
  const int vec = 16 / dtype_size(x.dtype);
  if (c.vec) {
    check_vec_tensor(what, "x", x, s, vec);
    check_vec_tensor(what, "y", y, s, vec);
  }
  if (c.param_vec) {
    check_vec_param(what, "weight", w, s, vec);
    check_vec_param(what, "bias", bias, s, vec);
  }
  const dim3 grid(grid_of(what, cdiv(s.B * s.M, c.rows))), block(static_cast<unsigned>(c.row_threads * c.rows));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const float e = static_cast<float>(eps);
  dispatch_dtype(what, x.dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_act(what, act, rms, [&](auto a) {
      constexpr int A = decltype(a)::value;
      if (rms) {
        if constexpr (A == kNone) HFKERN_LAUNCH((ln_fwd_kernel<T, true, kNone>), grid, block, 0, st, x, y, w, bias,
                                                s, c, e, mean, rstd);
      } else {
        HFKERN_LAUNCH((ln_fwd_kernel<T, false, A>), grid, block, 0, st, x, y, w, bias, s, c, e, mean, rstd);
      }
    });
  });
}

void layer_norm_backward(const LnTensor& gy, const LnTensor& x, const LnTensor& gx, const LnParam& w,
                         const LnParam& bias, const LnShape& s, const LnConfig& c, int64_t chunk, int64_t P,
                         const float* mean, const float* rstd, bool rms, LnActivation act, float* pw, float* pb,
                         void* stream) {
  const char* what = rms ? "rms_norm_backward" : "layer_norm_backward";
  check_shape(what, s);
  if (!kernel_dtype(x.dtype)) fail(what, "expected x of float32, float16 or bfloat16, got dtype code " +
                                             str(static_cast<int>(x.dtype)));
  if (gy.dtype != x.dtype && gy.dtype != DType::Float32)
    fail(what, "expected grad_y of x's dtype or float32, got dtype code " + str(static_cast<int>(gy.dtype)));
  if (gx.data != nullptr && gx.dtype != x.dtype) fail(what, "expected grad_x of x's dtype");
  check_config(what, c, s, x.dtype, kLnBwdValues, true);
  check_param(what, "weight", w);
  check_param(what, "bias", bias);
  if (rstd == nullptr || (!rms && mean == nullptr)) fail(what, "expected the forward's statistics");
  if (s.B * s.M == 0 || s.D == 0 || (gx.data == nullptr && pw == nullptr && pb == nullptr)) return;
  if (chunk < 1 || chunk % c.rows != 0 || P < 1 || P * chunk < s.M || (P - 1) * chunk >= s.M)
    fail(what, "expected P chunks of a multiple of " + str(c.rows) + " rows covering M = " + str(s.M) +
                   ", none empty, got chunk = " + str(chunk) + ", P = " + str(P));
  const int vec = 16 / dtype_size(x.dtype);
  if (c.vec) {
    check_vec_tensor(what, "x", x, s, vec);
    check_vec_tensor(what, "grad_y", gy, s, vec);
    if (gx.data != nullptr) check_vec_tensor(what, "grad_x", gx, s, vec);
  }
  if (c.param_vec) {
    check_vec_param(what, "weight", w, s, vec);
    check_vec_param(what, "bias", bias, s, vec);
  }
  const int n_part = int(pw != nullptr) + int(pb != nullptr);
  const int64_t smem = c.regs && c.rows > 1 ? int64_t(c.rows) * n_part * s.D * int64_t(sizeof(float)) : 0;
  if (smem > kLnMaxSharedBytes)
    fail(what, "combining " + str(c.rows) + " rows of D = " + str(s.D) + " needs " + str(smem) +
                   " bytes of shared memory, more than " + str(kLnMaxSharedBytes));
  const dim3 grid(grid_of(what, s.B * P)), block(static_cast<unsigned>(c.row_threads * c.rows));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const size_t sm = static_cast<size_t>(smem);
  dispatch_dtype(what, x.dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_act(what, act, rms, [&](auto a) {
      constexpr int A = decltype(a)::value;
      // grad_y in x's dtype, or float32 (an fp32 loss scale on 16-bit activations)
      auto run = [&](auto gtag) {
        using G = decltype(gtag);
        if (rms) {
          if constexpr (A == kNone) HFKERN_LAUNCH((ln_bwd_kernel<T, G, true, kNone>), grid, block, sm, st, gy, x, gx,
                                                  w, bias, s, c, chunk, P, mean, rstd, pw, pb);
        } else {
          HFKERN_LAUNCH((ln_bwd_kernel<T, G, false, A>), grid, block, sm, st, gy, x, gx, w, bias, s, c, chunk, P,
                        mean, rstd, pw, pb);
        }
      };
      if (gy.dtype == x.dtype) {
        run(T{});
      } else {
        if constexpr (!std::is_same_v<T, float>) run(float{});
      }
    });
  });
}

void layer_norm_sum_partials(const float* pw, const float* pb, int64_t B, int64_t P, int64_t D, const LnParam& gw,
                             const LnParam& gb, int threads, void* stream) {
  const char* what = "layer_norm_sum_partials";
  if (threads < 1 || threads > kMaxThreads)
    fail(what, "expected 1 to " + str(kMaxThreads) + " threads per block, got " + str(threads));
  if (B < 0 || D < 0 || P < 1) fail(what, "expected B, D >= 0 and P >= 1, got B = " + str(B) + ", D = " + str(D) +
                                              ", P = " + str(P));
  check_param(what, "grad_weight", gw);
  check_param(what, "grad_bias", gb);
  if ((gw.data != nullptr && pw == nullptr) || (gb.data != nullptr && pb == nullptr))
    fail(what, "a parameter gradient needs its partial sums");
  if (B * D == 0 || (gw.data == nullptr && gb.data == nullptr)) return;
  const dim3 grid(grid_of(what, cdiv(B * D, threads))), block(static_cast<unsigned>(threads));
  HFKERN_LAUNCH(ln_sum_partials_kernel, grid, block, 0, reinterpret_cast<cudaStream_t>(stream),
                gw.data != nullptr ? pw : nullptr, gb.data != nullptr ? pb : nullptr, B, P, D, gw, gb);
}

}  // namespace hfkern
