// batch_norm.cu: the array batch norm of B models (hfkern::array_batch_norm and
// its backward), with a fused activation.
//
// The op contract is hfkern/ops/batch_norm.py; hfkern/cuda/batch_norm.py checks
// the tensors and reduces their layout (hfkern/_norm_layout.py). Each model's
// input is seen as [R0, C, R1] through strides, so an array conv's [N, B, C, *S]
// memory, channels-last memory, a strided slice, a shared input (stride 0 on B)
// and an expanded grad_y (stride 0 everywhere) are read where they lie.
//
// Threads. A block is a tile of tr0 x tc x tr1 threads (BnTile): the channels
// vary fastest when they run along memory ([B, N, C], channels-last), R1
// otherwise (channels-first), so a warp reads contiguous memory either way.
//
// Forward, training:
//   * bn_stats_kernel: block (model, channel block, chunk p) runs a Welford
//     update per element in each thread, then combines its threads' (count,
//     mean, M2) per channel in a fixed tree (Chan's parallel formula: as accurate
//     as a two-pass variance, no sum of squares of raw values), and writes the
//     chunk's partial [B', P, C];
//   * bn_finalize_kernel: one thread per (model, channel) combines the P
//     partials in chunk order, writes mean and rstd, and blends the running
//     statistics in float32 (as torch's CUDA kernel). Eval: running -> mean, rstd.
//   * bn_apply_kernel: y = act((x - mean) * rstd * weight + bias).
// Backward: bn_bwd_partial_kernel recomputes z from x to get g = grad_y * act'(z)
// (nothing but mean and rstd is saved) and writes per-chunk sums of g and
// g * xhat; bn_bwd_reduce_kernel adds each channel's partials in chunk order;
// bn_bwd_dx_kernel writes grad_x. No atomics anywhere: the partition depends
// only on the shapes and the device's SM count, so two runs give bitwise equal
// results.
//
// Offsets are int64: a model's slice of a large activation passes 2**31 elements.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "hfkern/activation.h"
#include "hfkern/dispatch.h"
#include "hfkern/batch_norm.h"
#include "hfkern/dtypes.h"
#include "hfkern_cuda.h"

namespace hfkern {
namespace {

constexpr int kMaxThreads = kBnMaxThreads;
// Elements a thread loads before it uses them: independent loads in flight.
constexpr int kUnroll = 4;

// ---- element types and activations ---------------------------------------------------

// A per-channel value in its tensor's dtype, as float32 (float32, float16, bfloat16:
// the launchers refuse others).
__device__ __forceinline__ float load_channel(const BnChannels& t, int64_t b, int64_t c) {
  const int64_t i = b * t.s_b + c * t.s_c;
  switch (t.dtype) {
    case DType::Float16: return to_float(static_cast<const Half*>(t.data)[i]);
    case DType::BFloat16: return to_float(static_cast<const BFloat16*>(t.data)[i]);
    default: return static_cast<const float*>(t.data)[i];
  }
}

__device__ __forceinline__ void store_channel(const BnChannels& t, int64_t b, int64_t c, float v) {
  const int64_t i = b * t.s_b + c * t.s_c;
  switch (t.dtype) {
    case DType::Float16: static_cast<Half*>(t.data)[i] = from_float<Half>(v); break;
    case DType::BFloat16: static_cast<BFloat16*>(t.data)[i] = from_float<BFloat16>(v); break;
    default: static_cast<float*>(t.data)[i] = v; break;
  }
}

// ---- tiles and chunks ---------------------------------------------------------------

// A thread's place in its block's tile: row lane, channel lane, inner lane.
struct Lanes {
  int i0, ic, i1;
};

__device__ __forceinline__ Lanes lanes_of(const BnTile& t, int tid) {
  Lanes l;
  if (t.c_inner) {
    l.ic = tid % t.tc;
    l.i1 = (tid / t.tc) % t.tr1;
    l.i0 = tid / (t.tc * t.tr1);
  } else {
    l.i1 = tid % t.tr1;
    l.ic = (tid / t.tr1) % t.tc;
    l.i0 = tid / (t.tr1 * t.tc);
  }
  return l;
}

struct Bounds {
  int64_t r0_lo, r0_hi, r1_lo, r1_hi;
};

// The rows [r0_lo, r0_hi) and inner elements [r1_lo, r1_hi) of chunk p (hfkern/_norm_layout.py).
__device__ __forceinline__ Bounds chunk_bounds(const BnChunks& ch, const BnShape& s, int64_t p) {
  const int64_t p0 = p / ch.P1, p1 = p % ch.P1;
  Bounds b;
  b.r0_lo = p0 * ch.chunk0;
  b.r0_hi = b.r0_lo + ch.chunk0 < s.R0 ? b.r0_lo + ch.chunk0 : s.R0;
  b.r1_lo = p1 * ch.chunk1;
  b.r1_hi = b.r1_lo + ch.chunk1 < s.R1 ? b.r1_lo + ch.chunk1 : s.R1;
  return b;
}

// A thread's elements of a chunk, R1 fastest: (r0, r1) with r0 = r0_lo + i0 + k * tr0
// and r1 = r1_lo + i1 + j * tr1, stepped without divisions.
struct Cursor {
  int64_t r0, r1, r1_first, r0_hi, r1_hi;
  int tr0, tr1;

  __device__ Cursor(const Bounds& b, const Lanes& l, const BnTile& t)
      : r0(b.r0_lo + l.i0), r1(b.r1_lo + l.i1), r1_first(b.r1_lo + l.i1), r0_hi(b.r0_hi), r1_hi(b.r1_hi),
        tr0(t.tr0), tr1(t.tr1) {
    if (r1 >= r1_hi) r0 = r0_hi;  // no column of the chunk is this thread's
  }
  __device__ bool live() const { return r0 < r0_hi; }
  __device__ void next() {
    r1 += tr1;
    if (r1 >= r1_hi) {
      r1 = r1_first;
      r0 += tr0;
    }
  }
};

// Chan's combination of (n, mean, m2) with (nb, mb, m2b).
__device__ __forceinline__ void chan_combine(float& n, float& mean, float& m2, float nb, float mb, float m2b) {
  if (nb == 0.0f) return;
  const float total = n + nb;
  const float f = nb / total;
  const float delta = mb - mean;
  mean += delta * f;
  m2 += m2b + delta * delta * (n * f);
  n = total;
}

// A block's per-channel reduction over its tr0 x tr1 row lanes: each thread's slot in the
// block's shared arrays, channel-major (the lanes of one channel adjacent).
struct ChannelSlot {
  int lanes, rl, slot;  // row lanes per channel, this thread's row lane, its slot

  __device__ ChannelSlot(const BnTile& t, const Lanes& l)
      : lanes(t.tr0 * t.tr1), rl(l.i1 + t.tr1 * l.i0), slot(l.ic * lanes + rl) {}
};

// Folds the values each thread has stored at its slot, the channel's threads in a fixed
// tree: the upper half onto the lower, fold(dst, src) on slots, until the row lane 0 slot
// holds the channel's result. Every thread of the block calls it (it synchronizes).
template <typename Fold>
__device__ __forceinline__ void fold_channel(const ChannelSlot& cs, Fold fold) {
  __syncthreads();
  for (int live = cs.lanes; live > 1;) {
    const int half = (live + 1) / 2;
    if (cs.rl < live - half) fold(cs.slot, cs.slot + half);
    __syncthreads();
    live = half;
  }
}

// ---- forward ---------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
    bn_stats_kernel(BnTensor x,  // [B', R0, C, R1] through strides
                    BnShape s, BnTile t, BnChunks ch, int64_t n_cb,
                    float* __restrict__ pmean,  // [B', P, C]: the mean of each chunk
                    float* __restrict__ pm2) {  // [B', P, C]: its sum of squared deviations from that mean
  __shared__ float s_n[kMaxThreads], s_mean[kMaxThreads], s_m2[kMaxThreads];
  int64_t blk = blockIdx.x;
  const int64_t p = blk % ch.P;
  blk /= ch.P;
  const int64_t cb = blk % n_cb, b = blk / n_cb;
  const Lanes l = lanes_of(t, static_cast<int>(threadIdx.x));
  const int64_t c = cb * t.tc + l.ic;

  float n = 0.0f, mean = 0.0f, m2 = 0.0f;
  if (c < s.C) {
    const T* __restrict__ xb = static_cast<const T*>(x.data) + b * x.s_b + c * x.s_c;
    Cursor cur(chunk_bounds(ch, s, p), l, t);
    while (cur.live()) {
      float v[kUnroll];
      bool ok[kUnroll];
HFKERN_UNROLL
      for (int k = 0; k < kUnroll; ++k) {
        ok[k] = cur.live();
        v[k] = ok[k] ? to_float(xb[cur.r0 * x.s_r0 + cur.r1 * x.s_r1]) : 0.0f;
        if (ok[k]) cur.next();
      }
HFKERN_UNROLL
      for (int k = 0; k < kUnroll; ++k) {
        if (ok[k]) {  // Welford
          n += 1.0f;
          const float d = v[k] - mean;
          mean += d / n;
          m2 += d * (v[k] - mean);
        }
      }
    }
  }

  // the channel's threads, folded in a fixed tree with Chan's formula
  const ChannelSlot cs(t, l);
  s_n[cs.slot] = n;
  s_mean[cs.slot] = mean;
  s_m2[cs.slot] = m2;
  fold_channel(cs, [&](int dst, int src) {
    float a_n = s_n[dst], a_mean = s_mean[dst], a_m2 = s_m2[dst];
    chan_combine(a_n, a_mean, a_m2, s_n[src], s_mean[src], s_m2[src]);
    s_n[dst] = a_n;
    s_mean[dst] = a_mean;
    s_m2[dst] = a_m2;
  });
  if (cs.rl == 0 && c < s.C) {
    const int64_t part = (b * ch.P + p) * s.C + c;
    pmean[part] = s_mean[cs.slot];
    pm2[part] = s_m2[cs.slot];
  }
}

__global__ void __launch_bounds__(kMaxThreads)
    bn_finalize_kernel(BnFinalize a,  // partials [B or 1, P, C] float32; running stats [B, C]; nbt [B] int64
                       BnShape s, BnChunks ch,
                       float* __restrict__ mean_out,  // [B, C] float32, contiguous
                       float* __restrict__ rstd_out) {  // [B, C] float32, contiguous
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= s.B * s.C) return;
  const int64_t b = i / s.C, c = i % s.C;
  float mean, var;
  if (a.training) {
    int64_t count = 0;
    float m = 0.0f, m2 = 0.0f;
    const float* pm = a.pmean + b * a.s_part_b + c;
    const float* pv = a.pm2 + b * a.s_part_b + c;
    // in chunk order, one after another: the result does not depend on the launch
    for (int64_t p = 0; p < ch.P; ++p) {
      const Bounds bd = chunk_bounds(ch, s, p);
      const int64_t n_part = (bd.r0_hi - bd.r0_lo) * (bd.r1_hi - bd.r1_lo);
      if (n_part <= 0) continue;
      const int64_t total = count + n_part;
      const float f = static_cast<float>(n_part) / static_cast<float>(total);
      const float delta = pm[p * s.C] - m;
      m += delta * f;
      m2 += pv[p * s.C] + delta * delta * (static_cast<float>(count) * f);
      count = total;
    }
    if (count == 0) {  // the statistics of no values; the running ones stay
      mean = var = nanf("");
    } else {
      mean = m;
      var = m2 / static_cast<float>(count);
      if (a.update) {
        // float32, as torch's CUDA kernel blends
        const float f = a.cumulative ? static_cast<float>(1.0 / static_cast<double>(a.num_batches_tracked[b * a.s_nbt]))
                                     : static_cast<float>(a.momentum);
        const float rm = load_channel(a.running_mean, b, c), rv = load_channel(a.running_var, b, c);
        store_channel(a.running_mean, b, c, f * mean + (1.0f - f) * rm);
        store_channel(a.running_var, b, c, f * (var * static_cast<float>(a.unbias)) + (1.0f - f) * rv);
      }
    }
  } else {
    mean = load_channel(a.running_mean, b, c);
    var = load_channel(a.running_var, b, c);
  }
  mean_out[i] = mean;
  rstd_out[i] = 1.0f / sqrtf(var + static_cast<float>(a.eps));
}

// Element-wise kernels: block (model, channel block, row block, inner block); each
// thread has one channel and one inner index and kUnroll rows, tr0 apart.
struct ElementBlock {
  int64_t b, c, r1, r0;  // r0: the thread's first row
};

__device__ __forceinline__ ElementBlock element_block(const BnTile& t, const Lanes& l, int64_t n_cb, int64_t n_r0b,
                                                      int64_t n_r1b) {
  int64_t blk = blockIdx.x;
  const int64_t r1b = blk % n_r1b;
  blk /= n_r1b;
  const int64_t r0b = blk % n_r0b;
  blk /= n_r0b;
  ElementBlock e;
  e.c = (blk % n_cb) * t.tc + l.ic;
  e.b = blk / n_cb;
  e.r1 = r1b * t.tr1 + l.i1;
  e.r0 = r0b * t.tr0 * kUnroll + l.i0;
  return e;
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
    bn_apply_kernel(BnTensor x,  // [B, R0, C, R1] through strides
                    BnTensor y,  // [B, R0, C, R1] through y's strides, x's dtype
                    BnShape s, BnTile t, int64_t n_cb, int64_t n_r0b, int64_t n_r1b,
                    const float* __restrict__ mean,  // [B, C] float32, contiguous
                    const float* __restrict__ rstd,  // [B, C] float32, contiguous
                    BnChannels weight,               // [B, C] or absent
                    BnChannels bias,                 // [B, C] or absent
                    BnActivation act) {
  const Lanes l = lanes_of(t, static_cast<int>(threadIdx.x));
  const ElementBlock e = element_block(t, l, n_cb, n_r0b, n_r1b);
  if (e.c >= s.C || e.r1 >= s.R1) return;  // no barrier in this kernel
  const int64_t stat = e.b * s.C + e.c;
  const float m = mean[stat];
  const float scale = weight.data != nullptr ? rstd[stat] * load_channel(weight, e.b, e.c) : rstd[stat];
  const float shift = bias.data != nullptr ? load_channel(bias, e.b, e.c) : 0.0f;
  const T* __restrict__ xp = static_cast<const T*>(x.data) + e.b * x.s_b + e.c * x.s_c + e.r1 * x.s_r1;
  T* __restrict__ yp = static_cast<T*>(y.data) + e.b * y.s_b + e.c * y.s_c + e.r1 * y.s_r1;
  float v[kUnroll];
HFKERN_UNROLL
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t r0 = e.r0 + static_cast<int64_t>(k) * t.tr0;
    v[k] = r0 < s.R0 ? to_float(xp[r0 * x.s_r0]) : 0.0f;
  }
HFKERN_UNROLL
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t r0 = e.r0 + static_cast<int64_t>(k) * t.tr0;
    if (r0 < s.R0) yp[r0 * y.s_r0] = from_float<T>(activate((v[k] - m) * scale + shift, act));
  }
}

// ---- backward ---------------------------------------------------------------------------

// What a thread needs of its channel to recompute xhat and z.
struct ChannelMath {
  float mean, rstd, w, shift;

  __device__ ChannelMath(const float* mean_, const float* rstd_, const BnChannels& weight, const BnChannels& bias,
                         int64_t b, int64_t c, int64_t C) {
    mean = mean_[b * C + c];
    rstd = rstd_[b * C + c];
    w = weight.data != nullptr ? load_channel(weight, b, c) : 1.0f;
    shift = bias.data != nullptr ? load_channel(bias, b, c) : 0.0f;
  }
};

template <typename T, typename G>
__global__ void __launch_bounds__(kMaxThreads)
    bn_bwd_partial_kernel(BnTensor gy,  // [B, R0, C, R1] through strides, grad_y's dtype G
                          BnTensor x,   // [B, R0, C, R1] through x's strides
                          BnShape s, BnTile t, BnChunks ch, int64_t n_cb,
                          const float* __restrict__ mean,  // [B, C] float32, contiguous
                          const float* __restrict__ rstd,  // [B, C] float32, contiguous
                          BnChannels weight, BnChannels bias, BnActivation act,
                          float* __restrict__ pg,     // [B, P, C]: per-chunk sums of g
                          float* __restrict__ pgx) {  // [B, P, C]: per-chunk sums of g * xhat
  __shared__ float s_g[kMaxThreads], s_gx[kMaxThreads];
  int64_t blk = blockIdx.x;
  const int64_t p = blk % ch.P;
  blk /= ch.P;
  const int64_t cb = blk % n_cb, b = blk / n_cb;
  const Lanes l = lanes_of(t, static_cast<int>(threadIdx.x));
  const int64_t c = cb * t.tc + l.ic;

  float sum_g = 0.0f, sum_gx = 0.0f;
  if (c < s.C) {
    const ChannelMath cm(mean, rstd, weight, bias, b, c, s.C);
    const G* __restrict__ gb = static_cast<const G*>(gy.data) + b * gy.s_b + c * gy.s_c;
    const T* __restrict__ xb = static_cast<const T*>(x.data) + b * x.s_b + c * x.s_c;
    Cursor cur(chunk_bounds(ch, s, p), l, t);
    while (cur.live()) {
      float g[kUnroll], v[kUnroll];
      bool ok[kUnroll];
HFKERN_UNROLL
      for (int k = 0; k < kUnroll; ++k) {
        ok[k] = cur.live();
        g[k] = ok[k] ? to_float(gb[cur.r0 * gy.s_r0 + cur.r1 * gy.s_r1]) : 0.0f;
        v[k] = ok[k] ? to_float(xb[cur.r0 * x.s_r0 + cur.r1 * x.s_r1]) : 0.0f;
        if (ok[k]) cur.next();
      }
HFKERN_UNROLL
      for (int k = 0; k < kUnroll; ++k) {
        if (!ok[k]) continue;
        const float xhat = (v[k] - cm.mean) * cm.rstd;
        const float gk = activation_grad(g[k], xhat * cm.w + cm.shift, act);
        sum_g += gk;
        sum_gx += gk * xhat;
      }
    }
  }

  const ChannelSlot cs(t, l);
  s_g[cs.slot] = sum_g;
  s_gx[cs.slot] = sum_gx;
  fold_channel(cs, [&](int dst, int src) {
    s_g[dst] += s_g[src];
    s_gx[dst] += s_gx[src];
  });
  if (cs.rl == 0 && c < s.C) {
    const int64_t part = (b * ch.P + p) * s.C + c;
    pg[part] = s_g[cs.slot];
    pgx[part] = s_gx[cs.slot];
  }
}

__global__ void __launch_bounds__(kMaxThreads)
    bn_bwd_reduce_kernel(const float* __restrict__ pg,   // [B, P, C]
                         const float* __restrict__ pgx,  // [B, P, C]
                         int64_t B, int64_t C, int64_t P,
                         float* __restrict__ sums,  // [2, B, C]: sum of g, sum of g * xhat
                         BnChannels grad_weight,    // [B, C] contiguous, or absent
                         BnChannels grad_bias) {    // [B, C] contiguous, or absent
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B * C) return;
  const int64_t b = i / C, c = i % C;
  float sum_g = 0.0f, sum_gx = 0.0f;
  // one channel's partials are added one after another in chunk order
  for (int64_t p = 0; p < P; ++p) {
    sum_g += pg[(b * P + p) * C + c];
    sum_gx += pgx[(b * P + p) * C + c];
  }
  sums[i] = sum_g;
  sums[B * C + i] = sum_gx;
  if (grad_weight.data != nullptr) store_channel(grad_weight, b, c, sum_gx);
  if (grad_bias.data != nullptr) store_channel(grad_bias, b, c, sum_g);
}

template <typename T, typename G>
__global__ void __launch_bounds__(kMaxThreads)
    bn_bwd_dx_kernel(BnTensor gy,  // [B, R0, C, R1] through strides, grad_y's dtype G
                     BnTensor x,   // [B, R0, C, R1] through x's strides
                     BnTensor gx,  // [B, R0, C, R1] through grad_x's strides, x's dtype
                     BnShape s, BnTile t, int64_t n_cb, int64_t n_r0b, int64_t n_r1b,
                     const float* __restrict__ mean,  // [B, C] float32, contiguous
                     const float* __restrict__ rstd,  // [B, C] float32, contiguous
                     BnChannels weight, BnChannels bias,
                     const float* __restrict__ sums,  // [2, B, C] float32 (training only)
                     float inv_n, bool training, BnActivation act) {
  const Lanes l = lanes_of(t, static_cast<int>(threadIdx.x));
  const ElementBlock e = element_block(t, l, n_cb, n_r0b, n_r1b);
  if (e.c >= s.C || e.r1 >= s.R1) return;  // no barrier in this kernel
  const int64_t stat = e.b * s.C + e.c;
  const ChannelMath cm(mean, rstd, weight, bias, e.b, e.c, s.C);
  const float scale = cm.rstd * cm.w;
  const float c_g = training ? sums[stat] * inv_n : 0.0f;
  const float c_gx = training ? sums[s.B * s.C + stat] * inv_n : 0.0f;
  // eval without an activation needs grad_y alone
  const bool reads_x = training || act != BnActivation::None;
  const G* __restrict__ gp = static_cast<const G*>(gy.data) + e.b * gy.s_b + e.c * gy.s_c + e.r1 * gy.s_r1;
  const T* __restrict__ xp = static_cast<const T*>(x.data) + e.b * x.s_b + e.c * x.s_c + e.r1 * x.s_r1;
  T* __restrict__ op = static_cast<T*>(gx.data) + e.b * gx.s_b + e.c * gx.s_c + e.r1 * gx.s_r1;
  float g[kUnroll], v[kUnroll];
HFKERN_UNROLL
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t r0 = e.r0 + static_cast<int64_t>(k) * t.tr0;
    const bool ok = r0 < s.R0;
    g[k] = ok ? to_float(gp[r0 * gy.s_r0]) : 0.0f;
    v[k] = ok && reads_x ? to_float(xp[r0 * x.s_r0]) : 0.0f;
  }
HFKERN_UNROLL
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t r0 = e.r0 + static_cast<int64_t>(k) * t.tr0;
    if (r0 >= s.R0) continue;
    const float xhat = (v[k] - cm.mean) * cm.rstd;
    float gk = activation_grad(g[k], xhat * cm.w + cm.shift, act);
    if (training) gk = gk - c_g - xhat * c_gx;
    op[r0 * gx.s_r0] = from_float<T>(gk * scale);
  }
}

// ---- launch checks and dispatch -------------------------------------------------------


void check_shape(const char* what, const BnShape& s) {
  if (s.B < 0 || s.R0 < 0 || s.C < 0 || s.R1 < 0)
    fail(what, "expected non-negative sizes, got B = " + str(s.B) + ", R0 = " + str(s.R0) + ", C = " + str(s.C) +
                   ", R1 = " + str(s.R1));
}

void check_tile(const char* what, const BnTile& t) {
  const int64_t threads = int64_t(t.tr0) * t.tc * t.tr1;
  if (t.tr0 < 1 || t.tc < 1 || t.tr1 < 1 || threads > kMaxThreads)
    fail(what, "expected a tile of tr0 x tc x tr1 >= 1 threads, at most " + str(kMaxThreads) + ", got " +
                   str(t.tr0) + " x " + str(t.tc) + " x " + str(t.tr1));
}

void check_chunks(const char* what, const BnShape& s, const BnChunks& ch) {
  if (ch.chunk0 < 1 || ch.chunk1 < 1 || ch.P1 < 1 || ch.P < ch.P1 || ch.P % ch.P1 != 0 ||
      (ch.P / ch.P1) * ch.chunk0 < s.R0 || ch.P1 * ch.chunk1 < s.R1)
    fail(what, "expected P = P0 * P1 chunks of chunk0 x chunk1 covering R0 = " + str(s.R0) + " x R1 = " + str(s.R1) +
                   ", got chunk0 = " + str(ch.chunk0) + ", chunk1 = " + str(ch.chunk1) + ", P = " + str(ch.P) +
                   ", P1 = " + str(ch.P1));
}

void check_threads(const char* what, int threads) {
  if (threads < 1 || threads > kMaxThreads)
    fail(what, "expected 1 to " + str(kMaxThreads) + " threads per block, got " + str(threads));
}

void check_channel_dtype(const char* what, const char* name, const BnChannels& t) {
  if (t.data != nullptr && t.dtype != DType::Float32 && t.dtype != DType::Float16 && t.dtype != DType::BFloat16)
    fail(what, std::string("expected ") + name + " of float32, float16 or bfloat16, got dtype code " +
                   str(static_cast<int>(t.dtype)));
}

unsigned grid_of(const char* what, int64_t blocks) {
  if (blocks > 0x7fffffff) fail(what, "the grid needs " + str(blocks) + " blocks, more than 2**31 - 1");
  return static_cast<unsigned>(blocks);
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The element-wise kernels (bn_apply_kernel, bn_bwd_dx_kernel): their shape, tile and
// per-channel operands, checked; blocks over (model, channel block, row block, inner block)
// of kUnroll rows per thread.
void check_elementwise(const char* what, const BnShape& s, const BnTile& t, const BnChannels& weight,
                       const BnChannels& bias) {
  check_shape(what, s);
  check_tile(what, t);
  check_channel_dtype(what, "weight", weight);
  check_channel_dtype(what, "bias", bias);
}

bool no_elements(const BnShape& s) { return s.B == 0 || s.C == 0 || s.R0 == 0 || s.R1 == 0; }

struct ElementGrid {
  int64_t n_cb, n_r0b, n_r1b;
  dim3 grid, block;

  ElementGrid(const char* what, const BnShape& s, const BnTile& t)
      : n_cb(cdiv(s.C, t.tc)), n_r0b(cdiv(s.R0, int64_t(t.tr0) * kUnroll)), n_r1b(cdiv(s.R1, t.tr1)),
        grid(grid_of(what, s.B * n_cb * n_r0b * n_r1b)), block(static_cast<unsigned>(t.tr0 * t.tc * t.tr1)) {}
};


}  // namespace

void batch_norm_stats(const BnTensor& x, const BnShape& s, const BnTile& t, const BnChunks& ch, float* pmean,
                      float* pm2, void* stream) {
  const char* what = "batch_norm_stats";
  check_shape(what, s);
  check_tile(what, t);
  check_chunks(what, s, ch);
  if (s.B == 0 || s.C == 0 || s.R0 == 0 || s.R1 == 0) return;
  const int64_t n_cb = cdiv(s.C, t.tc);
  const dim3 grid(grid_of(what, s.B * n_cb * ch.P)), block(static_cast<unsigned>(t.tr0 * t.tc * t.tr1));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_dtype(what, x.dtype, [&](auto tag) {
    using T = decltype(tag);
    HFKERN_LAUNCH((bn_stats_kernel<T>), grid, block, 0, st, x, s, t, ch, n_cb, pmean, pm2);
  });
}

void batch_norm_finalize(const BnFinalize& a, const BnShape& s, const BnChunks& ch, float* mean, float* rstd,
                         int threads, void* stream) {
  const char* what = "batch_norm_finalize";
  check_shape(what, s);
  check_threads(what, threads);
  if (a.training && ch.P > 0) check_chunks(what, s, ch);
  if (a.training && ch.P > 0 && (a.pmean == nullptr || a.pm2 == nullptr)) fail(what, "training needs the partials");
  if ((a.update || !a.training) && (a.running_mean.data == nullptr || a.running_var.data == nullptr))
    fail(what, "expected running_mean and running_var");
  if (a.training && a.update && a.cumulative && a.num_batches_tracked == nullptr)
    fail(what, "a cumulative average needs num_batches_tracked");
  check_channel_dtype(what, "running_mean", a.running_mean);
  check_channel_dtype(what, "running_var", a.running_var);
  if (s.B * s.C == 0) return;
  const dim3 grid(grid_of(what, cdiv(s.B * s.C, threads))), block(static_cast<unsigned>(threads));
  HFKERN_LAUNCH(bn_finalize_kernel, grid, block, 0, reinterpret_cast<cudaStream_t>(stream), a, s, ch, mean, rstd);
}

void batch_norm_apply(const BnTensor& x, const BnTensor& y, const BnShape& s, const BnTile& t, const float* mean,
                      const float* rstd, const BnChannels& weight, const BnChannels& bias, BnActivation act,
                      void* stream) {
  const char* what = "batch_norm_apply";
  check_elementwise(what, s, t, weight, bias);
  if (x.dtype != y.dtype) fail(what, "expected y of x's dtype");
  if (no_elements(s)) return;
  const ElementGrid g(what, s, t);
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_dtype(what, x.dtype, [&](auto tag) {
    using T = decltype(tag);
    HFKERN_LAUNCH((bn_apply_kernel<T>), g.grid, g.block, 0, st, x, y, s, t, g.n_cb, g.n_r0b, g.n_r1b, mean, rstd,
                  weight, bias, act);
  });
}

void batch_norm_backward_partials(const BnTensor& gy, const BnTensor& x, const BnShape& s, const BnTile& t,
                                  const BnChunks& ch, const float* mean, const float* rstd, const BnChannels& weight,
                                  const BnChannels& bias, BnActivation act, float* pg, float* pgx, void* stream) {
  const char* what = "batch_norm_backward_partials";
  check_shape(what, s);
  check_tile(what, t);
  check_chunks(what, s, ch);
  check_channel_dtype(what, "weight", weight);
  check_channel_dtype(what, "bias", bias);
  if (s.B == 0 || s.C == 0 || s.R0 == 0 || s.R1 == 0) return;
  const int64_t n_cb = cdiv(s.C, t.tc);
  const dim3 grid(grid_of(what, s.B * n_cb * ch.P)), block(static_cast<unsigned>(t.tr0 * t.tc * t.tr1));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_dtype(what, x.dtype, [&](auto xtag) {
    dispatch_dtype(what, gy.dtype, [&](auto gtag) {
      using T = decltype(xtag);
      using G = decltype(gtag);
      HFKERN_LAUNCH((bn_bwd_partial_kernel<T, G>), grid, block, 0, st, gy, x, s, t, ch, n_cb, mean, rstd, weight,
                    bias, act, pg, pgx);
    });
  });
}

void batch_norm_backward_reduce(const float* pg, const float* pgx, int64_t B, int64_t C, int64_t P, float* sums,
                                const BnChannels& grad_weight, const BnChannels& grad_bias, int threads,
                                void* stream) {
  const char* what = "batch_norm_backward_reduce";
  check_threads(what, threads);
  if (B < 0 || C < 0 || P < 1) fail(what, "expected B, C >= 0 and P >= 1, got P = " + str(P));
  check_channel_dtype(what, "grad_weight", grad_weight);
  check_channel_dtype(what, "grad_bias", grad_bias);
  if (B * C == 0) return;
  const dim3 grid(grid_of(what, cdiv(B * C, threads))), block(static_cast<unsigned>(threads));
  HFKERN_LAUNCH(bn_bwd_reduce_kernel, grid, block, 0, reinterpret_cast<cudaStream_t>(stream), pg, pgx, B, C, P, sums,
                grad_weight, grad_bias);
}

void batch_norm_backward_dx(const BnTensor& gy, const BnTensor& x, const BnTensor& gx, const BnShape& s,
                            const BnTile& t, const float* mean, const float* rstd, const BnChannels& weight,
                            const BnChannels& bias, const float* sums, double inv_n, bool training, BnActivation act,
                            void* stream) {
  const char* what = "batch_norm_backward_dx";
  check_elementwise(what, s, t, weight, bias);
  if (gx.dtype != x.dtype) fail(what, "expected grad_x of x's dtype");
  if (training && sums == nullptr) fail(what, "training needs the sums");
  if (no_elements(s)) return;
  const ElementGrid g(what, s, t);
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_dtype(what, x.dtype, [&](auto xtag) {
    dispatch_dtype(what, gy.dtype, [&](auto gtag) {
      using T = decltype(xtag);
      using G = decltype(gtag);
      HFKERN_LAUNCH((bn_bwd_dx_kernel<T, G>), g.grid, g.block, 0, st, gy, x, gx, s, t, g.n_cb, g.n_r0b, g.n_r1b, mean,
                    rstd, weight, bias, sums, static_cast<float>(inv_n), training, act);
    });
  });
}

}  // namespace hfkern
