"""hfkern.fuse keeps what a forward does besides computing its output, per model, as torch does.

State a forward updates (counters and running averages in buffers, written in
place or rebound, under ``no_grad`` or not; momentum-encoder weights; tensor
attributes), grad-mode and autocast regions, random draws, and the rule that
fusing never changes the models it is given. Each case runs B separate torch
models and the fused model side by side for several calls (forward and
backward) and compares outputs, gradients (None where torch leaves None) and
every state entry. What a captured forward cannot reproduce is refused with a
FuseError naming the statement and the module.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _util import CallCounter, assert_fused_matches
from torch import nn
from torch.testing import assert_close

import hfkern

B = 3
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_unchanged(models, before):
    for m, state in zip(models, before):
        after = m.state_dict()
        assert after.keys() == state.keys()
        for k, v in state.items():
            assert torch.equal(after[k], v), f"fuse changed the input model's {k!r}"


def _run(make, x_shape=(5, 4), calls=3, backward=True, outer=None, opaque=None):
    """Fuse B models from ``make``; call both sides ``calls`` times with fresh inputs; compare all."""
    torch.manual_seed(0)
    models = [make() for _ in range(B)]
    before = [_state(m) for m in models]
    fused = hfkern.fuse(models, **(opaque or {}))
    _assert_unchanged(models, before)
    for _ in range(calls):
        x = torch.randn(B, *x_shape)
        with (outer() if outer else torch.enable_grad()):
            refs = [m(x[b]) for b, m in enumerate(models)]
            out = fused(x)
        assert out.requires_grad == refs[0].requires_grad
        ref = torch.stack(refs) if refs[0].requires_grad else torch.stack(refs).detach()
        assert_close(out, ref, **TOL)
        if backward and ref.requires_grad:
            ref.square().sum().backward()
            out.square().sum().backward()
        assert_fused_matches(fused, models, requires_grad=True, **TOL)
    return fused, models


# ---- state in buffers ---------------------------------------------------------------------------
class _Counter(nn.Module):
    """Counters written each way torch code writes them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        self.steps.add_(1)
        self.seen = self.seen + x.size(0)
        return self.fc(x) * self.calls


class _EMA(nn.Module):
    """A running average updated in place under no_grad, which feeds the output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("ema", torch.randn(4))

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return h + self.ema


class _RebindEMA(nn.Module):
    """A running average rebound to a detached expression (no no_grad)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        self.ema = 0.8 * self.ema + 0.2 * h.mean(0).detach()
        return h * self.ema


class _Queue(nn.Module):
    """MoCo's queue of keys: item assignment into a buffer, and an activation written in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("queue", torch.randn(6, 4))

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            self.queue[:2] = h[:2].detach()
            self.queue[2] += 1
        g = h.clone()
        g[:, 0] = 0
        return g @ self.queue.t()


@pytest.mark.parametrize("cls", [_Counter, _EMA, _RebindEMA, _Queue])
def test_buffer_updates_in_forward_per_model(cls):
    fused, models = _run(cls)
    if cls is _Counter:
        assert fused.calls.tolist() == [3.0] * B and fused.steps.tolist() == [3] * B
        assert fused.steps.dtype == torch.long
    if cls is _EMA:
        assert not fused.ema.requires_grad  # no autograd history: a second backward works


def test_buffer_counts_per_model_after_train_eval_switch():
    fused, models = _run(_Counter, calls=2)
    fused.eval()
    for m in models:
        m.eval()
    x = torch.randn(B, 5, 4)
    assert_close(fused(x), torch.stack([m(x[b]) for b, m in enumerate(models)]), **TOL)
    assert fused.calls.tolist() == [3.0] * B


class _Teacher(nn.Module):
    """A frozen teacher called under no_grad: torch gives it no gradient."""

    def __init__(self):
        super().__init__()
        self.student = nn.Linear(4, 4)
        self.teacher = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            t = self.teacher(x)
        return self.student(x) - t


class _MomentumEncoder(nn.Module):
    """MoCo's key encoder: an EMA of the query encoder, updated in forward by iterating parameters."""

    def __init__(self):
        super().__init__()
        self.q = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.k = copy.deepcopy(self.q)
        for p in self.k.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def _momentum_update(self):
        for pq, pk in zip(self.q.parameters(), self.k.parameters()):
            pk.data = pk.data * 0.9 + pq.data * 0.1

    def forward(self, x):
        self._momentum_update()
        return self.q(x) * self.k(x)


class _InPlaceTeacher(nn.Module):
    """The same EMA teacher written with in-place updates over named_parameters."""

    def __init__(self):
        super().__init__()
        self.student = nn.Linear(4, 4)
        self.teacher = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            teachers = dict(self.teacher.named_parameters())
            for name, ps in self.student.named_parameters():
                teachers[name].mul_(0.99).add_(ps, alpha=0.01)
        return self.student(x) + self.teacher(x)


@pytest.mark.parametrize("cls", [_Teacher, _MomentumEncoder, _InPlaceTeacher])
def test_teachers_and_momentum_encoders(cls):
    fused, models = _run(cls)
    if cls is _Teacher:
        assert fused.teacher.weight.grad is None and fused.student.weight.grad is not None


# ---- mode regions ---------------------------------------------------------------------------------
class _Regions(nn.Module):
    """Every grad-mode region, as a context and as a decorator."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    @torch.set_grad_enabled(False)
    def _frozen(self, x):
        return self.b(x)

    def forward(self, x):
        if self.kind == "enable_grad":
            with torch.enable_grad():
                return self.a(x) + self.b(x)
        if self.kind == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                h = self.b(x)
            return self.a(x) * h
        if self.kind == "decorator":
            return self.a(x) + self._frozen(x)
        if self.kind == "inference_mode":
            with torch.inference_mode():
                h = self.b(x)
            return self.a(x) + h
        if self.kind == "nested":
            with torch.no_grad():
                h = self.b(x)
                with torch.enable_grad():
                    g = self.a(x)
            return g * h
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["enable_grad", "set_grad_enabled", "decorator", "inference_mode", "nested"])
def test_grad_mode_regions(kind):
    _run(lambda: _Regions(kind))


def test_enable_grad_inside_a_no_grad_call():
    # Called under no_grad, the enable_grad region still builds a graph, as torch's does.
    fused, _ = _run(lambda: _Regions("enable_grad"), outer=torch.no_grad)
    assert torch.is_grad_enabled()


def test_grad_mode_restored_after_an_error_in_a_region():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            with torch.no_grad():
                h = self.fc(x)
                return h.view(h.size(0), 7)  # fails for every 4-feature input

    fused = hfkern.fuse([Fails() for _ in range(B)])
    with pytest.raises(RuntimeError):
        fused(torch.randn(B, 5, 4))
    assert torch.is_grad_enabled()


def test_autocast_region():
    class Cast(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.fc(x)
            return h

    torch.manual_seed(0)
    models = [Cast() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 5, 4)
    ref = torch.stack([m(x[b]) for b, m in enumerate(models)])
    out = fused(x)
    assert ref.dtype == out.dtype == torch.bfloat16
    assert_close(out, ref, rtol=1e-2, atol=1e-2)
    assert not torch.is_autocast_enabled("cpu")


# ---- random draws ----------------------------------------------------------------------------------
class _Noise(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if self.how == "constant_shape":
            return h + torch.randn(4)
        if self.how == "traced_sizes":
            return h + torch.randn(x.size(0), h.size(1))  # sizes torch.fx alone cannot take
        return h + torch.rand(h.size(-1))  # a shape every model shares


@pytest.mark.parametrize("how", ["constant_shape", "traced_shape", "traced_sizes"])
def test_random_draws_are_per_model_and_per_call(how):
    torch.manual_seed(0)
    models = [_Noise(how) for _ in range(B)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())  # equal models: only the noise differs
    fused = hfkern.fuse(models)
    x = torch.randn(5, 4).expand(B, 5, 4)
    first, second = fused(x), fused(x)
    noise = first - torch.stack([m.fc(x[b]) for b, m in enumerate(models)])
    assert not torch.allclose(noise[0], noise[1]), "every model drew the same numbers"
    assert not torch.allclose(first, second), "the draw was frozen at capture"


class _Sized(nn.Module):
    """Tensor factories sized by the input, as torch code writes them (an RNN's zero state, a
    mask of ones), and len() of the input."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        n = x.size(0)
        state = torch.zeros(n, 3, dtype=x.dtype, device=x.device) + torch.ones((x.shape[0], 1))
        scale = torch.full((n, 1), 0.5) + torch.eye(x.size(1))[:1, :1] + torch.linspace(0, 1, x.size(1))[-1]
        steps = torch.arange(1, n + 1).unsqueeze(1) / torch.empty(n, 1).fill_(len(x))
        return (self.fc(x) + state) * scale * steps


@pytest.mark.parametrize("N", [5, 2])
def test_tensor_factories_sized_by_the_input(N):
    fused, _ = _run(_Sized, x_shape=(N, 4))
    # recorded as the factories themselves on one model's sizes, not vmapped per model
    targets = {n.target for n in fused.graph.nodes if n.op == "call_function"}
    assert {torch.zeros, torch.ones, torch.full, torch.eye, torch.linspace, torch.empty} <= targets
    assert fused(torch.randn(B, N + 1, 4)).shape == (B, N + 1, 3)  # the sizes of each call


def test_in_place_draw_into_a_constant_is_refused():
    class Drawn(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) + torch.empty(4).normal_()

    with pytest.raises(hfkern.FuseError, match=r"normal_.*torch.empty\(4\).normal_\(\).*own forward \(Drawn\)"):
        hfkern.fuse([Drawn() for _ in range(B)])


# ---- attributes ---------------------------------------------------------------------------------------
class _PythonCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.steps = 0

    def forward(self, x):
        self.steps += 1
        return self.fc(x)


class _Outer(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.block = inner


def _outer_forward(self, x):
    return self.block(x)


_Outer.forward = _outer_forward


def test_python_state_in_forward_is_refused_with_the_statement_and_module():
    models = [_Outer(_PythonCounter()) for _ in range(B)]
    before = [m.block.steps for m in models]
    with pytest.raises(hfkern.FuseError, match=r"assigns the Python value 2 to attribute 'block.steps', "
                       r"which held 1 after one call.*`self.steps \+= 1`.*module 'block' \(_PythonCounter\)"
                       r".*register_buffer"):
        hfkern.fuse(models)
    assert [m.block.steps for m in models] == before


def test_new_parameters_and_submodules_in_forward_are_refused():
    class MakesParameter(nn.Module):
        def forward(self, x):
            self.w = nn.Parameter(torch.ones(4))
            return x * self.w

    class MakesModule(nn.Module):
        def forward(self, x):
            self.fc = nn.Linear(4, 4)
            return self.fc(x)

    with pytest.raises(hfkern.FuseError, match="assigns parameter 'w'"):
        hfkern.fuse([MakesParameter() for _ in range(B)])
    with pytest.raises(hfkern.FuseError, match="assigns submodule 'fc'"):
        hfkern.fuse([MakesModule() for _ in range(B)])


class _Remembers(nn.Module):
    """Plain tensor attributes: one forward reads the previous call's, as a recurrent cache does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.prev = torch.zeros(4)
        self.tag = None

    def forward(self, x):
        h = self.fc(x) + self.prev
        self.prev = h.mean(0).detach()
        self.tag = "seen"
        return h


def test_tensor_attributes_written_in_forward_are_per_model_state():
    fused, models = _run(_Remembers)
    assert_close(fused.prev, torch.stack([m.prev for m in models]), **TOL)
    assert fused.tag == "seen"
    for b, m in enumerate(models):
        assert_close(fused.extract_model(b).prev, m.prev, **TOL)


def test_tensor_constants_and_read_only_attributes():
    class Consts(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.mask = torch.tensor([1.0, 0.0, 1.0, 1.0])  # neither parameter nor buffer

        def forward(self, x):
            return self.fc(x) * self.mask + torch.tensor([0.5, 1.0, 1.5, 2.0])

    _run(Consts)
    models = [Consts() for _ in range(B)]
    models[2].mask = torch.tensor([0.0, 1.0, 1.0, 1.0])
    with pytest.raises(hfkern.FuseError, match=r"tensor attribute 'mask'.*differs between models 0 and 2"):
        hfkern.fuse(models)


def test_in_place_update_of_a_non_buffer_tensor_is_refused():
    class Cache(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.total = torch.zeros(4)

        def forward(self, x):
            self.total.add_(x.sum(0))
            return self.fc(x)

    models = [Cache() for _ in range(B)]
    with pytest.raises(hfkern.FuseError, match=r"modifies the tensor 'total' in place.*register it as a buffer"):
        hfkern.fuse(models)
    assert all(not m.total.any() for m in models)


# ---- opaque modules -------------------------------------------------------------------------------------
class _BranchyCounter(nn.Module):
    """Data-dependent code (so it must run in a loop or under vmap) that also counts in a buffer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.calls = self.calls + 1
        self.total.add_(x.detach().sum(0))
        return self.fc(x) * self.calls


@pytest.mark.parametrize("option", ["loop_modules", "vmap_modules"])
def test_opaque_modules_keep_buffer_updates(option):
    fused, models = _run(lambda: _Outer(_BranchyCounter()), opaque={option: (_BranchyCounter,)})
    assert fused.block.calls.tolist() == [3.0] * B


# ---- the input models ------------------------------------------------------------------------------------
def test_fuse_never_changes_the_models():
    for cls in (_Counter, _EMA, _RebindEMA, _Queue, _MomentumEncoder, _InPlaceTeacher, _Remembers):
        models = [cls() for _ in range(B)]
        before = [_state(m) for m in models]
        attrs = [dict(vars(m)) for m in models]
        hfkern.fuse(models)
        _assert_unchanged(models, before)
        for m, a in zip(models, attrs):
            assert vars(m).keys() == a.keys()


def test_compiled_fused_model_keeps_regions_and_buffer_updates():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = hfkern.fuse([_EMA() for _ in range(B)])
    compiled_model = hfkern.fuse([_EMA() for _ in range(B)])
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model)
    for _ in range(2):
        x = torch.randn(B, 5, 4)
        out, ref = compiled(x), eager(x)
        assert_close(out, ref, **TOL)
        out.sum().backward()
        ref.sum().backward()
    assert_close(compiled_model.ema, eager.ema, **TOL)
    assert_close(compiled_model.fc.weight.grad, eager.fc.weight.grad, **TOL)


def test_other_threads_are_untouched_while_a_capture_runs():
    """The capture's own patches (random factories, module attributes, grad-mode regions) serve
    the capturing thread only. (torch.fx patches module calls process-wide while it traces, so
    another thread calling a module then is fx's limitation, not tested here.)"""
    import threading

    started, done = threading.Event(), threading.Event()
    seen = []

    class Waits(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            started.set()
            done.wait(10)  # the other thread works while this forward is being captured
            return self.fc(x)

    def other():
        started.wait(10)
        try:
            seen.append(type(torch.randn(2)))
            m = nn.Linear(2, 2)
            m.steps = 1
            w = torch.ones(2, requires_grad=True)
            with torch.no_grad():
                seen.append((w * 2).requires_grad)
            seen.append(m.steps)
        finally:
            done.set()

    thread = threading.Thread(target=other)
    thread.start()
    hfkern.fuse([Waits() for _ in range(B)])
    thread.join(10)
    assert seen == [torch.Tensor, False, 1]


@pytest.mark.parametrize("call, walked", [
    ("a + b", set()), ("a * b", set()), ("a.add(b)", set()), ("torch.mul(a, 2.0)", set()),
    ("a.sub(b, alpha=2)", set()), ("a.transpose(1, 2).transpose(2, 1)", set()),
    ("torch.sum(a, dim=(0, 1), keepdim=True) * b", set()),
    ("a.max(1, keepdim=True)[0] + b", set()),                            # an int index into a tuple of arrays
    ("a.max(1, keepdim=True)[0:1][0] + b", {"per_model_getitem"}),      # a slice of it: walked
    ("a.sum(2, dtype=torch.float64, keepdim=True).float() * b", {"per_model_sum"}),  # a dtype keyword
])
def test_calls_of_array_tensors_and_plain_values_take_the_direct_path(call, walked, monkeypatch):
    """A call whose arguments are array tensors (of one rank, for an elementwise call; only
    the first, for a translated one) and plain values (numbers, flags, tuples of them) is run
    without the general path's walk over the arguments, as is an int index into a tuple of
    arrays (``torch.max(x, 1)[0]``); arrays of different ranks (the last subtraction), a
    non-plain keyword or a slice of a tuple of tensors take the general path. Both give what
    B torch models give."""
    from hfkern import fusion

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = nn.Linear(3, 3)
            self.g = nn.Linear(3, 3)

        def forward(self, x, y):
            a, b = self.f(x), self.g(x)
            out = eval(call, {"torch": torch, "a": a, "b": b})
            return out - self.g(y)  # [N, T, 3] - [T, 3] per model: ranks differ

    torch.manual_seed(0)
    B = 3
    models = [Net() for _ in range(B)]
    fused = hfkern.fuse(models)
    seen = []  # [name, took the direct path] per call
    real_call, real_direct = fusion._ArrayCall.__call__, fusion._ArrayCall._direct

    def call_spy(self, *args, **kwargs):
        seen.append([self.__name__, False])
        return real_call(self, *args, **kwargs)

    def direct_spy(self, args, kwargs):
        out = real_direct(self, args, kwargs)
        seen[-1][1] = out is not fusion._WALK
        return out

    monkeypatch.setattr(fusion._ArrayCall, "__call__", call_spy)
    monkeypatch.setattr(fusion._ArrayCall, "_direct", direct_spy)
    x, y = torch.randn(B, 4, 5, 3), torch.randn(B, 5, 3)
    out = fused(x, y)
    for b, m in enumerate(models):
        assert_close(out[b], m(x[b], y[b]))
    assert {name for name, direct in seen if not direct} == walked | {seen[-1][0]}, seen


@pytest.mark.parametrize("call", ["torch.bmm(a, b)", "a.bmm(b)", "torch.matmul(a, b)", "a @ b",
                                  "torch.matmul(a[0], b)", "torch.matmul(a, b[0, 0])", "a @ w",
                                  "torch.matmul(a.unsqueeze(0), b)"])
def test_products_of_two_arrays(call, monkeypatch):
    """bmm and matmul of two array values run as one batched product of the arrays where both
    are per-model batches of one rank (PointNet's transform: points @ the per-model 3x3), and
    per model under vmap where torch's broadcasting rules mix ranks; every model computes what
    its torch model does, forward and backward."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = nn.Linear(3, 3)
            self.g = nn.Linear(3, 3)
            self.w = nn.Parameter(torch.randn(3, 3))

        def forward(self, x, y):
            a, b = self.f(x), self.g(y).transpose(1, 2)  # [N, P, 3] and [N, 3, 3]
            return eval(call, {"torch": torch, "a": a, "b": b, "w": self.w})

    torch.manual_seed(0)
    B = 3
    models = [Net() for _ in range(B)]
    fused = hfkern.fuse(models)
    from hfkern import fusion
    vmapped = CallCounter(monkeypatch, fusion, "_vmap_call")
    x, y = torch.randn(B, 4, 5, 3), torch.randn(B, 4, 3, 3)
    out = fused(x, y)
    assert (vmapped.n == 0) == (call in ("torch.bmm(a, b)", "a.bmm(b)", "torch.matmul(a, b)", "a @ b"))
    out.square().sum().backward()
    for b, m in enumerate(models):
        ref = m(x[b], y[b])
        assert_close(out[b], ref)
        ref.square().sum().backward()
    for (name, p), *ps in zip(fused.named_parameters(), *(m.parameters() for m in models)):
        if ps[0].grad is None:  # unused by this call
            assert p.grad is None or not p.grad.any(), name
        else:
            assert_close(p.grad, torch.stack([q.grad for q in ps]), msg=name)


def test_bmm_of_arrays_that_are_not_per_model_batches_raises():
    class Net(nn.Module):
        def forward(self, a, b):
            return torch.bmm(a, b)

    fused = hfkern.fuse([Net(), Net()])
    a, b = torch.randn(2, 2, 3, 4, 5), torch.randn(2, 2, 3, 5, 6)  # per model 4-D
    with pytest.raises(RuntimeError, match="3"):  # torch's message, or vmap's: 3-D expected
        fused(a, b)
    with pytest.raises(RuntimeError, match="3D"):
        Net()(a[0], b[0])


# ---- writes through a reshaping call: torch's view semantics ---------------------------------------
class _WriteThrough(nn.Module):
    """A linear's output written in place through a reshaping call, then read as it is. On a
    shared input the array linear returns a [B, N, 6] view of [N, B, 6] memory, where a model's
    values cannot be flattened without a copy: `flatten`, `reshape(-1)`, `reshape_as`,
    `unflatten`, `torch.flatten` and `contiguous` copied and the write was lost (a silent error
    of 1.6), `view_as` raised torch's own view error."""

    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.kind = kind

    def forward(self, x):
        h = self.lin(x)
        k = self.kind
        if k == "flatten":
            h.flatten().mul_(2)
        elif k == "flatten_dims":
            h.flatten(0, 1).mul_(2)
        elif k == "torch.flatten":
            torch.flatten(h).mul_(2)
        elif k == "reshape":
            h.reshape(-1).add_(1)
        elif k == "torch.reshape":
            torch.reshape(h, (-1,)).add_(1)
        elif k == "reshape_as":
            h.reshape_as(torch.empty(h.numel())).mul_(2)
        elif k == "view_as":
            h.view_as(torch.empty(h.numel())).mul_(2)
        elif k == "unflatten":
            h.flatten().unflatten(0, (2, -1)).mul_(2)
        elif k == "contiguous":  # itself, for a contiguous tensor
            h.contiguous().mul_(2)
        elif k == "write_source":  # into the source, read through the reshaped result
            f = h.flatten()
            h.mul_(2)
            return f.view_as(h) + h
        return h


@pytest.mark.parametrize("kind", ["flatten", "flatten_dims", "torch.flatten", "reshape", "torch.reshape",
                                  "reshape_as", "view_as", "unflatten", "contiguous", "write_source"])
@pytest.mark.parametrize("shared", [True, False])
def test_writes_through_a_reshaping_call_reach_its_source(kind, shared):
    torch.manual_seed(0)
    models = [_WriteThrough(kind) for _ in range(B)]
    fused = hfkern.fuse(models)
    for _ in range(2):
        _assert_as_the_models(fused, models, (4, 6), shared, lambda m: m.lin.weight)


def _assert_as_the_models(fused, models, shape, shared, param):
    """A fresh batch of ``shape`` (shared, or one per model) through the fused model and the B
    models: the outputs, and the gradient of ``param(model)`` after a backward of their sum."""
    x = torch.randn(*shape) if shared else torch.randn(B, *shape)
    want = torch.stack([m(x if shared else x[b]) for b, m in enumerate(models)])
    got = fused(hfkern.broadcast(x, B) if shared else x)
    assert_close(got, want, **TOL)
    got.sum().backward()
    want.sum().backward()
    for b, m in enumerate(models):
        assert_close(param(fused).grad[b], param(m).grad, **TOL)


class _StridedWriteThrough(nn.Module):
    def __init__(self, read_source):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.read_source = read_source

    def forward(self, x):
        t = self.lin(x).t()           # non-contiguous in torch: its reshape copies
        f = t.reshape(-1)
        f.add_(1)
        return t + 1 if self.read_source else f


def test_a_write_through_a_strided_views_reshape_is_kept_or_refused():
    """Where the source is a transpose (or a slice), torch's reshape may copy or not, which the
    fused graph cannot tell: a forward that reads the source after writing through the reshape
    is refused, naming the call; one that does not read it runs, as nothing can see the
    difference."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    models = [_StridedWriteThrough(False) for _ in range(B)]
    got = hfkern.fuse(models)(hfkern.broadcast(x, B))
    assert_close(got, torch.stack([m(x) for m in models]), **TOL)
    models = [_StridedWriteThrough(True) for _ in range(B)]
    with pytest.raises(hfkern.FuseError, match=r"`\.reshape\(-1\)` at test_fuse_semantics\.py:\d+: .* cannot be "
                                               r"a view of its source"):
        hfkern.fuse(models)(hfkern.broadcast(x, B))


class _FlattenModuleWrite(nn.Module):
    """A write through nn.Flatten's output (a view in torch) that must reach the linear's output:
    the module was a layer of its own in the fused graph, outside the reshaping calls' analysis,
    and on a shared input its result was a copy (an error of 1.07)."""

    def __init__(self, module):
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.flat = nn.Flatten(1) if module == "flatten" else nn.Unflatten(2, (2, 3))

    def forward(self, x):  # x [N, T, 5]
        y = self.fc(x)
        f = self.flat(y)
        f[:, :1] = 0
        return y


@pytest.mark.parametrize("module", ["flatten", "unflatten"])
@pytest.mark.parametrize("shared", [True, False])
def test_writes_through_flatten_modules_reach_their_input(module, shared):
    torch.manual_seed(0)
    models = [_FlattenModuleWrite(module) for _ in range(B)]
    _assert_as_the_models(hfkern.fuse(models), models, (4, 3, 5), shared, lambda m: m.fc.bias)


class _OutIntoConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        o = torch.zeros(4, 5)
        with torch.no_grad():
            torch.mul(self.fc(x), 2, out=o)
        return o


def test_out_into_a_constant_is_refused():
    """``out=`` into a tensor made in forward from Python values (a constant of the captured
    forward) resized the constant to the B models' result: the first call returned [B, B, ...],
    and the model's constant stayed resized. Refused as an in-place write into it is."""
    with pytest.raises(hfkern.FuseError, match=r"modifies the tensor '_tensor_constant0' in place "
                                               r"\(`mul\(\.\.\., out=\.\.\.\)`\) at test_fuse_semantics\.py"):
        hfkern.fuse([_OutIntoConstant() for _ in range(B)])


class _WriteIntoLayerResult(nn.Module):
    def __init__(self, first):
        super().__init__()
        self.first, self.fc = first, nn.Linear(4, 3)

    def forward(self, x):
        y = self.first(x)
        y[:, 0] = 0.0  # the layer's output is a tensor of the model's own in torch
        return self.fc(y.flatten(1)[:, :4])


@pytest.mark.parametrize("first, shape", [(lambda: nn.MaxPool2d(4), (2, 1, 8, 8)),
                                          (lambda: nn.AdaptiveAvgPool2d(2), (2, 1, 8, 8)),
                                          (lambda: nn.LayerNorm(4, elementwise_affine=False), (2, 4)),
                                          (lambda: nn.Dropout(0.1), (2, 4))])
def test_writes_into_a_layer_result_broadcast_from_a_shared_input(first, shape):
    """On a shared input, these layers' results are one tensor broadcast to the B models (stride
    0), and a write into them raised torch's "more than one element ... refers to a single memory
    location": the result gets memory of its own where the forward writes into it."""
    torch.manual_seed(0)
    models = [_WriteIntoLayerResult(first()).eval() for _ in range(B)]
    fused = hfkern.fuse(models).eval()
    x = torch.randn(*shape)
    want = torch.stack([m(x) for m in models])
    assert_close(fused(hfkern.broadcast(x, B)), want, **TOL)
    assert_close(fused(torch.stack([x] * B)), want, **TOL)


class _WriteIntoInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        x = x.float()  # x itself, for a float32 input
        x.mul_(2)
        return self.fc(x)


def test_a_write_into_a_shared_input_is_a_fuse_error():
    """Per model, the write reaches the caller's tensor, as in torch; a shared input is one tensor
    for the B models and cannot take their writes: a FuseError naming the statement (it was
    torch's error about memory locations)."""
    torch.manual_seed(0)
    models = [_WriteIntoInput() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(4, 5)
    mine = torch.stack([x] * B)
    want = torch.stack([m(x.clone()) for m in models])
    assert_close(fused(mine), want, **TOL)
    assert_close(mine, torch.stack([2 * x] * B))
    with pytest.raises(hfkern.FuseError, match=r"`mul_` at test_fuse_semantics\.py:\d+: `x\.mul_\(2\)` .*shared by "
                                               r"the B models"):
        fused(hfkern.broadcast(x, B))


class _SetMemory(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        y = self.fc(x)
        return y.detach().clone().set_(torch.arange(3.0))


def test_set_is_refused():
    """``Tensor.set_`` was ignored: the result kept the tensor's own values and shape."""
    with pytest.raises(hfkern.FuseError, match=r"`\.set_\(\)` gives a tensor other memory at test_fuse_semantics"):
        hfkern.fuse([_SetMemory() for _ in range(B)])


class _FunctionalUnderAutocast(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(6, 6)
        self.w, self.b = nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(6))
        self.g, self.a = nn.Parameter(torch.rand(6) + 0.5), nn.Parameter(torch.rand(1))

    def forward(self, x):
        h = self.fc(x)
        k = self.kind
        if k == "linear":
            return F.linear(x, self.w, self.b)
        if k == "layer_norm":
            return F.layer_norm(h, (6,), self.g)
        if k == "conv1d":
            return F.conv1d(h.view(-1, 2, 3), self.w.view(6, 2, 3)[:4, :, :2], self.b[:4])
        if k == "prelu":
            return F.prelu(h, self.a)
        return F.cross_entropy(h, torch.zeros(h.size(0), dtype=torch.long)).reshape(1)


@pytest.mark.parametrize("kind", ["linear", "layer_norm", "conv1d", "prelu", "cross_entropy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_calls_run_per_model_keep_the_cpu_autocast_of_each_model(kind, dtype):
    """Calls on per-model tensors run under torch.vmap, which does not apply CPU autocast: a
    linear of a parameter used directly stayed float32 (bfloat16 per model), a convolution raised
    a dtype error, a cross entropy was computed in bfloat16. Under CPU autocast they run once per
    model, as each model's call would."""
    if dtype == torch.float16 and kind == "prelu":
        pytest.skip("torch's CPU prelu has no float16 kernel")
    torch.manual_seed(0)
    models = [_FunctionalUnderAutocast(kind) for _ in range(B)]
    fused = hfkern.fuse(copy.deepcopy(models))
    x = torch.randn(4, 6)
    with torch.autocast("cpu", dtype=dtype):
        want = torch.stack([m(x) for m in models])
        got = fused(hfkern.broadcast(x, B))
    assert got.dtype == want.dtype
    assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    got.float().sum().backward()
    want.float().sum().backward()
    for (name, p), theirs in zip(fused.named_parameters(), zip(*[m.parameters() for m in models])):
        if p.grad is not None or theirs[0].grad is not None:
            assert_close(p.grad, torch.stack([t.grad for t in theirs]), rtol=2e-2, atol=2e-2, msg=name)
