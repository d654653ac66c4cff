// dispatch.h: the host side of a kernel family's entry points: argument errors and
// the element type of a data tensor's code (hfkern/dtype_code.h) as a C++ type.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "hfkern/dtype_code.h"
#include "hfkern/dtypes.h"

namespace hfkern {

// An invalid argument of entry point `what` (the binding raises it as ValueError).
[[noreturn]] inline void fail(const char* what, const std::string& message) {
  throw std::invalid_argument(std::string("hfkern: ") + what + ": " + message);
}

inline std::string str(int64_t v) { return std::to_string(v); }

// Calls f(T{}) with the element type T (float, Half, BFloat16) of dtype code `t`;
// another code fails with "expected <expected>, got dtype code N".
template <typename F>
void dispatch_dtype(const char* what, DType t, F&& f, const char* expected = "float32, float16 or bfloat16 data") {
  switch (t) {
    case DType::Float32: f(float{}); break;
    case DType::Float16: f(Half{}); break;
    case DType::BFloat16: f(BFloat16{}); break;
    default: fail(what, std::string("expected ") + expected + ", got dtype code " + str(static_cast<int>(t)));
  }
}

}  // namespace hfkern
