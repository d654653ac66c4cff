"""Inputs and the contract check of hfkern::topk_select, shared by every backend's tests.

The check does not use hfkern's keys or search: its oracle is a stable
descending sort of ``|x|`` in float64 (torch sorts NaN above +inf and keeps
equal entries in index order). Every selection the contract allows, exact or
approximate, is a prefix of that order: the entries above the threshold, then
the entries tied at it, lowest index first. So a result is correct exactly when
its indices are the first ``count`` entries of the order, in ascending order.
"""

from __future__ import annotations

import torch

from hfkern import topk_capacity

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def oracle_order(row: torch.Tensor) -> torch.Tensor:
    """Positions of ``row`` (1-d) by decreasing magnitude, NaN first, ties by index."""
    return torch.sort(row.double().abs(), descending=True, stable=True).indices


def check_row(row: torch.Tensor, k: int, exact: bool, values, indices, count) -> None:
    n = row.numel()
    cap = topk_capacity(k, exact)
    assert values.shape == (cap,) and indices.shape == (cap,), (values.shape, indices.shape, cap)
    assert values.dtype == row.dtype and indices.dtype == torch.int32 and count.dtype == torch.int64
    c = int(count)
    if exact:
        assert c == k, f"exact: count {c} != k {k}"
    assert k <= c <= min(cap, n), f"count {c} outside [{k}, {min(cap, n)}] (n={n}, k={k})"
    idx = indices[:c].long()
    assert bool((idx[1:] > idx[:-1]).all()), "indices are not strictly ascending"
    expected = oracle_order(row)[:c].sort().values
    torch.testing.assert_close(idx, expected, rtol=0, atol=0)
    # the values are x's, bit for bit (NaN payloads, -0.0)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[row.element_size()]
    assert torch.equal(values[:c].view(bits), row[idx].view(bits))
    assert bool((values[c:] == 0).all()) and bool((indices[c:] == 0).all()), "padding is not zero"


def check_selection(x: torch.Tensor, k: int, exact: bool, result) -> None:
    """Assert that ``result`` (values, indices, count) is a valid selection of ``x``."""
    values, indices, count = result
    if x.dim() == 1:
        assert count.shape == ()
        check_row(x, k, exact, values, indices, count)
        return
    assert count.shape == (x.shape[0],)
    for r in range(x.shape[0]):
        check_row(x[r], k, exact, values[r], indices[r], count[r])


def special_input(kind: str, shape, dtype=torch.float32, generator=None) -> torch.Tensor:
    """Inputs that stress the search: ties, NaN, inf, heavy tails, mostly zeros."""
    n = shape[-1]
    g = generator
    if kind == "random":
        return torch.randn(shape, generator=g).to(dtype)
    if kind == "constant":
        return torch.full(shape, -0.75, dtype=dtype)
    if kind == "zeros":
        x = torch.zeros(shape, dtype=dtype)
        x.view(-1)[::3] = -0.0  # -0.0 and +0.0 are the same magnitude
        return x
    if kind == "nan":
        x = torch.randn(shape, generator=g).to(dtype)
        x[..., torch.randperm(n, generator=g)[: max(1, n // 50)]] = float("nan")
        return x
    if kind == "inf":
        x = torch.randn(shape, generator=g).to(dtype)
        pick = torch.randperm(n, generator=g)[: max(2, n // 40)]
        x[..., pick[::2]] = float("inf")
        x[..., pick[1::2]] = -float("inf")
        return x
    if kind == "cauchy":
        return torch.empty(shape).cauchy_(generator=g).to(dtype)
    if kind == "sparse":  # 0.5% nonzeros: fewer than k for most k, so zeros are selected too
        x = torch.zeros(shape)
        nz = torch.randperm(n, generator=g)[: max(1, n // 200)]
        x[..., nz] = torch.randn(x[..., nz].shape, generator=g)
        return x.to(dtype)
    if kind == "few_levels":  # many ties at every level, as quantized gradients have
        return torch.randint(-3, 4, shape, generator=g).to(dtype) * 0.5
    raise ValueError(kind)


SPECIAL_KINDS = ("random", "constant", "zeros", "nan", "inf", "cauchy", "sparse", "few_levels")
