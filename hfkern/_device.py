"""Device properties every kernel launcher shares, queried once per device."""

from __future__ import annotations

import functools

import torch

__all__ = ["sm_count"]

# What launchers size their grids for when no GPU answers (Triton's interpreter,
# the offline compile check): an H100's SM count.
DEFAULT_SM_COUNT = 132


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The number of streaming multiprocessors of ``device`` (a CUDA device), or
    :data:`DEFAULT_SM_COUNT` for any other device."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
