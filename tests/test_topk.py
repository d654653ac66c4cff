"""hfkern::topk_select on the torch path: the contract (tests/_topk_cases.py checks
every result against a stable sort of |x|), the threshold search, errors, opcheck."""

import pytest
import torch

import hfkern
from hfkern import _topk
from hfkern.ops import topk as topk_ops
from hfkern.ops.topk import TopK, topk_capacity, topk_select

from _topk_cases import FLOAT_DTYPES, SPECIAL_KINDS, check_selection, special_input


def test_exported_and_capacity():
    assert hfkern.topk_select is topk_select and hfkern.topk_capacity is topk_capacity
    assert [topk_capacity(k) for k in (1, 2, 3, 4, 5, 8, 100, 1001)] == [2, 3, 4, 5, 7, 10, 125, 1252]
    assert [topk_capacity(k, exact=True) for k in (1, 7, 1000)] == [1, 7, 1000]
    with pytest.raises(ValueError, match="k >= 1"):
        topk_capacity(0)
    with pytest.raises(TypeError, match="int"):
        topk_capacity(2.0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 1), (7, 7), (1000, 10), (1000, 999), (20011, 200), (70001, 701)])
def test_random_rows(dtype, exact, n, k):
    x = torch.randn(n).to(dtype)
    out = topk_select(x, k, exact=exact, seed=3)
    assert isinstance(out, TopK)
    check_selection(x, k, exact, out)


@pytest.mark.parametrize("kind", SPECIAL_KINDS)
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("n,k", [(1000, 1), (1000, 37), (40009, 400)])
def test_special_inputs(kind, exact, n, k):
    x = special_input(kind, (2, n))
    out = topk_select(x, k, exact=exact)
    check_selection(x, k, exact, out)
    if kind == "nan":  # fewer NaNs than k: every NaN is selected
        nan_at = torch.isnan(x[0]).nonzero().flatten()
        if nan_at.numel() <= k:
            assert set(nan_at.tolist()) <= set(out.indices[0, : int(out.count[0])].tolist())
    if kind == "constant" and not exact:  # every entry ties: the lowest-index cap entries
        cap = topk_capacity(k)
        assert out.count.tolist() == [cap, cap]
        assert out.indices[0].tolist() == list(range(cap))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_special_values_of_every_dtype(dtype):
    for kind in ("nan", "inf", "zeros", "few_levels"):
        x = special_input(kind, (3001,), dtype)
        for exact in (False, True):
            check_selection(x, 50, exact, topk_select(x, 50, exact=exact, seed=1))


def test_nan_ranks_above_inf_and_values_keep_their_bits():
    x = torch.tensor([1.0, float("inf"), -5.0, float("nan"), -float("inf"), 0.5, -0.0, 2.0])
    nan2 = torch.tensor(0x7FC00001, dtype=torch.int32).view(torch.float32)  # another NaN payload
    x[5] = nan2
    out = topk_select(x, 3, exact=True)
    assert out.indices.tolist() == [1, 3, 5]  # the two NaNs, then the first inf
    assert torch.equal(out.values.view(torch.int32), x[[1, 3, 5]].view(torch.int32))
    out = topk_select(x, 4, exact=True)
    assert out.indices.tolist() == [1, 3, 4, 5]


def test_exact_equals_torch_topk_set():
    x = torch.randn(5, 3001, dtype=torch.float64)  # no ties
    out = topk_select(x, 123, exact=True)
    ref = torch.topk(x.abs(), 123, dim=1).indices.sort(dim=1).values
    torch.testing.assert_close(out.indices.long(), ref, rtol=0, atol=0)
    torch.testing.assert_close(out.values, x.gather(1, ref), rtol=0, atol=0)
    assert out.count.tolist() == [123] * 5


def test_exact_ties_go_to_lower_indices():
    x = torch.tensor([3.0, -1.0, 1.0, 2.0, -1.0, 1.0, 0.0])
    assert topk_select(x, 3, exact=True).indices.tolist() == [0, 1, 3]
    assert topk_select(x, 5, exact=True).indices.tolist() == [0, 1, 2, 3, 4]


def test_approximate_count_is_a_threshold_count_and_fits_capacity():
    x = torch.randn(4, 100003)
    for k in (1, 10, 1000, 10000, 100003):
        out = topk_select(x, k)
        cap = topk_capacity(k)
        assert bool(((out.count >= k) & (out.count <= cap)).all())
        check_selection(x[:1], k, False, (out.values[:1], out.indices[:1], out.count[:1]))


def test_deterministic_for_a_seed():
    x = torch.randn(3, 50000)
    a, b = topk_select(x, 500, seed=11), topk_select(x.clone(), 500, seed=11)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    c = topk_select(x, 500, seed=12)  # another sample, still a valid selection
    check_selection(x, 500, False, c)


@pytest.mark.parametrize("seed", [0, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)])
def test_seeds_in_torchs_whole_range(seed):
    # torch.Generator takes [-2**63, 2**64); the op's int64 schema alone would refuse 2**63 and up.
    x = torch.randn(2, 40000)
    out = topk_select(x, 300, seed=seed)
    check_selection(x, 300, False, out)
    drawn = torch.randint(0, 40000, (2, _topk.SAMPLE_SIZE), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(_topk.sample_positions(2, 40000, _topk.op_seed(seed)), drawn)
    # Seeds torch counts as one (equal modulo 2**64) select the same entries.
    twin = seed % 2**64
    for u, v in zip(out, topk_select(x, 300, seed=twin)):
        assert torch.equal(u, v)


def test_rows_are_independent():
    x = torch.randn(3, 30011)
    y = x.clone()
    y[1] = torch.empty(30011).cauchy_() * 1e6
    y[2] = 0
    for exact in (False, True):
        a, b = topk_select(x, 300, exact=exact), topk_select(y, 300, exact=exact)
        for u, v in zip(a, b):
            assert torch.equal(u[0], v[0])
        check_selection(y, 300, exact, b)
        if exact:  # exact rows equal the one-row calls
            for r in range(3):
                single = topk_select(y[r], 300, exact=True)
                assert torch.equal(single.indices, b.indices[r]) and torch.equal(single.values, b.values[r])


@pytest.mark.parametrize("exact", [False, True])
def test_non_contiguous_inputs(exact):
    base = torch.randn(6, 8002)
    for x in (base[::2, ::2], base.t().contiguous().t()[:, 1:], base[1]):
        assert not x.is_contiguous() or x.dim() == 1
        out = topk_select(x, 40, exact=exact, seed=5)
        ref = topk_select(x.contiguous(), 40, exact=exact, seed=5)
        for u, v in zip(out, ref):
            assert torch.equal(u, v)
        check_selection(x, 40, exact, out)
    strided = base.view(-1)[::3]
    check_selection(strided, 100, exact, topk_select(strided, 100, exact=exact))


def test_one_row_and_shapes():
    x = torch.randn(1, 999)
    out = topk_select(x, 9)
    assert out.values.shape == (1, topk_capacity(9)) and out.count.shape == (1,)
    flat = topk_select(x[0], 9)
    assert flat.values.shape == (topk_capacity(9),) and flat.count.shape == ()
    for u, v in zip(out, flat):
        assert torch.equal(u[0], v)
    empty = topk_select(torch.randn(0, 10), 3)
    assert empty.values.shape == (0, 4) and empty.count.shape == (0,)


def test_sampled_search_needs_few_passes():
    # Count the counting passes: the seeded sample lands on a valid threshold at
    # once for Gaussian data; a tiny density on heavy-tailed data needs a few more.
    calls = []

    def counting(bits, spec, cand):
        calls.append(1)
        return topk_ops.count_ge_torch(bits, spec, cand)

    spec = _topk.key_spec(torch.float32)
    for x, k, most in ((torch.randn(1, 200000), 2000, 1), (torch.empty(1, 200000).cauchy_(), 20, 8)):
        calls.clear()
        bits = x.view(torch.int32)
        threshold, quota, count = _topk.find_threshold(bits, spec, k, topk_capacity(k), 0, counting)
        assert 1 <= len(calls) <= most, len(calls)
        assert k <= int(count) <= topk_capacity(k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_search_worst_case_bracket_closes(dtype):
    # Two distinct magnitudes, the larger ones fewer than k and the ties far more
    # than cap: the bracket must close to [K, K + 1] and keep the first ties.
    n, k = 50000, 1000
    x = torch.full((n,), 1e-3, dtype=dtype)
    x[torch.randperm(n)[:900]] = 7.0
    out = topk_select(x, k)
    assert int(out.count) == topk_capacity(k)
    check_selection(x, k, False, out)


def test_count_ge_matches_direct_count():
    spec = _topk.key_spec(torch.float32)
    x = special_input("few_levels", (3, 1001))
    bits = x.view(torch.int32)
    keys = _topk.keys_of(bits, spec).long()
    cand = torch.cat([keys[:, :20], torch.full((3, 1), spec.nan_key + 1), torch.zeros(3, 11, dtype=torch.int64)], 1)
    got = topk_ops.count_ge_torch(bits, spec, cand)
    ref = (keys.unsqueeze(1) >= cand.unsqueeze(2)).sum(2)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_bad_inputs():
    x = torch.randn(10)
    with pytest.raises(TypeError, match="dtype float32, float64, bfloat16 or float16, got torch.int64"):
        topk_select(torch.arange(10), 2)
    with pytest.raises(TypeError, match="got torch.complex64"):
        topk_select(torch.randn(10, dtype=torch.complex64), 2)
    with pytest.raises(ValueError, match=r"shape \[n\] or \[R, n\], got shape \(2, 3, 4\)"):
        topk_select(torch.randn(2, 3, 4), 2)
    with pytest.raises(ValueError, match=r"got shape \(\)"):
        topk_select(torch.tensor(1.0), 1)
    with pytest.raises(ValueError, match="1 <= k <= n = 10.*got k = 0"):
        topk_select(x, 0)
    with pytest.raises(ValueError, match="got k = 11"):
        topk_select(x, 11)
    with pytest.raises(TypeError, match="k to be an int, got float"):
        topk_select(x, 2.0)
    with pytest.raises(TypeError, match="k to be an int, got bool"):
        topk_select(x, True)
    with pytest.raises(TypeError, match="exact to be a bool"):
        topk_select(x, 2, exact=1)
    with pytest.raises(TypeError, match="seed to be an int"):
        topk_select(x, 2, seed=0.5)
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match=rf"seed in \[-2\*\*63, 2\*\*64\).*got {seed}"):
            topk_select(x, 2, seed=seed)
    with pytest.raises(ValueError, match="got k = 11"):  # the op checks too
        torch.ops.hfkern.topk_select(x, 11, False, 0)


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("shape", [(257,), (3, 129)])
def test_opcheck(exact, shape):
    torch.library.opcheck(torch.ops.hfkern.topk_select.default, (torch.randn(shape), 7, exact, 0))


def test_compiled_call_matches_eager():
    x = torch.randn(2, 4001)
    fn = torch.compile(lambda t: torch.ops.hfkern.topk_select(t, 40, False, 0), fullgraph=True, backend="eager")
    for u, v in zip(fn(x), topk_select(x, 40)):
        assert torch.equal(u, v)
