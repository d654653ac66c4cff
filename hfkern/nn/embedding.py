"""Array Embedding: B ``torch.nn.Embedding`` tables looked up by one op."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import init

from .._array import is_shared
from ..ops.embedding import (
    array_embedding_renorm_,
    embedding,
    embedding_checked_indices,
    raise_if_out_of_range,
)
from ._base import ArrayModule, stack_init

__all__ = ["Embedding"]

_INDEX_DTYPES = (torch.int64, torch.int32)


def check_indices(
    module: str, x: object, B: int, num_embeddings: int, weight: torch.Tensor
) -> torch.Tensor:
    """Check an array index tensor ``[B, *]`` before any lookup; return the indices to look up.

    Raises TypeError for a non-tensor or non-integer dtype, ValueError for a
    0-D tensor, a leading dim other than B or a device other than the
    weight's, and checks the range ``[0, num_embeddings)`` as
    ``torch.nn.functional.embedding`` does on each device
    (:func:`~hfkern.ops.embedding.raise_if_out_of_range`): on the CPU an
    IndexError naming the value and the model it came from, on CUDA a
    device-side assertion that does not synchronize. In eager mode and (inside
    an op opaque to the compiler) under ``torch.compile`` alike.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{module}: expected input to be a torch.Tensor of indices, got {type(x).__name__}")
    if x.dtype not in _INDEX_DTYPES:
        raise TypeError(
            f"{module}: expected input indices of dtype torch.int64 or torch.int32, got {x.dtype}"
        )
    if x.dim() == 0:
        raise ValueError(
            f"{module}: expected input of shape [B, *] (array dim first) with B={B}, got a 0-D tensor"
        )
    if x.size(0) != B:
        raise ValueError(
            f"{module}: expected input with leading (array) dim B={B}, got shape {list(x.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(f"{module}: input is on {x.device} but the weight is on {weight.device}")
    shared = is_shared(x)
    values = x[0] if shared else x
    if torch.compiler.is_compiling():
        checked = embedding_checked_indices(values, num_embeddings, shared, module)
        return checked.expand(x.shape) if shared else checked
    raise_if_out_of_range(module, values, num_embeddings, shared)
    return x


class Embedding(ArrayModule):
    """B ``torch.nn.Embedding`` models.

    Input ``[B, *]`` int64 or int32 indices (model b looks up ``input[b]`` in
    its own table), or :func:`hfkern.broadcast` of one ``[*]`` index tensor for
    all B models; output ``[B, *, embedding_dim]``; weight
    ``[B, num_embeddings, embedding_dim]``, each model initialized from
    ``N(0, 1)`` independently with its ``padding_idx`` row zeroed.

    ``max_norm`` renormalizes, in place and per model, exactly the rows that
    model's indices reference (as ``torch.nn.Embedding`` does);
    ``scale_grad_by_freq`` scales by each model's own index counts;
    ``sparse=True`` gives a sparse COO gradient ``[B, V, D]`` whose slice
    ``[b]`` is model b's torch gradient (``torch.optim.SparseAdam`` accepts it).
    ``requires_grad`` (``_freeze``, ``from_pretrained(freeze=...)``) carries
    through :meth:`from_modules` and :meth:`to_modules`.

    An index outside ``[0, num_embeddings)`` fails before any lookup, as
    ``torch.nn.functional.embedding``'s does on each device, in eager mode and
    under ``torch.compile`` alike (there the check is an opaque op,
    ``hfkern::embedding_checked_indices``). On the CPU it raises IndexError
    naming the index and the model it came from. On CUDA it fails a device-side
    assertion, which reads nothing back to the host: a training step does not
    wait for the device and can be captured as a CUDA graph
    (:func:`hfkern.capture_step`, ``mode="reduce-overhead"``); the error then
    surfaces as a RuntimeError at a later synchronization and leaves the CUDA
    context unusable, as torch's does. Run the same indices on the CPU to see
    which index and model.
    """

    _torch_cls = nn.Embedding
    _config_fields = (
        "num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
        "scale_grad_by_freq", "sparse",
    )

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        _freeze: bool = False,
        *,
        B: int,
        device=None,
        dtype=None,
    ):
        super().__init__()
        # The namesake on the meta device validates the arguments and turns a
        # negative padding_idx into V + padding_idx, exactly as torch does.
        template = nn.Embedding(
            num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
            scale_grad_by_freq, sparse, device="meta",
        )
        self._set_B(B, required=True)
        for field in self._config_fields:
            setattr(self, field, getattr(template, field))
        shape = (self.B, self.num_embeddings, self.embedding_dim)
        if _weight is None:
            self.weight = nn.Parameter(
                torch.empty(shape, device=device, dtype=dtype), requires_grad=not _freeze
            )
            self.reset_parameters()
        else:
            if not isinstance(_weight, torch.Tensor):
                raise TypeError(f"Embedding: expected _weight to be a torch.Tensor, got {type(_weight).__name__}")
            if tuple(_weight.shape) != shape:
                raise ValueError(
                    f"Embedding: expected _weight of shape [B, num_embeddings, embedding_dim] = "
                    f"{list(shape)}, got {list(_weight.shape)}"
                )
            self.weight = nn.Parameter(_weight, requires_grad=not _freeze)

    def reset_parameters(self) -> None:
        stack_init([self.weight], init.normal_)
        self._fill_padding_idx_with_zero()

    def _fill_padding_idx_with_zero(self) -> None:
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[:, self.padding_idx].fill_(0)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input`` ``[B, *]`` indices -> ``[B, *, embedding_dim]``."""
        idx = check_indices("Embedding", input, self.B, self.num_embeddings, self.weight)
        if self.max_norm is not None:
            with torch.no_grad():
                array_embedding_renorm_(self.weight, idx, float(self.max_norm), float(self.norm_type))
        padding_idx = -1 if self.padding_idx is None else self.padding_idx
        return embedding(self.weight, idx, padding_idx, self.scale_grad_by_freq, self.sparse)

    @classmethod
    def from_pretrained(
        cls,
        embeddings: torch.Tensor,
        freeze: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> "Embedding":
        """An array whose weight is ``embeddings`` ``[B, num_embeddings, embedding_dim]``.

        As in torch, the tensor becomes the parameter (no copy, padding row not
        zeroed) and ``freeze=True`` sets ``requires_grad=False``.
        """
        if not isinstance(embeddings, torch.Tensor):
            raise TypeError(
                f"Embedding.from_pretrained: expected embeddings to be a torch.Tensor, "
                f"got {type(embeddings).__name__}"
            )
        if embeddings.dim() != 3:
            raise ValueError(
                "Embedding.from_pretrained: expected embeddings of 3-D shape "
                f"[B, num_embeddings, embedding_dim], got {embeddings.dim()}-D shape {list(embeddings.shape)}"
            )
        B, rows, cols = embeddings.shape
        return cls(
            num_embeddings=rows, embedding_dim=cols, padding_idx=padding_idx, max_norm=max_norm,
            norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse,
            _weight=embeddings, _freeze=freeze, B=B,
        )
