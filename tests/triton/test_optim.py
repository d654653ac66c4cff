"""Triton multi-tensor optimizer steps against the torch implementation.

Interpreter tests call the launchers on CPU tensors (TRITON_INTERPRET=1) next to
the torch implementations in hfkern/ops/optim.py, several steps in a row, with
tensors of odd sizes that span several tiles. GPU tests run every array
optimizer under the triton backend against the torch backend.
"""

from __future__ import annotations

import gc
import inspect
import math
import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

import hfkern
import hfkern.optim as hoptim
from hfkern import _backend
from hfkern._optim_specs import OPTIMIZER_SPECS
from hfkern.ops import optim as ops
from _optim_cases import (  # noqa: F401
    CASES, FULL_OPTS, NAMES, SHAPES, Case, assert_same_state, case_id, check_masked_steps,
    check_empty_parameters,
)

triton = pytest.importorskip("triton")
from hfkern.triton import optim as tk  # noqa: E402

_OPS = [spec.op for spec in OPTIMIZER_SPECS] + ["nonfinite_models"]


class _Impls:
    """One backend's registered implementation of each optimizer op, by op name."""

    def __init__(self, backend):
        for op in _OPS:
            setattr(self, op, _backend._registry[op][backend].load())


ref = _Impls("torch")

# ---- interpreter: launchers against the torch implementation --------------------

@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # log(beta1 = 0)
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # its unselected branch
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_steps_match_torch(case, B):
    """Three steps: unmasked, then a mask whose skipped model has poisoned gradients, then
    another mask; the skipped model stays bit-identical, the others follow torch."""
    name, opts = case
    check_masked_steps(Case(name, opts, B), tk, ref)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", NAMES)
def test_empty_parameters_are_counted_and_leave_the_others_counts(name):
    check_empty_parameters(name, tk, ref)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["sgd", "adam", "rmsprop"])
def test_float64_and_mixed_dtypes(name):
    """float64 parameters compute in float64; a call with float32 and float64 parameters runs
    one launch per dtype (float32 hyperparameters, as the optimizers store for mixed groups)."""
    opts = {"sgd": dict(momentum=True, nesterov=True, wd=True), "adam": dict(amsgrad=True, wd=True),
            "rmsprop": dict(centered=True, momentum=True, wd=True)}[name]
    B = 3
    for dtypes in ([torch.float64] * 3, [torch.float32, torch.float64, torch.float32]):
        params = [torch.randn(B, *s, dtype=dt) for s, dt in zip([(5, 3), (37, 11), (16,)], dtypes)]
        want = Case(name, opts, B, params=params)
        got = want.clone()
        for skip in (None, torch.tensor([False, True, False])):
            grads = [torch.randn_like(p) for p in params]
            want.run_by_dtype(ref, grads, skip)
            got.run(tk, grads, skip)
        assert {p.dtype for p in got.params} == set(dtypes)
        only64 = set(dtypes) == {torch.float64}
        tol = dict(rtol=1e-12, atol=1e-12) if only64 else dict(rtol=1e-5, atol=1e-6)
        assert_same_state(got, want, **tol)


@pytest.mark.interpreter
def test_layouts():
    """Model-major parameters with permuted inner dims work (state shares their strides); a
    gradient laid out unlike its parameter, or not dense, is read where it lies (its gather
    row); a parameter whose models interleave in memory is refused."""
    B = 3
    p0 = torch.randn(B, 11, 5).transpose(1, 2)  # [B, 5, 11], model-major, inner dims permuted
    p1 = torch.randn(B, 40)
    want = Case("adam", dict(amsgrad=True, wd=True), B, params=[p0, p1])
    for lst in want.states:
        assert all(t.stride() == p.stride() for t, p in zip(lst, want.params))
    got = want.clone()
    for step in range(2):
        g0 = torch.randn(B, 5, 11)  # contiguous: unlike p0's layout
        g1 = torch.randn(B, 80)[:, ::2]  # not dense
        want.run(ref, [g0, g1], None)
        got.run(tk, [g0, g1], None)
    assert_same_state(got, want, rtol=1e-5, atol=1e-6)

    interleaved = torch.randn(7, B).t()  # [B, 7] with the models interleaved
    bad = Case("sgd", dict(momentum=True), B, params=[interleaved])
    with pytest.raises(ValueError, match=r"params\[0\].*strides \[1, 3\]"):
        bad.run(tk, [torch.randn(B, 7)], None)
    odd = Case("sgd", dict(momentum=True), B, params=[p1.clone()])
    odd.states[0][0] = torch.zeros(40, B).t()
    with pytest.raises(ValueError, match=r"momentum_buffers\[0\] laid out like params\[0\]"):
        odd.run(tk, [torch.randn(B, 40)], None)


@pytest.mark.interpreter
def test_plan_is_cached_per_shapes_and_holds_no_tensors():
    """The tile table depends on shapes, dtypes and layouts, never on addresses: new
    gradient tensors (as after zero_grad(set_to_none=True)) and even new parameters of
    the same shapes reuse it; the cache holds none of the call's tensors and stays bounded."""
    tk._plans.clear()
    builds = tk._planner.builds
    case = Case("adam", dict(amsgrad=False), 3)
    want = case.clone()
    grads = [torch.randn_like(p) for p in case.params]
    for _ in range(3):
        case.run(tk, grads)
        want.run(ref, grads)
    assert len(tk._plans) == 1 and tk._planner.builds == builds + 1
    fresh = [g.clone() for g in grads]
    case.run(tk, fresh)
    want.run(ref, fresh)
    assert_same_state(case, want, rtol=1e-5, atol=1e-6)
    other = want.clone()  # other tensors of the same shapes: the same table, other addresses
    other.run(tk, fresh)
    want.run(ref, fresh)
    assert_same_state(other, want, rtol=1e-5, atol=1e-6)
    assert len(tk._plans) == 1 and tk._planner.builds == builds + 1
    refs = [weakref.ref(t) for t in case.mutated() + other.mutated() + fresh]
    del case, want, other, fresh, grads
    gc.collect()
    assert all(r() is None for r in refs)
    for k in range(tk._MAX_CACHED + 3):
        c = Case("sgd", dict(momentum=False), 1, shapes=[(3 + k,)])
        c.run(tk, [torch.randn(1, 3 + k)])
    assert len(tk._plans) == tk._MAX_CACHED


@pytest.mark.interpreter
def test_nonfinite_models():
    B = 4
    grads = [
        torch.randn(B, 37, 11),  # several tiles per model
        torch.randn(B, dtype=torch.float64),
        torch.randn(B, 16, 8).half(),
        torch.randn(B, 0),
        torch.randn(B, 30, 2).transpose(1, 2),  # read in place: model-major
        torch.randn(B, 9, 2)[:, :, 0],  # not dense: checked through a copy
    ]
    assert tk.nonfinite_models(grads).tolist() == [False] * B
    grads[0][1, 36, 10] = math.inf  # the last element of model 1's last tile
    grads[2][3, 0, 0] = -math.inf
    grads[1][0] = math.nan
    grads[5][3, 4] = math.nan
    assert tk.nonfinite_models(grads).tolist() == ref.nonfinite_models(grads).tolist() == [
        True, True, False, True]
    grads[4][2, 1, 29] = math.nan
    assert tk.nonfinite_models(grads).tolist() == [True, True, True, True]
    big = torch.full((2, 8), 6e4, dtype=torch.float16)  # finite, though its sum is not
    assert tk.nonfinite_models([big]).tolist() == [False, False]


@pytest.mark.interpreter
def test_configs_are_timed_on_scratch_tensors(monkeypatch):
    """The timing path, with a live call's arguments (shrunk for the interpreter): it runs
    the kernel on scratch tensors only, and every live tensor stays as it was."""
    monkeypatch.setattr(tk, "_SCRATCH_ELEMS", 96)
    case = Case("rmsprop", dict(centered=False, momentum=True, wd=True), 3)
    grads = [torch.randn_like(p) for p in case.params]
    names = ["square_avgs", "grad_avgs", "momentum_buffers"]
    plan, addrs, _ = tk._plan(case.params, grads, case.states, names, case.steps)
    before = [t.clone() for t in case.mutated()]
    bases = [case.params[0], grads[0], case.states[0][0], case.params[0], case.states[2][0], case.steps[0]]
    skip = torch.tensor([False, True, False])
    args = (plan.groups[0].tiles, addrs, tk._dummy(addrs.device, torch.int64), *bases, case.hypers,
            case.hypers.stride(0), case.hypers.stride(1), skip)
    meta = dict(OPT="rmsprop", HAS_S0=True, HAS_S1=False, HAS_S2=True, NESTEROV=False, DECOUPLED=False,
                MAXIMIZE=False, HAS_WD=True, HAS_SKIP=True, F64=False, H64=False, GATHER=False, VEC_P=4,
                VEC_S=4, TRUST=False, BIAS_CORRECTION=False)
    config = tk._tune_on_scratch(args, case.hypers, meta)
    assert config.kwargs["BLOCK"] > 0
    assert all(torch.equal(a, b) for a, b in zip(case.mutated(), before))


def test_registered_as_explicit_cuda_backend():
    # auto-eligible where bench/results/ shows the kernel faster than the torch path
    auto = {"sgd_step_": True, "adam_step_": True, "adagrad_step_": False, "adadelta_step_": False,
            "rmsprop_step_": False, "lars_step_": False, "lamb_step_": False, "nonfinite_models": False}
    assert set(auto) == set(_OPS)
    for op in _OPS:
        entry = _backend._registry[op]["triton"]
        assert entry.load() is getattr(tk, op)
        assert entry.device_types == ("cuda",) and entry.auto is auto[op] and entry.dtypes == ()
        assert not hasattr(torch.ops.hfkern, f"{op.rstrip('_')}_triton")
    for spec in OPTIMIZER_SPECS:
        assert tuple(inspect.signature(getattr(tk, spec.op)).parameters) == spec.args
        schema = getattr(torch.ops.hfkern, spec.op).default._schema
        assert tuple(a.name for a in schema.arguments) == spec.args


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # a skipped model's 1 - beta**0
@pytest.mark.parametrize("name", NAMES)
def test_launchers_write_only_mutable_arguments_and_skip_fake_tensors(name):
    # What the op's schema promises of any implementation: the launcher writes only the
    # arguments the op declares mutable. Under FakeTensorMode (shape propagation) it
    # launches nothing; the kernels reach tensors through a device table, which a
    # traced graph cannot follow, so AOT tracing raises (below).
    opts = FULL_OPTS[name]
    spec = next(s for s in OPTIMIZER_SPECS if s.name == name)
    case = Case(name, opts, 3, shapes=[(4, 3), (5,)])
    for skip in (None, torch.tensor([False, True, False])):
        args = case.args([torch.randn_like(p) for p in case.params], skip)
        kept = [t for arg, value in zip(spec.args, args) if arg not in spec.mutated
                for t in (value if isinstance(value, list) else [value]) if isinstance(t, torch.Tensor)]
        before = [t.clone() for t in kept]
        getattr(tk, spec.op)(*args)
        assert all(torch.equal(t, b) for t, b in zip(kept, before))
        with FakeTensorMode() as mode:
            fake = pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
            getattr(tk, spec.op)(*fake)
    grads = [torch.randn(3, 4, 2), torch.randn(3)]
    with FakeTensorMode() as mode:
        out = tk.nonfinite_models([mode.from_tensor(g) for g in grads])
    assert out.shape == (3,) and out.dtype == torch.bool


@pytest.mark.interpreter
def test_aot_tracing_raises():
    case = Case("adam", dict(amsgrad=False), 3, shapes=[(4,)])
    args = case.args([torch.randn(3, 4)], None)
    with FunctionalTensorMode():
        functional = pytree.tree_map_only(torch.Tensor, FunctionalTensor.to_functional, args)
        with pytest.raises(RuntimeError, match="device table"):
            tk.adam_step_(*functional)


# ---- GPU: the optimizers under the triton backend against the torch backend ----

DEV = "cuda"

OPTIMIZERS = {
    "SGD": dict(lr=[0.02, 0.05, 0.1], momentum=[0.0, 0.5, 0.9], dampening=0.1, weight_decay=0.01,
                nesterov=False),
    "SGD-nesterov": dict(lr=[0.02, 0.05, 0.1], momentum=[0.3, 0.5, 0.9], weight_decay=[0.0, 0.01, 0.02],
                         nesterov=True, maximize=True),
    "Adam": dict(lr=[0.001, 0.01, 0.03], betas=([0.0, 0.8, 0.9], [0.95, 0.99, 0.999]), weight_decay=0.01,
                 amsgrad=True),
    "AdamW": dict(lr=[0.001, 0.01, 0.03], betas=(0.9, [0.95, 0.99, 0.999]), maximize=True),
    "Adagrad": dict(lr=[0.05, 0.1, 0.2], lr_decay=[0.0, 0.05, 0.1], initial_accumulator_value=0.1,
                    weight_decay=0.01),
    "Adadelta": dict(lr=[0.5, 1.0, 1.0], rho=[0.8, 0.9, 0.95], weight_decay=0.01, maximize=True),
    "RMSprop": dict(lr=[0.001, 0.005, 0.01], alpha=[0.9, 0.95, 0.99], momentum=[0.0, 0.5, 0.9],
                    centered=True, weight_decay=0.01),
    "RMSprop-plain": dict(lr=[0.001, 0.005, 0.01]),
}
# [B] bias, odd, a conv weight, and one spanning several tiles at every chunk size.
GPU_SHAPES = [(), (7, 3), (64, 3, 3, 3), (300, 257)]
# Many tiles at the GPU chunk sizes, one tensor 16-byte aligned (4096 * 64) and one not.
BIG_SHAPES = [(), (7, 3), (1000, 257), (4096, 64)]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _train(cls_name, dtype, backend, steps=20, B=3, device=None):
    device = device or DEV
    cfg = OPTIMIZERS[cls_name]
    cls = getattr(hoptim, cls_name.split("-")[0])
    gen = torch.Generator(device="cpu").manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(B, *s, generator=gen).to(device, dtype)) for s in GPU_SHAPES]
    opt = cls(params, **cfg, skip_nonfinite=True)
    skipped = []
    with hfkern.use_backend(backend):
        for step in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(device, dtype)
            if step == 5:
                params[-1].grad[2].view(-1)[-1] = math.nan  # model 2 skips this step
            skip = torch.tensor([False, True, False], device=device) if step == 9 else None
            opt.step(skip=skip)
            skipped.append(opt.last_skipped.tolist())
    return params, opt, skipped


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls_name", list(OPTIMIZERS))
def test_gpu_optimizers_match_torch_backend(cls_name, dtype):
    p_t, opt_t, skipped_t = _train(cls_name, dtype, "torch")
    p_k, opt_k, skipped_k = _train(cls_name, dtype, "triton")
    assert skipped_k == skipped_t
    assert skipped_k[5] == [False, False, True] and skipped_k[9] == [False, True, False]
    for a, b in zip(p_k, p_t):
        torch.testing.assert_close(a, b, **TOL[dtype])
        assert a.dtype == dtype
    for a, b in zip(p_k, p_t):
        sa, sb = opt_k.state[a], opt_t.state[b]
        assert set(sa) == set(sb)
        for key in sa:
            if key == "step":
                assert torch.equal(sa[key], sb[key])
            else:
                assert sa[key].dtype == sb[key].dtype == torch.float32
                torch.testing.assert_close(sa[key], sb[key], **TOL[dtype])


@pytest.mark.gpu
def test_gpu_steady_state_step_builds_nothing_without_syncing():
    """New gradient tensors at every step (zero_grad(), then new ones, as a training loop's)
    build no table and never synchronize; only the small address table is copied."""
    params = [torch.nn.Parameter(torch.randn(4, *s, device=DEV)) for s in GPU_SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = hoptim.Adam(params, lr=[0.01, 0.02, 0.03, 0.04], amsgrad=True, skip_nonfinite=True)
    with hfkern.use_backend("triton"):
        opt.step()  # builds the tables and times the kernel variant
        builds = tk._planner.builds
        start = [p.detach().clone() for p in params]
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                opt.zero_grad()
                for p in params:
                    p.grad = torch.randn_like(p)
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert tk._planner.builds == builds
    assert all(not torch.equal(p, p0) for p, p0 in zip(params, start))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_opcheck_ops_on_triton(name, dtype):
    opts = FULL_OPTS[name]
    case = Case(name, opts, 3, shapes=[(40, 33), (5,)], dtype=dtype, device=DEV)
    for skip in (None, torch.tensor([False, True, False], device=DEV)):
        args = case.args([torch.randn_like(p) for p in case.params], skip)
        with hfkern.use_backend("triton"):
            # schema, fake, autograd registration and (the op being opaque to tracing) AOT
            torch.library.opcheck(getattr(ops, f"{name}_step_"), args)
    grads = [torch.randn(3, 40, 33, device=DEV, dtype=dtype), torch.randn(3, device=DEV)]
    with hfkern.use_backend("triton"):
        torch.library.opcheck(ops.nonfinite_models, (grads,))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_gpu_launchers_match_torch_many_tiles(case):
    """Large tensors (many tiles at the GPU chunk sizes), 16-byte aligned and not."""
    name, opts = case
    want = Case(name, opts, 3, shapes=BIG_SHAPES, device=DEV)
    got = want.clone()
    for skip in (None, torch.tensor([False, True, False], device=DEV), None):
        grads = [torch.randn_like(p) for p in want.params]
        want.run(ref, grads, skip)
        got.run(tk, grads, skip)
    assert_same_state(got, want, rtol=1e-5, atol=1e-6, atol_per_magnitude=True)
