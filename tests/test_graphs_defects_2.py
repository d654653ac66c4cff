"""hfkern.capture_step: the parameters' gradients after a replay, writes to arguments under
inference mode, tensor layouts a graph cannot take, and calls that keep needing new graphs.

The captured runs use tests/_graph_sim.py's recorded graph, whose replay runs only the ops
the capture recorded and no Python, as a CUDA graph does, and are compared with eager runs
bit for bit.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import hfkern
import hfkern.nn as hnn
from hfkern import graphs
from _graph_sim import recorded

B = 3


@pytest.fixture(autouse=True)
def torch_backend():
    # the recorded graph sees ATen ops only (not hfkern's extension's)
    with hfkern.use_backend("torch"):
        yield


def _batches(n: int, shape=(5, 4)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _model():
    torch.manual_seed(0)
    lin = hnn.Linear(4, 3, B=B)
    return lin, hfkern.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)


def _sgd_step(lin, opt):
    """The whole step of ``lin`` and ``opt``: forward, per-model losses, backward, optimizer step."""
    def step(x):
        losses = lin(hfkern.broadcast(x, B)).pow(2).mean(dim=(1, 2))
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        return losses.detach()
    return step


def _run(captured: bool, loop, steps: int = 6):
    """``loop(run, lin, opt, x, i)`` for each batch, ``run`` the step (forward and backward:
    ``fwd_bwd``) or its capture (one warm-up call); per call the weights and the gradient the
    loop reads, and the captured step."""
    lin, opt = _model()

    def fwd_bwd(x):
        losses = lin(hfkern.broadcast(x, B)).pow(2).mean(dim=(1, 2))
        losses.sum().backward()
        return losses.detach()

    xs = _batches(steps)
    seen = []
    with recorded() if captured else contextlib.nullcontext():
        run = hfkern.capture_step(fwd_bwd, xs[0], warmup=1) if captured else fwd_bwd
        for i, x in enumerate(xs):
            grad = loop(run, lin, opt, x, i)
            seen.append((lin.weight.detach().clone(), None if grad is None else grad.clone()))
    return seen, run


def _assert_same_runs(eager, captured):
    for (w0, g0), (w1, g1) in zip(eager, captured):
        assert torch.equal(w0, w1)
        assert (g0 is None) == (g1 is None)
        if g0 is not None:
            assert torch.equal(g0, g1)


def test_gradients_cleared_before_the_call_are_the_steps_after_a_replay():
    """The caller clears the gradients (set to None, torch's default) before a captured
    forward and backward and steps the optimizer after it: after each replay every parameter's
    .grad is the step's gradient, so the optimizer trains as in eager calls. (Before, .grad
    stayed None after a replay and opt.step() updated nothing from the second call on.)"""
    def loop(run, lin, opt, x, i):
        opt.zero_grad()
        run(x)
        grad = lin.weight.grad
        opt.step()
        return grad

    eager, _ = _run(False, loop)
    captured, run = _run(True, loop)
    _assert_same_runs(eager, captured)
    assert run.graphs == 1  # one capture, then replays


def test_whole_step_with_gradients_cleared_outside_leaves_them_set():
    """The whole step captured, the gradients cleared outside it: after a replay .grad holds the
    step's gradient (gradient-norm logging after the call reads it), as after an eager call."""
    def make(lin, opt):
        def step(x):
            losses = lin(hfkern.broadcast(x, B)).pow(2).mean(dim=(1, 2))
            losses.sum().backward()
            opt.step()
            return losses.detach()
        return step

    results = []
    for captured in (False, True):
        lin, opt = _model()
        step = make(lin, opt)
        with recorded() if captured else contextlib.nullcontext():
            run = hfkern.capture_step(step, _batches(1)[0], warmup=1) if captured else step
            out = []
            for x in _batches(5):
                opt.zero_grad()
                run(x)
                assert lin.weight.grad is not None
                out.append((lin.weight.detach().clone(), lin.weight.grad.clone()))
        results.append(out)
    _assert_same_runs(*results)


def test_a_gradient_that_no_longer_fits_the_graph_forces_a_new_capture():
    """A step that adds to the gradients (no zero_grad anywhere) captures from the gradients
    as they are; the caller clearing them later (or assigning another tensor) is what an eager
    call computes from differently, so it forces a new capture, never a stale replay."""
    def loop(run, lin, opt, x, i):
        if i == 3:
            opt.zero_grad()  # set to None: the graph added to the old .grad
        if i == 5:
            lin.bias.grad = torch.ones_like(lin.bias)  # another tensor
        run(x)
        grad = lin.weight.grad
        if i % 2:
            opt.step()
        return grad

    eager, _ = _run(False, loop, steps=8)
    captured, run = _run(True, loop, steps=8)
    _assert_same_runs(eager, captured)
    assert run.graphs >= 2  # the first capture, and new ones after the changes


def test_gradients_cleared_at_some_calls_only():
    """The caller clears the gradients before some calls and not before others: each call
    computes what an eager call computes (a new capture where the graph would compute from
    another gradient than the call has)."""
    def loop(run, lin, opt, x, i):
        if i in (0, 1, 2, 5):
            opt.zero_grad()
        run(x)
        grad = lin.weight.grad
        opt.step()
        return grad

    eager, _ = _run(False, loop, steps=8)
    captured, _ = _run(True, loop, steps=8)
    _assert_same_runs(eager, captured)


def test_argument_written_under_inference_mode_is_copied_back():
    """An evaluation step called under torch.inference_mode() that accumulates into a tensor
    argument: the caller's tensor gets every call's write, as eagerly. (Before, the static copy
    made under inference mode had no version counter, the write was never seen and the
    caller's tensor kept the capturing call's value.)"""
    lin, _ = _model()

    def eval_step(x, acc):
        out = lin(hfkern.broadcast(x, B))
        acc.add_(out.pow(2).mean(dim=(1, 2)))
        return out.sum()

    accs = []
    for captured in (False, True):
        acc = torch.zeros(B)
        with recorded() if captured else contextlib.nullcontext():
            run = hfkern.capture_step(eval_step, torch.randn(5, 4), acc, warmup=1) if captured else eval_step
            for x in _batches(5):
                with torch.inference_mode():
                    run(x, acc)
        accs.append(acc)
    assert torch.equal(accs[0], accs[1])


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "nested", "mkldnn"])
def test_non_strided_arguments_are_refused_by_name(kind):
    """A tensor argument a graph could not copy into a static strided buffer (sparse, nested,
    MKLDNN) raises a TypeError naming the argument and its layout, on the CPU too (code does not
    branch between devices); the caller's tensor is not touched."""
    dense = torch.randn(3, 4)
    x = {"sparse_coo": lambda: dense.to_sparse(), "sparse_csr": lambda: dense.to_sparse_csr(),
         "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
         "mkldnn": lambda: dense.to_mkldnn()}[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's beta/prototype warnings)
        arg = x()
    step = hfkern.capture_step(lambda a, y: y * 2, torch.zeros(1), torch.zeros(1))
    with pytest.raises(TypeError, match=r"argument leaf 0 is a .*(sparse|nested|mkldnn).* strided"):
        step(arg, torch.ones(2))
    with pytest.raises(TypeError, match="argument leaf 0"):
        hfkern.capture_step(lambda a: a, arg)  # the example arguments are checked alike


def test_calls_that_keep_needing_new_graphs_warn_once_and_keep_bounded_records(monkeypatch):
    """A Python value that changes at every call (a step counter) makes every call a new
    signature, each warming up and never captured: a UserWarning says so once, naming the
    argument, and only the most recent signatures' warm-up records are kept (before, they grew
    by one per call, each holding the modules it ran)."""
    monkeypatch.setattr(graphs, "_KEPT_COLD", 16)
    lin, opt = _model()

    def step(x, it):
        losses = lin(hfkern.broadcast(x, B)).pow(2).mean(dim=(1, 2)) * (1 + 0 * it)
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        return losses.detach()

    x = _batches(1)[0]
    with recorded(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = hfkern.capture_step(step, x, 0, warmup=2)
        for it in range(60):
            run(x, it)
    ours = [w for w in caught if "capture_step" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "leaf 1 (a int, 9 values)" in str(ours[0].message) and "as a tensor" in str(ours[0].message)
    assert run.graphs == 0 and run.eager_calls == 60
    assert max(len(run._warm), len(run._last_eager), len(run._watches)) <= 16


def test_a_few_signatures_do_not_warn():
    """Batches of a few shapes (a last, smaller batch) are what graphs per signature are for:
    no warning."""
    step = _sgd_step(*_model())

    with recorded(), warnings.catch_warnings():
        warnings.simplefilter("error")
        run = hfkern.capture_step(step, torch.randn(5, 4), warmup=1)
        for n in (5, 5, 5, 2, 2, 2, 5):
            run(torch.randn(n, 4))
    assert run.graphs == 2


def test_many_recurring_batch_shapes_each_get_their_graph_without_a_warning():
    """Batches of 40 shapes, each recurring: every shape warms up and gets its graph (before,
    the records of signatures past the 32 most recent were dropped before they could reach a
    capture, so none was ever captured), and no warning (shapes are what graphs per signature
    are for)."""
    step = _sgd_step(*_model())

    with recorded(), warnings.catch_warnings():
        warnings.simplefilter("error")
        run = hfkern.capture_step(step, torch.randn(1, 4), warmup=1)
        for _ in range(3):
            for n in range(1, 41):
                run(torch.randn(n, 4))
    assert run.graphs == 40


def test_a_new_gradient_tensor_at_the_address_of_the_old_one_forces_a_new_capture():
    """The caller replaces a gradient the graph adds to (``.grad = None`` then a new tensor,
    which Python may place where the freed one was): the replay would write the old memory, so
    it is a change, found by identity with the gradient held, not by an address."""
    def loop(run, lin, opt, x, i):
        run(x)
        grad = lin.weight.grad
        if i >= 1:
            lin.weight.grad = None
            lin.weight.grad = torch.zeros_like(lin.weight)
        return grad

    eager, _ = _run(False, loop, steps=8)
    captured, run = _run(True, loop, steps=8)
    _assert_same_runs(eager, captured)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_accumulation_clearing_every_few_calls_keeps_its_graphs(set_to_none):
    """Forward and backward captured, the optimizer stepped and the gradients cleared outside
    every second call: the calls after a clear (no .grad) and the others (adding to one) have a
    graph each, replayed from then on, and every call equals the eager one (before the
    gradients were part of the key, every change of the two forced a new capture)."""
    def loop(run, lin, opt, x, i):
        run(x)
        grad = lin.weight.grad
        if i % 2:
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        return grad

    eager, _ = _run(False, loop, steps=16)
    captured, run = _run(True, loop, steps=16)
    _assert_same_runs(eager, captured)
    # a graph for each case (one more while the first settles: the .grad the graph adds to is then
    # the other graph's), then replays only
    assert run.graphs <= 3 and run.eager_calls <= 5


def test_a_step_that_adds_to_the_gradient_and_then_replaces_it_runs_as_eager():
    """The step adds to the gradient, then assigns another (``p.grad = p.grad.clamp(...)``);
    the caller steps and zeroes the gradients in place every second call. Each eager call adds
    to the previous call's new tensor, which a graph (reading the memory its capture added to)
    cannot: the calls equal eager ones (before, the replays kept adding to the old memory)."""
    def run_all(captured):
        lin, opt = _model()

        def fwd_bwd(x):
            losses = lin(hfkern.broadcast(x, B)).pow(2).mean(dim=(1, 2))
            losses.sum().backward()
            for p in lin.parameters():
                p.grad = p.grad.clamp(-0.5, 0.5)
            return losses.detach()

        seen = []
        with recorded() if captured else contextlib.nullcontext():
            run = hfkern.capture_step(fwd_bwd, _batches(1)[0], warmup=2) if captured else fwd_bwd
            for i, x in enumerate(_batches(10)):
                run(x)
                if i % 2:
                    opt.step()
                    opt.zero_grad(set_to_none=False)
                seen.append((lin.weight.detach().clone(), lin.weight.grad.clone()))
        return seen

    _assert_same_runs(run_all(False), run_all(True))
