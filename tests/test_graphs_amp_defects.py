"""hfkern.capture_step with GradScalers, skip masks, frozen modules and shared inputs.

Each test runs a training loop once eagerly and once through ``capture_step``
under tests/_graph_sim.py's recorded graph (a replay runs only the ATen ops the
capture recorded, no Python, as a CUDA graph does) and compares the two bit for
bit: losses, parameters, the GradScaler's scales and trackers, ``last_skipped``.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

import hfkern
from hfkern._array import is_shared
from hfkern.amp import GradScaler
from _graph_sim import recorded

B = 3


@pytest.fixture(autouse=True)
def torch_backend():
    # the recorded graph sees ATen ops only (not hfkern's extension's)
    with hfkern.use_backend("torch"):
        yield


def _maybe_recorded(captured):
    return recorded() if captured else contextlib.nullcontext()


# ---- 1. last_skipped: one tensor, which every graph writes ----------------------------------

def _scaled_sgd(init_scale=8.0, growth_interval=2000):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(B, 4))
    opt = hfkern.optim.SGD([w], lr=0.1)
    scaler = GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval, B=B)

    def step(x, poison):
        losses = (w * x.mean(0)).sum(1) * poison
        opt.zero_grad()
        scaler.scale(losses).sum().backward()
        scaler.step(opt)
        scaler.update()
        return losses.detach()

    return w, opt, scaler, step


def _skips(captured, calls):
    w, opt, scaler, step = _scaled_sgd()
    got = []
    with _maybe_recorded(captured):
        run = hfkern.capture_step(step, *calls[0], warmup=1) if captured else step
        for x, poison in calls:
            run(x, poison)
            got.append(opt.last_skipped.tolist())
    return got, w.detach().clone(), run


def test_last_skipped_is_written_by_whichever_graph_replays():
    """Two batch shapes, two graphs: each wrote the tensor its capture bound to last_skipped, so
    an overflow in the first graph's replays was invisible after the second was captured."""
    ones = torch.ones(B)
    calls = [(torch.ones(2, 4), ones), (torch.ones(3, 4), ones)] * 2 + [
        (torch.ones(2, 4), torch.tensor([1.0, math.inf, 1.0])),  # a replay of the first graph: model 1 overflows
        (torch.ones(3, 4), ones),
        (torch.ones(2, 4), torch.tensor([math.inf, 1.0, 1.0])),
    ]
    eager, captured = _skips(False, calls), _skips(True, calls)
    assert captured[0] == eager[0]
    assert eager[0][4] == [False, True, False] and eager[0][6] == [True, False, False]
    assert torch.equal(captured[1], eager[1])
    assert captured[2].graphs == 2


def test_last_skipped_after_an_epochs_short_last_batch():
    """The short last batch of an epoch runs eagerly (its own warm-up); the next epoch's replays
    of the full batch's graph must still show their overflows."""
    full, short = torch.ones(2, 4), torch.ones(1, 4)
    ones = torch.ones(B)
    calls = [(full, ones)] * 3 + [(short, ones), (full, torch.tensor([math.inf, 1.0, 1.0])), (full, ones)]
    eager, captured = _skips(False, calls), _skips(True, calls)
    assert captured[0] == eager[0]
    assert eager[0][4] == [True, False, False]
    assert torch.equal(captured[1], eager[1])


def test_last_skipped_is_one_tensor_per_optimizer_written_in_place():
    """Eagerly too: the same tensor after every step (a mask passed as skip is copied, not held),
    also after load_state_dict; a copy of another optimizer is its own."""
    p = nn.Parameter(torch.randn(B, 4))
    opt = hfkern.optim.Adam([p], lr=0.1, skip_nonfinite=True)
    assert opt.last_skipped is None
    p.grad = torch.ones_like(p)
    opt.step()
    held = opt.last_skipped
    assert held.tolist() == [False, False, False]
    mask = torch.tensor([False, True, False])
    opt.step(skip=mask)
    assert opt.last_skipped is held and held.tolist() == [False, True, False]
    mask[2] = True  # the caller's mask is not the optimizer's
    assert held.tolist() == [False, True, False]
    opt.load_state_dict(opt.state_dict())
    p.grad[0, 0] = math.nan
    opt.step()
    assert opt.last_skipped is held and held.tolist() == [True, False, False]
    twin = hfkern.optim.Adam([nn.Parameter(p.detach().clone())], lr=0.1)
    twin.load_state_dict(opt.state_dict())
    twin.param_groups[0]["params"][0].grad = torch.ones(B, 4)
    twin.step()
    assert twin.last_skipped is not held and held.tolist() == [True, False, False]


# ---- 2. frozen parameters and buffers given new memory ---------------------------------------

class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _zero_model_1(fused):
    with torch.no_grad():
        fused.conv.weight[1].zero_()  # written in the memory the parameter has now


def _channels_last(fused):
    fused.to(memory_format=torch.channels_last)  # relays the conv weights: w.data = ...
    _zero_model_1(fused)


def _data(fused):
    fused.conv.weight.data = fused.conv.weight.detach().clone()
    _zero_model_1(fused)


def _strides_only(fused):
    # the same memory read with other strides (each model's [O, I*k*k] block transposed)
    w = fused.conv.weight
    O, rest = w.shape[1], w[0, 0].numel()
    with torch.no_grad():
        w.as_strided_(w.shape, (O * rest, 1, O * w.shape[3] * w.shape[4], O * w.shape[4], O))


def _frozen_conv_training(captured, change, steps=6, change_at=3):
    torch.manual_seed(0)
    fused = hfkern.fuse([_ConvNet() for _ in range(B)])
    fused.conv.weight.requires_grad_(False)
    fused.conv.bias.requires_grad_(False)
    opt = hfkern.optim.SGD(fused.fc.parameters(), lr=0.1)  # no optimizer watches the conv

    def step(x, y):
        losses = hfkern.nn.functional.cross_entropy(fused(x), y)
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        return losses.detach()

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(B, 2, 2, 4, 4, generator=g), torch.randint(0, 3, (2,), generator=g))
               for _ in range(steps)]
    with _maybe_recorded(captured):
        run = hfkern.capture_step(step, *batches[0], warmup=1) if captured else step
        losses = []
        for i, (x, y) in enumerate(batches):
            if i == change_at:
                change(fused)
            losses.append(run(x, y))
    return torch.stack(losses), fused, run


@pytest.mark.parametrize("change", [_channels_last, _data, _strides_only],
                         ids=["channels_last", "data", "strides_only"])
def test_a_frozen_parameter_given_new_memory_forces_a_new_capture(change):
    captured = _frozen_conv_training(True, change)
    eager = _frozen_conv_training(False, change)
    assert torch.equal(captured[0], eager[0])
    for (k, v), (_, w) in zip(captured[1].state_dict().items(), eager[1].state_dict().items()):
        assert torch.equal(v, w), k
    assert captured[2].graphs == 2


def test_a_frozen_parameter_unfrozen_after_capture_forces_a_new_capture():
    """No optimizer steps it, so only the module knows: the graph's backward left its .grad out."""
    def unfreeze(fused):
        fused.conv.weight.requires_grad_(True)

    captured = _frozen_conv_training(True, unfreeze)
    eager = _frozen_conv_training(False, unfreeze)
    assert torch.equal(captured[0], eager[0])
    assert eager[1].conv.weight.grad is not None
    assert torch.equal(captured[1].conv.weight.grad, eager[1].conv.weight.grad)
    assert captured[2].graphs == 2


def test_a_buffer_replaced_after_capture_forces_a_new_capture():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.ones(B, 1))

        def forward(self, x):
            return x * self.scale

    def run(captured):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(B, 4))
        scaled = Scaled()
        opt = hfkern.optim.SGD([w], lr=0.1)

        def step(x):
            losses = scaled(w * x).pow(2).sum(1)
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
            return losses.detach()

        x = torch.ones(4)
        with _maybe_recorded(captured):
            f = hfkern.capture_step(step, x, warmup=1) if captured else step
            out = []
            for i in range(6):
                if i == 3:
                    scaled.scale = torch.full((B, 1), 0.5)  # a new tensor in the buffer's place
                out.append(f(x))
        return torch.stack(out), w.detach(), f

    captured, eager = run(True), run(False)
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    assert captured[2].graphs == 2


def test_a_frozen_parameter_written_in_place_needs_no_new_capture():
    """Values written into the memory the graph reads take effect without one."""
    captured = _frozen_conv_training(True, _zero_model_1)
    eager = _frozen_conv_training(False, _zero_model_1)
    assert torch.equal(captured[0], eager[0])
    assert captured[2].graphs == 1


# ---- 3. a GradScaler updated (or stepped) after the captured step --------------------------------

_POISON = {3: (1, math.inf), 4: (0, math.nan), 7: (2, math.inf)}


def _scaler_training(captured, inside, steps=10):
    """A GradScaler over an SGD step with overflows at some steps; ``inside``: the scaler's calls
    inside the step (the rest run after each call)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(B, 4))
    opt = hfkern.optim.SGD([w], lr=0.1, momentum=0.9)
    scaler = GradScaler("cpu", init_scale=2.0**4, growth_interval=2, B=B)

    def step(x, poison):
        losses = (w * x).sum(1) * poison
        opt.zero_grad()
        scaler.scale(losses).sum().backward()
        if "unscale_" in inside:
            scaler.unscale_(opt)
        if "step" in inside:
            scaler.step(opt)
        if "update" in inside:
            scaler.update()
        return losses.detach()

    g = torch.Generator().manual_seed(1)
    history = []
    with _maybe_recorded(captured):
        run = hfkern.capture_step(step, torch.ones(4), torch.ones(B), warmup=1) if captured else step
        for i in range(steps):
            poison = torch.ones(B)
            if i in _POISON:
                poison[_POISON[i][0]] = _POISON[i][1]
            losses = run(torch.randn(4, generator=g), poison)
            if "step" not in inside:
                scaler.step(opt)
            if "update" not in inside:
                scaler.update()
            history.append((losses, scaler.get_scale(), scaler._get_growth_tracker(), opt.last_skipped.clone(),
                            w.detach().clone()))
    return history, run


@pytest.mark.parametrize("inside", [("unscale_", "step"), ("step",), ("unscale_",)],
                         ids=["update_after", "update_after_no_unscale", "step_and_update_after"])
def test_a_scaler_updated_after_the_captured_step_matches_eager(inside):
    captured, run = _scaler_training(True, inside)
    eager, _ = _scaler_training(False, inside)
    for i, (a, b) in enumerate(zip(captured, eager)):
        for x, y in zip(a, b):
            assert torch.equal(x, y) or (x.is_floating_point() and torch.allclose(x, y, rtol=0, atol=0,
                                                                                  equal_nan=True)), i
    assert [h[3].tolist() for h in eager[3:5]] == [[False, True, False], [True, False, False]]
    assert eager[3][1].tolist() == [64.0, 16.0, 64.0]  # model 1 backed off, the others grew
    assert run.graphs == 1 and run.eager_calls == 1


def _scaled_sgd_step():
    """(w, scaler, step): an SGD step of B models through a GradScaler whose step() runs in the
    step and whose update() the caller makes."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(B, 4))
    opt = hfkern.optim.SGD([w], lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0, B=B)

    def step(x):
        losses = (w * x).sum(1)
        opt.zero_grad()
        scaler.scale(losses).sum().backward()
        scaler.step(opt)
        return losses.detach()

    return w, scaler, step


def test_a_replay_before_the_update_raises_as_an_eager_step_does():
    w, scaler, step = _scaled_sgd_step()

    x = torch.ones(4)
    with recorded():
        run = hfkern.capture_step(step, x, warmup=1)
        for _ in range(3):
            run(x)
            scaler.update()
        run(x)
        before = w.detach().clone()
        with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
            run(x)  # no update() since the last call: the replay does not run
        assert torch.equal(w.detach(), before)
        scaler.update()
        run(x)
    assert not torch.equal(w.detach(), before)


def test_the_replay_that_completes_a_cuda_capture_is_not_checked(monkeypatch):
    """A CUDA capture runs the step's Python (which leaves the records of a stepped optimizer)
    without its kernels; the replay that follows at once is that call's step, so the records'
    check does not apply to it."""
    from _graph_sim import RecordedGraph
    from hfkern import graphs

    class NotRunAtCapture(RecordedGraph):
        runs_at_capture = False

    w, scaler, step = _scaled_sgd_step()

    x = torch.ones(4)
    with recorded():
        monkeypatch.setattr(graphs.CapturedStep, "_new_graph", lambda self: NotRunAtCapture())
        run = hfkern.capture_step(step, x, warmup=1)
        for _ in range(4):
            run(x)
            scaler.update()
    assert run.graphs == 1


def test_a_captured_step_after_an_eager_unscale_is_refused():
    """unscale_() outside, step() inside: every replay would read the inf checks of the eager
    unscale_() at the capture."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(B, 4))
    opt = hfkern.optim.SGD([w], lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0, B=B)

    def optimizer_step(x):
        scaler.step(opt)
        scaler.update()
        return x

    x = torch.ones(4)
    with recorded():
        run = hfkern.capture_step(optimizer_step, x, warmup=1)
        for i in range(2):
            opt.zero_grad()
            scaler.scale((w * x).sum(1)).sum().backward()
            scaler.unscale_(opt)
            if i == 0:
                run(x)  # the warm-up, eager
            else:
                with pytest.raises(RuntimeError, match=r"unscale_\(\) of this optimizer that ran outside"):
                    run(x)


# ---- 4. a shared (hfkern.broadcast) argument stays shared ---------------------------------------

def _shared_input_training(captured, calls):
    torch.manual_seed(0)
    conv = hfkern.nn.Conv2d(3, 8, 3, padding=1, B=B)
    fc = hfkern.nn.Linear(8 * 25, 2, B=B)
    opt = hfkern.optim.SGD(list(conv.parameters()) + list(fc.parameters()), lr=0.1)
    seen = []

    def step(xb, y):
        seen.append((is_shared(xb), xb.stride()))
        out = fc(hfkern.nn.Flatten()(torch.relu(conv(xb))))
        losses = hfkern.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        return losses.detach()

    with _maybe_recorded(captured) as graphs:
        run = hfkern.capture_step(step, *calls[0], warmup=1) if captured else step
        losses = torch.stack([run(x, y) for x, y in calls])
    return losses, seen, run, graphs, conv.weight.detach()


def _shared_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(hfkern.broadcast(torch.randn(4, 3, 5, 5, generator=g), B), torch.randint(0, 2, (4,), generator=g))
            for _ in range(n)]


def test_a_broadcast_argument_is_captured_shared():
    """The captured step gets a shared input too (one copy of the batch, expanded as the
    caller's), so it computes once for the B models, as the eager step does."""
    calls = _shared_batches(5)
    eager = _shared_input_training(False, calls)
    losses, seen, run, graphs, weight = _shared_input_training(True, calls)
    assert torch.equal(losses, eager[0]) and torch.equal(weight, eager[4])
    assert seen == eager[1][:2] and all(shared for shared, _ in seen)
    assert run.graphs == 1 and graphs[0].replays == 3
    (graph,) = run._graphs.values()
    (x_static, _) = graph.static
    assert is_shared(x_static) and x_static.stride() == calls[0][0].stride()
    (_, target, base), _ = graph.inputs
    assert target.numel() == calls[0][0][0].numel() and base == (1, 4, 3, 5, 5)  # one batch, not B


def test_a_broadcast_channels_last_argument_keeps_its_strides_and_a_dense_one_gets_its_own_graph():
    shared = _shared_batches(3, seed=2)
    cl = [(x[0].contiguous(memory_format=torch.channels_last), y) for x, y in _shared_batches(3, seed=3)]
    cl = [(hfkern.broadcast(x, B), y) for x, y in cl]
    dense = [(x.clone(), y) for x, y in _shared_batches(3, seed=4)]  # the same shape, stacked copies
    calls = shared + cl + dense + shared[:1] + cl[:1]
    eager = _shared_input_training(False, calls)
    losses, seen, run, _, weight = _shared_input_training(True, calls)
    assert torch.equal(losses, eager[0]) and torch.equal(weight, eager[4])
    ran = (0, 1, 3, 4, 6, 7)  # the calls whose Python ran: each signature's warm-up and capture
    assert seen == [(is_shared(calls[i][0]), calls[i][0].stride()) for i in ran]
    assert [shared for shared, _ in seen] == [True, True, True, True, False, False]
    assert run.graphs == 3
