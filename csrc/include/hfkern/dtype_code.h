// dtype_code.h: the element-type codes that cross the binding (plain C++, no CUDA).
#pragma once

namespace hfkern {

// The codes the Python glue passes (hfkern/cuda/_ext.py, DTYPE_CODES).
enum class DType : int { Float32 = 0, Float16 = 1, BFloat16 = 2, Float64 = 3 };

}  // namespace hfkern
