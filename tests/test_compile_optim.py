"""The array optimizers' step under torch.compile(fullgraph=True).

dynamo runs ``ArrayOptimizer._init_group`` (validation, state creation, the
gather of the step's tensors) eagerly while tracing, as it runs torch's own
optimizers' ``_init_group``, and traces the op calls. These tests compare every
compiled step with an eager twin bit for bit, and check that what a user
changes between steps (a value assigned anew, in place, by
``set_hyperparameters``, a new param group, skip masks, surgery) reaches the
compiled step, re-tracing where the traced work depends on it and only there.
"""

import copy

import pytest
import torch
import torch._dynamo.testing

import hfkern
import hfkern.nn as hnn
import hfkern.optim as hoptim

B = 3
LRS = [0.01, 0.02, 0.005]

# Every optimizer, with the options that change its traced work switched on.
CASES = {
    "SGD": dict(momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": dict(amsgrad=True, weight_decay=0.01),
    "AdamW": dict(betas=([0.9, 0.8, 0.95], 0.99)),
    "RMSprop": dict(centered=True, momentum=0.5),
    "Adagrad": dict(lr_decay=0.01, initial_accumulator_value=0.1),
    "Adadelta": dict(weight_decay=0.01),
    "LAMB": dict(weight_decay=0.01),
    "LARS": dict(momentum=0.9, weight_decay=0.001),
}


def _pair(name, **overrides):
    """One model array and an eager twin, each with its own optimizer of ``name``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(hnn.Linear(5, 6, B=B), torch.nn.Tanh(), hnn.Linear(6, 4, B=B))
    twin = copy.deepcopy(model)
    kwargs = {**CASES[name], **overrides}
    lr = [1.0, 0.5, 0.8] if name == "Adadelta" else LRS
    make = getattr(hoptim, name)
    return model, make(model.parameters(), lr=lr, **kwargs), twin, make(twin.parameters(), lr=lr, **kwargs)


def _backward(models, x):
    for m in models:
        m.zero_grad()  # set_to_none: new gradient tensors every step, as in a training loop
        m(x).square().mean(dim=(1, 2)).sum().backward()


def _assert_same(model, twin):
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_step_equals_eager(name):
    torch._dynamo.reset()
    model, opt, twin, twin_opt = _pair(name)
    counter = torch._dynamo.testing.CompileCounter()
    step = torch.compile(opt.step, fullgraph=True, backend=counter)
    for _ in range(4):
        _backward((model, twin), torch.randn(B, 7, 5))
        step()
        twin_opt.step()
        _assert_same(model, twin)
    # One trace: new gradients every step and the state created at the first do not re-trace.
    assert counter.frame_count == 1
    for p, q in zip(model.parameters(), twin.parameters()):
        for key, value in twin_opt.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_step_through_aot_and_inductor(backend):
    torch._dynamo.reset()
    model, opt, twin, twin_opt = _pair("Adam")

    @torch.compile(fullgraph=True, backend=backend)
    def step():
        opt.step()

    for _ in range(3):
        _backward((model, twin), torch.randn(B, 4, 5))
        step()
        twin_opt.step()
        _assert_same(model, twin)


def test_changes_between_compiled_steps_reach_the_step():
    torch._dynamo.reset()
    model, opt, twin, twin_opt = _pair("SGD", nesterov=False, weight_decay=0.0)
    counter = torch._dynamo.testing.CompileCounter()

    @torch.compile(fullgraph=True, backend=counter)
    def step(skip=None):
        opt.step(skip=skip)

    def both(change=lambda o: None, traces=0, skip=None):
        before = counter.frame_count
        _backward((model, twin), torch.randn(B, 7, 5))
        change(opt)
        change(twin_opt)
        step(skip)
        twin_opt.step(skip=skip)
        _assert_same(model, twin)
        assert torch.equal(opt.last_skipped, twin_opt.last_skipped)
        assert counter.frame_count - before == traces

    both(traces=1)
    both()
    # Written in place: read by the traced step as it is.
    both(lambda o: o.param_groups[0]["lr"].mul_(0.5))
    both(lambda o: o.set_hyperparameters(1, lr=0.3))
    # Assigned anew (a float, a new tensor): validated at a new trace.
    both(lambda o: o.param_groups[0].__setitem__("lr", 0.05), traces=1)
    both(lambda o: o.param_groups[0].__setitem__("lr", torch.tensor([0.1, 0.02, 0.03])), traces=1)
    # Weight decay switched on for one model: work the traced step did not do.
    both(lambda o: o.set_hyperparameters(2, weight_decay=0.1), traces=1)
    both(lambda o: o.param_groups[0].__setitem__("nesterov", True), traces=1)
    both(skip=torch.tensor([True, False, True]), traces=1)
    both(skip=torch.tensor([False, False, True]))
    both(lambda o: o.reset_state(0))
    both()


def test_a_param_group_added_later_is_traced():
    torch._dynamo.reset()
    model, opt, twin, twin_opt = _pair("Adam")
    extra, twin_extra = hnn.Linear(5, 5, B=B), None
    twin_extra = copy.deepcopy(extra)
    step = torch.compile(opt.step, fullgraph=True, backend="eager")
    _backward((model, twin), torch.randn(B, 7, 5))
    step()
    twin_opt.step()
    opt.add_param_group({"params": extra.parameters(), "lr": 0.1})
    twin_opt.add_param_group({"params": twin_extra.parameters(), "lr": 0.1})
    for _ in range(2):
        x = torch.randn(B, 7, 5)
        _backward((model, twin), x)
        for m in (extra, twin_extra):
            m.zero_grad()
            m(x).sum().backward()
        step()
        twin_opt.step()
        _assert_same(model, twin)
        _assert_same(extra, twin_extra)


def test_skip_nonfinite_compiled():
    torch._dynamo.reset()
    model, opt, twin, twin_opt = _pair("AdamW", skip_nonfinite=True)
    step = torch.compile(opt.step, fullgraph=True, backend="eager")
    for bad in (None, 1, None):
        _backward((model, twin), torch.randn(B, 7, 5))
        if bad is not None:
            for m in (model, twin):
                m[0].weight.grad[bad, 0, 0] = float("nan")
        step()
        twin_opt.step()
        _assert_same(model, twin)
        assert torch.equal(opt.last_skipped, twin_opt.last_skipped)
    assert opt.last_skipped.tolist() == [False, False, False]
    # Eager steps after compiled ones write the same tensor, which stays right either way.
    held = opt.last_skipped
    for skip in (torch.tensor([False, True, False]), None):
        _backward((model, twin), torch.randn(B, 7, 5))
        opt.step(skip=skip)
        twin_opt.step(skip=skip)
        _assert_same(model, twin)
        assert opt.last_skipped is held and torch.equal(held, twin_opt.last_skipped)
    step(skip=torch.tensor([True, False, False]))
    assert held.tolist() == [True, False, False]


def test_a_bad_value_raises_at_the_compiled_step_and_changes_nothing():
    torch._dynamo.reset()
    model, opt, _, _ = _pair("Adam")
    step = torch.compile(opt.step, fullgraph=True, backend="eager")
    _backward((model,), torch.randn(B, 7, 5))
    step()
    params = [p.clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    opt.param_groups[0]["lr"] = -1.0
    # dynamo reports an error raised while it traces as its own error type, the
    # message kept (as for torch's optimizers' _init_group).
    with pytest.raises(Exception, match=r"Adam: lr must be >= 0 for every model, got \[-1.0, -1.0, -1.0\]"):
        step()
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    for key, entry in opt.state_dict()["state"].items():
        for k, v in entry.items():
            assert torch.equal(v, state[key][k])


def test_compiled_training_step_of_a_fused_model():
    """A whole step (forward, loss, backward, optimizer) under torch.compile: the
    backward is a graph break; the optimizer step traces."""
    torch._dynamo.reset()
    models = [torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)) for _ in range(B)]
    fused, twin = hfkern.fuse(models), hfkern.fuse(copy.deepcopy(models))
    opt = hoptim.SGD(fused.parameters(), lr=LRS, momentum=0.9)
    twin_opt = hoptim.SGD(twin.parameters(), lr=LRS, momentum=0.9)

    def train_step(model, optimizer, x, y):
        optimizer.zero_grad()
        losses = hfkern.nn.functional.cross_entropy(model(x), y)
        losses.sum().backward()
        optimizer.step()
        return losses.detach()

    compiled = torch.compile(train_step, backend="eager")
    for _ in range(3):
        x, y = hfkern.broadcast(torch.randn(6, 5), B), torch.randint(0, 3, (6,))
        got = compiled(fused, opt, x, y)
        want = train_step(twin, twin_opt, x, y)
        assert torch.equal(got, want)
        _assert_same(fused, twin)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_bad_value_in_a_compiled_step_raises_with_hfkerns_message(fullgraph):
    torch._dynamo.reset()
    model = hnn.Linear(3, 2, B=B)
    opt = hoptim.SGD(model.parameters(), lr=0.1)
    model(hfkern.broadcast(torch.randn(4, 3), B)).sum().backward()
    step = torch.compile(opt.step, fullgraph=fullgraph, backend="eager")
    step()
    cases = [(dict(skip=torch.zeros(B + 1, dtype=torch.bool)), ValueError, r"skip must have shape \[B\]=\[3\]"),
             (dict(skip=torch.zeros(B)), TypeError, "skip must be a bool tensor")]
    for kwargs, error, match in cases:
        # Without fullgraph the eager step's own error; with it, dynamo's, hfkern's message inside.
        with pytest.raises(Exception if fullgraph else error, match=match):
            step(**kwargs)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(Exception if fullgraph else ValueError, match="lr must be >= 0"):
        step()
