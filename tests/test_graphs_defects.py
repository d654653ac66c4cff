"""hfkern.capture_step: a replay must never run stale work, and must give what an eager call gives.

Each test trains (or steps) once eagerly and once through ``capture_step`` and
compares the two bit for bit. Where the defect is a host value frozen into the
graph (a module's mode, a dropout probability, a parameter's memory, a Python
float argument) the captured run uses tests/_graph_sim.py's recorded graph,
whose replay runs only the ops the capture recorded, no Python, as a CUDA graph
does; the others use the Python-replaying ``simulated`` graph of
tests/test_graphs.py.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

import hfkern
from hfkern import graphs
from hfkern.nn import Dropout
from _graph_sim import recorded

B = 3


@pytest.fixture
def torch_backend():
    # the recorded graph sees ATen ops only (not hfkern's extension's)
    with hfkern.use_backend("torch"):
        yield


class _Net(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(6, 1)

    def forward(self, x):
        return self.out(self.drop(self.fc(x)))


def _train(captured: bool, ps=(0.5, 0.1, 0.2), changes=None, steps=8, extra=None, net=None, shape=(4, 6)):
    """(losses [steps, B], fused model, the step called): a fused model of dropout nets
    (``net(p)``, default ``_Net``) trained with SGD on batches of ``shape``,
    ``changes[i](fused, opt)`` run before step i; with ``captured``, through capture_step
    (one warm-up call) under the recorded graph."""
    torch.manual_seed(0)
    fused = hfkern.fuse([(net or _Net)(p) for p in ps])
    opt = hfkern.optim.SGD(fused.parameters(), lr=0.1, momentum=0.9)
    post = extra if extra is not None else (lambda out: out)

    def step(x):
        out = post(fused(hfkern.broadcast(x, B)))
        losses = out.pow(2).mean(dim=tuple(range(1, out.dim())))
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        return losses.detach()

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(*shape, generator=g) for _ in range(steps)]
    with recorded() if captured else contextlib.nullcontext():
        run = hfkern.capture_step(step, batches[0], warmup=1) if captured else step
        losses = []
        for i, x in enumerate(batches):
            if changes and i in changes:
                changes[i](fused, opt)
            losses.append(run(x))
    return torch.stack(losses), fused, run


def _assert_same(a, b):
    assert torch.equal(a[0], b[0])
    for (k, v), (_, w) in zip(a[1].state_dict().items(), b[1].state_dict().items()):
        assert torch.equal(v, w), k


def _load(b, p, seed=5):
    def change(fused, opt):
        torch.manual_seed(seed)
        fused.load_model(b, _Net(p))
    return change


# ---- 1. host values a module's forward computes with ------------------------------------------

def test_a_per_model_dropout_probability_loaded_after_capture_takes_effect_without_a_capture(torch_backend):
    """load_model with another p: the per-model probabilities live in device tensors, written in
    place, so the graph drops with the new ones (the replays dropped with the old ones)."""
    changes = {3: _load(1, 0.0), 5: _load(2, 0.9, seed=6)}
    captured = _train(True, changes=changes)
    _assert_same(captured, _train(False, changes=changes))
    assert captured[2].graphs == 1 and captured[2].eager_calls == 1


def test_a_dropout_probability_that_changes_the_work_forces_a_new_capture(torch_backend):
    """One p for every model is F.dropout's host argument, and one p or one per model are two
    different computations: a change of either kind is captured anew."""
    def uniform(p):
        def change(fused, opt):
            fused.drop.p = p
        return change

    # per model -> all equal (F.dropout's path) -> another common value -> per model again
    changes = {2: uniform(0.3), 4: uniform(0.6), 6: uniform((0.1, 0.2, 0.3))}
    captured = _train(True, changes=changes, steps=10)
    _assert_same(captured, _train(False, changes=changes, steps=10))
    assert captured[2].graphs == 4


def test_train_and_eval_after_capture_force_a_new_capture(torch_backend):
    changes = {3: lambda fused, opt: fused.eval(), 6: lambda fused, opt: fused.train()}
    captured = _train(True, changes=changes, steps=9)
    _assert_same(captured, _train(False, changes=changes, steps=9))
    assert captured[2].graphs == 3


def test_the_mode_of_a_plain_torch_module_the_step_runs_is_watched(torch_backend):
    """A torch module outside hfkern whose forward reads self.training: its mode at capture is
    frozen in the graph, so a switch is captured anew."""
    class Twice(nn.Module):
        def forward(self, x):
            return x * 2 if self.training else x

    def run(captured):
        twice = Twice()
        changes = {3: lambda fused, opt: twice.eval(), 5: lambda fused, opt: twice.train()}
        return _train(captured, ps=(0.0, 0.0, 0.0), changes=changes, extra=twice)

    captured = run(True)
    _assert_same(captured, run(False))
    assert captured[2].graphs == 3


def test_a_submodules_mode_is_watched_too(torch_backend):
    changes = {3: lambda fused, opt: fused.drop.eval()}
    captured = _train(True, changes=changes)
    _assert_same(captured, _train(False, changes=changes))
    assert captured[2].graphs == 2


def test_the_host_checks_per_call_stay_small(torch_backend):
    """What every call checks: the optimizers' structure and the watched modules (a few
    microseconds for this model; measured, not asserted tightly: other processes share the CPU)."""
    import timeit

    _, fused, run = _train(True, steps=3)
    (graph,) = run._graphs.values()
    assert not graph.stale()
    assert len(graph.modules.modules) == len(list(fused.modules()))
    per_call = min(timeit.repeat(graph.stale, number=200, repeat=5)) / 200
    assert per_call < 1e-3


# ---- 2. memory replaced after capture -----------------------------------------------------------

def _linear_training(captured, change_at, change, opt_cls=hfkern.optim.SGD, steps=6):
    torch.manual_seed(0)
    fused = hfkern.fuse(lambda: nn.Linear(5, 1), B)
    opt = opt_cls(fused.parameters(), lr=0.1)

    def step(x):
        losses = fused(hfkern.broadcast(x, B)).pow(2).mean(dim=(1, 2))
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        return losses.detach()

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 5, generator=g) for _ in range(steps)]
    with recorded() if captured else contextlib.nullcontext():
        run = hfkern.capture_step(step, batches[0], warmup=1) if captured else step
        losses = []
        for i, x in enumerate(batches):
            if i == change_at:
                change(fused, opt)
            losses.append(run(x))
    return torch.stack(losses), fused, run


@pytest.mark.parametrize("change", [
    lambda fused, opt: (fused.double(), fused.float()),  # the same Parameter objects, new memory
    lambda fused, opt: setattr(fused.weight, "data", fused.weight.detach().clone()),
], ids=["double_float", "data"])
def test_parameters_given_new_memory_force_a_new_capture(change, torch_backend):
    captured = _linear_training(True, 3, change)
    _assert_same(captured, _linear_training(False, 3, change))
    assert captured[2].graphs == 2


def test_optimizer_state_replaced_after_capture_forces_a_new_capture(torch_backend):
    change = lambda fused, opt: opt.state.clear()
    captured = _linear_training(True, 3, change, hfkern.optim.Adam)
    _assert_same(captured, _linear_training(False, 3, change, hfkern.optim.Adam))
    assert captured[2].graphs == 2


def test_a_parameter_frozen_after_capture_forces_a_new_capture(torch_backend):
    change = lambda fused, opt: fused.bias.requires_grad_(False)
    captured = _linear_training(True, 3, change, hfkern.optim.Adam)
    _assert_same(captured, _linear_training(False, 3, change, hfkern.optim.Adam))
    assert captured[2].graphs == 2


# ---- 3. arguments the step writes in place ---------------------------------------------------------

def test_arguments_written_in_place_are_copied_back(simulated_or_recorded):
    def step(x, acc):
        acc.add_(x)  # a running sum the caller keeps
        return acc

    x = torch.arange(3.0)
    eager_acc, acc = torch.zeros(3), torch.zeros(3)
    for _ in range(5):
        step(x, eager_acc)
    with simulated_or_recorded():
        run = hfkern.capture_step(step, x, acc, warmup=2)
        for _ in range(5):
            out = run(x, acc)
            assert out is acc  # the argument itself, as an eager call returns it
    assert torch.equal(acc, eager_acc) and run.graphs == 1


# ---- 4. arguments that require grad ----------------------------------------------------------------

def test_an_input_that_requires_grad_gets_the_grad_an_eager_call_gives_it(torch_backend):
    w = torch.tensor([1.0, 2.0, 3.0])

    def step(x):
        (w * x).pow(2).sum().backward()
        return x.grad.clone()  # the input's gradient (FGSM-like)

    def calls(run):
        xs = [torch.full((3,), float(i + 1), requires_grad=True) for i in range(3)]
        again = torch.full((3,), 5.0, requires_grad=True)
        outs = [run(x) for x in xs] + [run(again) for _ in range(4)]  # .grad accumulates
        return outs, [x.grad for x in xs] + [again.grad]

    eager = calls(step)
    with recorded():
        run = hfkern.capture_step(step, torch.zeros(3, requires_grad=True), warmup=1)
        captured = calls(run)
    for a, b in zip(eager[0] + eager[1], captured[0] + captured[1]):
        assert torch.equal(a, b)
    assert run.graphs == 2  # with and without a .grad before the call


def test_a_non_leaf_input_that_requires_grad_is_refused_on_the_cpu_too():
    run = hfkern.capture_step(lambda x: x * 2, torch.zeros(3))
    w = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="argument leaf 0 requires grad and is not a leaf"):
        run(w * 2)


# ---- 5. a change between the last eager call and the capture ----------------------------------

def test_a_group_changed_after_the_warmup_is_validated_eagerly_before_the_capture(monkeypatch, torch_backend):
    """Validating a new value copies it to the device and reads it back (which work it switches
    on): inside a capture that fails, and every later call tried again."""
    from hfkern.optim import _base

    validated_while_capturing = []
    validate = _base.ArrayOptimizer._validate_group

    def watched(self, group):
        validated_while_capturing.append(graphs._recording.capturing)
        return validate(self, group)

    monkeypatch.setattr(_base.ArrayOptimizer, "_validate_group", watched)

    def change(fused, opt):
        opt.param_groups[0]["lr"] = 0.05  # assigned anew between the warm-up and the capture

    captured = _linear_training(True, 1, change)
    _assert_same(captured, _linear_training(False, 1, change))
    assert True not in validated_while_capturing
    assert (captured[2].eager_calls, captured[2].graphs) == (2, 1)


# ---- 6. non-tensor arguments keyed by their bits -----------------------------------------------

@pytest.mark.parametrize("zero, negative_zero", [
    (np.float32(0.0), np.float32(-0.0)), (np.float16(0.0), np.float16(-0.0)), (complex(0.0), complex(-0.0, 0.0)),
    (np.complex64(0.0), np.complex64(complex(-0.0, 0.0))),
], ids=["float32", "float16", "complex", "complex64"])
def test_numpy_and_complex_scalars_key_their_graphs_by_their_bits(zero, negative_zero):
    def step(x, s):
        return x / float(complex(s).real)  # a host value the graph holds

    x = torch.ones(2)
    with recorded():
        run = hfkern.capture_step(step, x, zero, warmup=1)
        for _ in range(2):
            run(x, zero)
        assert torch.equal(run(x, negative_zero), step(x, negative_zero))  # -inf, not the +0 graph's inf
        nan = type(zero)(float("nan"))
        for _ in range(4):
            run(x, type(zero)(nan))
    assert len(run._warm) == 3 and run.graphs == 2  # a NaN matches itself: one graph, not one per call


# ---- 7. grad mode and autocast -----------------------------------------------------------------------

def _tiny_step():
    w = nn.Parameter(torch.ones(B, 2))
    opt = hfkern.optim.SGD([w], lr=0.1)

    def step(x):
        loss = (w * x).sum(1)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        return loss.detach()

    return w, step


def test_a_call_under_no_grad_runs_as_an_eager_call_does(torch_backend):
    w, step = _tiny_step()
    x = torch.ones(2)
    with recorded():
        run = hfkern.capture_step(step, x, warmup=1)
        run(x)
        run(x)
        before = w.detach().clone()
        with torch.no_grad(), pytest.raises(RuntimeError, match="does not require grad"):
            run(x)  # eagerly, as its own signature's warm-up: it raises as the step does
    assert torch.equal(w.detach(), before)


def test_autocast_gets_its_own_graph(torch_backend):
    def make():
        torch.manual_seed(0)
        lin = nn.Parameter(torch.randn(B, 4, 4))

        def step(x):
            return torch.bmm(hfkern.broadcast(x, B), lin).float()

        return step

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 4, generator=g) for _ in range(4)]
    eager, step = make(), make()
    with recorded():
        run = hfkern.capture_step(step, xs[0], warmup=1)
        for x in xs[:2]:
            assert torch.equal(run(x), eager(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for x in xs:
                assert torch.equal(run(x), eager(x))
    assert run.graphs == 2


# ---- keyword arguments ----------------------------------------------------------------------------

def test_keyword_arguments_in_another_order_replay_the_same_graph():
    def step(x, *, a, b):
        return x * a - b

    x, a, b = torch.ones(2), torch.full((2,), 3.0), torch.full((2,), 1.0)
    with recorded():
        run = hfkern.capture_step(step, x, warmup=1)
        assert torch.equal(run(x, a=a, b=b), step(x, a=a, b=b))
        assert torch.equal(run(x, b=b, a=a), step(x, a=a, b=b))  # the capture
        assert torch.equal(run(x, a=a * 2, b=b), step(x, a=a * 2, b=b))  # a replay
    assert run.graphs == 1 and run.eager_calls == 1


def test_reset_drops_the_graphs():
    _, step = _tiny_step()
    x = torch.ones(2)
    with recorded():
        run = hfkern.capture_step(step, x, warmup=1)
        run(x)
        run(x)
        run.reset()
        run(x)
        run(x)
    assert (run.eager_calls, run.graphs) == (2, 2)


# ---- the dropout layers' device-held probabilities ----------------------------------------------

def test_a_dropout_layer_whose_p_is_set_drops_with_it():
    x = torch.ones(B, 64, 8)
    layer, fresh = Dropout((0.1, 0.2, 0.3), B=B), Dropout((0.7, 0.0, 0.5), B=B)
    with torch.inference_mode():
        layer(x)  # the device tensors made under inference mode are written in place outside it
    layer.p = (0.7, 0.0, 0.5)
    torch.manual_seed(3)
    got = layer(x)
    torch.manual_seed(3)
    assert torch.equal(got, fresh(x))


@pytest.fixture(params=["simulated", "recorded"])
def simulated_or_recorded(request, monkeypatch):
    if request.param == "recorded":
        return recorded
    from test_graphs import _SimulatedGraph

    @contextlib.contextmanager
    def simulated():
        with monkeypatch.context() as m:
            m.setattr(graphs, "_on_cuda", lambda args, kwargs: True)
            m.setattr(graphs.CapturedStep, "_warmup_stream", staticmethod(contextlib.nullcontext))
            m.setattr(graphs.CapturedStep, "_new_graph", lambda self: _SimulatedGraph())
            yield

    return simulated


# ---- attention dropout, per model: the same device tensors as Dropout's ------------------------

class _AttnNet(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.attn = nn.MultiheadAttention(6, 2, dropout=p, batch_first=True)
        self.out = nn.Linear(6, 1)

    def forward(self, x):
        return self.out(self.attn(x, x, x, need_weights=False)[0])


def test_a_per_model_attention_dropout_loaded_after_capture_takes_effect_without_a_capture(torch_backend):
    def load(fused, opt):
        torch.manual_seed(5)
        fused.load_model(1, _AttnNet(0.0))

    kw = dict(changes={3: load}, steps=6, net=_AttnNet, shape=(2, 4, 6))
    captured = _train(True, **kw)
    _assert_same(captured, _train(False, **kw))
    assert captured[2].graphs == 1 and captured[2].eager_calls == 1
    assert captured[1].attn.dropout == (0.5, 0.0, 0.2)


def test_another_profiler_during_capture_is_warned_of(torch_backend):
    """Under another sys.setprofile profiler the step's modules cannot be found, so their modes
    are not watched: capture_step says so rather than replay a stale graph silently later."""
    import cProfile
    import warnings

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        with pytest.warns(UserWarning, match="another Python profiler"):
            _train(True, steps=3)
    finally:
        profiler.disable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(True, steps=3)  # none without one
