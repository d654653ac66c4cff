"""Each trial's order of training batches: a function of its own epoch, not of its array.

Every trial of a sweep sees the training set in the same order: epoch ``e``
is the permutation ``torch.randperm(n)`` drawn from a generator seeded with
``(seed, e)``, cut into ``n // batch_size`` batches (the last partial batch is
dropped, as ``DataLoader(drop_last=True)`` does). A trial's batches therefore
depend only on how many steps *it* has trained, so a trial that enters an
array mid-sweep (a refilled slot) trains on exactly the batches it would see
alone, and its trajectory equals that of the trial trained alone. Slots at the
same step share one batch (the array reads it once, as a broadcast input);
slots at different steps read their own rows of a ``[B, batch_size, ...]``
gather.
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["batch_indices", "BatchOrder"]


def _epoch_permutation(n: int, epoch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(epoch)) % (2**63))
    return torch.randperm(n, generator=g)


def batch_indices(n: int, batch_size: int, step: int, seed: int = 0) -> torch.Tensor:
    """The sample indices ``[batch_size]`` (int64, CPU) a trial trains on at its step ``step`` (0-based).

    ``n`` samples, ``n // batch_size`` steps per epoch; use it to train a model
    alone on the batches a sweep runner with the same ``data_seed`` gives it.
    """
    for label, value, least in (("n", n, 1), ("batch_size", batch_size, 1), ("step", step, 0), ("seed", seed, None)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"batch_indices: expected {label} as an int, got {type(value).__name__} {value!r}")
        if least is not None and value < least:
            raise ValueError(f"batch_indices: expected {label} >= {least}, got {value}")
    steps = n // batch_size
    if steps < 1:
        raise ValueError(f"batch_indices: expected batch_size <= n, got batch_size={batch_size} for n={n}")
    epoch, i = divmod(int(step), steps)
    return _epoch_permutation(n, epoch, seed)[i * batch_size:(i + 1) * batch_size]


class BatchOrder:
    """:func:`batch_indices` for many trials at once, with the epochs' permutations kept on ``device``."""

    def __init__(self, n: int, batch_size: int, seed: int, device: torch.device):
        self.n, self.batch_size, self.seed, self.device = n, batch_size, seed, device
        self.steps_per_epoch = n // batch_size
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = _epoch_permutation(self.n, epoch, self.seed).to(self.device)
            self._perms[epoch] = perm
        return perm

    def prepare(self, first_step: int, last_step: int) -> None:
        """Make the permutations of the epochs of steps ``first_step..last_step`` now (on the
        current stream), so that reading them later, on any stream, makes none."""
        for epoch in range(first_step // self.steps_per_epoch, last_step // self.steps_per_epoch + 1):
            self._perm(epoch)

    def forget_before(self, epoch: int) -> None:
        """Drop the permutations of epochs no trial will train again."""
        for e in [e for e in self._perms if e < epoch]:
            del self._perms[e]

    def rows(self, steps: list[int]) -> torch.Tensor:
        """``[len(steps), batch_size]`` indices: row b is the batch of a trial at step ``steps[b]``."""
        out = []
        for s in steps:
            epoch, i = divmod(s, self.steps_per_epoch)
            out.append(self._perm(epoch)[i * self.batch_size:(i + 1) * self.batch_size])
        return torch.stack(out)
