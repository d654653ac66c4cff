// depthwise_conv.h: the array depthwise conv2d's host entry points
// (csrc/conv/depthwise_conv.cu), in plain C++ for the binding.
//
// hfkern/ops/conv.py states the op; hfkern/cuda/conv.py decides which calls are
// depthwise (2-D, not transposed, groups == C_in == C_out) and checks the
// tensors. Every activation is an [B, N, C, H, W] tensor seen through five
// strides (elements): an array conv's [N, B, C, H, W] memory, channels-last
// array memory [N, H, W, B, C], a strided slice, and a shared input (s_b = 0)
// are all read where they lie. The weight [B, C, 1, kh, kw] is passed without
// its singleton dim.
//
// A thread block is a tile of tc x th x tw threads over (model-channel pairs,
// rows, columns); the channels vary fastest when they run along memory
// (channels-last, c_inner), the columns otherwise, so a warp reads contiguous
// memory either way. A thread computes `rows` consecutive rows of one column.
#pragma once

#include <cstdint>

#include "hfkern/dtype_code.h"

namespace hfkern {

// The most threads of a block (the size of the weight-gradient reduction array),
// and the most rows one thread computes.
constexpr int kDwMaxThreads = 256;
constexpr int kDwMaxRows = 4;

// An [B, N, C, H, W] activation through its strides; s_b == 0: one input shared by the models.
struct DwTensor {
  void* data = nullptr;  // const for the inputs
  DType dtype = DType::Float32;
  int64_t s_b = 0, s_n = 0, s_c = 0, s_h = 0, s_w = 0;
};

// A weight (or its gradient) [B, C, kh, kw] through its strides; a bias [B, C] uses s_b, s_c
// only, and data == nullptr means no bias.
struct DwWeight {
  void* data = nullptr;
  DType dtype = DType::Float32;
  int64_t s_b = 0, s_c = 0, s_h = 0, s_w = 0;
};

// x [B, N, C, H, W] -> y [B, N, C, OH, OW]; OH = (H + 2 pad_h - dil_h (kh - 1) - 1) / stride_h + 1.
struct DwGeometry {
  int64_t B = 0, N = 0, C = 0, H = 0, W = 0, OH = 0, OW = 0;
  int kh = 1, kw = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dil_h = 1, dil_w = 1;
};

// Threads of a block: tc x th x tw, channels fastest (c_inner) or columns fastest;
// each thread computes `rows` consecutive rows.
struct DwTile {
  int tc = 1, th = 1, tw = 1, rows = 1;
  bool c_inner = false;
};

// y = conv(x, w) + bias, y in x's dtype (float32 accumulation). x may be shared (s_b = 0).
void depthwise_conv_fwd(const DwTensor& x, const DwWeight& w, const DwWeight& bias, const DwTensor& y,
                        const DwGeometry& g, const DwTile& t, void* stream);

// grad_x = the adjoint conv of grad_y: each input pixel gathers the taps that reach it.
// sum_models: grad_x is one [N, C, H, W] input gradient summed over the B models (its
// s_b is ignored), for an input the models share.
void depthwise_conv_dgrad(const DwTensor& grad_y, const DwWeight& w, const DwTensor& grad_x, bool sum_models,
                          const DwGeometry& g, const DwTile& t, void* stream);

// Weight gradient, pass 1: the N * OH rows of every (model, channel) split into P chunks
// of chunk_rows rows; per chunk and tap the sum of grad_y * x, partials [B * C, P, kh * kw]
// float32.
void depthwise_conv_wgrad_partials(const DwTensor& grad_y, const DwTensor& x, const DwGeometry& g,
                                   const DwTile& t, int64_t chunk_rows, int64_t P, float* partials, void* stream);

// Pass 2: per (model, channel, tap) the P partials added in chunk order, stored into
// grad_w [B, C, kh, kw] (its strides, its dtype).
void depthwise_conv_wgrad_reduce(const float* partials, const DwGeometry& g, int64_t P, const DwWeight& grad_w,
                                 int threads, void* stream);

}  // namespace hfkern
