"""hfkern.capture_step: a whole training step as one CUDA graph replay.

On the CPU the captured step runs eagerly and must give exactly what the plain
step gives. The capture logic itself (warm-up calls, the capture, replays,
scheduler steps deferred to after each replay, new captures for a new batch
signature or new parameter groups) runs here against a simulated graph whose
replay re-runs the step's device work but none of its host steps, as a CUDA
graph does. On a GPU the real graphs must equal eager steps bit for bit over
20 steps with a scheduler, a surgery and a skip mask in the middle.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

import hfkern
from hfkern import graphs
from _fuse_models import DigitsCNN

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for bench.models

B = 3
STEPS = 20


class _SimulatedGraph:
    """A graph whose capture runs the step (host steps recorded, as in a real capture) and whose
    replay re-runs its device work only: host steps are recorded and dropped, as a CUDA graph
    replays kernels and no Python."""

    runs_at_capture = True

    def capture(self, fn):
        self.fn = fn
        self.outputs = fn()
        return self.outputs

    def replay(self):
        rec = graphs._recording
        saved = rec.capturing, rec.host_steps, rec.optimizers
        rec.capturing, rec.host_steps, rec.optimizers = True, [], {}
        try:
            new = self.fn()
        finally:
            rec.capturing, rec.host_steps, rec.optimizers = saved
        for static, value in zip(tree_flatten(self.outputs)[0], tree_flatten(new)[0]):
            static.copy_(value)


@pytest.fixture
def simulated(monkeypatch):
    monkeypatch.setattr(graphs, "_on_cuda", lambda args, kwargs: True)
    monkeypatch.setattr(graphs.CapturedStep, "_warmup_stream", staticmethod(contextlib.nullcontext))
    monkeypatch.setattr(graphs.CapturedStep, "_new_graph", lambda self: _SimulatedGraph())


def _setup(device="cpu"):
    torch.manual_seed(0)
    fused = hfkern.fuse(DigitsCNN, B).to(device)
    opt = hfkern.optim.SGD(fused.parameters(), lr=[0.05, 0.02, 0.1], momentum=0.9, weight_decay=1e-4)
    sched = hfkern.optim.lr_scheduler.StepLR(opt, step_size=[3, 4, 5], gamma=0.5)
    scaler = hfkern.amp.GradScaler(device, init_scale=2.0**8, B=B)

    def step(x, y, skip):
        losses = torch.stack([F.cross_entropy(o, y) for o in fused(hfkern.broadcast(x, B))])
        opt.zero_grad()
        scaler.scale(losses).sum().backward()
        scaler.step(opt, skip=skip)
        scaler.update()
        sched.step()
        return losses.detach()

    return fused, opt, sched, scaler, step


def _batches(n, device="cpu", N=16):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        skip = torch.zeros(B, dtype=torch.bool)
        if i % 7 == 5:
            skip[i % B] = True  # a skip mask now and then
        out.append((torch.randn(N, 1, 8, 8, generator=g).to(device), torch.randint(0, 10, (N,), generator=g).to(device),
                    skip.to(device)))
    return out


def _train(captured: bool, device="cpu", surgery_at=10):
    fused, opt, sched, scaler, step = _setup(device)
    batches = _batches(STEPS, device)
    run = hfkern.capture_step(step, *batches[0]) if captured else step
    losses = []
    for i, batch in enumerate(batches):
        if i == surgery_at:  # between steps: all of it lives in tensors the graph reads
            fused.reset_model(1, seed=7)
            opt.reset_state(1)
            opt.set_hyperparameters(2, lr=0.03)
            sched.reset_model(1, step_size=2)
            scaler.reset_model(1)
        losses.append(run(*batch))
    return torch.stack(losses), fused, opt, sched, run


def _assert_same_training(a, b):
    (la, fa, oa, sa, _), (lb, fb, ob, sb, _) = a, b
    assert torch.equal(la, lb)
    for (k, v), (_, w) in zip(fa.state_dict().items(), fb.state_dict().items()):
        assert torch.equal(v, w), k
    for p, q in zip(fa.parameters(), fb.parameters()):
        for key, s in oa.state[p].items():
            assert torch.equal(s, ob.state[q][key]), key
    assert torch.equal(sa.last_epochs, sb.last_epochs)
    for ga, gb in zip(oa.param_groups, ob.param_groups):
        assert torch.equal(ga["lr"], gb["lr"])


def test_on_cpu_the_captured_step_runs_eagerly_with_identical_results():
    captured = _train(True)
    _assert_same_training(captured, _train(False))
    run = captured[-1]
    assert run.graphs == 0 and run.eager_calls == STEPS


def test_replays_equal_eager_steps_with_scheduler_surgery_and_skip_masks(simulated):
    captured = _train(True)
    _assert_same_training(captured, _train(False))
    run = captured[-1]
    # three eager warm-up calls, one capture, then replays; the scheduler stepped after each
    assert run.eager_calls == 3 and run.graphs == 1


def test_scheduler_steps_are_deferred_to_after_each_replay(simulated):
    fused, opt, sched, scaler, step = _setup()
    batches = _batches(6)
    run = hfkern.capture_step(step, *batches[0], warmup=2)
    for i, batch in enumerate(batches):
        run(*batch)
        assert sched.last_epochs.tolist() == [i + 1] * B  # once per call: not at capture and again after
    (graph,) = run._graphs.values()
    assert [m.__qualname__ for m, _, _ in graph.host_steps] == ["LRScheduler.step"]


def test_a_new_batch_shape_gets_its_own_graph_after_its_own_warmup(simulated):
    fused, opt, sched, scaler, step = _setup()
    run = hfkern.capture_step(step, *_batches(1)[0], warmup=2)
    full, short = _batches(4), _batches(4, N=5)
    for batch in full:
        run(*batch)
    assert (run.eager_calls, run.graphs) == (2, 1)
    for batch in short:  # the last, smaller batch of an epoch
        run(*batch)
    assert (run.eager_calls, run.graphs) == (4, 2)
    run(*full[0])  # the first graph is kept
    assert (run.eager_calls, run.graphs) == (4, 2)


def test_new_parameter_groups_force_a_new_capture(simulated):
    fused, opt, sched, scaler, step = _setup()
    extra = torch.nn.Parameter(torch.zeros(B, 4))
    run = hfkern.capture_step(step, *_batches(1)[0], warmup=1)
    batches = _batches(6)
    for batch in batches[:3]:
        run(*batch)
    assert (run.eager_calls, run.graphs) == (1, 1)
    opt.add_param_group({"params": [extra], "lr": 0.1})
    run(*batches[3])  # the graph would step stale groups: an eager warm-up, then a new capture
    assert (run.eager_calls, run.graphs) == (2, 1)
    run(*batches[4])
    assert (run.eager_calls, run.graphs) == (2, 2)


def test_a_warmup_call_that_raises_does_not_count(simulated):
    """Counted before the step ran, failed warm-up calls let the next call capture at once, with
    no eager step having allocated the state or compiled the kernels."""
    calls = []

    def step(x, fail):
        calls.append(fail)
        if fail:
            raise RuntimeError("bad batch")
        return x * 2

    x = torch.randn(3)
    run = hfkern.capture_step(step, x, False, warmup=2)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="bad batch"):
            run(x, True)
    for _ in range(2):
        run(x, False)
    assert run.graphs == 0  # two successful eager calls first
    assert torch.equal(run(x, False), x * 2) and run.graphs == 1


def test_non_tensor_arguments_key_their_graphs_by_value(simulated):
    """A NaN argument never matched its own key (a warm-up forever, a cache entry per call); a
    numpy array raised TypeError on CUDA only; 0.0 and -0.0 are different values to a graph."""
    import numpy as np

    def step(x, scale, table):
        return x * scale + float(np.sum(table))

    x, table = torch.randn(3), np.arange(3.0)
    run = hfkern.capture_step(step, x, 1.0, table, warmup=1)
    for _ in range(3):
        run(x, float("nan"), table.copy())
    assert (run.eager_calls, run.graphs, len(run._warm)) == (1, 1, 1)
    run(x, -0.0, table)
    run(x, 0.0, table)
    run(x, 0.0, table + 1)  # another table: another graph
    assert len(run._warm) == 4

    class Opaque:
        __hash__ = None

    for on_cuda in (True, False):  # the same error without a graph (on the CPU)
        graphs_on_cuda = graphs._on_cuda
        try:
            graphs._on_cuda = lambda args, kwargs: on_cuda
            with pytest.raises(TypeError, match="argument leaf 1 is an unhashable Opaque"):
                run(x, Opaque(), table)
        finally:
            graphs._on_cuda = graphs_on_cuda


def test_new_grad_scaler_factors_force_a_new_capture(simulated):
    """The factors and the interval are host values the scaler's update computes with: a graph
    captured before set_growth_factor would grow the scales by the old factor."""
    opt, scaler, run, batches = _captured_after_two_steps()
    scaler.update(new_scale=4.0)  # written in place: the graph reads it
    run(*batches[2])
    assert (run.eager_calls, run.graphs) == (1, 1)
    for i, change in enumerate((lambda: scaler.set_growth_factor(4.0), lambda: scaler.set_backoff_factor(0.25),
                                lambda: scaler.set_growth_interval(3),
                                lambda: scaler.load_state_dict({**scaler.state_dict(), "growth_factor": 3.0}))):
        change()
        run(*batches[3 + i])  # an eager step, then a new capture
        assert (run.eager_calls, run.graphs) == (2 + i, 1 + i)
        run(*batches[3 + i])
        assert (run.eager_calls, run.graphs) == (2 + i, 2 + i)


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="step_fn to be callable"):
        hfkern.capture_step(3, torch.zeros(1))
    with pytest.raises(TypeError, match="warmup to be an int"):
        hfkern.capture_step(lambda x: x, torch.zeros(1), warmup=2.0)
    with pytest.raises(ValueError, match="warmup >= 1"):
        hfkern.capture_step(lambda x: x, torch.zeros(1), warmup=0)
    with pytest.raises(ValueError, match="example arguments holding the batch tensors"):
        hfkern.capture_step(lambda x: x)


def test_the_wrapped_callables_attributes_do_not_replace_the_captured_steps(simulated):
    # update_wrapper copied step_fn's __dict__ over the wrapper's own fields: a step
    # object's `warmup` replaced the one asked for, and a wrapped CapturedStep's
    # step_fn and graph cache became the wrapper's
    class Step:
        """A step object with attributes of its own."""

        def __init__(self):
            self.warmup, self.step_fn, self.graphs = 100, None, "mine"

        def __call__(self, x):
            return x * 2

    x = torch.randn(2)
    run = hfkern.capture_step(Step(), x, warmup=3)
    assert (run.warmup, run.graphs, run.__doc__) == (3, 0, Step.__doc__)
    assert torch.equal(run(x), x * 2)

    def step(x):
        return x + 1

    inner = hfkern.capture_step(step, x, warmup=2)
    outer = hfkern.capture_step(inner, x, warmup=5)
    assert (outer.warmup, outer.step_fn, outer.__name__) == (5, inner, "step")
    assert outer._graphs is not inner._graphs
    assert torch.equal(outer(x), x + 1)


@pytest.mark.gpu
def test_gpu_replays_equal_eager_steps_bit_for_bit(deterministic):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eager = _train(False, "cuda")
    # the control: eager training repeats itself bit for bit, so a difference below is the capture's
    _assert_same_training(_train(False, "cuda"), eager)
    captured = _train(True, "cuda")
    _assert_same_training(captured, eager)
    run = captured[-1]
    assert run.eager_calls == 3 and run.graphs == 1


@pytest.mark.gpu
def test_gpu_captures_a_fused_language_model_step(deterministic):
    """A fused transformer LM's step (embeddings, attention, layer norms, Adam) as replays,
    equal to eager steps bit for bit: the embeddings' index check reads nothing back on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from _fuse_models import ARCHITECTURES

    arch = ARCHITECTURES["transformer_lm"]

    def train(captured):
        torch.manual_seed(0)
        fused = hfkern.fuse(arch.factory, B).cuda()
        opt = hfkern.optim.Adam(fused.parameters(), lr=[1e-3, 2e-3, 5e-3], weight_decay=1e-2)

        def step(x):
            out = fused(hfkern.broadcast(x, B))
            losses = torch.stack([arch.loss(out[b]) for b in range(B)])
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
            return losses.detach()

        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 23, (arch.N, 7), generator=g).cuda() for _ in range(8)]
        run = hfkern.capture_step(step, batches[0]) if captured else step
        return torch.stack([run(x) for x in batches]), fused, run

    eager, captured = train(False), train(True)
    assert torch.equal(captured[0], eager[0])
    for (k, v), (_, w) in zip(captured[1].state_dict().items(), eager[1].state_dict().items()):
        assert torch.equal(v, w), k
    assert captured[2].graphs == 1


def _workload_step(workload: str, device: str, step_size: int):
    """A bench workload's fused training step at the smoke size (B = 3): ``(nets, step)``,
    ``step(*batch)`` running forward, per-model losses, backward, the hfkern optimizer and a
    StepLR scheduler of each net, as bench/train_throughput.py's array modes do."""
    from bench.models import WORKLOADS

    w = WORKLOADS[workload]
    torch.manual_seed(0)
    nets = {n: hfkern.fuse([w.build(n, "smoke") for _ in range(B)]).to(device) for n in w.nets}
    name, kwargs = w.optimizer
    cls = {"sgd": hfkern.optim.SGD, "adam": hfkern.optim.Adam, "adamw": hfkern.optim.AdamW}[name]
    opts = {n: cls(a.parameters(), lr=w.learning_rates(B), **kwargs) for n, a in nets.items()}
    scheds = {n: hfkern.optim.lr_scheduler.StepLR(o, step_size=step_size, gamma=0.5) for n, o in opts.items()}

    def apply(net, *inputs, per_model=False):
        if not per_model:
            inputs = tuple(hfkern.broadcast(x, B) for x in inputs)
        return nets[net](*inputs).float()

    def update(net, losses):
        opts[net].zero_grad()
        losses.sum().backward()
        opts[net].step()
        scheds[net].step()

    return nets, lambda *batch: w.step(apply, update, batch)


@pytest.mark.gpu
@pytest.mark.parametrize("workload", ["resnet18", "pointnet"])
def test_gpu_captures_the_benchmarks_fused_step(workload, deterministic):
    """The step bench/train_throughput.py's array+capture mode replays (its workloads at the
    smoke size: convolution + batch norm calls in their steady state, grouped regions, the
    optimizer's torch path, a scheduler), equal to eager steps bit for bit over 8 steps."""
    from bench.models import WORKLOADS

    w = WORKLOADS[workload]

    def train(captured):
        nets, step = _workload_step(workload, "cuda", step_size=3)
        batches = [tuple(t.cuda() for t in w.batch("smoke", seed=i)) for i in range(8)]
        run = hfkern.capture_step(step, *batches[0]) if captured else step
        with hfkern.use_backend("torch"):
            losses = torch.stack([run(*batch) for batch in batches])
        return losses, nets, run

    eager, captured = train(False), train(True)
    assert torch.equal(captured[0], eager[0])
    for n in w.nets:
        for (k, v), (_, u) in zip(captured[1][n].state_dict().items(), eager[1][n].state_dict().items()):
            assert torch.equal(v, u), f"{n}.{k}"
    assert captured[2].graphs == 1 and captured[2].eager_calls == 3


def _captured_after_two_steps():
    """(optimizer, scaler, captured step, 8 batches): one warm-up call, then a capture."""
    fused, opt, sched, scaler, step = _setup()
    run = hfkern.capture_step(step, *_batches(1)[0], warmup=1)
    batches = _batches(8)
    for batch in batches[:2]:
        run(*batch)
    assert (run.eager_calls, run.graphs) == (1, 1)
    return opt, scaler, run, batches


def test_values_that_change_the_work_force_a_new_capture(simulated):
    opt, scaler, run, batches = _captured_after_two_steps()
    opt.set_hyperparameters(0, lr=0.2)  # written in place: the graph reads it
    run(*batches[2])
    assert (run.eager_calls, run.graphs) == (1, 1)
    opt.param_groups[0]["dampening"] = 0.1  # assigned anew: validated at an eager step, then captured
    run(*batches[3])
    run(*batches[4])
    assert (run.eager_calls, run.graphs) == (2, 2)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records the torch calls that read device values on the host or index with host values
    (a CUDA graph cannot hold them: on a GPU each would synchronize or copy a list of indices
    to the device, and under capture it fails)."""

    NAMES = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "unique",
             "unique_consecutive", "masked_select", "equal", "argwhere"}

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        index = args[1] if name in ("__getitem__", "__setitem__") and len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        boolean_index = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)
        list_index = any(isinstance(i, list) for i in parts)  # a host tensor of indices, copied over
        if name in self.NAMES or boolean_index or list_index:
            self.found.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("workload", ["resnet18", "pointnet", "dcgan", "mobilenet_v2", "transformer_lm",
                                      "bert_small"])
def test_the_captured_part_of_a_fused_training_step_reads_nothing_on_the_host(workload, monkeypatch):
    """What capture_step would record of a fused workload's step (forward, per-model losses,
    backward, the hfkern optimizer; the scheduler is deferred) makes no call that reads device
    values on the host, so it can be captured. Checked on the CPU before any GPU sees it, with
    the embeddings' index check as it runs on CUDA (a device-side assertion, no host read)."""
    from bench.models import WORKLOADS
    from hfkern.ops import embedding

    monkeypatch.setattr(embedding, "_ASSERTED_ON", embedding._ASSERTED_ON | {"cpu"})

    w = WORKLOADS[workload]
    _, step = _workload_step(workload, "cpu", step_size=2)
    batch = w.batch("smoke", seed=0)
    for _ in range(2):  # warm-up: state is allocated at the first step
        step(*batch)
    reads = _HostReads()
    graphs._recording.capturing, graphs._recording.host_steps = True, []
    try:
        with reads:
            step(*batch)
        deferred = graphs._recording.host_steps
    finally:
        graphs._recording.capturing, graphs._recording.host_steps = False, []
    assert reads.found == []
    assert len(deferred) == len(w.nets)  # each net's scheduler step waits for the replay


def test_the_captured_part_with_a_grad_scaler_and_skip_masks_reads_nothing_on_the_host():
    fused, opt, sched, scaler, step = _setup()
    batches = _batches(8)
    for batch in batches[:2]:
        step(*batch)
    reads = _HostReads()
    graphs._recording.capturing, graphs._recording.host_steps = True, []
    try:
        with reads:
            step(*batches[5])  # a batch with a skip mask
        deferred = graphs._recording.host_steps
    finally:
        graphs._recording.capturing, graphs._recording.host_steps = False, []
    assert reads.found == [] and len(deferred) == 1


@pytest.mark.parametrize("name, kwargs", [
    ("SGD", dict(lr=[0.1, 0.2, 0.05], momentum=0.9, dampening=0.1, weight_decay=1e-2)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
    ("Adam", dict(lr=1e-2, amsgrad=True, weight_decay=1e-2)),
    ("AdamW", dict(lr=1e-2)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.1)),
    ("Adadelta", dict(lr=1.0)),
    ("RMSprop", dict(lr=1e-2, momentum=0.5, centered=True)),
    ("LARS", dict(lr=0.1, momentum=0.9, weight_decay=1e-3, exclude_1d=True)),
    ("LAMB", dict(lr=1e-2, weight_decay=1e-2, exclude_1d=True)),
])
@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_optimizer_steps_on_the_torch_path_read_and_index_nothing_from_the_host(name, kwargs, skip_nonfinite):
    """Every array optimizer's step on the torch backend (what auto runs on CUDA) can be
    captured: no host read of a device value and no index from a host list, over parameters
    of interleaved ranks (the per-(parameter, model) factors are kept rank by rank)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(B, 5), (B, 2, 2, 2), (B, 4), (B, 2, 3)]]
    opt = getattr(hfkern.optim, name)(params, skip_nonfinite=skip_nonfinite, **kwargs)
    with hfkern.use_backend("torch"):
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            reads = _HostReads()
            with reads:
                opt.step(skip=torch.tensor([False, True, False]))
            assert reads.found == []
