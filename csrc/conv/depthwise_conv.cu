// depthwise_conv.cu: the array depthwise conv2d of B models (hfkern::array_conv with
// groups == C_in == C_out, 2-D, not transposed) and its input and weight gradients.
//
// The op contract is hfkern/ops/conv.py; hfkern/cuda/conv.py picks the depthwise calls
// and checks the tensors. cuDNN runs B models' depthwise layers as one grouped conv of
// B * C groups of one channel, its weakest case (MobileNetV2); these are direct kernels:
// every (model, channel) pair is an independent plane, so the array dim is just more
// planes on the grid.
//
// Threads. A block is a tile of tc x th x tw threads (DwTile) over (model-channel
// pairs, rows, columns) of one sample; the pairs vary fastest when they run along
// memory (channels-last array memory [N, H, W, B, C]), the columns otherwise
// ([N, B, C, H, W]), so a warp reads contiguous memory in both. Each thread computes
// `rows` consecutive rows of one column. Operands are read through strides, so a
// shared input (s_b = 0), a strided slice and either memory format need no copy.
//
//   * dw_fwd_kernel: y = sum over the kh x kw taps of w * x, plus the bias;
//   * dw_dgrad_kernel: the adjoint, as a gather: each input pixel sums the taps of
//     the outputs it reached (stride phases and padding masked), for a shared input
//     over the B models in model order; no atomics;
//   * dw_wgrad_partial_kernel: per (pair block, chunk of N * OH rows) the tap sums of
//     grad_y * x, reduced over the block's threads in a fixed tree, written as partials
//     [B * C, P, kh * kw]; dw_wgrad_reduce_kernel adds each tap's P partials in chunk
//     order. The partition depends on the shapes and the SM count only: bitwise
//     reproducible results.
//
// 3x3 and 5x5 kernels are template instances with the taps unrolled and the weights
// (forward, input gradient) or the tap sums (weight gradient) in registers; any other
// size runs the general instance (KH = KW = 0), whose weight gradient gives every tap
// its own blocks. Accumulation is float32 for every dtype. Offsets are int64: a
// model's plane times N and B passes 2**31 elements.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "hfkern/dispatch.h"
#include "hfkern/depthwise_conv.h"
#include "hfkern/dtypes.h"
#include "hfkern_cuda.h"

namespace hfkern {
namespace {

constexpr int kMaxThreads = kDwMaxThreads;
// Every kernel is declared __launch_bounds__(kMaxThreads, 1): with the thread bound alone
// ptxas (CUDA 13) spilled the unrolled 3x3/5x5 instances at 48-80 registers; with the
// occupancy stated it keeps them in registers (bench/ptxas_cuda.py: 0 spills).
constexpr int kMaxRows = kDwMaxRows;

// A thread's place in its block's tile: pair lane, row lane, column lane.
struct Lanes {
  int ic, ih, iw;
};

__device__ __forceinline__ Lanes lanes_of(const DwTile& t, int tid) {
  Lanes l;
  if (t.c_inner) {
    l.ic = tid % t.tc;
    l.iw = (tid / t.tc) % t.tw;
    l.ih = tid / (t.tc * t.tw);
  } else {
    l.iw = tid % t.tw;
    l.ih = (tid / t.tw) % t.th;
    l.ic = tid / (t.tw * t.th);
  }
  return l;
}

// Blocks of the element kernels: pair blocks fastest, then column, row blocks, samples.
// Block, pair and row counts are below 2**31 (the launch checks): 32-bit index math and
// divisions (a 64-bit division is a long emulated sequence on the GPU).
struct Blocks {
  int n_cb, n_hb, n_wb;
};

struct BlockPos {
  int n, hb, wb, cb;
};

__device__ __forceinline__ BlockPos block_pos(const Blocks& nb) {
  int blk = static_cast<int>(blockIdx.x);
  BlockPos p;
  p.cb = blk % nb.n_cb;
  blk /= nb.n_cb;
  p.wb = blk % nb.n_wb;
  blk /= nb.n_wb;
  p.hb = blk % nb.n_hb;
  p.n = blk / nb.n_hb;
  return p;
}

// The kh x kw weights of one (model, channel): in registers for a fixed size, read
// where they lie for the general instance.
template <typename T, int KH, int KW>
struct Taps {
  float v[KH * KW];
  __device__ __forceinline__ Taps(const DwWeight& w, int b, int c) {
    const T* p = static_cast<const T*>(w.data) + b * w.s_b + c * w.s_c;
HFKERN_UNROLL
    for (int i = 0; i < KH; ++i)
HFKERN_UNROLL
      for (int j = 0; j < KW; ++j) v[i * KW + j] = to_float(p[i * w.s_h + j * w.s_w]);
  }
  __device__ __forceinline__ float operator()(int i, int j) const { return v[i * KW + j]; }
};

template <typename T>
struct Taps<T, 0, 0> {
  const T* p;
  int64_t s_h, s_w;
  __device__ __forceinline__ Taps(const DwWeight& w, int b, int c)
      : p(static_cast<const T*>(w.data) + b * w.s_b + c * w.s_c), s_h(w.s_h), s_w(w.s_w) {}
  __device__ __forceinline__ float operator()(int i, int j) const { return to_float(p[i * s_h + j * s_w]); }
};

// ---- forward ------------------------------------------------------------------------

template <typename T, int KH, int KW>
__global__ void __launch_bounds__(kMaxThreads, 1)
    dw_fwd_kernel(DwTensor x,      // [B, N, C, H, W] through strides (s_b = 0: shared)
                  DwWeight w,      // [B, C, kh, kw]
                  DwWeight bias,   // [B, C], or data == nullptr
                  DwTensor y,      // [B, N, C, OH, OW]
                  DwGeometry g, DwTile t, Blocks nb) {
  const Lanes l = lanes_of(t, static_cast<int>(threadIdx.x));
  const BlockPos bp = block_pos(nb);
  const int pair = bp.cb * t.tc + l.ic;
  const int ow = bp.wb * t.tw + l.iw;
  const int oh0 = (bp.hb * t.th + l.ih) * t.rows;
  if (pair >= g.B * g.C || ow >= g.OW || oh0 >= g.OH) return;  // no barrier in this kernel
  const int C = static_cast<int>(g.C);
  const int b = pair / C, c = pair % C;
  const int kh = KH > 0 ? KH : g.kh, kw = KW > 0 ? KW : g.kw;
  const Taps<T, KH, KW> wt(w, b, c);
  const float shift = bias.data != nullptr ? to_float(static_cast<const T*>(bias.data)[b * bias.s_b + c * bias.s_c])
                                          : 0.0f;
  const T* __restrict__ xp = static_cast<const T*>(x.data) + bp.n * x.s_n + b * x.s_b + c * x.s_c;
  T* __restrict__ yp = static_cast<T*>(y.data) + bp.n * y.s_n + b * y.s_b + c * y.s_c + ow * y.s_w;
  const int iw0 = ow * g.stride_w - g.pad_w;
HFKERN_UNROLL
  for (int r = 0; r < kMaxRows; ++r) {
    const int oh = oh0 + r;
    if (r >= t.rows || oh >= g.OH) break;
    const int ih0 = oh * g.stride_h - g.pad_h;
    float acc = 0.0f;
HFKERN_UNROLL
    for (int i = 0; i < kh; ++i) {
      const int ih = ih0 + i * g.dil_h;
      if (ih < 0 || ih >= g.H) continue;
      const T* __restrict__ row = xp + ih * x.s_h;
HFKERN_UNROLL
      for (int j = 0; j < kw; ++j) {
        const int iw = iw0 + j * g.dil_w;
        if (iw >= 0 && iw < g.W) acc += wt(i, j) * to_float(row[iw * x.s_w]);
      }
    }
    yp[oh * y.s_h] = from_float<T>(acc + shift);
  }
}

// ---- input gradient -------------------------------------------------------------------

// grad_x[ih, iw] = sum over taps (i, j) with oh = (ih + pad_h - i dil_h) / stride_h whole
// and in range (the same for ow) of w[i, j] * grad_y[oh, ow].
template <typename T, int KH, int KW>
__global__ void __launch_bounds__(kMaxThreads, 1)
    dw_dgrad_kernel(DwTensor gy,  // [B, N, C, OH, OW] through strides
                    DwWeight w,   // [B, C, kh, kw]
                    DwTensor gx,  // [B, N, C, H, W], or [N, C, H, W] with sum_models (s_b unused)
                    bool sum_models, DwGeometry g, DwTile t, Blocks nb) {
  const Lanes l = lanes_of(t, static_cast<int>(threadIdx.x));
  const BlockPos bp = block_pos(nb);
  const int pair = bp.cb * t.tc + l.ic;
  const int iw = bp.wb * t.tw + l.iw;
  const int ih0 = (bp.hb * t.th + l.ih) * t.rows;
  if (pair >= (sum_models ? g.C : g.B * g.C) || iw >= g.W || ih0 >= g.H) return;  // no barrier
  const int C = static_cast<int>(g.C);
  const int c = pair % C;
  const int b_lo = sum_models ? 0 : pair / C, b_hi = sum_models ? static_cast<int>(g.B) : b_lo + 1;
  const int kh = KH > 0 ? KH : g.kh, kw = KW > 0 ? KW : g.kw;
  T* __restrict__ op = static_cast<T*>(gx.data) + bp.n * gx.s_n + (sum_models ? 0 : b_lo * gx.s_b) + c * gx.s_c +
                       iw * gx.s_w;
HFKERN_UNROLL
  for (int r = 0; r < kMaxRows; ++r) {
    const int ih = ih0 + r;
    if (r >= t.rows || ih >= g.H) break;
    float acc = 0.0f;
    // the models one after another, in order: a shared input's sum does not depend on the launch
    for (int b = b_lo; b < b_hi; ++b) {
      const Taps<T, KH, KW> wt(w, b, c);
      const T* __restrict__ gp = static_cast<const T*>(gy.data) + bp.n * gy.s_n + b * gy.s_b + c * gy.s_c;
HFKERN_UNROLL
      for (int i = 0; i < kh; ++i) {
        const int ph = ih + g.pad_h - i * g.dil_h;
        if (ph < 0 || ph % g.stride_h != 0) continue;
        const int oh = ph / g.stride_h;
        if (oh >= g.OH) continue;
        const T* __restrict__ row = gp + oh * gy.s_h;
HFKERN_UNROLL
        for (int j = 0; j < kw; ++j) {
          const int pw = iw + g.pad_w - j * g.dil_w;
          if (pw < 0 || pw % g.stride_w != 0) continue;
          const int ow = pw / g.stride_w;
          if (ow < g.OW) acc += wt(i, j) * to_float(row[ow * gy.s_w]);
        }
      }
    }
    op[ih * gx.s_h] = from_float<T>(acc);
  }
}

// ---- weight gradient ------------------------------------------------------------------

// Block (tap, pair block, chunk p): the rows [p * chunk_rows, (p + 1) * chunk_rows) of
// the N * OH output rows of its pairs, all columns. The general instance (KH = KW = 0)
// sums one tap, the block's; the fixed sizes sum every tap at once.
template <typename T, int KH, int KW>
__global__ void __launch_bounds__(kMaxThreads, 1)
    dw_wgrad_partial_kernel(DwTensor gy,  // [B, N, C, OH, OW] through strides
                            DwTensor x,   // [B, N, C, H, W] through strides (s_b = 0: shared)
                            DwGeometry g, DwTile t, int n_cb, int chunk_rows, int P,
                            float* __restrict__ partials) {  // [B * C, P, kh * kw]
  constexpr int kTaps = KH > 0 ? KH * KW : 1;
  __shared__ float s_red[kMaxThreads];
  int blk = static_cast<int>(blockIdx.x);
  const int p = blk % P;
  blk /= P;
  const int cb = blk % n_cb;
  const int tap0 = blk / n_cb;  // the general instance's tap
  const Lanes l = lanes_of(t, static_cast<int>(threadIdx.x));
  const int pair = cb * t.tc + l.ic;
  const int taps = g.kh * g.kw;

  float acc[kTaps];
HFKERN_UNROLL
  for (int k = 0; k < kTaps; ++k) acc[k] = 0.0f;
  if (pair < g.B * g.C) {
    const int C = static_cast<int>(g.C), OH = static_cast<int>(g.OH);
    const int b = pair / C, c = pair % C;
    const T* __restrict__ gb = static_cast<const T*>(gy.data) + b * gy.s_b + c * gy.s_c;
    const T* __restrict__ xb = static_cast<const T*>(x.data) + b * x.s_b + c * x.s_c;
    const int rows = static_cast<int>(g.N * g.OH);
    const int64_t chunk_end = static_cast<int64_t>(p + 1) * chunk_rows;
    const int r_end = chunk_end < rows ? static_cast<int>(chunk_end) : rows;
    const int ti = KH > 0 ? 0 : tap0 / g.kw, tj = KH > 0 ? 0 : tap0 % g.kw;
    int r = p * chunk_rows + l.ih;
    int n = r / OH, oh = r - n * OH;  // stepped below without divisions
    for (; r < r_end; r += t.th) {
      const T* __restrict__ grow = gb + n * gy.s_n + oh * gy.s_h;
      const T* __restrict__ xn = xb + n * x.s_n;
      const int ih0 = oh * g.stride_h - g.pad_h;
      for (int ow = l.iw; ow < g.OW; ow += t.tw) {
        const float gv = to_float(grow[ow * gy.s_w]);
        const int iw0 = ow * g.stride_w - g.pad_w;
        if constexpr (KH > 0) {
HFKERN_UNROLL
          for (int i = 0; i < KH; ++i) {
            const int ih = ih0 + i * g.dil_h;
            if (ih < 0 || ih >= g.H) continue;
            const T* __restrict__ xrow = xn + ih * x.s_h;
HFKERN_UNROLL
            for (int j = 0; j < KW; ++j) {
              const int iw = iw0 + j * g.dil_w;
              if (iw >= 0 && iw < g.W) acc[i * KW + j] += gv * to_float(xrow[iw * x.s_w]);
            }
          }
        } else {
          const int ih = ih0 + ti * g.dil_h, iw = iw0 + tj * g.dil_w;
          if (ih >= 0 && ih < g.H && iw >= 0 && iw < g.W) acc[0] += gv * to_float(xn[ih * x.s_h + iw * x.s_w]);
        }
      }
      for (oh += t.th; oh >= OH; oh -= OH) ++n;
    }
  }

  // each pair's th x tw threads, folded in a fixed tree: the upper half onto the lower
  const int lanes = t.th * t.tw;
  const int rl = l.iw + t.tw * l.ih;
  const int slot = l.ic * lanes + rl;
HFKERN_UNROLL
  for (int k = 0; k < kTaps; ++k) {
    s_red[slot] = acc[k];
    __syncthreads();
    for (int live = lanes; live > 1;) {
      const int half = (live + 1) / 2;
      if (rl < live - half) s_red[slot] += s_red[slot + half];
      __syncthreads();
      live = half;
    }
    if (rl == 0 && pair < g.B * g.C)
      partials[(static_cast<int64_t>(pair) * P + p) * taps + (KH > 0 ? k : tap0)] = s_red[slot];
    __syncthreads();  // read before the next tap overwrites it
  }
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads, 1)
    dw_wgrad_reduce_kernel(const float* __restrict__ partials,  // [B * C, P, kh * kw]
                           DwGeometry g, int64_t P,
                           DwWeight gw) {  // [B, C, kh, kw] through strides
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int taps = g.kh * g.kw;
  if (i >= g.B * g.C * taps) return;
  const int64_t pair = i / taps;
  const int tap = static_cast<int>(i % taps);
  float sum = 0.0f;
  // in chunk order, one after another: the result does not depend on the launch
  for (int64_t p = 0; p < P; ++p) sum += partials[(pair * P + p) * taps + tap];
  const int64_t b = pair / g.C, c = pair % g.C;
  static_cast<T*>(gw.data)[b * gw.s_b + c * gw.s_c + (tap / g.kw) * gw.s_h + (tap % g.kw) * gw.s_w] =
      from_float<T>(sum);
}

// ---- launch checks and dispatch -------------------------------------------------------


constexpr int64_t kMaxIndex = 0x7fffffff;

void check_geometry(const char* what, const DwGeometry& g) {
  if (g.B < 0 || g.N < 0 || g.C < 0 || g.H < 1 || g.W < 1 || g.OH < 1 || g.OW < 1)
    fail(what, "expected B, N, C >= 0 and H, W, OH, OW >= 1, got B = " + str(g.B) + ", N = " + str(g.N) +
                   ", C = " + str(g.C) + ", H x W = " + str(g.H) + " x " + str(g.W) + ", OH x OW = " + str(g.OH) +
                   " x " + str(g.OW));
  if (g.kh < 1 || g.kw < 1 || g.stride_h < 1 || g.stride_w < 1 || g.dil_h < 1 || g.dil_w < 1 || g.pad_h < 0 ||
      g.pad_w < 0)
    fail(what, "expected kernel, stride, dilation >= 1 and padding >= 0, got kernel " + str(g.kh) + " x " +
                   str(g.kw) + ", stride " + str(g.stride_h) + " x " + str(g.stride_w) + ", dilation " +
                   str(g.dil_h) + " x " + str(g.dil_w) + ", padding " + str(g.pad_h) + " x " + str(g.pad_w));
  // row and column indices (and their padded, dilated reach) are 32-bit in the kernels
  const int64_t reach_h = g.H + 2 * int64_t(g.pad_h) + int64_t(g.dil_h) * g.kh + int64_t(g.stride_h) * g.OH;
  const int64_t reach_w = g.W + 2 * int64_t(g.pad_w) + int64_t(g.dil_w) * g.kw + int64_t(g.stride_w) * g.OW;
  if (reach_h > kMaxIndex || reach_w > kMaxIndex)
    fail(what, "spatial sizes, padding and dilation reach past 2**31 - 1");
  // (model, channel) pairs, samples and rows of samples are 32-bit in the kernels
  if (g.B * g.C > kMaxIndex || g.N * (g.H > g.OH ? g.H : g.OH) > kMaxIndex - kMaxThreads * kMaxRows)
    fail(what, "expected B * C and N * H (N * OH) below 2**31 - 1024, got B * C = " + str(g.B * g.C) + ", N = " + str(g.N));
  const int64_t oh = (g.H + 2 * int64_t(g.pad_h) - int64_t(g.dil_h) * (g.kh - 1) - 1) / g.stride_h + 1;
  const int64_t ow = (g.W + 2 * int64_t(g.pad_w) - int64_t(g.dil_w) * (g.kw - 1) - 1) / g.stride_w + 1;
  if (oh != g.OH || ow != g.OW)
    fail(what, "expected OH x OW = " + str(oh) + " x " + str(ow) + " for this geometry, got " + str(g.OH) + " x " +
                   str(g.OW));
}

void check_tile(const char* what, const DwTile& t) {
  const int64_t threads = int64_t(t.tc) * t.th * t.tw;
  if (t.tc < 1 || t.th < 1 || t.tw < 1 || threads > kMaxThreads || t.rows < 1 || t.rows > kMaxRows)
    fail(what, "expected a tile of tc x th x tw >= 1 threads, at most " + str(kMaxThreads) + ", and 1 to " +
                   str(kMaxRows) + " rows per thread, got " + str(t.tc) + " x " + str(t.th) + " x " + str(t.tw) +
                   ", " + str(t.rows) + " rows");
}

void check_dtype(const char* what, const char* name, DType got, DType want) {
  if (got != want)
    fail(what, std::string("expected ") + name + " of the data's dtype (code " + str(static_cast<int>(want)) +
                   "), got dtype code " + str(static_cast<int>(got)));
}

unsigned grid_of(const char* what, int64_t blocks) {
  if (blocks > kMaxIndex) fail(what, "the grid needs " + str(blocks) + " blocks, more than 2**31 - 1");
  return static_cast<unsigned>(blocks);
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<T>{}, Tag<K>{}) with the element type T and the kernel size K (Size<3>,
// Size<5> or the general Size<0>).
template <int K>
struct Size {
  static constexpr int value = K;
};

template <typename F>
void dispatch(const char* what, DType dtype, const DwGeometry& g, F&& f) {
  auto sized = [&](auto tag) {
    if (g.kh == 3 && g.kw == 3)
      f(tag, Size<3>{});
    else if (g.kh == 5 && g.kw == 5)
      f(tag, Size<5>{});
    else
      f(tag, Size<0>{});
  };
  dispatch_dtype(what, dtype, [&](auto v) { sized(Tag<decltype(v)>{}); });
}

// The element kernels' blocks over an [N, pairs, rows, cols] output.
Blocks element_blocks(const DwTile& t, int64_t pairs, int64_t rows, int64_t cols) {
  return {static_cast<int>(cdiv(pairs, t.tc)), static_cast<int>(cdiv(rows, int64_t(t.th) * t.rows)),
          static_cast<int>(cdiv(cols, t.tw))};
}

}  // namespace

void depthwise_conv_fwd(const DwTensor& x, const DwWeight& w, const DwWeight& bias, const DwTensor& y,
                        const DwGeometry& g, const DwTile& t, void* stream) {
  const char* what = "depthwise_conv_fwd";
  check_geometry(what, g);
  check_tile(what, t);
  check_dtype(what, "weight", w.dtype, x.dtype);
  check_dtype(what, "y", y.dtype, x.dtype);
  if (bias.data != nullptr) check_dtype(what, "bias", bias.dtype, x.dtype);
  if (g.B * g.N * g.C == 0) return;
  const Blocks nb = element_blocks(t, g.B * g.C, g.OH, g.OW);
  const dim3 grid(grid_of(what, g.N * nb.n_hb * nb.n_wb * nb.n_cb)), block(static_cast<unsigned>(t.tc * t.th * t.tw));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch(what, x.dtype, g, [&](auto tag, auto size) {
    using T = typename decltype(tag)::type;
    constexpr int K = decltype(size)::value;
    HFKERN_LAUNCH((dw_fwd_kernel<T, K, K>), grid, block, 0, st, x, w, bias, y, g, t, nb);
  });
}

void depthwise_conv_dgrad(const DwTensor& gy, const DwWeight& w, const DwTensor& gx, bool sum_models,
                          const DwGeometry& g, const DwTile& t, void* stream) {
  const char* what = "depthwise_conv_dgrad";
  check_geometry(what, g);
  check_tile(what, t);
  check_dtype(what, "weight", w.dtype, gy.dtype);
  check_dtype(what, "grad_x", gx.dtype, gy.dtype);
  if (g.N * g.C == 0 || (g.B == 0 && !sum_models)) return;
  const Blocks nb = element_blocks(t, sum_models ? g.C : g.B * g.C, g.H, g.W);
  const dim3 grid(grid_of(what, g.N * nb.n_hb * nb.n_wb * nb.n_cb)), block(static_cast<unsigned>(t.tc * t.th * t.tw));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch(what, gy.dtype, g, [&](auto tag, auto size) {
    using T = typename decltype(tag)::type;
    constexpr int K = decltype(size)::value;
    HFKERN_LAUNCH((dw_dgrad_kernel<T, K, K>), grid, block, 0, st, gy, w, gx, sum_models, g, t, nb);
  });
}

void depthwise_conv_wgrad_partials(const DwTensor& gy, const DwTensor& x, const DwGeometry& g, const DwTile& t,
                                   int64_t chunk_rows, int64_t P, float* partials, void* stream) {
  const char* what = "depthwise_conv_wgrad_partials";
  check_geometry(what, g);
  check_tile(what, t);
  check_dtype(what, "x", x.dtype, gy.dtype);
  if (t.rows != 1) fail(what, "expected a tile of one row per thread, got " + str(t.rows));
  if (chunk_rows < 1 || P < 1 || P > kMaxIndex || chunk_rows > kMaxIndex || cdiv(g.N * g.OH, chunk_rows) > P)
    fail(what, "expected P chunks of chunk_rows >= 1 rows covering N * OH = " + str(g.N * g.OH) + " rows, got P = " +
                   str(P) + ", chunk_rows = " + str(chunk_rows));
  if (g.B * g.C == 0) return;
  const int n_cb = static_cast<int>(cdiv(g.B * g.C, t.tc));
  const bool general = !((g.kh == 3 && g.kw == 3) || (g.kh == 5 && g.kw == 5));
  const dim3 grid(grid_of(what, n_cb * P * (general ? int64_t(g.kh) * g.kw : 1))),
      block(static_cast<unsigned>(t.tc * t.th * t.tw));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch(what, gy.dtype, g, [&](auto tag, auto size) {
    using T = typename decltype(tag)::type;
    constexpr int K = decltype(size)::value;
    HFKERN_LAUNCH((dw_wgrad_partial_kernel<T, K, K>), grid, block, 0, st, gy, x, g, t, n_cb,
                  static_cast<int>(chunk_rows), static_cast<int>(P), partials);
  });
}

void depthwise_conv_wgrad_reduce(const float* partials, const DwGeometry& g, int64_t P, const DwWeight& gw,
                                 int threads, void* stream) {
  const char* what = "depthwise_conv_wgrad_reduce";
  if (threads < 1 || threads > kMaxThreads)
    fail(what, "expected 1 to " + str(kMaxThreads) + " threads per block, got " + str(threads));
  if (g.B < 0 || g.C < 0 || g.kh < 1 || g.kw < 1 || P < 0)
    fail(what, "expected B, C, P >= 0 and a kernel of at least 1 x 1, got B = " + str(g.B) + ", C = " + str(g.C) +
                   ", P = " + str(P) + ", kernel " + str(g.kh) + " x " + str(g.kw));
  const int64_t n = g.B * g.C * g.kh * g.kw;
  if (n == 0) return;
  const dim3 grid(grid_of(what, cdiv(n, threads))), block(static_cast<unsigned>(threads));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_dtype(
      what, gw.dtype,
      [&](auto v) {
        using T = decltype(v);
        HFKERN_LAUNCH((dw_wgrad_reduce_kernel<T>), grid, block, 0, st, partials, g, P, gw);
      },
      "grad_w of float32, float16 or bfloat16");
}

}  // namespace hfkern
