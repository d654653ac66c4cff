"""The CUDA multi-tensor optimizer steps (csrc/optim/multi_tensor_step.cu) against the torch implementation.

Emulator tests run the very kernel sources, built as host C++ into
hfkern._C_emu, on CPU tensors through the same launchers as on a GPU
(hfkern.cuda.optim.emulated), several steps in a row, with tensors of odd
sizes that span several tiles, skip masks over poisoned gradients, every
option, mixed parameter dtypes and layouts the table can and cannot address.
GPU tests run the array optimizers under the cuda backend against the torch backend.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import hfkern
import hfkern.optim as hoptim
from hfkern import _backend
from hfkern.cuda import _ext
from hfkern.cuda import optim as ck
from _optim_cases import (
    CASES, FULL_OPTS, Case, assert_same_state, case_id, check_empty_parameters, check_masked_steps,
)

_KERNEL_OPS = ("sgd_step_", "adam_step_", "lars_step_", "lamb_step_")


class _Impls:
    def __init__(self, get):
        for op in _KERNEL_OPS:
            setattr(self, op, get(op))


ref = _Impls(lambda op: _backend._registry[op]["torch"].load())
emu = _Impls(ck.emulated)

CUDA_CASES = [c for c in CASES if c[0] in ("sgd", "adam", "lars", "lamb")] + [
    ("sgd", dict(momentum=True)),
    ("adam", dict(amsgrad=False, decoupled=True, wd=True, maximize=True)),
]
# Per-model shapes: a [B] bias, odd, a 16-multiple spanning two emulated tiles
# (aligned: vector path), an odd one spanning three (scalar path).
SHAPES = [(), (5, 3), (24, 16), (37, 11)]


@pytest.mark.emulator
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("case", CUDA_CASES, ids=[case_id(c) for c in CUDA_CASES])
def test_emulated_steps_match_torch(case, B):
    """Three steps: unmasked, then a mask whose skipped model has poisoned gradients, then
    another mask; the skipped model stays bit-identical, the others follow torch."""
    name, opts = case
    check_masked_steps(Case(name, opts, B, shapes=SHAPES), emu, ref)


@pytest.mark.emulator
@pytest.mark.parametrize("name", ["sgd", "adam", "lars", "lamb"])
def test_emulated_empty_parameters_are_counted_and_leave_the_others_counts(name):
    check_empty_parameters(name, emu, ref)


@pytest.mark.emulator
@pytest.mark.parametrize("name", ["sgd", "adam", "lars", "lamb"])
def test_emulated_low_precision_and_mixed_dtypes(name):
    """bfloat16, float16 and float32 parameters in one call (one launch per dtype), float32
    state; the update is computed in float32 and rounded into the parameter once."""
    opts = FULL_OPTS[name]
    B = 3
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16]
    params = [torch.randn(B, *s).to(dt) for s, dt in zip([(5, 3), (32, 8), (37, 11), (16,)], dtypes)]
    want = Case(name, opts, B, params=params)
    got = want.clone()
    for skip in (None, torch.tensor([False, True, False]), None):
        grads = [torch.randn_like(p) for p in params]
        want.run(ref, grads, skip)
        got.run(emu, grads, skip)
    for a, b, dt in zip(got.params, want.params, dtypes):
        assert a.dtype == dt
        # One rounding into the parameter; float32 math may round the other way at a tie.
        tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}[dt]
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    for lst_a, lst_b in zip(got.states, want.states):
        for a, b in zip(lst_a, lst_b):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.emulator
def test_emulated_layouts_and_misaligned_tensors():
    """Permuted inner dims (state shares the parameter's strides), gradients laid out unlike
    their parameter or not dense (read where they lie, through a gather row), tensors at odd
    element offsets (the scalar path), a strided hyperparameter table and skip mask;
    interleaved models are refused."""
    B = 3
    p0 = torch.randn(B, 11, 5).transpose(1, 2)  # [B, 5, 11], model-major, inner dims permuted
    buf = torch.randn(1 + B * 64)
    p1 = buf[1:].view(B, 64)  # 16-multiple per model, but 4 bytes off 16-byte alignment
    want = Case("adam", dict(amsgrad=True, wd=True), B, params=[p0, p1])
    want.hypers = torch.randn(B, 5).abs().t().mul(0.01).add(torch.tensor([[0], [0.8], [0.9], [0], [0]]))
    assert not want.hypers.is_contiguous()
    got = want.clone()
    got.params[1] = torch.randn(1 + B * 64)[1:].view(B, 64).copy_(want.params[1])
    for skip in (None, torch.tensor([False, True, False, True])[::2]):  # [False, False], then strided
        g0 = torch.randn(B, 5, 11)  # contiguous: unlike p0's layout
        g1 = torch.randn(B, 128)[:, ::2]  # not dense
        s = None if skip is None else torch.tensor([False, True, False, False, True, True])[::2]
        want.run(ref, [g0, g1], s)
        got.run(emu, [g0, g1], s)
    assert_same_state(got, want, rtol=1e-5, atol=1e-6)

    interleaved = torch.randn(7, B).t()  # [B, 7] with the models interleaved
    bad = Case("sgd", dict(momentum=True), B, params=[interleaved])
    with pytest.raises(ValueError, match=r"cuda backend needs every parameter dense.*params\[0\]"):
        bad.run(emu, [torch.randn(B, 7)], None)


@pytest.mark.emulator
def test_emulated_rejects_what_the_kernels_do_not_serve():
    case = Case("adam", dict(amsgrad=False), 2, shapes=[(4,)], dtype=torch.float64)
    grads = [torch.randn_like(p) for p in case.params]
    with pytest.raises(TypeError, match=r"float32, bfloat16 or float16 parameters, got torch.float64"):
        case.run(emu, grads)
    case = Case("sgd", dict(momentum=False), 2, shapes=[(4,)])
    with pytest.raises(ValueError, match=r"expected params\[0\] on a cuda device, got cpu"):
        ck.sgd_step_(*case.args([torch.randn(2, 4)], None))  # the GPU launcher, given CPU tensors
    with pytest.raises(ValueError, match=r"implements \['adam_step_', 'lamb_step_', 'lars_step_', 'sgd_step_'\], "
                                         r"got 'rmsprop_step_'"):
        ck.emulated("rmsprop_step_")


@pytest.mark.emulator
def test_binding_checks_its_arguments():
    """The kernels' own guards, behind the Python checks: pybind11 turns them into ValueError."""
    module = _ext.load(emulated=True)
    assert module.EMULATED and module.CUDA_ARCHITECTURES == ""
    with pytest.raises(ValueError, match=r"threads per block a multiple of 32 in \[32, 512\], got 48"):
        module.count_steps(0, 0, 0, 1, 1, 0, 48, 0)
    with pytest.raises(ValueError, match="needs an address table and step offsets"):
        module.count_steps(0, 0, 0, 1, 1, 0, 32, 0)
    table = torch.zeros(1, 16, dtype=torch.int64)  # stands in for the tables: nothing is launched
    kwargs = dict(tiles=table.data_ptr(), n_tiles=0, addrs=table.data_ptr(), gathers=0, param_dtype=0, params=0,
                  grads=0, state0=0, state1=0, state2=0, steps=0, hypers=0, hyper_row_stride=1,
                  hyper_model_stride=1, skip=0, maximize=False, has_weight_decay=False,
                  decoupled_weight_decay=False, momentum=False, nesterov=True, amsgrad=False, threads=32, stream=0)
    with pytest.raises(ValueError, match="nesterov needs momentum buffers"):
        module.sgd_step(**kwargs)
    with pytest.raises(ValueError, match="got dtype code 3"):
        module.adam_step(**{**kwargs, "nesterov": False, "param_dtype": 3, "n_tiles": 1})
    with pytest.raises(ValueError, match="trust-ratio step needs partials"):
        module.lamb_step(**{**kwargs, "nesterov": False, "n_tiles": 1, "trust": True})
    with pytest.raises(ValueError, match="excluded parameter .* takes no weight decay"):
        module.lars_step(**{**kwargs, "nesterov": False, "has_weight_decay": True})
    with pytest.raises(ValueError, match="needs a tile table and an address table"):
        module.adam_step(**{**kwargs, "nesterov": False, "n_tiles": 1, "addrs": 0})


def test_registered_as_explicit_cuda_backend():
    for op in _KERNEL_OPS:
        impl = _backend._registry[op]["cuda"]
        assert impl.device_types == ("cuda",) and not impl.auto  # auto waits for a GPU benchmark


# ---- what a build covers (no extension needed) --------------------------------------

def test_architectures_and_coverage():
    sass, ptx = _ext.architectures("80-real;90")
    assert (sass, ptx) == ((80, 90), (90,))
    assert _ext.architectures("86,90-virtual") == ((86,), (86, 90))
    with pytest.raises(ValueError, match="'native'"):
        _ext.architectures("80;native")
    assert _ext.covering((9, 0), sass, ptx) == "SASS sm_90"
    assert _ext.covering((8, 9), sass, ptx) == "SASS sm_80"  # same major, newer minor
    assert _ext.covering((12, 0), sass, ptx).startswith("PTX compute_90")  # JIT on a newer device
    assert _ext.covering((7, 5), sass, ptx) is None
    assert _ext.covering((8, 0), (86,), ()) is None  # sm_86 code does not run on sm_80


def test_backend_info_reports_the_build():
    info = hfkern.backend_info()["backends"]["cuda"]
    try:
        module = _ext.load()
    except ImportError as e:
        assert info["architectures"] == {} and not info["available"]
        assert "could not be loaded" in info["reason"] and str(e) == info["reason"]
        return
    sass, ptx = _ext.architectures(module.CUDA_ARCHITECTURES)
    assert info["architectures"]["sass"] == list(sass) and info["architectures"]["ptx"] == list(ptx)
    if not torch.cuda.is_available():
        # without a driver the extension's own runtime says so first
        assert not info["available"]
        assert re.search(r"torch.cuda.is_available\(\) is False|cannot reach a device", info["reason"])
        assert info["architectures"]["device"] is None
    else:
        assert info["architectures"]["covered_by"] is not None
        assert info["available"] == bool(info["architectures"]["covered_by"])


# ---- GPU: the optimizers under the cuda backend ----------------------------------------

DEV = "cuda"
OPTIMIZERS = {
    "SGD": dict(lr=[0.05, 0.1, 0.2]),
    "SGD-momentum": dict(lr=[0.05, 0.1, 0.2], momentum=[0.0, 0.5, 0.9], dampening=0.1, weight_decay=0.01),
    "SGD-nesterov": dict(lr=[0.05, 0.1, 0.2], momentum=0.9, nesterov=True, maximize=True),
    "Adam": dict(lr=[0.001, 0.01, 0.02], betas=([0.8, 0.9, 0.95], 0.999)),
    "Adam-amsgrad": dict(lr=[0.001, 0.01, 0.02], weight_decay=[0.0, 0.01, 0.1], amsgrad=True),
    "AdamW": dict(lr=[0.001, 0.01, 0.02], weight_decay=[0.0, 0.01, 0.1], amsgrad=True, maximize=True),
    "LARS": dict(lr=[0.5, 1.0, 2.0], momentum=[0.0, 0.9, 0.9], weight_decay=[0.0, 1e-4, 1e-3], exclude_1d=True),
    "LAMB": dict(lr=[0.001, 0.01, 0.02], weight_decay=[0.0, 0.01, 0.1], norm_bounds=(0.0, [10.0, 10.0, 1e30])),
}
# [B] bias, odd, a conv weight, one spanning several tiles at every chunk size, one
# 16-byte aligned over many tiles.
GPU_SHAPES = [(), (7, 3), (64, 3, 3, 3), (300, 257), (4096, 64)]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _train(cls_name, dtype, backend, steps=12, B=3, misalign=False):
    cfg = OPTIMIZERS[cls_name]
    cls = getattr(hoptim, cls_name.split("-")[0])
    gen = torch.Generator(device="cpu").manual_seed(1)
    params = []
    for s in GPU_SHAPES:
        init = torch.randn(B, *s, generator=gen).to(DEV, dtype)
        if misalign:  # one element into a buffer: no tile is 16-byte aligned
            init = torch.empty(1 + init.numel(), device=DEV, dtype=dtype)[1:].view(init.shape).copy_(init)
        params.append(torch.nn.Parameter(init))
    opt = cls(params, **cfg)
    with hfkern.use_backend(backend):
        for step in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(DEV, dtype)
            skip = torch.tensor([False, True, False], device=DEV) if step in (3, 7) else None
            if skip is not None:
                params[-1].grad[1].view(-1)[-1] = math.nan  # the skipped model's poison
            opt.step(skip=skip)
    return params, opt


@pytest.mark.gpu
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls_name", list(OPTIMIZERS))
def test_gpu_optimizers_match_torch_backend(cls_name, dtype, misalign):
    p_t, opt_t = _train(cls_name, dtype, "torch", misalign=misalign)
    p_k, opt_k = _train(cls_name, dtype, "cuda", misalign=misalign)
    for a, b in zip(p_k, p_t):
        assert a.dtype == dtype and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **TOL[dtype])
    for a, b in zip(p_k, p_t):
        sa, sb = opt_k.state[a], opt_t.state[b]
        assert set(sa) == set(sb)
        for key in sa:
            if key == "step":
                assert torch.equal(sa[key], sb[key])
            else:
                torch.testing.assert_close(sa[key], sb[key], **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_CASES, ids=[case_id(c) for c in CUDA_CASES])
def test_gpu_launchers_match_torch(case):
    name, opts = case
    want = Case(name, opts, 3, shapes=GPU_SHAPES, device=DEV)
    got = want.clone()
    for skip in (None, torch.tensor([False, True, False], device=DEV), None):
        grads = [torch.randn_like(p) for p in want.params]
        want.run(ref, grads, skip)
        got.run(ck, grads, skip)
    assert_same_state(got, want, rtol=1e-5, atol=1e-6, atol_per_magnitude=True)


@pytest.mark.gpu
def test_gpu_rejects_float64_and_steady_state_never_syncs():
    case = Case("adam", dict(amsgrad=False), 2, shapes=[(4,)], dtype=torch.float64, device=DEV)
    with pytest.raises(TypeError, match="float64"):
        case.run(ck, [torch.randn_like(p) for p in case.params])
    params = [torch.nn.Parameter(torch.randn(4, *s, device=DEV)) for s in GPU_SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = hoptim.Adam(params, lr=[0.01, 0.02, 0.03, 0.04], amsgrad=True)
    with hfkern.use_backend("cuda"):
        opt.step()  # builds the tables
        builds = ck._planner.builds
        start = [p.detach().clone() for p in params]
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                opt.zero_grad()  # new gradient tensors at every step, as a training loop's
                for p in params:
                    p.grad = torch.randn_like(p)
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert ck._planner.builds == builds
    assert all(not torch.equal(p, p0) for p, p0 in zip(params, start))
