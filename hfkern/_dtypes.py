"""Dtype rules every layer shares (ops, kernels, modules, optimizers).

Written once here so that the torch path, the kernels and the modules can
never disagree on them.
"""

from __future__ import annotations

import torch

__all__ = ["FLOAT_DTYPES", "KERNEL_DTYPES", "acc_dtype"]

# The floating-point dtypes hfkern parameters, activations and optimizer steps accept.
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# The data dtypes the GPU kernels compute in; float64 stays on the torch path.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics, reductions and optimizer state are kept in:
    float64 for float64 data, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32
