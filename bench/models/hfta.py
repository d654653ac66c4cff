"""HFTA-style fused models and optimizers of the workloads: B models as one, in plain torch.

The baseline bench/train_throughput.py's ``hfta`` mode times: horizontally fused
training as the original HFTA (Wang et al., MLSys 2021) formulates it, written
from that formulation with torch's own ops and modules only, no hfkern. A fused
model is built from B torch models of a workload (:func:`fuse`) and trains
exactly what they compute:

* **convolutions** (1-D, 2-D, transposed) are one torch convolution with
  ``groups = B * groups`` on the grouped layout ``[N, B*C, *s]`` (weights
  ``[B*C_out, C_in/groups, *k]``, transposed ``[B*C_in, C_out/groups, *k]``);
  a shared input is repeated B times along the channels first, as HFTA does;
* **batch norm** is one ``nn.BatchNorm1d/2d(B*C)`` on the same layout (after a
  linear layer its ``[B, N, F]`` output is moved to ``[N, B*F]`` and back);
* **linear layers** are ``torch.baddbmm`` on ``[B, N, in] x [B, in, out]``;
  embeddings one lookup in the ``[B*V, D]`` table with per-model index offsets;
  layer norm normalizes without affine, then ``addcmul`` with ``[B, ..., D]``
  weights; attention runs torch's ``scaled_dot_product_attention`` on
  ``[B, N, heads, S, d]``;
* pooling, activations, dropout and residual adds run on the fused tensors;
  the workload's training step sums the per-model losses before backward.

The models' own module trees are mirrored, so a fused parameter has the name of
the parameter it stacks; :func:`per_model` maps fused parameters, gradients or
buffers back to each model's names and shapes. Memory format: the contiguous
(NCHW-like) grouped layout, the format every mode of the harness uses (its
``array[torch]`` mode keeps the same ``[N, B*C, H, W]`` memory).

**The optimizer** (:func:`optimizer`). The harness gives the B models different
learning rates (``Workload.learning_rates``), the point of a sweep, while a
torch optimizer has one learning rate per parameter group, and a fused tensor
holds all B models. HFTA's answer, taken here, keeps the fused parameters and
applies each model's hyper-parameters as a ``[B, 1]`` column broadcast against
the ``[B, -1]`` view of every parameter. Every other hyper-parameter of the
workloads (momentum, betas, eps, weight decay) is shared by the models, so the
update is torch's own multi-tensor (``foreach=True``) implementation of
SGD / Adam / AdamW, op for op, over all fused parameters at once, with the
learning rate entering as that column where torch multiplies by a scalar. The
original HFTA loops over the parameters in Python, one op per tensor; the
``torch._foreach_*`` calls here do the same arithmetic with fewer dispatches
(on CUDA, the ops with scalar operands run as multi-tensor kernels), so this
stand-in is no slower than HFTA's own optimizer and the comparison with hfkern's
array optimizer is, if anything, generous to the baseline.

Workloads: all of ``bench.models.WORKLOADS`` (:data:`BUILDERS`); :func:`fuse`
raises ``NotImplementedError`` for any other.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dcgan import DCGANDiscriminator, DCGANGenerator
from .mobilenet import ConvBNReLU, InvertedResidual, MobileNetV2
from .pointnet import PointNetCls, STNkd
from .resnet import BasicBlock, ResNet18
from .transformer import BertSmall, TransformerLM

__all__ = ["BUILDERS", "fuse", "fuse_modules", "supports", "per_model", "optimizer", "HftaSGD", "HftaAdam", "HftaAdamW",
           "grouped_input", "to_models"]


# ---- layout helpers ---------------------------------------------------------------------------
def grouped_input(x: Tensor, B: int, per_model: bool = False) -> Tensor:
    """The grouped layout of an input: shared ``[N, C, *s]`` (repeated B times) or
    per-model ``[B, N, C, *s]`` -> ``[N, B*C, *s]``, model b's channels in block b."""
    if per_model:
        return x.transpose(0, 1).reshape(x.size(1), -1, *x.shape[3:])
    return x.repeat(1, B, *([1] * (x.dim() - 2)))


def to_models(y: Tensor, B: int) -> Tensor:
    """Grouped ``[N, B*C, *s]`` -> ``[B, N, C, *s]`` (a view)."""
    return y.view(y.size(0), B, -1, *y.shape[2:]).transpose(0, 1)


def _same(mods: Sequence[nn.Module], *attrs: str) -> None:
    for a in attrs:
        values = [getattr(m, a) for m in mods]
        if any(v != values[0] for v in values[1:]):
            raise ValueError(f"hfta: the B models must agree on {type(mods[0]).__name__}.{a}; got {values}")


def _same_tensor(mods: Sequence[nn.Module], name: str) -> None:
    values = [int(getattr(m, name)) for m in mods]
    if len(set(values)) > 1:
        raise ValueError(f"hfta: the B models must agree on {name}; got {values}")


def _cat(tensors: Iterable[Tensor]) -> Tensor:
    return torch.cat([t.detach() for t in tensors])


def _stack(tensors: Iterable[Tensor]) -> Tensor:
    return torch.stack([t.detach() for t in tensors])


# ---- fused layers -----------------------------------------------------------------------------
class _Stacked:
    """Mixin of a torch layer whose parameters and buffers concatenate the B
    models' along dim 0 (``[B*C, ...]``); ``unstack`` gives them as ``[B, C, ...]``."""

    B: int

    def unstack(self, name: str, t: Tensor) -> Tensor:
        if t.dim() == 0:                      # num_batches_tracked: one count, the same for every model
            return t.expand(self.B)
        return t.view(self.B, -1, *t.shape[1:])


class Conv1d(_Stacked, nn.Conv1d):
    """B ``nn.Conv1d`` as one grouped convolution: ``[N, B*C_in, L] -> [N, B*C_out, L']``."""


class Conv2d(_Stacked, nn.Conv2d):
    """B ``nn.Conv2d`` as one grouped convolution: ``[N, B*C_in, H, W] -> [N, B*C_out, H', W']``."""


class ConvTranspose2d(_Stacked, nn.ConvTranspose2d):
    """B ``nn.ConvTranspose2d`` as one grouped transposed convolution on ``[N, B*C, H, W]``."""


class BatchNorm1d(_Stacked, nn.BatchNorm1d):
    """B ``nn.BatchNorm1d(C)`` as one ``nn.BatchNorm1d(B*C)`` on ``[N, B*C]`` or ``[N, B*C, L]``."""


class BatchNorm2d(_Stacked, nn.BatchNorm2d):
    """B ``nn.BatchNorm2d(C)`` as one ``nn.BatchNorm2d(B*C)`` on ``[N, B*C, H, W]``."""


_CONVS = {nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.ConvTranspose2d: ConvTranspose2d}
_NORMS = {nn.BatchNorm1d: BatchNorm1d, nn.BatchNorm2d: BatchNorm2d}


def _conv(mods: Sequence[nn.Module]) -> nn.Module:
    m, B = mods[0], len(mods)
    _same(mods, "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
          "padding_mode", "output_padding")
    if m.padding_mode != "zeros":
        raise NotImplementedError(f"hfta: padding_mode {m.padding_mode!r} (only 'zeros')")
    kw = dict(stride=m.stride, padding=m.padding, dilation=m.dilation, groups=B * m.groups,
              bias=m.bias is not None, device=m.weight.device, dtype=m.weight.dtype)
    if m.transposed:
        kw["output_padding"] = m.output_padding
    f = _CONVS[type(m)](B * m.in_channels, B * m.out_channels, m.kernel_size, **kw)
    f.B = B
    with torch.no_grad():
        f.weight.copy_(_cat(x.weight for x in mods))
        if f.bias is not None:
            f.bias.copy_(_cat(x.bias for x in mods))
    return f


def _batch_norm(mods: Sequence[nn.Module]) -> nn.Module:
    m, B = mods[0], len(mods)
    _same(mods, "num_features", "eps", "momentum", "affine", "track_running_stats")
    f = _NORMS[type(m)](B * m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats,
                        device=m.running_mean.device if m.running_mean is not None else None,
                        dtype=m.weight.dtype if m.affine else None)
    f.B = B
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean", "running_var"):
            if getattr(f, name) is not None:
                getattr(f, name).copy_(_cat(getattr(x, name) for x in mods))
        if m.track_running_stats:
            _same_tensor(mods, "num_batches_tracked")
            f.num_batches_tracked.copy_(m.num_batches_tracked)
    return f


def batch_norm_features(bn: nn.Module, x: Tensor) -> Tensor:
    """A fused ``BatchNorm1d(B*F)`` on linear-layer features ``[B, N, F]``: the
    features move to ``[N, B*F]`` for the norm and back (two copies, HFTA's cost)."""
    B, N, Fe = x.shape
    return bn(x.transpose(0, 1).reshape(N, B * Fe)).view(N, B, Fe).transpose(0, 1)


class Linear(nn.Module):
    """B ``nn.Linear(in, out)`` as one batched matmul: ``[B, ..., in] -> [B, ..., out]``.

    ``weight`` ``[B, in, out]`` (model b's weight transposed), ``bias`` ``[B, out]``.
    """

    def __init__(self, mods: Sequence[nn.Linear]):
        super().__init__()
        _same(mods, "in_features", "out_features")
        self.B = len(mods)
        self.weight = nn.Parameter(_stack(m.weight.t() for m in mods))
        self.bias = nn.Parameter(_stack(m.bias for m in mods)) if mods[0].bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x = x.reshape(self.B, -1, x.size(-1))
        y = (torch.bmm(x, self.weight) if self.bias is None
             else torch.baddbmm(self.bias.unsqueeze(1), x, self.weight))
        return y.view(*lead, -1)

    def unstack(self, name: str, t: Tensor) -> Tensor:
        return t.transpose(1, 2) if name == "weight" else t


class TiedLinear(nn.Module):
    """The bias of B linear layers whose weights are the B models' ``[B, V, D]``
    embedding tables (BERT's decoder): ``[B, ..., D] -> [B, ..., V]``."""

    def __init__(self, mods: Sequence[nn.Linear]):
        super().__init__()
        self.B = len(mods)
        self.bias = nn.Parameter(_stack(m.bias for m in mods))

    def forward(self, x: Tensor, table: Tensor) -> Tensor:
        lead = x.shape[:-1]
        y = torch.baddbmm(self.bias.unsqueeze(1), x.reshape(self.B, -1, x.size(-1)), table.transpose(1, 2))
        return y.view(*lead, -1)

    def unstack(self, name: str, t: Tensor) -> Tensor:
        return t


class Embedding(nn.Module):
    """B ``nn.Embedding(V, D)`` as one lookup: indices ``[*]`` shared by the models
    -> ``[B, *, D]``. ``weight`` ``[B, V, D]``, read as one ``[B*V, D]`` table with
    model b's indices offset by ``b*V``."""

    def __init__(self, mods: Sequence[nn.Embedding]):
        super().__init__()
        m = mods[0]
        _same(mods, "num_embeddings", "embedding_dim", "padding_idx", "max_norm", "scale_grad_by_freq", "sparse")
        if m.padding_idx is not None or m.max_norm is not None or m.sparse or m.scale_grad_by_freq:
            raise NotImplementedError("hfta: Embedding with padding_idx, max_norm, sparse or scale_grad_by_freq")
        self.B, self.V = len(mods), m.num_embeddings
        self.weight = nn.Parameter(_stack(x.weight for x in mods))

    def forward(self, idx: Tensor) -> Tensor:
        offsets = torch.arange(0, self.B * self.V, self.V, device=idx.device).view(self.B, *([1] * idx.dim()))
        return F.embedding(idx.unsqueeze(0) + offsets, self.weight.view(self.B * self.V, -1))

    def unstack(self, name: str, t: Tensor) -> Tensor:
        return t


class LayerNorm(nn.Module):
    """B ``nn.LayerNorm(D)`` on ``[B, ..., D]``: normalize without affine, then
    ``addcmul`` with the ``[B, 1, ..., D]`` weight and bias."""

    def __init__(self, mods: Sequence[nn.LayerNorm]):
        super().__init__()
        _same(mods, "normalized_shape", "eps", "elementwise_affine")
        m = mods[0]
        if len(m.normalized_shape) != 1 or not m.elementwise_affine or m.bias is None:
            raise NotImplementedError("hfta: LayerNorm over one dim with weight and bias only")
        self.B, self.shape, self.eps = len(mods), m.normalized_shape, m.eps
        self.weight = nn.Parameter(_stack(x.weight for x in mods))
        self.bias = nn.Parameter(_stack(x.bias for x in mods))

    def forward(self, x: Tensor) -> Tensor:
        cols = (self.B,) + (1,) * (x.dim() - 2) + (-1,)
        return torch.addcmul(self.bias.view(cols), F.layer_norm(x, self.shape, None, None, self.eps),
                             self.weight.view(cols))

    def unstack(self, name: str, t: Tensor) -> Tensor:
        return t


class SelfAttention(nn.Module):
    """B ``nn.MultiheadAttention`` (batch first, self-attention) on ``[B, N, S, D]``.

    ``in_proj_weight`` ``[B, D, 3D]``, ``in_proj_bias`` ``[B, 3D]``, ``out_proj``
    a fused :class:`Linear`; the heads run as one ``scaled_dot_product_attention``
    on ``[B, N, heads, S, D/heads]``. ``attn_mask`` is additive, broadcast against
    ``[N, heads, S, S]`` (the models share it).
    """

    def __init__(self, mods: Sequence[nn.MultiheadAttention]):
        super().__init__()
        m = mods[0]
        _same(mods, "embed_dim", "num_heads", "dropout", "batch_first", "_qkv_same_embed_dim")
        if not (m._qkv_same_embed_dim and m.batch_first and m.in_proj_bias is not None
                and m.bias_k is None and not m.add_zero_attn):
            raise NotImplementedError("hfta: MultiheadAttention other than batch-first self-attention with biases")
        self.B, self.heads, self.dropout = len(mods), m.num_heads, m.dropout
        self.in_proj_weight = nn.Parameter(_stack(x.in_proj_weight.t() for x in mods))
        self.in_proj_bias = nn.Parameter(_stack(x.in_proj_bias for x in mods))
        self.out_proj = Linear([x.out_proj for x in mods])

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        B, N, S, D = x.shape
        qkv = torch.baddbmm(self.in_proj_bias.unsqueeze(1), x.reshape(B, N * S, D), self.in_proj_weight)
        q, k, v = qkv.view(B, N, S, 3, self.heads, D // self.heads).permute(3, 0, 1, 4, 2, 5)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(o.transpose(2, 3).reshape(B, N, S, D))

    def unstack(self, name: str, t: Tensor) -> Tensor:
        return t.transpose(1, 2) if name == "in_proj_weight" else t


class TransformerEncoderLayer(nn.Module):
    """B ``nn.TransformerEncoderLayer`` (batch first) on ``[B, N, S, D]``."""

    def __init__(self, mods: Sequence[nn.TransformerEncoderLayer]):
        super().__init__()
        m = mods[0]
        _same(mods, "norm_first", "activation")
        self.B, self.norm_first, self.activation = len(mods), m.norm_first, m.activation
        self.self_attn = SelfAttention([x.self_attn for x in mods])
        self.linear1 = Linear([x.linear1 for x in mods])
        self.linear2 = Linear([x.linear2 for x in mods])
        self.norm1 = LayerNorm([x.norm1 for x in mods])
        self.norm2 = LayerNorm([x.norm2 for x in mods])
        self.dropout, self.dropout1, self.dropout2 = (copy.deepcopy(m.dropout), copy.deepcopy(m.dropout1),
                                                      copy.deepcopy(m.dropout2))

    def _sa(self, x, attn_mask, is_causal):
        return self.dropout1(self.self_attn(x, attn_mask, is_causal))

    def _ff(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        if self.norm_first:
            x = x + self._sa(self.norm1(x), attn_mask, is_causal)
            return x + self._ff(self.norm2(x))
        x = self.norm1(x + self._sa(x, attn_mask, is_causal))
        return self.norm2(x + self._ff(x))


class _Encoder(nn.Module):
    """``nn.TransformerEncoder``'s layers (no final norm), for the parameter names."""

    def __init__(self, encoders: Sequence[nn.TransformerEncoder]):
        super().__init__()
        if any(e.norm is not None for e in encoders):
            raise NotImplementedError("hfta: TransformerEncoder with a final norm")
        self.layers = nn.ModuleList(TransformerEncoderLayer(ls) for ls in zip(*[e.layers for e in encoders]))

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        for layer in self.layers:
            x = layer(x, attn_mask, is_causal)
        return x


# Layers without parameters compute the same on the fused tensors as on one model's.
_STATELESS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity,
              nn.AdaptiveAvgPool2d, nn.MaxPool2d, nn.AvgPool2d)
# Containers whose forward only chains their children and adds residuals: their
# own code runs unchanged on the grouped layout.
_LAYOUT_FREE = (nn.Sequential, BasicBlock, InvertedResidual, ConvBNReLU)


def fuse_modules(mods: Sequence[nn.Module]) -> nn.Module:
    """B copies of one torch module (same class and configuration) as one fused
    module on the grouped layout; containers keep their class and forward with
    fused children (the parameter names stay the models')."""
    m = mods[0]
    if any(type(x) is not type(m) for x in mods):
        raise ValueError(f"hfta: the B models must agree on module classes; got {[type(x).__name__ for x in mods]}")
    if type(m) in _CONVS:
        return _conv(mods)
    if type(m) in _NORMS:
        return _batch_norm(mods)
    if isinstance(m, nn.Linear):
        return Linear(mods)
    if isinstance(m, _STATELESS):
        return copy.deepcopy(m)
    if isinstance(m, _LAYOUT_FREE):
        if m._parameters or m._buffers:
            raise NotImplementedError(f"hfta: container {type(m).__name__} with its own parameters")
        f = copy.copy(m)
        f._modules = OrderedDict((name, fuse_modules([x._modules[name] for x in mods]))
                                 for name in m._modules)
        f.B = len(mods)
        return f
    raise NotImplementedError(f"hfta: no fused form of {type(m).__name__}")


def _children(mods: Sequence[nn.Module], name: str) -> list:
    return [getattr(m, name) for m in mods]


# ---- fused models of the workloads ------------------------------------------------------------
class _Model(nn.Module):
    """A fused workload model: ``forward(*inputs, per_model=False)`` takes the
    inputs of one model (shared) or ``[B, ...]`` per-model ones and returns
    ``[B, N, ...]``, what the B torch models return, stacked."""

    def __init__(self, mods: Sequence[nn.Module], kind: type):
        super().__init__()
        if not mods:
            raise ValueError("hfta: expected at least one model, got none")
        if any(not isinstance(m, kind) for m in mods):
            raise TypeError(f"hfta: expected {kind.__name__} models, got {sorted({type(m).__name__ for m in mods})}")
        self.B = len(mods)

    def _fuse(self, mods, *names):
        for n in names:
            setattr(self, n, fuse_modules(_children(mods, n)))


class HftaResNet18(_Model):
    """B CIFAR ResNet-18: images ``[N, 3, 32, 32]`` -> logits ``[B, N, classes]``."""

    def __init__(self, mods: Sequence[ResNet18]):
        super().__init__(mods, ResNet18)
        self._fuse(mods, "conv1", "bn1", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc")

    def forward(self, x: Tensor, per_model: bool = False) -> Tensor:
        x = F.relu(self.bn1(self.conv1(grouped_input(x, self.B, per_model))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)                       # [N, B*C]
        return self.fc(to_models(x, self.B))                        # [B, N, C] -> [B, N, classes]


class HftaMobileNetV2(_Model):
    """B CIFAR MobileNetV2: images ``[N, 3, 32, 32]`` -> logits ``[B, N, classes]``."""

    def __init__(self, mods: Sequence[MobileNetV2]):
        super().__init__(mods, MobileNetV2)
        self._fuse(mods, "features", "classifier")

    def forward(self, x: Tensor, per_model: bool = False) -> Tensor:
        x = self.features(grouped_input(x, self.B, per_model))
        x = torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1)
        return self.classifier(to_models(x, self.B))


class HftaDCGANGenerator(_Model):
    """B DCGAN generators: noise ``[N, nz, 1, 1]`` -> images ``[B, N, 3, 64, 64]``."""

    def __init__(self, mods: Sequence[DCGANGenerator]):
        super().__init__(mods, DCGANGenerator)
        self._fuse(mods, "main")

    def forward(self, z: Tensor, per_model: bool = False) -> Tensor:
        return to_models(self.main(grouped_input(z, self.B, per_model)), self.B)


class HftaDCGANDiscriminator(_Model):
    """B DCGAN discriminators: images ``[N, 3, 64, 64]`` (or ``[B, N, 3, 64, 64]``)
    -> probabilities ``[B, N]``."""

    def __init__(self, mods: Sequence[DCGANDiscriminator]):
        super().__init__(mods, DCGANDiscriminator)
        self._fuse(mods, "main")

    def forward(self, x: Tensor, per_model: bool = False) -> Tensor:
        y = self.main(grouped_input(x, self.B, per_model))          # [N, B, 1, 1]
        return y.view(y.size(0), self.B).t()


def transform_points(x: Tensor, trans: Tensor) -> Tensor:
    """Each model's points times its own ``k x k`` transforms (PointNet's
    ``bmm(x^T, trans)^T``): x ``[N, B*k, P]``, trans ``[B, N, k, k]`` -> ``[N, B*k, P]``."""
    N, _, P = x.shape
    B, _, k, _ = trans.shape
    return torch.matmul(trans.permute(1, 0, 3, 2), x.view(N, B, k, P)).reshape(N, B * k, P)


class _HftaSTN(nn.Module):
    """B PointNet spatial transformers: ``[N, B*k, P]`` -> transforms ``[B, N, k, k]``."""

    def __init__(self, mods: Sequence[STNkd]):
        super().__init__()
        _same(mods, "k", "width")
        self.B, self.k, self.width = len(mods), mods[0].k, mods[0].width
        for n in ("conv1", "conv2", "conv3", "fc1", "fc2", "fc3", "bn1", "bn2", "bn3", "bn4", "bn5"):
            setattr(self, n, fuse_modules(_children(mods, n)))

    def forward(self, x: Tensor) -> Tensor:
        N = x.size(0)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.conv3(x)))
        x = to_models(torch.max(x, 2)[0], self.B)                  # [B, N, 16w]
        x = F.relu(batch_norm_features(self.bn4, self.fc1(x)))
        x = F.relu(batch_norm_features(self.bn5, self.fc2(x)))
        iden = torch.eye(self.k, device=x.device, dtype=x.dtype).flatten()
        return (self.fc3(x) + iden).view(self.B, N, self.k, self.k)


class HftaPointNet(_Model):
    """B PointNet classifiers: points ``[N, 3, P]`` -> log-probabilities ``[B, N, k]``."""

    def __init__(self, mods: Sequence[PointNetCls]):
        super().__init__(mods, PointNetCls)
        _same(mods, "feature_transform", "width")
        self.feature_transform, self.width = mods[0].feature_transform, mods[0].width
        self.stn = _HftaSTN(_children(mods, "stn"))
        if self.feature_transform:
            self.fstn = _HftaSTN(_children(mods, "fstn"))
        self._fuse(mods, "conv1", "conv2", "conv3", "bn1", "bn2", "bn3", "fc1", "fc2", "fc3", "dropout", "bn4", "bn5")

    def forward(self, x: Tensor, per_model: bool = False) -> Tensor:
        x = grouped_input(x, self.B, per_model)                    # [N, B*3, P]
        x = transform_points(x, self.stn(x))
        x = F.relu(self.bn1(self.conv1(x)))
        if self.feature_transform:
            x = transform_points(x, self.fstn(x))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.bn3(self.conv3(x))
        x = to_models(torch.max(x, 2)[0], self.B)                  # [B, N, 16w]
        x = F.relu(batch_norm_features(self.bn4, self.fc1(x)))
        x = F.relu(batch_norm_features(self.bn5, self.dropout(self.fc2(x))))
        return F.log_softmax(self.fc3(x), dim=-1)


class HftaTransformerLM(_Model):
    """B causal transformer LMs: tokens ``[N, S]`` -> logits ``[B, N, S, vocab]``."""

    def __init__(self, mods: Sequence[TransformerLM]):
        super().__init__(mods, TransformerLM)
        self.tok = Embedding(_children(mods, "tok"))
        self.pos = Embedding(_children(mods, "pos"))
        self.encoder = _Encoder(_children(mods, "encoder"))
        self.norm = LayerNorm(_children(mods, "norm"))
        self.head = Linear(_children(mods, "head"))

    def forward(self, idx: Tensor, per_model: bool = False) -> Tensor:
        if per_model:
            raise NotImplementedError("hfta: per-model token inputs")
        pos = torch.arange(idx.size(1), device=idx.device)
        h = self.tok(idx) + self.pos(pos).unsqueeze(1)              # [B, N, S, D]
        return self.head(self.norm(self.encoder(h, is_causal=True)))


class HftaBertSmall(_Model):
    """B BERT-small masked LMs: ids, token types and attention mask ``[N, S]`` ->
    logits ``[B, N, S, vocab]`` (the decoder tied to each model's word embedding)."""

    def __init__(self, mods: Sequence[BertSmall]):
        super().__init__(mods, BertSmall)
        for m in mods:
            if m.decoder.weight is not m.word.weight:
                raise NotImplementedError("hfta: BertSmall with an untied decoder")
        self.word = Embedding(_children(mods, "word"))
        self.position = Embedding(_children(mods, "position"))
        self.token_type = Embedding(_children(mods, "token_type"))
        self.emb_norm = LayerNorm(_children(mods, "emb_norm"))
        self.emb_dropout = copy.deepcopy(mods[0].emb_dropout)
        self.encoder = _Encoder(_children(mods, "encoder"))
        self.mlm_dense = Linear(_children(mods, "mlm_dense"))
        self.mlm_norm = LayerNorm(_children(mods, "mlm_norm"))
        self.decoder = TiedLinear(_children(mods, "decoder"))

    def forward(self, ids: Tensor, types: Tensor, attention: Tensor, per_model: bool = False) -> Tensor:
        if per_model:
            raise NotImplementedError("hfta: per-model token inputs")
        N, S = ids.shape
        pos = torch.arange(S, device=ids.device)
        h = self.word(ids) + self.position(pos).unsqueeze(1) + self.token_type(types)
        h = self.emb_dropout(self.emb_norm(h))
        # torch turns the key padding mask into an additive one; shared by the models and heads
        mask = torch.zeros(N, 1, 1, S, device=ids.device, dtype=h.dtype).masked_fill_(
            (attention == 0).view(N, 1, 1, S), float("-inf"))
        h = self.encoder(h, attn_mask=mask)
        h = self.mlm_norm(F.gelu(self.mlm_dense(h)))
        return self.decoder(h, self.word.weight)


BUILDERS: dict[str, Mapping[str, Callable[[Sequence[nn.Module]], nn.Module]]] = {
    "resnet18": {"net": HftaResNet18},
    "mobilenet_v2": {"net": HftaMobileNetV2},
    "pointnet": {"net": HftaPointNet},
    "dcgan": {"G": HftaDCGANGenerator, "D": HftaDCGANDiscriminator},
    "transformer_lm": {"net": HftaTransformerLM},
    "bert_small": {"net": HftaBertSmall},
}


def supports(workload: str) -> bool:
    """Whether :func:`fuse` has a fused form of the workload's networks."""
    return workload in BUILDERS


def fuse(workload: str, net: str, models: Sequence[nn.Module]) -> nn.Module:
    """The HFTA-style fused network ``net`` of ``workload`` from its B torch models
    (copies their parameters and buffers; the models are left as they were)."""
    if workload not in BUILDERS:
        raise NotImplementedError(f"hfta: not implemented for workload {workload!r}; "
                                  f"implemented for {sorted(BUILDERS)}")
    if net not in BUILDERS[workload]:
        raise ValueError(f"hfta: {workload} has no network {net!r}; expected one of {tuple(BUILDERS[workload])}")
    return BUILDERS[workload][net](list(models))


def per_model(fused: nn.Module, named: Iterable[tuple[str, Tensor]]) -> list[dict[str, Tensor]]:
    """Fused tensors by name (parameters, their gradients, buffers) as each model's:
    entry b maps the torch model's names to model b's tensor, in its shape, as a
    view of the fused tensor (so writing into it writes the fused one)."""
    B = fused.B
    out: list[dict[str, Tensor]] = [{} for _ in range(B)]
    for name, t in named:
        owner, _, leaf = name.rpartition(".")
        per = fused.get_submodule(owner).unstack(leaf, t)
        for b in range(B):
            out[b][name] = per[b]
    return out


# ---- the optimizer ------------------------------------------------------------------------------
class _HftaOptimizer(torch.optim.Optimizer):
    """torch's multi-tensor update over fused parameters (every one ``[B*C, ...]``
    or ``[B, ...]``, model-major, read as ``[B, -1]``) with one learning rate per
    model, a ``[B, 1]`` column; every other hyper-parameter is shared."""

    def __init__(self, params, B: int, lr, defaults: dict):
        lrs = [float(v) for v in lr] if isinstance(lr, (list, tuple)) else [float(lr)] * B
        if len(lrs) != B:
            raise ValueError(f"hfta: expected {B} learning rates, got {len(lrs)}")
        super().__init__(params, dict(lr=lrs, **defaults))
        self.B = B
        self._lr_cols: dict[int, Tensor] = {}
        kinds = {(p.device, p.dtype) for g in self.param_groups for p in g["params"]}
        if len(kinds) > 1:
            raise ValueError(f"hfta: expected parameters of one device and dtype, got {sorted(map(str, kinds))}")

    def _lr_column(self, group, p: Tensor) -> Tensor:
        """The group's learning rates as a ``[B, 1]`` tensor, made once (a step copies nothing to the device)."""
        key = id(group)
        if key not in self._lr_cols:
            self._lr_cols[key] = torch.tensor(group["lr"], dtype=p.dtype, device=p.device).view(self.B, 1)
        return self._lr_cols[key]

    def _views(self, group):
        """Parameters with gradients and their gradients, as ``[B, -1]`` views."""
        ps = [p for p in group["params"] if p.grad is not None]
        return ps, [p.view(self.B, -1) for p in ps], [p.grad.view(self.B, -1) for p in ps]


class HftaSGD(_HftaOptimizer):
    """``torch.optim.SGD(foreach=True)`` of each model, its lr a ``[B, 1]`` column."""

    def __init__(self, params, B: int, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        super().__init__(params, B, lr, dict(momentum=momentum, dampening=dampening,
                                             weight_decay=weight_decay, nesterov=nesterov))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            ps, params, grads = self._views(group)
            if not ps:
                continue
            wd, momentum, dampening = group["weight_decay"], group["momentum"], group["dampening"]
            if wd != 0:
                grads = torch._foreach_add(grads, params, alpha=wd)
            if momentum != 0:
                if all("momentum_buffer" in self.state[p] for p in ps):
                    bufs = [self.state[p]["momentum_buffer"] for p in ps]
                    torch._foreach_mul_(bufs, momentum)
                    torch._foreach_add_(bufs, grads, alpha=1 - dampening)
                else:                                   # torch starts a buffer from the first gradient
                    bufs = []
                    for p, g in zip(ps, grads):
                        buf = self.state[p].get("momentum_buffer")
                        if buf is None:
                            buf = self.state[p]["momentum_buffer"] = g.detach().clone()
                        else:
                            buf.mul_(momentum).add_(g, alpha=1 - dampening)
                        bufs.append(buf)
                if group["nesterov"]:
                    grads = torch._foreach_add(grads, bufs, alpha=momentum)
                else:
                    grads = bufs
            neg_lr = -self._lr_column(group, ps[0])
            torch._foreach_addcmul_(params, grads, [neg_lr] * len(params))


class HftaAdam(_HftaOptimizer):
    """``torch.optim.Adam(foreach=True)`` (``AdamW`` with ``decoupled``) of each
    model, its lr a ``[B, 1]`` column; the step size ``-lr / (1 - beta1^t)`` divides
    the denominator, as torch's capturable path does with its tensor step sizes."""

    decoupled = False

    def __init__(self, params, B: int, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, B, lr, dict(betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            ps, params, grads = self._views(group)
            if not ps:
                continue
            beta1, beta2 = group["betas"]
            wd, lr = group["weight_decay"], self._lr_column(group, ps[0])
            for p in ps:
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p).view(self.B, -1)
                    st["exp_avg_sq"] = torch.zeros_like(p).view(self.B, -1)
                st["step"] += 1
            if wd != 0:
                if self.decoupled:
                    torch._foreach_mul_(params, [1 - lr * wd] * len(params))
                else:
                    grads = torch._foreach_add(grads, params, alpha=wd)
            exp_avgs = [self.state[p]["exp_avg"] for p in ps]
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in ps]
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            # Parameters stepped equally often (all of them, unless one went
            # without a gradient) share their bias corrections.
            by_step: dict[int, list[int]] = {}
            for i, p in enumerate(ps):
                by_step.setdefault(self.state[p]["step"], []).append(i)
            for t, idx in by_step.items():
                bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
                denom = torch._foreach_sqrt([exp_avg_sqs[i] for i in idx])
                torch._foreach_div_(denom, math.sqrt(bc2))
                torch._foreach_add_(denom, group["eps"])
                torch._foreach_div_(denom, [lr * (-1 / bc1)] * len(idx))
                torch._foreach_addcdiv_([params[i] for i in idx], [exp_avgs[i] for i in idx], denom)


class HftaAdamW(HftaAdam):
    """``torch.optim.AdamW(foreach=True)`` of each model, its lr a ``[B, 1]`` column."""

    decoupled = True

    def __init__(self, params, B: int, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, B, lr, betas, eps, weight_decay)


_OPTIMIZERS = {"sgd": HftaSGD, "adam": HftaAdam, "adamw": HftaAdamW}


def optimizer(name: str, params, B: int, lr, **kwargs) -> torch.optim.Optimizer:
    """The HFTA-style optimizer ``name`` (``sgd``, ``adam``, ``adamw``, a workload's
    ``optimizer[0]``) over fused parameters; ``lr`` a float or B floats."""
    if name not in _OPTIMIZERS:
        raise ValueError(f"hfta: unknown optimizer {name!r}; expected one of {tuple(_OPTIMIZERS)}")
    return _OPTIMIZERS[name](params, B, lr, **kwargs)
