// multi_tensor_step.h: the multi-tensor optimizer steps (csrc/optim/multi_tensor_step.cu),
// declared in plain C++ for the binding.
//
// The Python glue (hfkern/cuda/optim.py) passes three tables (hfkern/_multi_tensor.py has
// the contract), so that one launch per parameter dtype addresses every parameter of
// every model:
//   * the tile table: one int64 row of kTileColumns per (tensor, model, chunk) tile. It
//     depends only on the tensors' shapes, dtypes and layouts, so it is built once and
//     cached, and gradients that are new tensors at every step do not change it;
//   * the address table: one int64 row of kAddressColumns per tensor, made at every step:
//     the tensor's element offset from the first tensor of each list (the group's first
//     parameter, gradient and state tensors; steps[0] for the step counts) and whether
//     its tiles allow 16-byte vector access;
//   * the gather table: one int64 row of kGatherColumns per gradient laid out unlike its
//     parameter (channels-last, not dense), read where it lies: (size, stride) of its
//     dims in the parameter's memory order, innermost first, padded with (1, 0).
// Element k of a tile is at params + addrs[i][kAddrParam] + tile[kColOffset] + k (state
// alike), grads + addrs[i][kAddrGrad] + tile[kColGrad] + k, or for a gathered gradient
// grads + addrs[i][kAddrGrad] + tile[kColGrad] + gathered(tile[kColStart] + k).
#pragma once

#include <cstdint>

#include "hfkern/dtype_code.h"

namespace hfkern {

// Columns of a tile row; hfkern/_multi_tensor.py declares the same (checked at import).
enum TileColumn : int {
  kColTensor = 0,  // the tensor's position i in the call's lists: its address row
  kColModel = 1,   // the model b
  kColOffset = 2,  // element offset of the tile in tensor i of the parameter and state lists: b * n_i + start
  kColGrad = 3,    // ... in grads[i]: b * grads[i].stride(0), plus start unless gathered
  kColStart = 4,   // the tile's first element within model b's slice
  kColLength = 5,  // elements in the tile
  kColStep = 6,    // offset of the step count steps[i][b] from steps[i]: b * steps[i].stride(0)
  kColGather = 7,  // the gradient's row in the gather table, or -1: laid out like its parameter
  kColFirst = 8,   // row of the first tile of this tile's (tensor, model) pair (its tiles are consecutive)
  kColTiles = 9,   // tiles of the pair
  kTileColumns = 10,
};

// Columns of an address row (one per tensor, made at every step).
enum AddressColumn : int {
  kAddrParam = 0,    // element offset of params[i] from the group's first parameter
  kAddrGrad = 1,     // ... of grads[i] from the group's first gradient
  kAddrState0 = 2,   // ... of each state list's tensor i from the list's group first, in the op's order
  kAddrState1 = 3,
  kAddrState2 = 4,
  kAddrStep = 5,     // ... of steps[i] from steps[0]
  kAddrAligned = 6,  // 1: every address and length of the tensor's tiles allow 16-byte vector access
  kAddressColumns = 7,
};

// A gather row: (size, stride) pairs of a gradient's dims in its parameter's memory order.
constexpr int kMaxGradDims = 4;
constexpr int kGatherColumns = 2 * kMaxGradDims;

// One dtype group of a step: its tile table, the call's address table, the group's
// gather table and the group's first tensor of each list (every other tensor is an
// offset from it). Device pointers under nvcc, host pointers under the emulator.
struct StepGroup {
  const int64_t* tiles;   // [n_tiles, kTileColumns]
  int64_t n_tiles;
  const int64_t* addrs;   // [n, kAddressColumns] (n: the call's tensors, every group's)
  const int64_t* gathers; // [G, kGatherColumns], or nullptr: no tile has kColGather >= 0
  DType param_dtype;      // Float32, Float16 or BFloat16; grads share it
  void* params;
  const void* grads;
  float* state[3];        // float32 state lists; an absent list is never read
  const float* steps;     // steps[0]: incremented step counts (unread where the optimizer has none)
  const float* hypers;    // [rows, B] float32
  int64_t hyper_row_stride, hyper_model_stride;  // elements
  const uint8_t* skip;    // [B] bool, or nullptr
  // [n_tiles, 2] float32 scratch of a trust-ratio step (options.trust): the norm pass's
  // per-tile sums of squares, which the update sums per (tensor, model) pair in row order.
  float* partials = nullptr;
};

// Hyperparameter rows, in the order of hfkern._optim_specs (checked at import).
enum SgdRow : int { kSgdLr, kSgdMomentum, kSgdDampening, kSgdWeightDecay, kSgdRows };
enum AdamRow : int { kAdamLr, kAdamBeta1, kAdamBeta2, kAdamEps, kAdamWeightDecay, kAdamRows };
enum LarsRow : int { kLarsLr, kLarsMomentum, kLarsWeightDecay, kLarsTrustCoefficient, kLarsEps, kLarsRows };
enum LambRow : int {
  kLambLr, kLambBeta1, kLambBeta2, kLambEps, kLambWeightDecay, kLambNormMin, kLambNormMax, kLambRows
};

struct StepOptions {
  bool maximize = false;
  bool has_weight_decay = false;
  bool decoupled_weight_decay = false;  // Adam: AdamW's weight decay
  bool momentum = false;                // SGD: momentum buffers present
  bool nesterov = false;                // SGD
  bool amsgrad = false;                 // Adam: max_exp_avg_sqs present
  bool trust = false;                   // LARS/LAMB: adapted parameters (norm pass, then the ratio);
                                        // false: excluded ones (ratio 1; has_weight_decay must be false)
  bool bias_correction = false;         // LAMB
};

// steps[addrs[i][kAddrStep] + offsets[k]] += 1 for every (tensor, model) k = i * B + b
// (offsets[k] = b * steps[i].stride(0)) whose model is not skipped and, given counted_by (a
// hyperparameter row: model b's value at counted_by[b * counted_stride]), has a non-zero
// value there (SGD counts only its updates with momentum). n: tensors x models.
void count_steps(float* steps, const int64_t* addrs, const int64_t* offsets, int64_t n, int64_t B,
                 const uint8_t* skip, const float* counted_by, int64_t counted_stride, int threads, void* stream);

// hfkern::sgd_step_ / hfkern::adam_step_ on one dtype group (hfkern/ops/optim.py has the math).
void sgd_step(const StepGroup& group, const StepOptions& options, int threads, void* stream);
void adam_step(const StepGroup& group, const StepOptions& options, int threads, void* stream);
// hfkern::lars_step_ / hfkern::lamb_step_ on one dtype group of adapted (options.trust:
// a norm pass into group.partials, then the update) or excluded parameters.
void lars_step(const StepGroup& group, const StepOptions& options, int threads, void* stream);
void lamb_step(const StepGroup& group, const StepOptions& options, int threads, void* stream);

}  // namespace hfkern
