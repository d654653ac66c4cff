// embedding.h: the array embedding's host entry points (csrc/embedding/embedding.cu),
// in plain C++ for the binding.
//
// hfkern/ops/embedding.py states the op; hfkern/cuda/embedding.py checks the
// tensors, collapses the index dims of indices and grad_out to [M, L] through
// strides (a contiguous [B, N, L] is [B, N*L]; an array layer's [N, B, L] memory
// stays [B, N, L]) and chooses the vector widths. Strides and offsets are in
// elements (in words for the forward's table and output), int64 everywhere.
//
// The dense backward runs in four steps, all on the given stream, none waiting
// for the device:
//   1. embedding_sort_keys: key = b * V + index (b = 0 when the indices are
//      shared: one sort serves every model), value = the position in its model;
//   2. embedding_sort: one stable sort of the (key, value) pairs, by
//      cub::DeviceRadixSort::SortPairs on the GPU (temporary storage from the
//      caller, sized by embedding_sort_temp_bytes), by std::stable_sort in the
//      emulator build; stability fixes the order every row's hits are added in;
//   3. embedding_segments: bounds[r] = the first sorted entry with key >= r, so
//      row r's hits are sorted entries [bounds[r], bounds[r + 1]);
//   4. embedding_backward_chunks (only when more than `chunk` entries are
//      sorted), then embedding_backward_rows: see csrc/embedding/embedding.cu.
#pragma once

#include <cstddef>
#include <cstdint>

#include "hfkern/dtype_code.h"

namespace hfkern {

// The most threads of a block of every embedding kernel.
constexpr int kEmbMaxThreads = 256;

// An index tensor [B, M, L] (int32 or int64, index_bytes 4 or 8) through its strides;
// s_b == 0 for one index tensor shared by the models. Position p of a model is
// (p / L, p % L).
struct EmbIndex {
  const void* data = nullptr;
  int index_bytes = 8;
  int64_t L = 1;
  int64_t s_b = 0, s_m = 0, s_l = 0;
};

// The forward's row copy in words of word_bytes (2, 4, 8 or 16): out[b, p, :] =
// weight[b, idx[b, p], :], a row being Dw words s_wd apart (s_wd == 1 whenever a
// word holds more than one element).
struct EmbForward {
  const void* weight = nullptr;  // [B, V, Dw] words through s_wb, s_wv, s_wd
  void* out = nullptr;           // [B, n, Dw] words, contiguous
  int word_bytes = 4;
  int64_t B = 0, n = 0, Dw = 0;
  int64_t s_wb = 0, s_wv = 0, s_wd = 1;
  EmbIndex idx;
};

// tx threads along a row (words), ty rows per block.
void embedding_forward(const EmbForward& args, int tx, int ty, void* stream);

// keys[j] (key_bytes 4: uint32, 8: uint64) and positions[j] (int32) of the models * n
// lookups in model-major order: key = b * V + idx[b, p], position = p.
void embedding_sort_keys(const EmbIndex& idx, int64_t models, int64_t n, int64_t V, int key_bytes, void* keys,
                         int32_t* positions, int threads, void* stream);

// Bytes of temporary storage embedding_sort needs for `items` pairs (0 in the emulator build).
size_t embedding_sort_temp_bytes(int64_t items, int key_bytes, int end_bit);

// Stable sort of (keys_in, values_in) by the key bits [0, end_bit) into (keys_out,
// values_out); items <= 2**31 - 1; temp: temp_bytes bytes of device memory.
void embedding_sort(void* temp, size_t temp_bytes, const void* keys_in, void* keys_out, const int32_t* values_in,
                    int32_t* values_out, int64_t items, int key_bytes, int end_bit, void* stream);

// bounds[r] for r in [0, rows]: the first of the `items` sorted keys >= r (int32).
void embedding_segments(const void* sorted_keys, int key_bytes, int64_t items, int64_t rows, int32_t* bounds,
                        int threads, void* stream);

// The dense backward's operands. Sorted-key rows: models * V (models = 1 when
// shared, else B); sorted entries: items = models * n.
struct EmbBackward {
  const void* grad = nullptr;  // grad_out [B, M, L, D] through s_gb, s_gm, s_gl, s_gd
  DType dtype = DType::Float32;
  int64_t L = 1;
  int64_t s_gb = 0, s_gm = 0, s_gl = 0, s_gd = 1;
  const int32_t* perm = nullptr;    // [items] the sorted positions
  const int32_t* bounds = nullptr;  // [models * V + 1]
  float* part = nullptr;            // [tiles, 2, PB, D] float32 chunk sums; nullptr: no chunk pass
  void* grad_w = nullptr;           // [B, V, D] contiguous, grad_out's dtype
  int64_t B = 0, V = 0, D = 0, items = 0;
  int64_t padding_idx = -1;  // -1: none
  int64_t chunk = 64;        // hits per chunk of a long row (fixes the summation order)
  int vec = 1;               // elements per load and store (1, 2, 4, 8; 16 bytes at most)
  bool shared = false;
  bool scale = false;  // scale_grad_by_freq
};

// The partial sums of the rows hit more than `chunk` times: sorted entries are cut
// into tiles of `chunk`; each tile's first and last long row get one partial each.
// tx threads along D per partial.
void embedding_backward_chunks(const EmbBackward& args, int tx, void* stream);

// grad_w, every row written once: tx threads along D, ty rows per block.
void embedding_backward_rows(const EmbBackward& args, int tx, int ty, void* stream);

}  // namespace hfkern
