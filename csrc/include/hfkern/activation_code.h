// activation_code.h: the codes of a norm's fused activation that cross the binding
// (plain C++, no CUDA); the math is hfkern/activation.h.
#pragma once

namespace hfkern {

// The fused activation after a norm's affine map, by the codes the Python glue
// passes (hfkern/_norm_layout.py, NORM_ACTIVATIONS): identity, ReLU, exact GELU.
enum class Activation : int { None = 0, Relu = 1, Gelu = 2 };

}  // namespace hfkern
