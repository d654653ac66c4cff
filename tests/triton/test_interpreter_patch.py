"""tests/_triton_interpreter.py: helper calls skip the re-scan of triton.language, and
kernels compute what they computed before, with the language restored after a launch."""

import pytest
import torch
import triton
import triton.language as tl

import _triton_interpreter

pytestmark = pytest.mark.interpreter  # the patch is of Triton's interpreter (TRITON_INTERPRET=1)


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _shifted(x, s):
    return _scaled(x, s) + 1.0  # a helper calling a helper


@triton.jit
def _kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):  # x, y: [n]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, _shifted(x, 2.0) + _scaled(x, 3.0), mask=mask)


def test_helpers_skip_the_scan_and_compute_the_same():
    assert _triton_interpreter.install() == ""  # conftest installed it: installing again is a no-op
    x = torch.randn(37)
    y = torch.empty_like(x)
    before = _triton_interpreter.scans_skipped()
    _kernel[(3,)](x, y, x.numel(), BLOCK=16)
    # three programs, three helper calls each
    assert _triton_interpreter.scans_skipped() - before == 9
    torch.testing.assert_close(y, x * 2.0 + 1.0 + x * 3.0)
    # the launch's scope restored Triton's own builtins
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.store)


def test_outside_a_launch_nothing_is_skipped():
    from triton.runtime import interpreter

    before = _triton_interpreter.scans_skipped()
    scope = interpreter._patch_lang(_kernel.fn)
    try:
        assert not tl.core.is_builtin(tl.load)  # patched: no launch had patched it
    finally:
        scope.restore()
    assert _triton_interpreter.scans_skipped() == before
    assert tl.core.is_builtin(tl.load)
