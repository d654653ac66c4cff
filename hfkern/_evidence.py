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

from dataclasses import dataclass

__all__ = ["Evidence", "EVIDENCE", "for_op"]


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
