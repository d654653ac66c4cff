// dtypes.h: element types shared by every hfkern kernel, under nvcc and under
// the host grid emulator alike.
//
// 16-bit floats are stored as their raw bits (`Half`, `BFloat16`) so that the
// same struct crosses the binding and the kernel under both compilers; the
// conversions use the CUDA intrinsics on the device and a portable
// round-to-nearest-even path on the host.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "hfkern/dtype_code.h"
#include "hfkern_cuda.h"

namespace hfkern {

struct alignas(2) Half {
  uint16_t bits;
};
struct alignas(2) BFloat16 {
  uint16_t bits;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ double to_float(double x) { return x; }

#if defined(__CUDACC__)
__device__ __forceinline__ float to_float(Half x) { return __half2float(__ushort_as_half(x.bits)); }
__device__ __forceinline__ float to_float(BFloat16 x) {
  return __bfloat162float(__ushort_as_bfloat16(x.bits));
}
#else
inline float to_float(Half x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, 2);
  return static_cast<float>(h);
}
inline float to_float(BFloat16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
#endif

// from_float<T>(x): x rounded to nearest even into T.
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

#if defined(__CUDACC__)
template <>
__device__ __forceinline__ Half from_float<Half>(float x) { return {__half_as_ushort(__float2half_rn(x))}; }
template <>
__device__ __forceinline__ BFloat16 from_float<BFloat16>(float x) {
  return {__bfloat16_as_ushort(__float2bfloat16_rn(x))};
}
#else
template <>
inline Half from_float<Half>(float x) {
  const _Float16 h = static_cast<_Float16>(x);  // IEEE round to nearest even
  Half out;
  std::memcpy(&out.bits, &h, 2);
  return out;
}
template <>
inline BFloat16 from_float<BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x0040u)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return {uint16_t(u >> 16)};
}
#endif

}  // namespace hfkern
