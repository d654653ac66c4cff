// activation.h: the fused activations of the norm kernels and their derivatives,
// under nvcc and under the host grid emulator alike. Statistics and z are float32.
#pragma once

#include <cmath>

#include "hfkern/activation_code.h"
#include "hfkern_cuda.h"

namespace hfkern {

namespace activation_detail {
constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
}  // namespace activation_detail

// act(z). A kernel templated on its activation passes a constant and the switch folds away.
__device__ __forceinline__ float activate(float z, Activation act) {
  switch (act) {
    case Activation::Relu: return z < 0.0f ? 0.0f : z;  // NaN stays NaN, as torch.relu
    case Activation::Gelu: return 0.5f * z * (1.0f + erff(z * activation_detail::kSqrt1_2));  // the exact (erf) form
    default: return z;
  }
}

// grad_y * act'(z): relu passes grad_y where z > 0; gelu's derivative is Phi(z) + z * phi(z).
__device__ __forceinline__ float activation_grad(float gy, float z, Activation act) {
  switch (act) {
    case Activation::Relu: return z > 0.0f ? gy : 0.0f;
    case Activation::Gelu: {
      const float cdf = 0.5f * (1.0f + erff(z * activation_detail::kSqrt1_2));
      const float pdf = activation_detail::kInvSqrt2Pi * expf(-0.5f * z * z);
      return gy * (cdf + z * pdf);
    }
    default: return gy;
  }
}

}  // namespace hfkern
