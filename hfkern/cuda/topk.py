"""hfkern::topk_select on the CUDA kernels (csrc/topk/topk_select.cu).

The op's contract is in :mod:`hfkern.ops.topk`; the threshold search is
:mod:`hfkern._topk`'s, shared by every backend (torch ops on the device), and
the kernels do its two passes over the data: the counting pass (partial counts
per thread block, summed here) and the stable compaction (block counts,
exclusive scans here, an ordered write). Counts are exact integers, so the
selection equals the torch path's bit for bit; exact mode is the same search
with ``cap = k``. Every float dtype is served (the kernels copy bit patterns).

``emulated("topk_select")`` runs the same launcher on CPU tensors through
``hfkern._C_emu``, the kernels built for the host grid emulator.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .. import _topk
from .._device import sm_count
from . import _ext
from ._launch import Launcher, implements

__all__ = ["topk_select", "emulated"]

_THREADS = 256
_BLOCKS_PER_SM = 4  # blocks per row aimed at, over the rows: a few waves when rows are few
# Under the emulator every block is a group of host threads: small blocks and
# short spans, so that test rows span several blocks of several tiles.
_EMULATED_THREADS = 64
_EMULATED_BLOCKS = 3


def _tiling(R: int, n: int, threads: int, device: torch.device, emulate: bool) -> tuple[int, int]:
    """(P, tiles): blocks per row and tiles of ``threads`` entries per block."""
    tiles_total = -(-n // threads)
    blocks = _EMULATED_BLOCKS if emulate else max(1, _BLOCKS_PER_SM * sm_count(device) // max(R, 1))
    tiles = -(-tiles_total // max(1, min(blocks, tiles_total)))
    return -(-tiles_total // tiles), tiles


class _Launcher(Launcher):
    """The top-k kernels on one device kind (:class:`hfkern.cuda._launch.Launcher`)."""

    def __init__(self, emulate: bool):
        super().__init__(emulate)
        self.threads = _EMULATED_THREADS if emulate else _THREADS

    def require(self, ext) -> None:
        if int(ext.TOPK_CANDIDATES) != _topk.NUM_CANDIDATES:
            raise RuntimeError(
                f"{ext.__name__} counts {ext.TOPK_CANDIDATES} candidates per pass, but hfkern._topk "
                f"uses {_topk.NUM_CANDIDATES}; rebuild it"
            )

    def count_ge(self, bits: Tensor, spec: _topk.KeySpec, candidates: Tensor) -> Tensor:
        R, n = bits.shape
        ext = self.ext(bits.device)
        cand = candidates.clamp(max=spec.nan_key + 1).contiguous()  # int64, as the kernel reads them
        P, tiles = _tiling(R, n, self.threads, bits.device, self.emulate)
        partial = torch.empty(R, P, _topk.NUM_CANDIDATES, dtype=torch.int32, device=bits.device)
        ext.topk_count(bits.data_ptr(), bits.element_size(), R, n, cand.data_ptr(), partial.data_ptr(), P, tiles,
                       spec.mag_mask, spec.nan_key, self.threads, _ext.stream(bits.device))
        return partial.sum(1, dtype=torch.int64)

    def compact(self, bits: Tensor, dtype: torch.dtype, spec: _topk.KeySpec, threshold: Tensor, quota: Tensor,
                cap: int) -> tuple[Tensor, Tensor]:
        R, n = bits.shape
        device = bits.device
        ext = self.ext(device)
        stream = _ext.stream(device)
        threshold, quota = threshold.contiguous(), quota.contiguous()
        P, tiles = _tiling(R, n, self.threads, device, self.emulate)
        gt = torch.empty(R, P, dtype=torch.int32, device=device)
        eq = torch.empty(R, P, dtype=torch.int32, device=device)
        ext.topk_block_counts(bits.data_ptr(), bits.element_size(), R, n, threshold.data_ptr(), gt.data_ptr(),
                              eq.data_ptr(), P, tiles, spec.mag_mask, spec.nan_key, self.threads, stream)
        tie_offset, out_offset = _topk.compaction_offsets(gt, eq, quota)
        values = torch.zeros(R, cap, dtype=bits.dtype, device=device)
        indices = torch.zeros(R, cap, dtype=torch.int32, device=device)
        ext.topk_write(bits.data_ptr(), bits.element_size(), R, n, threshold.data_ptr(), quota.data_ptr(),
                       tie_offset.data_ptr(), out_offset.data_ptr(), values.data_ptr(), indices.data_ptr(), cap,
                       P, tiles, spec.mag_mask, spec.nan_key, self.threads, stream)
        return values.view(dtype), indices

    def __call__(self, x: Tensor, k: int, exact: bool, seed: int) -> tuple[Tensor, Tensor, Tensor]:
        self.check_device("topk_select", "x", x)
        return _topk.select(x, k, exact, seed, self.count_ge, self.compact)


_device_launcher = _Launcher(emulate=False)


# auto never picks it until a committed GPU benchmark shows it faster than the
# torch path on the device (the selection is identical either way);
# set_backend("cuda") selects it.
@implements("topk_select", dtypes=None)
def topk_select(x: Tensor, k: int, exact: bool, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """hfkern::topk_select on CUDA tensors with the kernels of hfkern._C."""
    return _device_launcher(x, k, exact, seed)


def emulated(op: str = "topk_select") -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """The cuda launcher of ``op`` on CPU tensors, running the same kernel sources in
    the host grid emulator (hfkern._C_emu)."""
    if op != "topk_select":
        raise ValueError(f"hfkern.cuda.topk implements ['topk_select'], got {op!r}")
    return _Launcher(emulate=True)
