"""The array convention: shared inputs, input checks, layouts and conv geometry.

Every array tensor has the array dimension B first. Physically, conv-family ops
keep activations as ``[N, B, C, *spatial]`` memory behind a ``[B, N, C, *spatial]``
view (so cuDNN's grouped conv reads ``[N, B*C, *spatial]`` without a copy); the
helpers here let the element-wise and pooling layers between two convs keep that
memory order instead of forcing it back to ``[B, N, ...]``. The conv geometry
(argument checks, output sizes) is here too, because the modules, the ops and
every backend's kernels must agree on it.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch._prims_common import make_channels_last_strides_for, make_contiguous_strides_for
from torch.autograd import forward_ad

__all__ = ["broadcast", "is_shared"]

MAX_NDIM = 64  # torch's own limit on tensor rank


def broadcast(x: torch.Tensor, B: int) -> torch.Tensor:
    """Share one input among the B models of an array, without a copy.

    Returns a ``[B, *x.shape]`` view of ``x`` whose array dimension has stride 0.
    hfkern modules treat it exactly like B stacked copies of ``x`` and use the
    cheaper math where there is one (a first conv or linear layer on a shared
    input is one dense conv/matmul with the B weights concatenated).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"broadcast: expected a torch.Tensor, got {type(x).__name__}")
    B = check_B(B, "broadcast: B")
    return x.unsqueeze(0).expand(B, *x.shape)


def is_shared(x: torch.Tensor) -> bool:
    """True if ``x`` is an :func:`broadcast` view (stride 0 on a non-trivial array dim)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"is_shared: expected a torch.Tensor, got {type(x).__name__}")
    return x.dim() > 0 and x.stride(0) == 0 and x.size(0) > 1


def shares_work(x: torch.Tensor) -> bool:
    """Whether a module may compute once for the B models of a shared input (:func:`broadcast`),
    from ``x[0]``: an :func:`is_shared` view that autograd does not differentiate. Where it does
    (``x`` requires grad, as a gradient penalty's input does), each model's gradient with
    respect to the view must be its own row, which a computation from ``x[0]`` would sum into
    the first row; the module then computes as for B inputs (their sum, ``x``'s gradient, is
    the same either way)."""
    return is_shared(x) and not (x.requires_grad and torch.is_grad_enabled())


def check_B(B: object, name: str = "B") -> int:
    """Validate an array size: a Python int (not bool) >= 1."""
    if isinstance(B, bool) or not isinstance(B, int):
        raise TypeError(f"{name} must be an int >= 1, got {type(B).__name__} {B!r}")
    if B < 1:
        raise ValueError(f"{name} must be >= 1, got {B}")
    return B


def check_input(
    module: str,
    x: object,
    B: int | None,
    model_ndims: Sequence[int],
    param: torch.Tensor | None = None,
    name: str = "input",
    *,
    mixed_precision: bool = False,
) -> torch.Tensor:
    """Check an array input ``[B, *model_shape]`` before any kernel sees it.

    ``model_ndims`` lists the per-model ranks the torch namesake accepts (for
    Conv2d: ``(3, 4)``; for "any rank from k up": ``range(k, MAX_NDIM)``). With ``param`` given, dtype and device must match it
    (dtype is not checked under autocast, where torch mixes them on purpose).
    ``mixed_precision``: a bfloat16 or float16 input with float32 parameters is
    accepted outside autocast too, as torch's norms accept it (they compute in
    float32 and return the input's dtype); torch's convolutions and linear layers
    refuse it, and so do their arrays.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{module}: expected {name} to be a torch.Tensor, got {type(x).__name__}")
    if x.dim() - 1 not in model_ndims:
        if isinstance(model_ndims, range) and model_ndims.stop >= MAX_NDIM:
            shapes = f"at least {model_ndims.start + 1}-D"
        else:
            shapes = " or ".join(f"{d + 1}-D" for d in model_ndims)
        raise ValueError(
            f"{module}: expected {name} of {shapes} shape [B, ...] (array dim first), "
            f"got {x.dim()}-D shape {list(x.shape)}"
        )
    if B is not None and x.size(0) != B:
        raise ValueError(
            f"{module}: expected {name} with leading (array) dim B={B}, got shape {list(x.shape)}"
        )
    if param is not None:
        check_same_device_dtype(module, x, param, name, mixed_precision=mixed_precision)
    return x


# The mixed precision torch's norms take outside autocast: input dtype -> parameter dtype.
_MIXED_PRECISION = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def is_mixed_precision(x: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``x`` and ``param`` are the mixed precision torch's norms compute: a
    bfloat16 or float16 ``x`` with float32 parameters (and statistics)."""
    return _MIXED_PRECISION.get(x.dtype) == param.dtype


def check_same_device_dtype(
    module: str, x: torch.Tensor, param: torch.Tensor, name: str = "input", *,
    mixed_precision: bool = False,
) -> None:
    """``x`` on ``param``'s device and of its dtype (any dtypes under autocast; with
    ``mixed_precision``, also a bfloat16 or float16 ``x`` with float32 ``param``)."""
    if x.device != param.device:
        raise ValueError(
            f"{module}: {name} is on {x.device} but the parameters are on {param.device}"
        )
    autocast = torch.is_autocast_enabled(x.device.type)
    if autocast and x.dtype != param.dtype and not x.is_floating_point():
        # autocast mixes floating-point dtypes only: an integer input is refused under it too
        raise TypeError(f"{module}: expected {name} of a floating-point dtype under autocast (the parameters' "
                        f"dtype is {param.dtype}), got {x.dtype}")
    if x.dtype != param.dtype and not autocast and not (
            mixed_precision and is_mixed_precision(x, param)):
        also = ", or bfloat16 or float16" if mixed_precision and param.dtype == torch.float32 else ""
        raise TypeError(
            f"{module}: expected {name} of dtype {param.dtype} (the parameters' dtype{also}), "
            f"got {x.dtype}"
        )


def check_channels(module: str, x: torch.Tensor, dim: int, expected: int, name: str = "input") -> None:
    if x.size(dim) != expected:
        raise ValueError(
            f"{module}: expected {name} with {expected} channels at dim {dim} "
            f"(shape [B, N, C, ...]), got {x.size(dim)} in shape {list(x.shape)}"
        )


def per_model_memory_first(x: torch.Tensor) -> bool:
    """True if ``x`` ([B, N, ...]) is stored as ``[N, B, ...]``-contiguous memory."""
    if x.dim() < 2:
        return False
    return x.numel() == 0 or _dense_in(x.shape, x.stride(), (1, 0, *range(2, x.dim())))


def fold(x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Merge the array and batch dims of ``x`` ([B, N, *rest]) into one batch dim.

    Returns ``(folded, unfold)``: ``folded`` is ``[N*B, *rest]`` when ``x`` has
    ``[N, B, ...]`` memory (a free view, and the result of ``unfold`` keeps that
    memory order for the next conv) and ``[B*N, *rest]`` otherwise. ``unfold``
    maps a ``[B*N or N*B, *out_rest]`` result back to ``[B, N, *out_rest]``.
    Ops that treat every (model, sample) pair independently use it.
    """
    B, N = x.shape[:2]
    if per_model_memory_first(x) and not is_shared(x):
        folded = x.transpose(0, 1).reshape(N * B, *x.shape[2:])

        def unfold(y: torch.Tensor) -> torch.Tensor:
            return y.view(N, B, *y.shape[1:]).transpose(0, 1)

    else:
        folded = x.reshape(B * N, *x.shape[2:])

        def unfold(y: torch.Tensor) -> torch.Tensor:
            return y.view(B, N, *y.shape[1:])

    return folded, unfold


def fold_planes(x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """:func:`fold` for ops that treat every (sample, channel) plane on its own
    (pooling, interpolation): a channels-last array image ``[B, N, C, H, W]`` is
    folded into its grouped view ``[N, B*C, H, W]`` instead (free, and
    channels-last, which torch's kernels keep), and ``unfold`` maps a
    ``[N, B*C, H', W']`` result back to the same memory format."""
    if array_memory_format(x) == torch.channels_last and not is_shared(x):
        B = x.size(0)
        return to_grouped(x), lambda y: from_grouped(y, B, torch.channels_last)
    return fold(x)


def new_batch_major(
    like: torch.Tensor, shape: Sequence[int], memory_format: torch.memory_format = torch.contiguous_format
) -> torch.Tensor:
    """An uninitialized ``[B, N, *rest]`` tensor (``shape``) in array memory, with
    ``like``'s dtype and device: ``[N, B, *rest]`` memory, or for
    ``memory_format=torch.channels_last`` (``shape`` ``[B, N, C, H, W]``) the
    ``[N, H, W, B, C]`` memory of :func:`array_memory_format`.

    Allocated with those strides rather than as a permuted view, so that an op
    returning it returns a tensor of its own (see :func:`op_result`).
    """
    return like.new_empty_strided(tuple(shape), batch_major_strides(shape, memory_format))


def batch_major_strides(
    shape: Sequence[int], memory_format: torch.memory_format = torch.contiguous_format
) -> tuple[int, ...]:
    """The strides :func:`new_batch_major` gives ``shape``: those of a contiguous
    ``[N, B, *rest]`` (channels-last: ``[N, H, W, B, C]``) permuted to ``[B, N, ...]``,
    dims of size one included."""
    if memory_format == torch.channels_last:
        B, N, C, H, W = shape
        return (C, H * W * B * C, 1, W * B * C, B * C)
    B, N, *rest = shape
    inner = math.prod(rest)
    return (inner, B * inner, *(math.prod(rest[i + 1:]) for i in range(len(rest))))


def exact_batch_major(y: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """An op's array result ``y`` (``[B, N, *rest]`` in ``memory_format``'s array memory,
    e.g. :func:`from_grouped`'s view) with exactly :func:`new_batch_major`'s strides, the
    ones its fake gives, also on dims of size one. A view sets those from its own rule:
    with one channel, or one model, memory that is both formats then reads as the other
    one (:func:`array_memory_format`), and the next op's layout would differ from the
    compiled graph's. The same elements, so a free ``as_strided`` (a copy only if the
    memory is not ``memory_format``'s at all). For an op kernel's output (below autograd)."""
    shape = y.shape
    if 1 not in shape and 0 not in shape:  # no dim of size one: the memory fixes the strides
        return y
    strides = batch_major_strides(shape, memory_format)
    if y.stride() == strides:
        return y
    if y.numel() == 0 or all(n == 1 or a == b for n, a, b in zip(shape, y.stride(), strides)):
        return y.as_strided(shape, strides, y.storage_offset())
    return new_batch_major(y, shape, memory_format).copy_(y)


def exact_empty_strides(y: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """``y`` with exactly the strides ``torch.empty(y.shape, memory_format=memory_format)``
    gives (dims of size one included; ``y.contiguous(memory_format=...)`` keeps ``y``'s
    there): a free ``as_strided`` where only those differ, else a copy. For an op
    kernel's output whose fake is that ``torch.empty``."""
    shape = y.shape
    strides = tuple(make_channels_last_strides_for(shape) if memory_format == torch.channels_last
                    else make_contiguous_strides_for(shape))
    if y.stride() == strides:
        return y
    if y.numel() == 0 or all(n == 1 or a == b for n, a, b in zip(shape, y.stride(), strides)):
        return y.as_strided(shape, strides, y.storage_offset())
    return torch.empty_like(y, memory_format=memory_format).copy_(y)


def eager_empty_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.empty_like(x)`` with the strides eager torch gives it, also under
    ``FakeTensorMode``: what a fake returns for an output the op gives the layout of
    ``torch.empty_like(x)``. Eager torch keeps ``x``'s strides where ``x`` is
    non-overlapping and dense (and else infers dense ones keeping its dim order);
    the fake's ``empty_like`` derives them from a dim order, which differs on dims of
    size one (x ``[1, 2, 4, 1, 1]`` with strides ``(4, 4, 1, 4, 4)``: eager keeps
    them, channels-last for :func:`array_memory_format`; a fake gets
    ``(8, 4, 1, 1, 1)``, contiguous). Symbolic sizes: ``torch.empty_like(x)``."""
    sizes, strides = tuple(x.shape), tuple(x.stride())
    if x.layout != torch.strided or not all(type(v) is int for v in (*sizes, *strides)):
        return torch.empty_like(x, dtype=dtype)
    if not _non_overlapping_and_dense(sizes, strides):
        strides = _infer_dense_strides(sizes, strides)
    return x.new_empty_strided(sizes, strides, dtype=dtype)


def _non_overlapping_and_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """ATen's ``is_non_overlapping_and_dense`` (dims of size < 2 place no condition; an
    empty tensor is dense)."""
    if 0 in sizes:
        return True
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(sizes, strides) if n >= 2):
        if stride != expected:
            return False
        expected *= size
    return True


def _infer_dense_strides(sizes: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """ATen's ``infer_dense_strides`` (what eager ``empty_like`` gives a tensor that is not
    dense): dense strides in the dim order of ``strides``, found by its stable insertion
    sort (a stride of 0 compares as ambiguous; equal strides put the smaller size inner)."""
    ndim = len(sizes)
    if ndim < 2:
        return (1,) * ndim
    perm = list(range(ndim - 1, -1, -1))  # innermost first

    def order(d0: int, d1: int) -> int:
        s0, s1 = strides[d0], strides[d1]
        if s0 == 0 or s1 == 0:
            return 0
        if s0 != s1:
            return -1 if s0 < s1 else 1
        return 1 if sizes[d0] > sizes[d1] else 0

    for i in range(1, ndim):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = order(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    out = [0] * ndim
    step = 1
    for d in perm:
        out[d] = step
        if sizes[d] > 1:
            step *= sizes[d]
    return tuple(out)


# ---- memory formats of array images --------------------------------------------
#
# An array image [B, N, C, H, W] lives in one of two memories, named by the
# torch memory format its grouped view [N, B*C, H, W] has:
#   torch.contiguous_format  [N, B, C, H, W]  (NCHW of the grouped view; the default)
#   torch.channels_last      [N, H, W, B, C]  (NHWC: cuDNN's fast grouped convs read
#                                              and write it without a conversion)
# Array ops keep the memory they are given: an output follows its input's format.

MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last)
_TO_NHWBC, _FROM_NHWBC = (1, 3, 4, 0, 2), (3, 0, 4, 1, 2)  # [B, N, C, H, W] <-> [N, H, W, B, C]


def _canonical_strides(x: torch.Tensor, memory_format: torch.memory_format, image: bool) -> tuple[int, ...]:
    """The strides ``memory_format`` gives ``x``'s shape: of an ``[N, C, H, W]``
    image (``image``) or of an array image ``[B, N, C, H, W]``."""
    if image:
        N, C, H, W = x.shape
        return (C * H * W, H * W, W, 1) if memory_format == torch.contiguous_format else (H * W * C, 1, W * C, C)
    B, N, C, H, W = x.shape
    if memory_format == torch.contiguous_format:
        return (C * H * W, B * C * H * W, H * W, W, 1)
    return (C, H * W * B * C, 1, W * B * C, B * C)


def array_memory_format(x: torch.Tensor, shared: bool = False) -> torch.memory_format:
    """The memory format of an array image: ``torch.channels_last`` for an
    ``[B, N, C, H, W]`` tensor stored as ``[N, H, W, B, C]`` memory (or, with
    ``shared``, a per-batch ``[N, C, H, W]`` input in channels-last memory),
    else ``torch.contiguous_format``. Memory that is both (one channel, or
    ``H = W = 1``) is channels-last only with exactly the strides
    :func:`new_batch_major` (or ``torch.empty(..., memory_format=
    torch.channels_last)``) gives it. Other ranks are ``contiguous_format``.

    Read from the sizes and strides (every layer asks, so no view is made).
    """
    image = shared or (x.dim() == 5 and is_shared(x))
    sizes, strides = x.shape, x.stride()
    if image:
        if x.dim() == 5:
            sizes, strides = sizes[1:], strides[1:]
        if len(sizes) != 4:
            return torch.contiguous_format
        cl_order, nchw_order = _NHWC, _NCHW
    else:
        if len(sizes) != 5:
            return torch.contiguous_format
        cl_order, nchw_order = _TO_NHWBC, _TO_NBCHW
    # torch counts any empty tensor contiguous, and so any permutation of one (the array
    # case); its channels-last check of an image reads the strides whatever the sizes.
    empty = x.numel() == 0
    channels_last = (empty and not image) or _dense_in(sizes, strides, cl_order)
    nchw = empty or _dense_in(sizes, strides, nchw_order)
    if channels_last and nchw:  # both: the exact strides decide
        x = x[0] if x.dim() == 5 and image else x
        cl_strides = _canonical_strides(x, torch.channels_last, image)
        channels_last = tuple(strides) == cl_strides != _canonical_strides(x, torch.contiguous_format, image)
    return torch.channels_last if channels_last else torch.contiguous_format


_NHWC, _NCHW, _TO_NBCHW = (0, 2, 3, 1), (0, 1, 2, 3), (1, 0, 2, 3, 4)


def _dense_in(sizes, strides, order) -> bool:
    """Whether dims ``order`` (outermost first) of a tensor of ``sizes`` and
    ``strides`` are dense row-major memory: ``x.permute(order).is_contiguous()``
    without making the view (dims of size one place no condition, as in torch)."""
    expected = 1
    for d in reversed(order):
        size = sizes[d]
        if size != 1:
            if strides[d] != expected:
                return False
            expected *= size
    return True


def check_memory_format(where: str, memory_format: object, allow_none: bool = False) -> torch.memory_format | None:
    """``memory_format`` if it is one of :data:`MEMORY_FORMATS` (or None when allowed), else raise."""
    if (memory_format is None and allow_none) or any(memory_format is f for f in MEMORY_FORMATS):
        return memory_format
    if isinstance(memory_format, torch.memory_format):
        raise ValueError(
            f"{where}: array images support torch.contiguous_format and torch.channels_last, "
            f"got {memory_format}"
        )
    raise TypeError(f"{where}: expected a torch.memory_format, got {type(memory_format).__name__} "
                    f"{memory_format!r}")


def to_array_memory_format(x: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """The array image ``x`` (``[B, N, C, H, W]``, possibly shared) in ``memory_format``:
    ``x`` itself when it is already, else a copy (differentiable)."""
    if array_memory_format(x) == memory_format:
        return x
    if shares_work(x):
        image = x[0]
        return torch.empty_like(image, memory_format=memory_format).copy_(image).expand(x.shape)
    return new_batch_major(x, x.shape, memory_format).copy_(x)


def like_weight(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A gradient of ``weight``'s shape in the layout of ``torch.empty_like(weight)``
    (``weight``'s strides for a dense weight): ``grad`` itself when its strides
    already are, else a copy. Weight-gradient ops return this so that a
    gradient matches its parameter's memory and its fake's strides."""
    if grad.stride() == weight.stride():
        return grad
    return torch.empty_like(weight, dtype=grad.dtype).copy_(grad)


def op_result(y: torch.Tensor) -> torch.Tensor:
    """An op kernel's output as a tensor of its own, not a view of the kernel's scratch.

    Array ops return ``[B, N, ...]`` views of ``[N, B, ...]`` memory. torch
    forbids in-place changes (``nn.ReLU(inplace=True)``, ``out += identity``) to
    a view created inside a custom op or autograd Function, because autograd
    could not rebase its backward; ``detach()`` keeps the memory and drops the
    view relation. Kernels run below autograd, so nothing is lost.
    """
    return y.detach() if y._is_view() else y


def to_grouped(x: torch.Tensor) -> torch.Tensor:
    """``[B, N, C, *s]`` -> ``[N, B*C, *s]``: a view when ``x`` has ``[N, B, ...]`` memory
    (or ``[N, H, W, B, C]`` memory, whose grouped view is channels-last)."""
    B, N = x.shape[:2]
    return x.transpose(0, 1).reshape(N, B * x.shape[2], *x.shape[3:])


def from_grouped(
    y: torch.Tensor, B: int, memory_format: torch.memory_format = torch.contiguous_format
) -> torch.Tensor:
    """``[N, B*C, *s]`` -> a ``[B, N, C, *s]`` view of array memory: ``[N, B, C, *s]``,
    or ``[N, H, W, B, C]`` for ``memory_format=torch.channels_last`` (a copy only
    where ``y`` is not already in that format)."""
    y = grouped_in_format(y, memory_format)
    return y.view(y.shape[0], B, y.shape[1] // B, *y.shape[2:]).transpose(0, 1)


def fresh_array(y: torch.Tensor, B: int, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """:func:`from_grouped` for a grouped result computed under autograd that no backward
    node saved (a convolution's or a batch norm's output): the same memory and strides,
    as a tensor of its own rather than a view of ``y``. In-place ops on it (a
    ``ReLU(inplace=True)``, a residual ``+=``) are then plain in-place ops; on a view,
    autograd would rebase the view's history, whose backward copies the whole base
    per op (``CopySlices``). Its version counter is not ``y``'s, which is why ``y``
    must not be saved for backward: apply what saves it (an activation) to the result."""
    y = grouped_in_format(y, memory_format)
    return torch.ops.aten._unsafe_view(y, (y.shape[0], B, y.shape[1] // B, *y.shape[2:])).transpose_(0, 1)


def fresh_grouped(y: torch.Tensor) -> torch.Tensor:
    """:func:`to_grouped` of an array computed under autograd that no backward node saved (a
    norm's output): where that is a view, the same memory and strides as a tensor of its
    own (:func:`fresh_array`'s inverse), so that in-place ops on it (an activation module's)
    are plain in-place ops rather than a view's, whose backward copies the whole base."""
    B, N, C = y.shape[:3]
    t = y.transpose(0, 1)
    if y.stride(0) == C * y.stride(2):  # B and C merge: the grouped form is a view
        return torch.ops.aten._unsafe_view(t, (N, B * C, *y.shape[3:]))
    return t.reshape(N, B * C, *y.shape[3:])  # a copy


def array_of_grouped(yg: torch.Tensor, B: int) -> torch.Tensor:
    """``[N, B*C, *s]`` -> the ``[B, N, C, *s]`` array whose grouped form (:func:`to_grouped`)
    is ``yg``: a view of ``yg`` in any layout (``[N, B, C, *s]`` memory for a contiguous
    ``yg``, ``[N, H, W, B, C]`` for a channels-last one)."""
    return yg.unflatten(1, (B, yg.shape[1] // B)).transpose(0, 1)


def grouped_in_format(y: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """The grouped ``y`` in ``memory_format`` (a copy only where it is not)."""
    if memory_format == torch.channels_last:
        # Memory that is both formats at once must have exactly the channels-last
        # strides to count as channels-last (array_memory_format): a fake's strides.
        if not y.is_contiguous(memory_format=memory_format) or \
                (y.is_contiguous() and y.stride() != _canonical_strides(y, memory_format, image=True)):
            y = torch.empty_like(y, memory_format=memory_format).copy_(y)
        return y
    return y.contiguous()


# ---- index and gradient rows of the array embedding --------------------------------
# Both kernel backends of the embedding address the lookups of each model through
# at most two strided dims.

def _collapse_dims(sizes, strides) -> list[tuple[int, int]] | None:
    """Merge the dims of a strided view where memory allows; [(size, stride)] of at
    most two dims, outermost first, or None if more than two remain."""
    dims: list[tuple[int, int]] = []
    for size, stride in zip(sizes, strides):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    if len(dims) > 2:
        return None
    return [(1, 0)] * (2 - len(dims)) + dims


def lookup_dims(t: torch.Tensor, n: int, trailing: int) -> tuple[torch.Tensor, int, int, int]:
    """``t`` ``[B, *, ...]`` (``trailing`` dims after ``*``) -> (t or a copy, L, stride M, stride L)."""
    end = t.dim() - trailing
    dims = _collapse_dims(t.shape[1:end], t.stride()[1:end])
    if dims is None:
        # More than two uncollapsible dims: rare enough that one copy is acceptable.
        t = t.reshape(t.shape[0], n, *t.shape[end:])
        dims = [(1, 0), (n, t.stride(1))]
    (_, s_m), (size_l, s_l) = dims
    return t, size_l, s_m, s_l


_CONV_ND = (1, 2)  # the spatial dims array convolutions support


def refuse_forward_ad(op: str, *tensors: torch.Tensor | None) -> None:
    """RuntimeError where forward-mode AD would run through the dispatched op ``op``:
    ``torch.func.jvp``/``jacfwd`` (a functorch Jvp transform active) or ``torch.autograd.forward_ad``
    (an input with a tangent). torch's custom ops have no forward-mode formula, and a custom op
    with a registered backward gives zero tangents silently rather than raising. A few cheap
    reads where neither is active (every call of a fused forward runs this)."""
    if torch.compiler.is_compiling():  # (dynamo cannot trace functorch's stack; a graph has no tangents)
        return
    if torch._C._functorch.peek_interpreter_stack() is not None:
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        jvp = torch._C._functorch.TransformType.Jvp
        active = any(i.key() == jvp for i in retrieve_all_functorch_interpreters())
    elif forward_ad._current_level >= 0:
        active = any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)
    else:
        return
    if active:
        raise RuntimeError(
            f"hfkern::{op}: forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) is not "
            f"supported: the op has no forward-mode formula, and torch would give zero tangents")


def check_conv_args(
    op: str, activation_dims: int, weight: torch.Tensor, stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], output_padding: Sequence[int], groups: int,
    *, grad_out: torch.Tensor | None = None, transposed: bool | None = None, x: torch.Tensor | None = None,
    input_size: Sequence[int] | None = None, bias: torch.Tensor | None = None,
) -> None:
    """Raise unless the arguments describe a 1-D or 2-D array convolution.

    ``activation_dims`` is the number of dims of the conv's input (``[B, N, C, *s]``
    or a shared ``[N, C, *s]``); messages name ``hfkern::{op}``. A 3-D
    convolution raises NotImplementedError, anything else malformed
    ValueError. Metadata only: no device value is read.

    Given ``transposed`` (what the ops and their fakes pass), the operands are checked
    against the weight too: the input ``x`` (or, for the input gradient, its
    ``input_size``) has the weight's B and C_in, ``bias`` is ``[B, C_out]``,
    ``grad_out`` has the convolution's output shape, and every tensor has the
    weight's device (ValueError) and dtype (TypeError).
    """
    nd = len(stride)
    kernel_nd = weight.dim() - 3
    if nd not in _CONV_ND or kernel_nd not in _CONV_ND:
        # A 3-D conv is a well-formed request this library does not implement;
        # any other count of spatial dims is malformed.
        unsupported = 3 in (nd, kernel_nd)
        raise (NotImplementedError if unsupported else ValueError)(
            f"hfkern::{op}: supports 1-D and 2-D convolutions only (stride, padding, dilation "
            f"and output_padding of length 1 or 2, weight [B, C_out, C_in/groups, *k] of 4 or "
            f"5 dims), got {'a 3-D convolution: ' if unsupported else ''}stride {list(stride)} "
            f"and weight of shape {list(weight.shape)}"
        )
    if kernel_nd != nd:
        raise ValueError(
            f"hfkern::{op}: expected weight of {nd + 3} dims ([B, C_out, C_in/groups, *k] with "
            f"{nd} kernel dims, as stride {list(stride)}), got {list(weight.shape)}"
        )
    if len(padding) != nd or len(dilation) != nd or len(output_padding) != nd:
        for name, value in (("padding", padding), ("dilation", dilation), ("output_padding", output_padding)):
            if len(value) != nd:
                raise ValueError(
                    f"hfkern::{op}: expected {name} of length {nd} (one per spatial dim, as stride "
                    f"{list(stride)}), got {list(value)}"
                )
    if activation_dims not in (nd + 2, nd + 3):
        raise ValueError(
            f"hfkern::{op}: expected an input of {nd + 3} dims [B, N, C_in, *s] (or {nd + 2} dims "
            f"[N, C_in, *s], shared) for a {nd}-D convolution, got {activation_dims} dims"
        )
    if grad_out is not None and grad_out.dim() != nd + 3:
        raise ValueError(
            f"hfkern::{op}: expected grad_out of {nd + 3} dims [B, N, C_out, *s'] for a {nd}-D "
            f"convolution, got shape {list(grad_out.shape)}"
        )
    if groups < 1:
        raise ValueError(f"hfkern::{op}: expected groups >= 1, got {groups}")
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or min(output_padding) < 0:
        raise ValueError(f"hfkern::{op}: expected stride >= 1, dilation >= 1, padding >= 0 and output_padding "
                         f">= 0 in every dim, got stride {list(stride)}, dilation {list(dilation)}, padding "
                         f"{list(padding)}, output_padding {list(output_padding)}")
    if transposed and any(o >= max(st, d) for o, st, d in zip(output_padding, stride, dilation)):
        raise ValueError(f"hfkern::{op}: expected output_padding smaller than stride or dilation in every dim (as "
                         f"torch's transposed convolutions), got output_padding {list(output_padding)}, stride "
                         f"{list(stride)}, dilation {list(dilation)}")
    if transposed is None:
        return
    # The operands against the weight [B, C_out, C_in/groups, *k] (transposed: [B, C_in,
    # C_out/groups, *k]): the input (x, or its shape input_size) [B, N, C_in, *s] or shared
    # [N, C_in, *s] with the weight's B and C_in, bias [B, C_out], grad_out the output's shape
    # [B, N, C_out, *s']; the weight's dtype (TypeError) and device for every tensor. Every
    # forward runs this: one expression of integer and attribute comparisons where all is
    # well, _explain_conv_operands where it is not.
    ws = weight.shape
    B, w1, w2 = ws[0], ws[1], ws[2]
    c_in, c_out = (w1, w2 * groups) if transposed else (w2 * groups, w1)
    size = input_size if x is None else x.shape
    dtype, device = weight.dtype, weight.device
    if (w1 % groups or size[-nd - 1] != c_in or (len(size) == nd + 3 and size[0] != B)
            or (x is not None and (x.dtype != dtype or x.device != device))
            or (bias is not None and (bias.shape != (B, c_out) or bias.dtype != dtype or bias.device != device))
            or (grad_out is not None and (grad_out.dtype != dtype or grad_out.device != device or list(grad_out.shape)
                                          != _conv_output_shape(size, weight, stride, padding, dilation, transposed,
                                                                output_padding, c_out)))):
        _explain_conv_operands(op, weight, stride, padding, dilation, output_padding, groups, transposed, x,
                               size, bias, grad_out, c_in, c_out)


def _conv_output_shape(size, weight, stride, padding, dilation, transposed, output_padding, c_out) -> list[int]:
    """``[B, N, C_out, *s']``: the output shape of the array convolution of an input of shape ``size``."""
    nd = weight.dim() - 3
    out = conv_output_size(size[-nd:], weight.shape[-nd:], stride, padding, dilation, transposed, output_padding)
    return [weight.shape[0], size[-nd - 2], c_out, *out]


def _explain_conv_operands(op, weight, stride, padding, dilation, output_padding, groups, transposed, x, size,
                           bias, grad_out, c_in, c_out) -> None:
    """Raise for the first operand :func:`_check_conv_operands` rejects."""
    B, w1, nd = weight.shape[0], weight.shape[1], weight.dim() - 3
    if w1 % groups:
        raise ValueError(
            f"hfkern::{op}: expected weight's dim 1 ({'C_in' if transposed else 'C_out'}) divisible by "
            f"groups={groups}, got weight of shape {list(weight.shape)}"
        )
    per_model = len(size) == nd + 3
    if (per_model and size[0] != B) or size[-nd - 1] != c_in:
        expected = f"[B={B}, N, C_in={c_in}, *s]" if per_model else f"[N, C_in={c_in}, *s] (shared)"
        raise ValueError(
            f"hfkern::{op}: expected {'input_size' if x is None else 'x'} of shape {expected} for weight of "
            f"shape {list(weight.shape)} ({'transposed, ' if transposed else ''}groups={groups}), got {list(size)}"
        )
    for name, t in (("x", x), ("bias", bias), ("grad_out", grad_out)):
        if t is None:
            continue
        if t.device != weight.device:
            raise ValueError(
                f"hfkern::{op}: expected {name} on the weight's device ({weight.device}), got {name} on {t.device}"
            )
        if t.dtype != weight.dtype:
            raise TypeError(f"hfkern::{op}: expected {name} of the weight's dtype ({weight.dtype}), got {t.dtype}")
    if bias is not None and bias.shape != (B, c_out):
        raise ValueError(f"hfkern::{op}: expected bias of shape [B={B}, C_out={c_out}], got {list(bias.shape)}")
    if grad_out is not None:
        expected = _conv_output_shape(size, weight, stride, padding, dilation, transposed, output_padding, c_out)
        if list(grad_out.shape) != expected:
            raise ValueError(
                f"hfkern::{op}: expected grad_out of the convolution's output shape {expected} ([B, N, C_out, *s'] "
                f"for an input of shape {list(size)}), got {list(grad_out.shape)}"
            )
    raise AssertionError(f"hfkern::{op}: operands judged mismatched, but none is")


def conv_output_size(
    size: Sequence[int], kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
) -> list[int]:
    """The spatial output sizes of a convolution (or transposed one) of spatial input ``size``."""
    if transposed:
        return [
            (i - 1) * s - 2 * p + d * (k - 1) + op + 1
            for i, k, s, p, d, op in zip(size, kernel_size, stride, padding, dilation, output_padding)
        ]
    return [
        (i + 2 * p - d * (k - 1) - 1) // s + 1
        for i, k, s, p, d in zip(size, kernel_size, stride, padding, dilation)
    ]


def hyper(value, B: int, name: str, *, like: torch.Tensor | None = None) -> torch.Tensor:
    """A per-model hyperparameter as a ``[B]`` float64 tensor.

    Accepts a real number (Python or numpy scalar), a length-B sequence of
    them, or a 1-D tensor or numpy array of length B (a 0-d one counts as one
    value for every model). Rejects bool and complex values and anything else
    with a TypeError, other lengths, NaN and negative values with a ValueError;
    every message names ``name``.
    """
    import numbers
    import sys

    # A numpy value can only exist once numpy has been imported; looking it up
    # keeps numpy an optional dependency that hfkern never imports itself.
    np = sys.modules.get("numpy")

    def real_scalar(v: object) -> bool:  # numpy's integer and floating scalars are numbers.Real
        return isinstance(v, numbers.Real) and not isinstance(v, bool)

    if np is not None and isinstance(value, np.ndarray):
        if value.dtype.kind not in "iuf":
            kind = {"b": "bool", "c": "complex"}.get(value.dtype.kind, str(value.dtype))
            raise TypeError(f"{name} must hold real numbers (one per model), got a {kind} numpy array")
        value = torch.from_numpy(value.astype(np.float64))
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must hold real numbers (one per model), got a {value.dtype} tensor")
        t = value.detach().to(dtype=torch.float64, device="cpu")
        if t.dim() == 0:
            t = t.expand(B)
    elif real_scalar(value):
        t = torch.full((B,), float(value), dtype=torch.float64)
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        def one_number(v: object) -> bool:
            if isinstance(v, torch.Tensor):
                return v.numel() == 1 and not v.is_complex() and v.dtype != torch.bool
            if np is not None and isinstance(v, np.ndarray):
                return v.size == 1 and v.dtype.kind in "iuf"
            return real_scalar(v)

        if not all(one_number(v) for v in value):
            raise TypeError(f"{name} must be a float or a length-{B} sequence of floats, got {value!r}")
        t = torch.tensor([float(v) for v in value], dtype=torch.float64)
    else:
        raise TypeError(
            f"{name} must be a float, a length-{B} sequence, a 1-D tensor or a 1-D numpy array, "
            f"got {type(value).__name__}"
        )
    if t.dim() != 1 or t.numel() != B:
        raise ValueError(f"{name} must have one value per model (length B={B}), got shape {list(t.shape)}")
    if torch.isnan(t).any():
        raise ValueError(f"{name} must not be NaN, got {t.tolist()}")
    if (t < 0).any():
        raise ValueError(f"{name} must be >= 0 for every model, got {t.tolist()}")
    if like is not None:
        t = t.to(device=like.device)
    return t
