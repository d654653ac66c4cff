// multi_tensor_step.h: the multi-tensor optimizer steps (csrc/optim/multi_tensor_step.cu),
// declared in plain C++ for the binding.
//
// The Python glue (hfkern/cuda/optim.py) builds a tile table (hfkern/_multi_tensor.py):
// one int64 row of kTileColumns per (tensor, model, chunk) tile, holding element
// offsets from the first tensor of each list, so that one launch per parameter
// dtype addresses every parameter of every model.
#pragma once

#include <cstdint>

#include "hfkern/dtype_code.h"

namespace hfkern {

// Columns of a tile row; hfkern/_multi_tensor.py declares the same (checked at import).
enum TileColumn : int {
  kColParam = 0,   // element offset of the tile in the parameter list
  kColGrad = 1,    // ... in the gradient list
  kColState0 = 2,  // ... in each state list, in the op's argument order
  kColState1 = 3,
  kColState2 = 4,
  kColStep = 5,    // offset of the tile's step count steps[i][b]
  kColModel = 6,   // the model b
  kColLength = 7,  // elements in the tile
  kColAligned = 8, // 1: every address and the length allow 16-byte vector access
  kColFirst = 9,   // row of the first tile of this tile's (tensor, model) pair (its tiles are consecutive)
  kColTiles = 10,  // tiles of the pair
  kTileColumns = 11,
};

// One dtype group of a step: the tile table and the group's first tensor of
// each list (every other tensor is an offset from it). Device pointers under
// nvcc, host pointers under the emulator.
struct StepGroup {
  const int64_t* tiles;   // [n_tiles, kTileColumns]
  int64_t n_tiles;
  DType param_dtype;      // Float32, Float16 or BFloat16; grads share it
  void* params;
  const void* grads;
  float* state[3];        // float32 state lists; an absent list is never read
  const float* steps;     // incremented step counts (unread where the optimizer has none)
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

// steps[offsets[k]] += 1 for every (tensor, model) k = i * B + b whose model is not skipped
// and, given counted_by (a hyperparameter row: model b's value at counted_by[b * counted_stride]),
// has a non-zero value there (SGD counts only its updates with momentum).
void count_steps(float* steps, const int64_t* offsets, int64_t n, int64_t B, const uint8_t* skip,
                 const float* counted_by, int64_t counted_stride, int threads, void* stream);

// hfkern::sgd_step_ / hfkern::adam_step_ on one dtype group (hfkern/ops/optim.py has the math).
void sgd_step(const StepGroup& group, const StepOptions& options, int threads, void* stream);
void adam_step(const StepGroup& group, const StepOptions& options, int threads, void* stream);
// hfkern::lars_step_ / hfkern::lamb_step_ on one dtype group of adapted (options.trust:
// a norm pass into group.partials, then the update) or excluded parameters.
void lars_step(const StepGroup& group, const StepOptions& options, int threads, void* stream);
void lamb_step(const StepGroup& group, const StepOptions& options, int threads, void* stream);

}  // namespace hfkern
