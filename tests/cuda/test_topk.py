"""The CUDA top-k kernels (csrc/topk/topk_select.cu) against the torch path.

The backends share the threshold search and count exactly, so the CUDA
selection must equal the torch path's bit for bit, approximate mode included,
and pass the contract's oracle (tests/_topk_cases.py). Emulator tests run the
kernel sources built as host C++ (hfkern._C_emu) on CPU tensors through the
same launcher as on a GPU, with blocks of 64 threads so that a row spans
several blocks of several tiles and every tile runs the block scans; GPU tests
go through the op with the cuda backend selected.
"""

from __future__ import annotations

import pytest
import torch

import hfkern
from hfkern import _backend, _topk

from _topk_cases import FLOAT_DTYPES, SPECIAL_KINDS, check_selection, special_input

from hfkern.cuda import topk as ck  # noqa: E402

ref = _backend._registry["topk_select"]["torch"].load()
emu = ck.emulated("topk_select")


def assert_same(a, b):
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape
        if u.is_floating_point():
            u, v = u.view(torch.uint8), v.view(torch.uint8)
        assert torch.equal(u, v)


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("shape,k", [((1,), 1), ((2, 1501), 20), ((3, 257), 257)])
def test_emulated_matches_torch(dtype, exact, shape, k):
    x = torch.randn(shape).to(dtype)
    out = emu(x, k, exact, 3)
    check_selection(x, k, exact, out)
    assert_same(out, ref(x, k, exact, 3))


@pytest.mark.emulator
@pytest.mark.parametrize("kind", SPECIAL_KINDS)
def test_emulated_special_inputs(kind):
    x = special_input(kind, (2, 1200))
    for exact in (False, True):
        out = emu(x, 40, exact, 0)
        check_selection(x, 40, exact, out)
        assert_same(out, ref(x, 40, exact, 0))


@pytest.mark.emulator
def test_emulated_sampled_row_non_contiguous_and_ties_past_capacity():
    x = torch.randn(3, _topk.SAMPLE_SIZE + 1001)[::2]  # rows longer than the sample
    out = emu(x, 120, False, 9)
    check_selection(x, 120, False, out)
    assert_same(out, ref(x, 120, False, 9))
    y = torch.full((1700,), -0.5, dtype=torch.bfloat16)
    y[torch.randperm(1700)[:30]] = 2.0
    out = emu(y, 90, False, 0)
    assert int(out[2]) == hfkern.topk_capacity(90)
    check_selection(y, 90, False, out)


@pytest.mark.emulator
def test_emulated_count_pass_matches_direct_count():
    spec = _topk.key_spec(torch.float64)
    x = special_input("few_levels", (2, 999), torch.float64)
    x[1, 5:9] = float("nan")
    bits = _topk.row_bits(x, spec)
    keys = _topk.keys_of(bits, spec)
    cand = torch.cat([keys[:, :28], torch.full((2, 4), spec.nan_key + 1)], 1)
    got = emu.count_ge(bits, spec, cand)
    torch.testing.assert_close(got, (keys.unsqueeze(1) >= cand.unsqueeze(2)).sum(2), rtol=0, atol=0)


@pytest.mark.emulator
def test_emulated_launcher_and_kernel_checks():
    with pytest.raises(ValueError, match="expected x on a cpu device"):
        emu(torch.randn(10, device="meta"), 2, False, 0)
    ext = emu.ext(torch.device("cpu"))
    assert ext.TOPK_CANDIDATES == _topk.NUM_CANDIDATES
    with pytest.raises(ValueError, match="threads per block a multiple of 32"):
        ext.topk_count(0, 4, 1, 10, 0, 0, 1, 1, 0x7FFFFFFF, 0x7F800001, 48, 0)
    with pytest.raises(ValueError, match="expected elem_bytes 2, 4 or 8, got 3"):
        ext.topk_count(0, 3, 1, 10, 0, 0, 1, 1, 0x7FFFFFFF, 0x7F800001, 64, 0)
    with pytest.raises(ValueError, match="covering n = 1000"):
        ext.topk_block_counts(0, 4, 1, 1000, 0, 0, 0, 1, 1, 0x7FFFFFFF, 0x7F800001, 64, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("kind", SPECIAL_KINDS)
def test_gpu_matches_torch(dtype, exact, kind):
    x = special_input(kind, (3, 300007), dtype).cuda()
    with hfkern.use_backend("cuda"):
        out = hfkern.topk_select(x, 3000, exact=exact, seed=5)
    with hfkern.use_backend("torch"):
        expected = hfkern.topk_select(x, 3000, exact=exact, seed=5)
    assert_same(out, expected)
    check_selection(x.cpu(), 3000, exact, [t.cpu() for t in out])
