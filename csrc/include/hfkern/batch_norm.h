// batch_norm.h: the array batch norm's host entry points (csrc/norm/batch_norm.cu),
// in plain C++ for the binding.
//
// hfkern/ops/batch_norm.py states the op; hfkern/cuda/batch_norm.py checks the
// tensors and reduces their layout (hfkern/_norm_layout.py): each model's x is
// seen as [R0, C, R1] through four strides, the reduced dims N and S merged into
// R0 (outer) and R1 (inner). Strides and offsets are in elements.
//
// A thread block runs a tile of tr0 x tc x tr1 threads; the dim that runs along
// memory is the fastest-varying one (channels with c_inner, R1 otherwise), so
// neighbouring threads read neighbouring elements. Reductions split the
// R0 x R1 elements of each (model, channel) into P fixed chunks
// (hfkern/_norm_layout.py, partition), one block each, whose partials are
// combined in chunk order by a per-channel kernel: no atomics, so the results
// do not depend on the order blocks run in.
#pragma once

#include <cstdint>

#include "hfkern/activation_code.h"
#include "hfkern/dtype_code.h"

namespace hfkern {

// The fused activation after the affine map (hfkern/activation_code.h).
using BnActivation = Activation;

// The most threads of a block (the size of the kernels' shared reduction arrays).
constexpr int kBnMaxThreads = 256;

// One [B, R0, C, R1] operand: its data, dtype and strides (elements).
struct BnTensor {
  void* data = nullptr;  // const for the inputs; the kernels write only y and grad_x
  DType dtype = DType::Float32;
  int64_t s_b = 0, s_r0 = 0, s_c = 0, s_r1 = 0;
};

// A [B, C] per-channel tensor through its strides, in its own dtype; data == nullptr: absent.
struct BnChannels {
  void* data = nullptr;  // written only as running statistics and parameter gradients
  DType dtype = DType::Float32;
  int64_t s_b = 0, s_c = 0;
};

struct BnShape {
  int64_t B = 0, R0 = 0, C = 0, R1 = 0;
};

// Threads of a block: tr0 x tc x tr1, channels fastest (c_inner) or R1 fastest.
struct BnTile {
  int tr0 = 1, tc = 1, tr1 = 1;
  bool c_inner = false;
};

// The chunks of one (model, channel)'s R0 x R1 elements (hfkern/_norm_layout.py).
struct BnChunks {
  int64_t chunk0 = 1, chunk1 = 1, P = 1, P1 = 1;
};

// Training statistics, pass 1: per-chunk means and centred sums of squares,
// pmean/pm2 [shape.B, P, C] float32 (shape.B: the models with their own statistics,
// 1 for a shared input).
void batch_norm_stats(const BnTensor& x, const BnShape& shape, const BnTile& tile, const BnChunks& chunks,
                      float* pmean, float* pm2, void* stream);

// Per (model, channel): in training the P partials combined in chunk order into
// mean/rstd [B, C] float32 contiguous, and the running statistics updated in place
// (update: they exist; cumulative: factor 1 / num_batches_tracked[b], int64 through
// s_nbt, else momentum); partials of model b at b * s_part_b (0: shared). P == 0
// (no values) gives NaN statistics and no update. In eval mean/rstd come from the
// running statistics. threads: per block.
struct BnFinalize {
  const float* pmean = nullptr;
  const float* pm2 = nullptr;
  int64_t s_part_b = 0;
  BnChannels running_mean, running_var;
  const int64_t* num_batches_tracked = nullptr;
  int64_t s_nbt = 0;
  bool training = true, update = false, cumulative = false;
  double momentum = 0.0, unbias = 1.0, eps = 1e-5;
};
void batch_norm_finalize(const BnFinalize& args, const BnShape& shape, const BnChunks& chunks, float* mean,
                         float* rstd, int threads, void* stream);

// y = act((x - mean) * rstd * weight + bias), y laid out through y's strides in x's dtype.
void batch_norm_apply(const BnTensor& x, const BnTensor& y, const BnShape& shape, const BnTile& tile,
                      const float* mean, const float* rstd, const BnChannels& weight, const BnChannels& bias,
                      BnActivation act, void* stream);

// Backward pass 1: with g = grad_y * act'(z), per-chunk sums of g and g * xhat,
// pg/pgx [B, P, C] float32.
void batch_norm_backward_partials(const BnTensor& grad_y, const BnTensor& x, const BnShape& shape,
                                  const BnTile& tile, const BnChunks& chunks, const float* mean, const float* rstd,
                                  const BnChannels& weight, const BnChannels& bias, BnActivation act, float* pg,
                                  float* pgx, void* stream);

// Backward pass 2, per (model, channel): the P partials summed in chunk order into
// sums [2, B, C] float32 (sum g, sum g * xhat), and into grad_weight / grad_bias
// ([B, C] contiguous in their dtype; data == nullptr: not wanted).
void batch_norm_backward_reduce(const float* pg, const float* pgx, int64_t B, int64_t C, int64_t P, float* sums,
                                const BnChannels& grad_weight, const BnChannels& grad_bias, int threads,
                                void* stream);

// grad_x = weight * rstd * (g - sum g / n - xhat * sum(g * xhat) / n) in training
// (sums from batch_norm_backward_reduce, inv_n = 1 / n), weight * rstd * g in eval.
void batch_norm_backward_dx(const BnTensor& grad_y, const BnTensor& x, const BnTensor& grad_x,
                            const BnShape& shape, const BnTile& tile, const float* mean, const float* rstd,
                            const BnChannels& weight, const BnChannels& bias, const float* sums, double inv_n,
                            bool training, BnActivation act, void* stream);

}  // namespace hfkern
