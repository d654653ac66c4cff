// multi_tensor_step.cu: one launch updates every parameter of every model.
//
// The apex multi_tensor_apply pattern on hfkern's tables: the Python glue
// (hfkern/cuda/optim.py, tables from hfkern/_multi_tensor.py) cuts model b's
// slice of every parameter into tiles of at most a chunk of elements, one int64
// row per tile (its tensor, model, offsets within the tensor, length) in a table
// that depends only on shapes, dtypes and layouts, and passes at every step a
// small per-tensor address table (each tensor's element offset from the first
// tensor of its list, and whether every access may be a 16-byte vector), as
// apex's and torch's fused optimizers pass addresses per launch. A gradient laid
// out unlike its parameter is read where it lies through its gather row. One
// thread block runs one tile:
//
//   * it reads model b's hyperparameter column hypers[:, b] and its (already
//     incremented) step count from device memory, so a scheduler may rewrite the
//     hyperparameters in place between steps, and computes the per-model
//     scalars once, in float32 (the hyperparameters' dtype) as the torch path does;
//   * a skipped model's blocks return before touching anything;
//   * the element loop computes in float32 for float32, bfloat16 and float16
//     parameters (float32 state) and rounds into the parameter once.
//
// The math follows hfkern/ops/optim.py's torch implementation operation by
// operation (its docstrings have the formulas).
//
// Trust-ratio steps (LARS, LAMB) with options.trust run two launches: norm_kernel
// writes each tile's two sums of squares into group.partials (LAMB's also updates
// the moments), then every thread of step_kernel sums its (tensor, model) pair's
// partials in row order (the same order everywhere, no atomics) before the scalars. Options that change what is
// read and written (momentum buffers, amsgrad) and the parameter dtype are
// template parameters; the other flags are uniform branches.
#include <cmath>
#include <stdexcept>
#include <string>

#include "hfkern/dtypes.h"
#include "hfkern/multi_tensor_step.h"
#include "hfkern_cuda.h"

namespace hfkern {
namespace {

constexpr int kMaxThreads = 512;
// Elements per vector access: 16 bytes of float32 state (an aligned tile's
// offsets and length are multiples of 16 elements, see hfkern/_multi_tensor.py).
constexpr int kVec = 4;

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__device__ __forceinline__ float sqrt_rn(float x) { return sqrtf(x); }  // IEEE (no fast math)

// max that propagates NaN from either side, as torch.maximum.
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// 1 - beta ** t, as -expm1(t * log(beta)): full relative precision where beta ** t
// is close to 1 (beta = 0 gives 1).
__device__ __forceinline__ double one_minus_pow(double beta, float t) {
  return -expm1(static_cast<double>(t) * log(beta));
}

// ---- the optimizers: per-model scalars and the element update -------------------------
//
// scalars<H>(h, rs, t, norms, o): h points at model b's column of hypers (float32:
// the op's contract for non-float64 parameters), rs is the row stride, t the step
// count, norms the pair's sums of squares (trust-ratio steps with o.trust); the
// arithmetic is in H, as the torch path's. update(c, o, p, g, s): one element, s
// the optimizer's state values (in registers), returns the new p. A trust-ratio
// optimizer also has norm_terms(c, o, p, g, s, w, x): the two values whose squares
// the norm pass sums (it may update s).

struct Norms {
  float w_sq = 0.0f, x_sq = 0.0f;
};

template <bool MOMENTUM>
struct Sgd {
  static constexpr int kStates = MOMENTUM ? 1 : 0;
  static constexpr bool kReadsSteps = MOMENTUM;
  struct Scalars {
    float neg_lr, momentum, decay, scale, weight_decay;
    bool on;  // the model has momentum: without, it steps with its gradient and keeps its buffer
  };

  template <typename H>
  __device__ static Scalars scalars(const H* h, int64_t rs, float t, const Norms&, const StepOptions&) {
    const H lr = h[kSgdLr * rs], momentum = h[kSgdMomentum * rs];
    const H dampening = h[kSgdDampening * rs], weight_decay = h[kSgdWeightDecay * rs];
    H decay = momentum, scale = H(1) - dampening;
    if (MOMENTUM && t == 1.0f) {
      // A model's first update with momentum (the count counts only those) sets its
      // buffer to the gradient (torch clones it).
      decay = H(0);
      scale = H(1);
    }
    return {static_cast<float>(-lr), static_cast<float>(momentum), static_cast<float>(decay),
            static_cast<float>(scale), static_cast<float>(weight_decay), momentum != H(0)};
  }

  __device__ static float update(const Scalars& c, const StepOptions& o, float p, float g, float* s) {
    float d = o.maximize ? -g : g;
    if (o.has_weight_decay) d = d + p * c.weight_decay;
    if (MOMENTUM && c.on) {
      float& buf = s[0];
      buf = buf * c.decay + d * c.scale;
      d = o.nesterov ? d + buf * c.momentum : buf;
    }
    return p + d * c.neg_lr;
  }
};

template <bool AMSGRAD>
struct Adam {
  static constexpr int kStates = AMSGRAD ? 3 : 2;
  static constexpr bool kReadsSteps = true;
  struct Scalars {
    float neg_step_size, bc2_sqrt, eps, weight_decay, param_decay, beta2, w1, w2;
    bool w1_small;
  };

  template <typename H>
  __device__ static Scalars scalars(const H* h, int64_t rs, float t, const Norms&, const StepOptions&) {
    const H lr = h[kAdamLr * rs], beta1 = h[kAdamBeta1 * rs], beta2 = h[kAdamBeta2 * rs];
    const H eps = h[kAdamEps * rs], weight_decay = h[kAdamWeightDecay * rs];
    const H bc1 = static_cast<H>(one_minus_pow(beta1, t));
    const H bc2 = static_cast<H>(one_minus_pow(beta2, t));
    const H step_size = lr / bc1;
    const H w1 = H(1) - beta1;
    Scalars c;
    c.neg_step_size = static_cast<float>(-step_size);
    c.bc2_sqrt = static_cast<float>(sqrt_rn(bc2));
    c.eps = static_cast<float>(eps);
    c.weight_decay = static_cast<float>(weight_decay);
    c.param_decay = static_cast<float>(H(1) - lr * weight_decay);
    c.beta2 = static_cast<float>(beta2);
    c.w1 = static_cast<float>(w1);
    c.w2 = static_cast<float>(H(1) - beta2);
    c.w1_small = (w1 < H(0) ? -w1 : w1) < H(0.5);
    return c;
  }

  __device__ static float update(const Scalars& c, const StepOptions& o, float p, float g, float* s) {
    float& m = s[0];
    float& v = s[1];
    float d = o.maximize ? -g : g;
    if (o.has_weight_decay) {
      if (o.decoupled_weight_decay)
        p = p * c.param_decay;
      else
        d = d + p * c.weight_decay;
    }
    // torch.lerp's formula for m = lerp(m, d, 1 - beta1).
    const float diff = d - m;
    m = c.w1_small ? m + c.w1 * diff : d - diff * (1.0f - c.w1);
    v = v * c.beta2 + (d * c.w2) * d;
    float v_hat = v;
    if (AMSGRAD) {
      s[2] = nan_max(s[2], v);
      v_hat = s[2];
    }
    const float denom = sqrt_rn(v_hat) / c.bc2_sqrt + c.eps;
    return p + (m / denom) * c.neg_step_size;
  }
};

template <bool MOMENTUM>
struct Lars {
  static constexpr int kStates = MOMENTUM ? 1 : 0;
  static constexpr bool kReadsSteps = false;
  static constexpr bool kNormWritesState = false;
  struct Scalars {
    float scale, momentum, weight_decay;  // scale = lr * local_lr
    bool on;  // the model has momentum: without, it steps without its buffer and keeps it
  };

  template <typename H>
  __device__ static Scalars scalars(const H* h, int64_t rs, float, const Norms& n, const StepOptions& o) {
    const H lr = h[kLarsLr * rs], momentum = h[kLarsMomentum * rs], weight_decay = h[kLarsWeightDecay * rs];
    H scale = lr;
    if (o.trust) {
      const H trust = h[kLarsTrustCoefficient * rs], eps = h[kLarsEps * rs];
      const H w_norm = static_cast<H>(sqrt_rn(n.w_sq)), g_norm = static_cast<H>(sqrt_rn(n.x_sq));
      const bool ok = w_norm > H(0) && g_norm > H(0);
      scale = lr * (ok ? trust * w_norm / (g_norm + weight_decay * w_norm + eps) : H(1));
    }
    return {static_cast<float>(scale), static_cast<float>(momentum), static_cast<float>(weight_decay),
            momentum != H(0)};
  }

  __device__ static void norm_terms(const Scalars&, const StepOptions&, float p, float g, float*, float& w,
                                    float& x) {
    w = p;
    x = g;  // ||grad||: maximize's sign does not change it
  }

  __device__ static float update(const Scalars& c, const StepOptions& o, float p, float g, float* s) {
    float d = o.maximize ? -g : g;
    if (o.has_weight_decay) d = d + p * c.weight_decay;
    if (MOMENTUM && c.on) {
      s[0] = s[0] * c.momentum + d * c.scale;
      return p - s[0];
    }
    return p + d * -c.scale;
  }
};

struct Lamb {
  static constexpr int kStates = 2;
  static constexpr bool kReadsSteps = true;
  static constexpr bool kNormWritesState = true;  // the norm pass updates the moments
  struct Scalars {
    float scale, bc1, bc2_sqrt, eps, weight_decay, beta2, w1, w2;  // scale = lr * ratio
    bool w1_small;
  };

  template <typename H>
  __device__ static Scalars scalars(const H* h, int64_t rs, float t, const Norms& n, const StepOptions& o) {
    const H lr = h[kLambLr * rs], beta1 = h[kLambBeta1 * rs], beta2 = h[kLambBeta2 * rs];
    H bc1 = H(1), bc2_sqrt = H(1);  // dividing by 1 is exact: one code path for both
    if (o.bias_correction) {
      bc1 = static_cast<H>(one_minus_pow(beta1, t));
      bc2_sqrt = sqrt_rn(static_cast<H>(one_minus_pow(beta2, t)));
    }
    H scale = lr;
    if (o.trust) {
      const H lo = h[kLambNormMin * rs], hi = h[kLambNormMax * rs];
      const H w_norm = static_cast<H>(sqrt_rn(n.w_sq)), r_norm = static_cast<H>(sqrt_rn(n.x_sq));
      const H phi = fminf(fmaxf(w_norm, lo), hi);
      scale = lr * ((w_norm > H(0) && r_norm > H(0)) ? phi / r_norm : H(1));
    }
    const H w1 = H(1) - beta1;
    Scalars c;
    c.scale = static_cast<float>(scale);
    c.bc1 = static_cast<float>(bc1);
    c.bc2_sqrt = static_cast<float>(bc2_sqrt);
    c.eps = static_cast<float>(h[kLambEps * rs]);
    c.weight_decay = static_cast<float>(h[kLambWeightDecay * rs]);
    c.beta2 = static_cast<float>(beta2);
    c.w1 = static_cast<float>(w1);
    c.w2 = static_cast<float>(H(1) - beta2);
    c.w1_small = (w1 < H(0) ? -w1 : w1) < H(0.5);
    return c;
  }

  __device__ static void moments(const Scalars& c, const StepOptions& o, float g, float* s) {
    const float d = o.maximize ? -g : g;
    float& m = s[0];
    float& v = s[1];
    const float diff = d - m;  // torch.lerp's formula for m = lerp(m, d, 1 - beta1)
    m = c.w1_small ? m + c.w1 * diff : d - diff * (1.0f - c.w1);
    v = v * c.beta2 + (d * c.w2) * d;
  }

  // r = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps) [+ weight_decay * p]
  __device__ static float direction(const Scalars& c, const StepOptions& o, float p, const float* s) {
    const float denom = sqrt_rn(s[1]) / c.bc2_sqrt + c.eps;
    float r = (s[0] / c.bc1) / denom;
    if (o.has_weight_decay) r = r + p * c.weight_decay;
    return r;
  }

  __device__ static void norm_terms(const Scalars& c, const StepOptions& o, float p, float g, float* s, float& w,
                                    float& x) {
    moments(c, o, g, s);
    w = p;
    x = direction(c, o, p, s);
  }

  __device__ static float update(const Scalars& c, const StepOptions& o, float p, float g, float* s) {
    if (!o.trust) moments(c, o, g, s);  // with trust the norm pass has updated them
    return p + direction(c, o, p, s) * -c.scale;
  }
};

// ---- the driver ---------------------------------------------------------------------

// Whether Opt is a trust-ratio optimizer (has norm_terms).
template <class Opt, class = void>
struct HasNorms {
  static constexpr bool value = false;
};
template <class Opt>
struct HasNorms<Opt, decltype(void(&Opt::norm_terms))> {
  static constexpr bool value = true;
};

// Offset in a gradient's model slice of element j of its parameter's slice: the gather
// row's (size, stride) pairs, innermost first (padding (1, 0) adds 0).
__device__ __forceinline__ int64_t gathered(const int64_t* layout, int64_t j) {
  int64_t o = 0;
HFKERN_UNROLL
  for (int d = 0; d < kMaxGradDims; ++d) {
    const int64_t size = layout[2 * d];
    o += (j % size) * layout[2 * d + 1];
    j /= size;
  }
  return o;
}

// Where one tile of a step lives: each list's first element, the gradient's gather row
// (nullptr: laid out like its parameter), the tile's start in its slice and length.
template <typename P, int kStates>
struct TileAt {
  P* p;
  const P* g;
  float* s[kStates > 0 ? kStates : 1];
  const int64_t* gather;
  int64_t start, n;
  bool aligned;

  __device__ TileAt(const StepGroup& group, const int64_t* row, const int64_t* addr) {
    const int64_t offset = row[kColOffset];
    p = static_cast<P*>(group.params) + addr[kAddrParam] + offset;
    g = static_cast<const P*>(group.grads) + addr[kAddrGrad] + row[kColGrad];
    for (int j = 0; j < kStates; ++j) s[j] = group.state[j] + addr[kAddrState0 + j] + offset;
    gather = row[kColGather] >= 0 ? group.gathers + row[kColGather] * kGatherColumns : nullptr;
    start = row[kColStart];
    n = row[kColLength];
    aligned = addr[kAddrAligned] != 0;  // never for a gathered gradient
  }

  // Element i of the tile's gradient.
  __device__ P grad(int64_t i) const { return gather == nullptr ? g[i] : g[gathered(gather, start + i)]; }
};

// The pair's two sums of squares: its tiles' partials in row order.
__device__ __forceinline__ Norms pair_norms(const float* partials, const int64_t* row) {
  Norms n;
  const int64_t first = row[kColFirst], count = row[kColTiles];
  for (int64_t k = 0; k < count; ++k) {
    n.w_sq += partials[2 * (first + k)];
    n.x_sq += partials[2 * (first + k) + 1];
  }
  return n;
}

template <class Opt, typename P>
__global__ void __launch_bounds__(kMaxThreads) step_kernel(StepGroup group, StepOptions options) {
  const int64_t* row = group.tiles + static_cast<int64_t>(blockIdx.x) * kTileColumns;
  const int64_t* addr = group.addrs + row[kColTensor] * kAddressColumns;
  const int64_t b = row[kColModel];
  if (group.skip != nullptr && group.skip[b] != 0) return;  // nothing of a skipped model is written

  const float t = Opt::kReadsSteps ? group.steps[addr[kAddrStep] + row[kColStep]] : 0.0f;
  const int64_t rs = group.hyper_row_stride;
  const Norms norms = HasNorms<Opt>::value && options.trust ? pair_norms(group.partials, row) : Norms{};
  const typename Opt::Scalars c = Opt::scalars(group.hypers + b * group.hyper_model_stride, rs, t, norms, options);

  const TileAt<P, Opt::kStates> at(group, row, addr);
  P* __restrict__ p = at.p;
  const P* __restrict__ g = at.g;
  float* const* s = at.s;
  const int64_t n = at.n;

  if (at.aligned) {
    // Whole packs only: an aligned tile's length is a multiple of kVec.
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kVec; i < n; i += static_cast<int64_t>(blockDim.x) * kVec) {
      Pack<P, kVec> pv = *reinterpret_cast<const Pack<P, kVec>*>(p + i);
      const Pack<P, kVec> gv = *reinterpret_cast<const Pack<P, kVec>*>(g + i);
      Pack<float, kVec> sv[Opt::kStates > 0 ? Opt::kStates : 1];
      for (int j = 0; j < Opt::kStates; ++j) sv[j] = *reinterpret_cast<const Pack<float, kVec>*>(s[j] + i);
HFKERN_UNROLL
      for (int k = 0; k < kVec; ++k) {
        float st[Opt::kStates > 0 ? Opt::kStates : 1];
        for (int j = 0; j < Opt::kStates; ++j) st[j] = sv[j].v[k];
        pv.v[k] = from_float<P>(Opt::update(c, options, to_float(pv.v[k]), to_float(gv.v[k]), st));
        for (int j = 0; j < Opt::kStates; ++j) sv[j].v[k] = st[j];
      }
      for (int j = 0; j < Opt::kStates; ++j) *reinterpret_cast<Pack<float, kVec>*>(s[j] + i) = sv[j];
      *reinterpret_cast<Pack<P, kVec>*>(p + i) = pv;
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      float st[Opt::kStates > 0 ? Opt::kStates : 1];
      for (int j = 0; j < Opt::kStates; ++j) st[j] = s[j][i];
      p[i] = from_float<P>(Opt::update(c, options, to_float(p[i]), to_float(at.grad(i)), st));
      for (int j = 0; j < Opt::kStates; ++j) s[j][i] = st[j];
    }
  }
}

// The first pass of a trust-ratio step: each tile's sums of squares of Opt::norm_terms,
// per thread in element order, then a tree over the block (fixed shape: deterministic).
template <class Opt, typename P>
__global__ void __launch_bounds__(kMaxThreads) norm_kernel(StepGroup group, StepOptions options) {
  __shared__ float sums[2][kMaxThreads];
  const int64_t* row = group.tiles + static_cast<int64_t>(blockIdx.x) * kTileColumns;
  const int64_t* addr = group.addrs + row[kColTensor] * kAddressColumns;
  const int64_t b = row[kColModel];
  if (group.skip != nullptr && group.skip[b] != 0) return;  // no update of this model reads its partials

  const float t = Opt::kReadsSteps ? group.steps[addr[kAddrStep] + row[kColStep]] : 0.0f;
  const typename Opt::Scalars c =
      Opt::scalars(group.hypers + b * group.hyper_model_stride, group.hyper_row_stride, t, Norms{}, options);
  const TileAt<P, Opt::kStates> at(group, row, addr);
  const P* __restrict__ p = at.p;
  float* const* s = at.s;
  const int64_t n = at.n;

  float w_sq = 0.0f, x_sq = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    float st[Opt::kStates > 0 ? Opt::kStates : 1];
    for (int j = 0; j < Opt::kStates; ++j) st[j] = s[j][i];
    float w, x;
    Opt::norm_terms(c, options, to_float(p[i]), to_float(at.grad(i)), st, w, x);
    if (Opt::kNormWritesState)
      for (int j = 0; j < Opt::kStates; ++j) s[j][i] = st[j];
    w_sq += w * w;
    x_sq += x * x;
  }
  const int tid = threadIdx.x;
  sums[0][tid] = w_sq;
  sums[1][tid] = x_sq;
  __syncthreads();
  for (int live = blockDim.x; live > 1;) {  // any block size: fold the upper half onto the lower
    const int half = (live + 1) / 2;
    if (tid < live - half) {
      sums[0][tid] += sums[0][tid + half];
      sums[1][tid] += sums[1][tid + half];
    }
    __syncthreads();
    live = half;
  }
  if (tid == 0) {
    group.partials[2 * static_cast<int64_t>(blockIdx.x)] = sums[0][0];
    group.partials[2 * static_cast<int64_t>(blockIdx.x) + 1] = sums[1][0];
  }
}

__global__ void __launch_bounds__(kMaxThreads)
    count_kernel(float* steps, const int64_t* addrs, const int64_t* offsets, int64_t n, int64_t B,
                 const uint8_t* skip, const float* counted_by, int64_t counted_stride) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= n) return;
  if (skip != nullptr && skip[k % B] != 0) return;
  if (counted_by != nullptr && counted_by[(k % B) * counted_stride] == 0.0f) return;
  steps[addrs[(k / B) * kAddressColumns + kAddrStep] + offsets[k]] += 1.0f;
}

void check_threads(int threads) {
  if (threads < 32 || threads > kMaxThreads || threads % 32 != 0)
    throw std::invalid_argument("hfkern: expected threads per block a multiple of 32 in [32, " +
                                std::to_string(kMaxThreads) + "], got " + std::to_string(threads));
}

template <class Opt, typename P>
void launch_passes(const StepGroup& group, const StepOptions& options, dim3 grid, dim3 block, cudaStream_t s) {
  if constexpr (HasNorms<Opt>::value) {
    if (options.trust) HFKERN_LAUNCH((norm_kernel<Opt, P>), grid, block, 0, s, group, options);
  }
  HFKERN_LAUNCH((step_kernel<Opt, P>), grid, block, 0, s, group, options);
}

template <class Opt>
void launch_group(const StepGroup& group, const StepOptions& options, int threads, void* stream) {
  check_threads(threads);
  if (group.n_tiles < 0 || group.n_tiles > 0x7fffffff)
    throw std::invalid_argument("hfkern: expected 0 <= n_tiles < 2**31, got " + std::to_string(group.n_tiles));
  if (group.n_tiles == 0) return;
  if (HasNorms<Opt>::value && options.trust && group.partials == nullptr)
    throw std::invalid_argument("hfkern: a trust-ratio step needs partials (2 floats per tile)");
  if (group.tiles == nullptr || group.addrs == nullptr)
    throw std::invalid_argument("hfkern: a step needs a tile table and an address table");
  const dim3 grid(static_cast<unsigned>(group.n_tiles)), block(static_cast<unsigned>(threads));
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  switch (group.param_dtype) {
    case DType::Float32:
      launch_passes<Opt, float>(group, options, grid, block, s);
      break;
    case DType::BFloat16:
      launch_passes<Opt, BFloat16>(group, options, grid, block, s);
      break;
    case DType::Float16:
      launch_passes<Opt, Half>(group, options, grid, block, s);
      break;
    default:
      throw std::invalid_argument("hfkern: the CUDA optimizer steps take float32, bfloat16 or float16 "
                                  "parameters, got dtype code " +
                                  std::to_string(static_cast<int>(group.param_dtype)));
  }
}

}  // namespace

void count_steps(float* steps, const int64_t* addrs, const int64_t* offsets, int64_t n, int64_t B,
                 const uint8_t* skip, const float* counted_by, int64_t counted_stride, int threads, void* stream) {
  check_threads(threads);
  if (n <= 0) return;
  if (B <= 0) throw std::invalid_argument("hfkern: expected B >= 1, got " + std::to_string(B));
  if (addrs == nullptr || offsets == nullptr)
    throw std::invalid_argument("hfkern: counting steps needs an address table and step offsets");
  const dim3 grid(static_cast<unsigned>((n + threads - 1) / threads)), block(static_cast<unsigned>(threads));
  HFKERN_LAUNCH(count_kernel, grid, block, 0, reinterpret_cast<cudaStream_t>(stream), steps, addrs, offsets, n, B,
                skip, counted_by, counted_stride);
}

void sgd_step(const StepGroup& group, const StepOptions& options, int threads, void* stream) {
  if (options.nesterov && !options.momentum)
    throw std::invalid_argument("hfkern: nesterov needs momentum buffers");
  if (options.momentum)
    launch_group<Sgd<true>>(group, options, threads, stream);
  else
    launch_group<Sgd<false>>(group, options, threads, stream);
}

void adam_step(const StepGroup& group, const StepOptions& options, int threads, void* stream) {
  if (options.amsgrad)
    launch_group<Adam<true>>(group, options, threads, stream);
  else
    launch_group<Adam<false>>(group, options, threads, stream);
}

void lars_step(const StepGroup& group, const StepOptions& options, int threads, void* stream) {
  if (!options.trust && options.has_weight_decay)
    throw std::invalid_argument("hfkern: an excluded parameter (trust false) takes no weight decay");
  if (options.momentum)
    launch_group<Lars<true>>(group, options, threads, stream);
  else
    launch_group<Lars<false>>(group, options, threads, stream);
}

void lamb_step(const StepGroup& group, const StepOptions& options, int threads, void* stream) {
  if (!options.trust && options.has_weight_decay)
    throw std::invalid_argument("hfkern: an excluded parameter (trust false) takes no weight decay");
  launch_group<Lamb>(group, options, threads, stream);
}

}  // namespace hfkern
