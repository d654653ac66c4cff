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
  kTileColumns = 9,
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
};

// Hyperparameter rows, in the order of hfkern._optim_specs (checked at import).
enum SgdRow : int { kSgdLr, kSgdMomentum, kSgdDampening, kSgdWeightDecay, kSgdRows };
enum AdamRow : int { kAdamLr, kAdamBeta1, kAdamBeta2, kAdamEps, kAdamWeightDecay, kAdamRows };

struct StepOptions {
  bool maximize = false;
  bool has_weight_decay = false;
  bool decoupled_weight_decay = false;  // Adam: AdamW's weight decay
  bool momentum = false;                // SGD: momentum buffers present
  bool nesterov = false;                // SGD
  bool amsgrad = false;                 // Adam: max_exp_avg_sqs present
};

// steps[offsets[k]] += 1 for every (tensor, model) k = i * B + b whose model is not skipped.
void count_steps(float* steps, const int64_t* offsets, int64_t n, int64_t B, const uint8_t* skip,
                 int threads, void* stream);

// hfkern::sgd_step_ / hfkern::adam_step_ on one dtype group (hfkern/ops/optim.py has the math).
void sgd_step(const StepGroup& group, const StepOptions& options, int threads, void* stream);
void adam_step(const StepGroup& group, const StepOptions& options, int threads, void* stream);

}  // namespace hfkern
