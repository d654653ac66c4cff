"""The committed evidence ``auto`` chooses GPU kernels by: whole training steps, not kernels.

A kernel benchmark measures a kernel under the conditions of its benchmark; a
user runs a training loop, whose conditions differ (gradients reallocated by
``zero_grad()`` every step, host time per launch, layouts other ops leave).
An auto-eligible implementation (``_backend.register(..., auto=True)``: it
keeps the torch path's numerics) is chosen by ``auto`` for an op only where a
record below names a committed result of ``bench/train_throughput.py`` showing
the *whole training step* faster with that backend serving the op than without
it, on a device of the class measured. Without a record, ``auto`` on CUDA
takes the torch path. ``hfkern.backend_info()`` shows the record behind each
choice.

A record is added with the result it cites, in the commit that adds that
result under ``bench/results/``; ``tests/test_backend.py`` checks that each
cited file exists.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["Evidence", "EVIDENCE", "for_op", "LayoutEvidence", "LAYOUT_EVIDENCE", "memory_format_record"]


@dataclass(frozen=True)
class Evidence:
    """One committed measurement that justifies ``auto`` choosing ``backend`` for ``op``."""

    op: str  # the hfkern op (``"adam_step_"``)
    backend: str  # "triton" or "cuda"
    device: str  # the device class: matched, case-insensitively, inside torch.cuda.get_device_name()
    result: str  # the committed result file, relative to the repository root (bench/results/...)
    summary: str  # what it showed: model, B, dtype, step time with and without the backend


# No GPU result of a whole training step has shown a non-torch backend faster yet.
EVIDENCE: tuple[Evidence, ...] = ()


def for_op(op: str, backend: str, device_name: str, records: tuple[Evidence, ...] | None = None) -> Evidence | None:
    """The record that lets ``auto`` choose ``backend`` for ``op`` on ``device_name``, or None."""
    name = device_name.lower()
    for record in EVIDENCE if records is None else records:
        if record.op == op and record.backend == backend and record.device.lower() in name:
            return record
    return None


# ---- the memory format of array images -----------------------------------------
#
# The same rule for layouts: an array conv module left at ``memory_format=None``
# (auto) converts its activations to channels-last memory only where a record
# below cites a committed whole-step result showing the step faster in that
# format on the device class, for the dtype the convs run in. Without one, auto
# keeps the memory its input has (the [N, B, C, H, W] of the array convs).


@dataclass(frozen=True)
class LayoutEvidence:
    """One committed measurement that justifies auto choosing ``memory_format`` for array convs."""

    memory_format: str  # "channels_last"
    device: str  # matched, case-insensitively, inside torch.cuda.get_device_name()
    dtypes: tuple[str, ...]  # the conv compute dtypes it was measured in ("bfloat16", "float32")
    result: str  # the committed result file (bench/results/...)
    summary: str  # model, B, dtype, step time in each format


LAYOUT_EVIDENCE: tuple[LayoutEvidence, ...] = ()


def memory_format_record(device_name: str, dtype: torch.dtype,
                         records: tuple[LayoutEvidence, ...] | None = None) -> LayoutEvidence | None:
    """The record that lets auto lay array images out as its ``memory_format`` on
    ``device_name`` for convs computing in ``dtype``, or None."""
    name, dtype_name = device_name.lower(), str(dtype).removeprefix("torch.")
    for record in LAYOUT_EVIDENCE if records is None else records:
        if record.device.lower() in name and dtype_name in record.dtypes:
            return record
    return None


@functools.lru_cache(maxsize=None)
def auto_memory_format(device: torch.device, dtype: torch.dtype) -> torch.memory_format | None:
    """The memory format auto converts array images to on ``device`` (None: keep the input's)."""
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        record = memory_format_record(torch.cuda.get_device_name(), dtype)
    return None if record is None else getattr(torch, record.memory_format)
