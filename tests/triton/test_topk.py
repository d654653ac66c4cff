"""Triton top-k selection (counting pass, stable compaction) against the torch path.

The backends run one shared threshold search with exact integer counts, so
the Triton selection must equal the torch path's bit for bit, approximate mode
included; every result is also checked against the contract's oracle
(tests/_topk_cases.py). Interpreter tests call the launcher on CPU tensors
(TRITON_INTERPRET=1) with rows that span several programs of several tiles;
GPU tests go through the op with the triton backend selected.
"""

import pytest
import torch

import hfkern
from hfkern import _backend, _topk
from hfkern.ops import topk as topk_ops

from _topk_cases import FLOAT_DTYPES, SPECIAL_KINDS, check_selection, special_input

triton = pytest.importorskip("triton")
from hfkern.triton import topk as tk  # noqa: E402

ref = _backend._registry["topk_select"]["torch"].load()


def assert_same(a, b):
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape
        if u.is_floating_point():
            u, v = u.view(torch.uint8), v.view(torch.uint8)  # bit for bit, NaN payloads included
        assert torch.equal(u, v)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("shape,k", [((1,), 1), ((2, 3001), 30), ((3, 1025), 1025)])
def test_interpreted_matches_torch(dtype, exact, shape, k):
    x = torch.randn(shape).to(dtype)
    out = tk.topk_select(x, k, exact, 7)
    check_selection(x, k, exact, out)
    assert_same(out, ref(x, k, exact, 7))


@pytest.mark.interpreter
@pytest.mark.parametrize("exact", [False, True])
def test_interpreted_sampled_rows_match_torch(exact):
    # rows longer than the sample: the first pass's candidates come from a seeded sample
    x = torch.randn(1, _topk.SAMPLE_SIZE + 3001)
    out = tk.topk_select(x, 190, exact, 7)
    check_selection(x, 190, exact, out)
    assert_same(out, ref(x, 190, exact, 7))


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", SPECIAL_KINDS)
@pytest.mark.parametrize("exact", [False, True])
def test_interpreted_special_inputs(kind, exact):
    x = special_input(kind, (2, 2051))
    out = tk.topk_select(x, 60, exact, 0)
    check_selection(x, 60, exact, out)
    assert_same(out, ref(x, 60, exact, 0))


@pytest.mark.interpreter
def test_interpreted_non_contiguous_and_ties_past_capacity():
    base = torch.randn(4, 6002, dtype=torch.float64)
    x = base[::2, ::3]
    assert_same(tk.topk_select(x, 33, False, 2), ref(x.contiguous(), 33, False, 2))
    y = torch.full((2500,), 0.25, dtype=torch.float16)  # ties far beyond cap: the first cap kept
    y[torch.randperm(2500)[:40]] = -3.0
    out = tk.topk_select(y, 100, False, 0)
    assert int(out[2]) == hfkern.topk_capacity(100)
    check_selection(y, 100, False, out)


@pytest.mark.interpreter
def test_interpreted_count_pass_matches_direct_count():
    spec = _topk.key_spec(torch.bfloat16)
    x = special_input("few_levels", (3, 3001), torch.bfloat16)
    x[0, :10] = float("nan")
    bits = _topk.row_bits(x, spec)
    keys = _topk.keys_of(bits, spec).long()
    cand = torch.cat([keys[:, :30], torch.full((3, 2), spec.nan_key + 1)], 1)
    got = tk.count_ge(bits, spec, cand)
    torch.testing.assert_close(got, (keys.unsqueeze(1) >= cand.unsqueeze(2)).sum(2), rtol=0, atol=0)
    torch.testing.assert_close(got, topk_ops.count_ge_torch(bits, spec, cand), rtol=0, atol=0)


@pytest.mark.interpreter
def test_launcher_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        tk.topk_select(torch.randn(10), 2, False, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("kind", SPECIAL_KINDS)
def test_gpu_matches_torch(dtype, exact, kind):
    x = special_input(kind, (3, 300007), dtype).cuda()
    with hfkern.use_backend("triton"):
        out = hfkern.topk_select(x, 3000, exact=exact, seed=5)
    with hfkern.use_backend("torch"):
        expected = hfkern.topk_select(x, 3000, exact=exact, seed=5)
    assert_same(out, expected)
    check_selection(x.cpu(), 3000, exact, [t.cpu() for t in out])
