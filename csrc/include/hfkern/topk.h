// topk.h: the top-k selection kernels' host entry points (plain C++, no CUDA),
// the two passes over the data of hfkern::topk_select (csrc/topk/topk_select.cu).
//
// Rows are [R, n] contiguous bit patterns of 2, 4 or 8 bytes (elem_bytes); a
// row's entries are compared by their magnitude key, (bits & mag_mask) clamped
// to nan_key (hfkern/_topk.py). Each row is split into P programs (thread
// blocks) of `tiles` tiles of `threads` entries: block p of row r covers
// entries [p * tiles * threads, (p + 1) * tiles * threads).
#pragma once

#include <cstdint>

namespace hfkern {

// Thresholds per counting pass (hfkern._topk.NUM_CANDIDATES must equal it).
constexpr int kTopkCandidates = 32;

// partial[r, p, c] = how many keys of block p of row r are >= candidates[r, c]
// (candidates: [R, kTopkCandidates] int64, each <= nan_key + 1; partial int32).
void topk_count(const void* bits, int elem_bytes, int64_t R, int64_t n, const int64_t* candidates,
                int32_t* partial, int64_t P, int64_t tiles, int64_t mag_mask, int64_t nan_key, int threads,
                void* stream);

// gt[r, p], eq[r, p] = how many keys of block p of row r are > / == threshold[r] (int32).
void topk_block_counts(const void* bits, int elem_bytes, int64_t R, int64_t n, const int64_t* threshold,
                       int32_t* gt, int32_t* eq, int64_t P, int64_t tiles, int64_t mag_mask, int64_t nan_key,
                       int threads, void* stream);

// The stable compaction: block p of row r writes its kept entries (key > threshold,
// or key == threshold with rank among the row's ties < quota[r]) in index order
// from values[r, out_offset[r, p]] on, their positions to indices; tie_offset[r, p]
// is the number of ties in the row before the block (both [R, P] int64 exclusive scans).
void topk_write(const void* bits, int elem_bytes, int64_t R, int64_t n, const int64_t* threshold,
                const int64_t* quota, const int64_t* tie_offset, const int64_t* out_offset, void* values,
                int32_t* indices, int64_t cap, int64_t P, int64_t tiles, int64_t mag_mask, int64_t nan_key,
                int threads, void* stream);

}  // namespace hfkern
