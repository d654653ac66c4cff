"""Autocast rules for hfkern ops: each op casts its inputs as torch casts the op
it fuses, so that a model under ``torch.autocast`` computes in the same dtypes
whether its layers are B torch modules or one hfkern array.

torch decides per op and device (aten/src/ATen/autocast_mode.cpp): convolutions
run in the autocast dtype on every device (``lower_precision_fp``); layer norm
runs in float32 on CUDA and in its input's dtype on the CPU; batch norm and
embedding have no rule (batch norm takes low-precision input with float32
parameters and statistics; embedding returns its weight's dtype). A family
module registers its op's rule with :func:`register`; an op without one runs
on whatever dtypes reach it, as torch's unlisted ops do.

Unlike ``torch.library.register_autocast``, whose target dtype is fixed when
registering, ``lower`` reads the active autocast dtype at each call, so one
registration serves bfloat16 and float16 regions alike.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

# Tensors autocast may cast: torch leaves float64 (and non-floating) tensors alone.
_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)
POLICIES = ("lower", "fp32")

# Library objects own their registrations: they live as long as the module.
_libraries: dict[str, torch.library.Library] = {}


def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dtype in _ELIGIBLE and value.device.type == device_type and value.dtype != dtype:
            return value.to(dtype)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, device_type, dtype) for v in value)
    return value


# (qualname, device type) -> the policy registered
_policies: dict[tuple[str, str], str] = {}


def cast_inputs(qualname: str, device_type: str, *values: Any) -> tuple:
    """``values`` as op ``qualname`` receives them in the current autocast region on
    ``device_type`` (unchanged outside one, and where the op has no rule there): for
    the eager paths that run an op's implementation without dispatching the op
    (:func:`hfkern._backend.eager_torch`)."""
    policy = _policies.get((qualname, device_type))
    if policy is None or not torch.is_autocast_enabled(device_type):
        return values
    dtype = torch.float32 if policy == "fp32" else torch.get_autocast_dtype(device_type)
    return tuple(_cast(v, device_type, dtype) for v in values)


def register_like(qualname: str, torch_op: str, policy: str, device_types: Iterable[str] = ("cpu", "cuda")) -> None:
    """:func:`register` on those of ``device_types`` where torch's own ``torch_op``
    (``"aten::rms_norm"``) has an autocast kernel in this torch build.

    For ops whose rule torch changed between versions: torch 2.11's CUDA autocast
    left RMS norm in its input's dtype (measured on an H200), later versions list
    it with layer norm among the float32 ops.
    """
    devices = [d for d in device_types if torch._C._dispatch_has_kernel_for_dispatch_key(
        torch_op, "Autocast" + torch._C._dispatch_key_for_device(d))]
    if devices:
        register(qualname, policy, devices)


def register(qualname: str, policy: str, device_types: Iterable[str] = ("cpu", "cuda")) -> None:
    """Give op ``qualname`` (``"hfkern::array_conv"``) torch's autocast ``policy`` on
    ``device_types``: ``"lower"`` casts its floating inputs to the autocast dtype of
    the region (torch's ``lower_precision_fp``), ``"fp32"`` to float32."""
    if policy not in POLICIES:
        raise ValueError(f"autocast policy for {qualname}: expected one of {POLICIES}, got {policy!r}")
    namespace, name = qualname.split("::")
    op = getattr(getattr(torch.ops, namespace), name).default
    lib = _libraries.setdefault(namespace, torch.library.Library(namespace, "IMPL"))
    for device_type in device_types:
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, *args, _device_type=device_type, _excluded=excluded, **kwargs):
            dtype = torch.float32 if policy == "fp32" else torch.get_autocast_dtype(_device_type)
            with torch._C._ExcludeDispatchKeyGuard(_excluded):
                return op(*_cast(args, _device_type, dtype), **_cast(kwargs, _device_type, dtype))

        lib.impl(name, kernel, key, with_keyset=True)
        _policies[(qualname, device_type)] = policy
