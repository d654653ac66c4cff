// layer_norm.h: the array layer norm's and RMS norm's host entry points
// (csrc/norm/layer_norm.cu), in plain C++ for the binding.
//
// hfkern/ops/layer_norm.py states the ops; hfkern/cuda/layer_norm.py checks the
// tensors and reduces their layout: the B x M rows of D = prod(normalized_shape)
// elements are addressed through strides, the per-model batch dims merged into
// at most two strided dims (rows M0 x M1) and the normalized dims into at most
// two (columns D0 x D1). Strides and offsets are in elements.
//
// Threads. A row is reduced by `row_threads` threads (a power of two): within
// groups of `lanes` threads by warp shuffles, across the groups of a row through
// shared memory. A block holds `rows` rows side by side (short rows: a warp, or
// part of one, per row) or one row (long rows: a block per row). Each thread owns
// the packs p = lane, lane + row_threads, ... of its row, a pack being the
// 16 / sizeof(x's dtype) consecutive columns [p * VEC, p * VEC + VEC), read with
// one vector load where every data tensor allows it (`vec`).
#pragma once

#include <cstdint>

#include "hfkern/activation_code.h"
#include "hfkern/dtype_code.h"

namespace hfkern {

// The fused activation after the affine map (hfkern/activation_code.h); RMS norm has none.
using LnActivation = Activation;

// The most threads of a block (the size of the kernels' shared reduction arrays).
constexpr int kLnMaxThreads = 512;
// ... of the backward: its threads hold the row twice and its parameter-gradient
// sums, and need up to 255 registers (a 512-thread block would cap them at 128 and spill).
constexpr int kLnMaxBwdThreads = 256;
// The float32 values of a row each thread holds in registers when the row fits
// (`regs`): the forward keeps x, the backward x and grad_y (and two sums).
constexpr int kLnFwdValues = 32;
constexpr int kLnBwdValues = 8;
// Shared memory the backward may use to combine the rows of a block (bytes).
constexpr int kLnMaxSharedBytes = 48 * 1024;

// One [B, M, D] operand: its data, dtype and strides (elements): row m of model b
// at b * s_b + (m / M1) * s_m0 + (m % M1) * s_m1, column d at
// (d / D1) * s_d0 + (d % D1) * s_d1 (d * s_d1 when D1 == D).
struct LnTensor {
  void* data = nullptr;  // const for the inputs; the kernels write only y and grad_x
  DType dtype = DType::Float32;
  int64_t s_b = 0, s_m0 = 0, s_m1 = 0, s_d0 = 0, s_d1 = 0;
};

// A [B, D] per-model parameter (or its gradient) through its strides; data == nullptr: absent.
struct LnParam {
  void* data = nullptr;  // written only as a parameter gradient
  DType dtype = DType::Float32;
  int64_t s_b = 0, s_d = 0;
};

struct LnShape {
  int64_t B = 0, M = 0, M1 = 1, D = 0, D1 = 1;
};

// How a launch maps rows to threads (hfkern/cuda/layer_norm.py, _config).
struct LnConfig {
  int row_threads = 32;     // threads per row, a power of two
  int lanes = 32;           // the threads of a shuffle group: a power of two <= 32 dividing row_threads
  int rows = 1;             // rows per block; 1 whenever row_threads > lanes
  bool regs = true;         // the row held in registers (at most k*Values / VEC packs per thread), else swept
  bool vec = false;         // the data tensors read and written a pack at a time
  bool param_vec = false;   // weight and bias likewise
};

// y = act((x - mean) * rstd * weight + bias) (RMS norm: x * rstd * weight), y through
// its strides in x's dtype; mean (layer norm only) and rstd [B, M] float32 contiguous.
void layer_norm_forward(const LnTensor& x, const LnTensor& y, const LnParam& weight, const LnParam& bias,
                        const LnShape& shape, const LnConfig& config, double eps, bool rms, LnActivation act,
                        float* mean, float* rstd, void* stream);

// The backward's pass over the rows. Each model's M rows are split into P chunks of
// `chunk` rows (a multiple of config.rows), one block each. With gz = grad_y *
// act'(z) (z recomputed from x): grad_x (grad_x.data == nullptr: not wanted) and
// the chunk's float32 partial sums of gz * xhat (pw) and gz (pb), [B, P, D]
// (nullptr: not wanted). mean is ignored for RMS norm; bias is read only for the
// activation's derivative.
void layer_norm_backward(const LnTensor& grad_y, const LnTensor& x, const LnTensor& grad_x, const LnParam& weight,
                         const LnParam& bias, const LnShape& shape, const LnConfig& config, int64_t chunk, int64_t P,
                         const float* mean, const float* rstd, bool rms, LnActivation act, float* pw, float* pb,
                         void* stream);

// grad_weight / grad_bias [B, D] (their dtype; data == nullptr: not wanted): the
// P partials of each column summed in chunk order.
void layer_norm_sum_partials(const float* pw, const float* pb, int64_t B, int64_t P, int64_t D,
                             const LnParam& grad_weight, const LnParam& grad_bias, int threads, void* stream);

}  // namespace hfkern
