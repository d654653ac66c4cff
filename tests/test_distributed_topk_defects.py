"""hfkern.distributed: regressions of topk_hook / TopKState / k_for (Gloo, two processes).

* a sparse gradient (``nn.Embedding(sparse=True)``) is refused with a TypeError that names
  the bucket and the parameter, before the state changes; more generally a hook call that
  raises (a failed selection or collective) leaves the step and the residuals as they were;
* complex parameters are exchanged as their real views: dense steps are DDP's all-reduce
  bit for bit, sparse steps (and their error feedback) equal those of a twin model holding
  the real views as real parameters;
* a bucket of parameters with no elements passes through in every mode;
* ``k_for`` validates its arguments (0 for an empty row);
* ``TopKState(process_group=...)`` and ``load_state_dict`` refuse what does not fit.

One spawn runs every check (process start-up costs seconds); each rank records "ok" or the
traceback per check, and the tests below assert on the records.
"""

import datetime
import json
import math
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from _dist_topk_cases import FakeBucket, join_records
from hfkern.distributed import k_for

WORLD = 2
_DEADLINE_S = 180

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with Gloo")


# ---- helpers (run in the worker processes) ---------------------------------------------------
class Params(nn.Module):
    def __init__(self, tensors):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(t) for t in tensors])


def _grads(shapes, rank, step, salt):
    g = torch.Generator().manual_seed(1000 * salt + 10 * step + rank)
    return [torch.randn(s, generator=g) * torch.rand(s, generator=g).pow(3) * 4 for s in shapes]


def _call(state, params, grads, index=0, last=True):
    """topk_hook on one bucket holding ``params`` (contiguous) in reversed order, as DDP's
    first buckets are; the result per parameter."""
    from hfkern.distributed import topk_hook

    order = list(reversed(range(len(params))))
    buf = torch.cat([grads[i].reshape(-1) for i in order]).clone()
    out = topk_hook(state, FakeBucket(buf, index, last, [params[i] for i in order])).wait()
    res, off = [None] * len(params), 0
    for i in order:
        res[i] = out[off:off + grads[i].numel()].clone()
        off += grads[i].numel()
    return res


def _snapshot(state):
    sd = state.state_dict()
    return (sd["step"], {k: v.clone() for k, v in sd["residuals"].items()}, sorted(state._residuals),
            sorted(state._loose), dict(state.bucket_stats), state.payload_bytes)


def _assert_unchanged(state, before, what):
    step, res, buckets, loose, stats, payload = _snapshot(state)
    assert step == before[0], f"{what}: the step went from {before[0]} to {step}"
    assert res.keys() == before[1].keys(), f"{what}: residuals {sorted(before[1])} -> {sorted(res)}"
    for k in res:
        assert torch.equal(res[k], before[1][k]), f"{what}: the residual of parameter {k} changed"
    assert (buckets, loose) == (before[2], before[3]), \
        f"{what}: residual store {before[2]}/{before[3]} -> {buckets}/{loose}"
    assert stats == before[4] and payload == before[5], f"{what}: statistics changed"


def _expect(exc, texts, fn, what):
    try:
        fn()
    except exc as e:
        for t in texts:
            assert t in str(e), f"{what}: {t!r} not in {str(e)!r}"
        return e
    raise AssertionError(f"{what}: did not raise {exc.__name__}")


# ---- checks ---------------------------------------------------------------------------------
def check_sparse_gradient_refused(ctx):
    """nn.Embedding(sparse=True): a TypeError naming the bucket and the parameter, raised
    before the step counts or a residual is made (it was add(sparse, dense) after both)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hfkern.distributed import TopKState, topk_hook

    for kw in ({"density": 0.01}, {"density": 0.01, "warmup_steps": 5}, {"density": 0.5, "fallback": False}):
        torch.manual_seed(0)
        emb = nn.Embedding(50, 4, sparse=True)
        ddp = DDP(emb)
        st = TopKState(emb, **kw)
        ddp.register_comm_hook(st, topk_hook)
        before = _snapshot(st)
        e = _expect(Exception, ["bucket 0", "parameter 0 ('weight')", "sparse"],
                    lambda ddp=ddp: ddp(torch.tensor([ctx["rank"], 7])).sum().backward(), f"sparse {kw}")
        assert isinstance(e, TypeError), f"sparse {kw}: {type(e).__name__}: {e}"
        _assert_unchanged(st, before, f"sparse {kw}")


def check_failed_call_keeps_state(ctx):
    """A hook call that fails after the checks (the selection, the dense all-reduce) leaves
    the step, the residuals and the statistics as they were (the step had advanced, the
    residual had been zeroed or taken over)."""
    from hfkern.distributed import TopKState
    from hfkern.distributed import topk as topk_module

    rank = ctx["rank"]
    shapes = [(6, 5), (7,)]

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    for name, kw in (("flat", {}), ("hierarchical", {"nodes": ctx["one_node"]}),
                     ("hierarchical 2 nodes", {"nodes": ctx["two_nodes"]})):
        model = Params([torch.zeros(s) for s in shapes])
        params = list(model.parameters())
        st = TopKState(model, density=0.2, fallback=False, **kw)
        _call(st, params, _grads(shapes, rank, 0, 3))
        assert st.step == 1 and st.state_dict()["residuals"], name
        for attr, target in (("_select", topk_module), ("all_reduce", topk_module.dist)):
            if attr == "all_reduce":
                st.warmup_steps = 100  # the dense path: adds and clears the residual
            before = _snapshot(st)
            real = getattr(target, attr)
            setattr(target, attr, boom)
            try:
                _expect(RuntimeError, ["injected failure"], lambda st=st, params=params: _call(st, params, _grads(shapes, rank, 1, 3)),
                        f"{name} {attr}")
            finally:
                setattr(target, attr, real)
            _assert_unchanged(st, before, f"{name}: failed {attr}")
        # A layout change (a loaded state: residuals per parameter) is taken over only by a
        # call that goes through.
        st.warmup_steps = 0
        saved = st.state_dict()
        st.load_state_dict(saved)
        before = _snapshot(st)
        assert before[2] == [] and before[3] == [0, 1], before[2:4]
        topk_module._select, real = boom, topk_module._select
        try:
            _expect(RuntimeError, ["injected failure"], lambda st=st, params=params: _call(st, params, _grads(shapes, rank, 1, 3)),
                    f"{name} after load")
        finally:
            topk_module._select = real
        _assert_unchanged(st, before, f"{name}: failed call after load_state_dict")
        _call(st, params, _grads(shapes, rank, 1, 3))  # and the state still works
        assert st.step == 2 and sorted(st._residuals) == [0] and not st._loose, name


def _complex_model(seed, twin=False, real=True):
    """Complex parameters in several layouts (and a real one); ``twin``: the same model with
    every complex parameter replaced by its real view, as a real parameter of the same strides."""
    g = torch.Generator().manual_seed(seed)
    B = 3
    ts = [torch.randn(B, 5, generator=g, dtype=torch.complex64),
          torch.randn(4, B, generator=g, dtype=torch.complex64).t(),           # transposed
          torch.randn(2, 4, B, generator=g, dtype=torch.complex64).permute(2, 0, 1)]
    if real:  # DDP puts it in a bucket of its own (buckets hold one dtype)
        ts.append(torch.randn(B, 3, generator=g))
    if twin:
        ts = [torch.view_as_real(t).clone() if t.is_complex() else t for t in ts]
    return Params(ts)


def _complex_loss(model, rank, step):
    loss = 0
    for i, p in enumerate(model.ps):
        x = torch.view_as_real(p) if p.is_complex() else p
        g = torch.Generator().manual_seed(10_000 + 100 * step + 10 * i + rank)
        c = torch.randn(x.shape, generator=g) * torch.rand(x.shape, generator=g).pow(3) * 4
        loss = loss + (x * c).sum() + 0.5 * (x * x).sum()
    return loss


class _ComplexLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, rank, step):
        return _complex_loss(self.model, rank, step)


def _run_complex(model, state, steps, rank, train=True, **ddp_kw):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hfkern.distributed import topk_hook

    ddp = DDP(_ComplexLoss(model), **ddp_kw)
    if state is not None:
        ddp.register_comm_hook(state, topk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    grads = []
    for t in range(steps):
        opt.zero_grad()
        ddp(rank, t).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if train:
            opt.step()
    return grads


def _real(t):
    return torch.view_as_real(t) if t.is_complex() else t


def check_complex_dense_equals_ddp(ctx):
    """Complex parameters (DDP averages their real views): density 1 (dense by fallback),
    the warm-up, and density 1 without fallback (flat, hierarchical) are plain DDP bit for bit."""
    from hfkern.distributed import TopKState

    rank = ctx["rank"]
    ref = _run_complex(_complex_model(0), None, 3, rank)
    for name, kw in (("density 1", {"density": 1.0}),
                     ("warm-up", {"density": 0.1, "warmup_steps": 3}),
                     ("flat, density 1, no fallback", {"density": 1.0, "fallback": False}),
                     ("hierarchical one node, density 1, no fallback",
                      {"density": 1.0, "fallback": False, "nodes": ctx["one_node"]}),
                     ("hierarchical two nodes, density 1, no fallback",
                      {"density": 1.0, "fallback": False, "nodes": ctx["two_nodes"]})):
        model = _complex_model(0)
        st = TopKState(model, **kw)
        got = _run_complex(model, st, 3, rank)
        for t, (a, b) in enumerate(zip(got, ref)):
            for i, (x, y) in enumerate(zip(a, b)):
                assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride(), (name, t, i)
                assert torch.equal(_real(x), _real(y)), f"{name}: step {t}, parameter {i} differs from DDP"
        assert st.step == 3, (name, st.step)


def check_complex_sparse_is_real_view(ctx):
    """Sparse steps select among the real and imaginary parts: the gradients and residuals
    equal those of a twin model holding the real views as real parameters, bit for bit, over
    steps with error feedback (flat, hierarchical, per model, approximate selection); the
    residuals round-trip through state_dict as complex tensors."""
    from hfkern.distributed import TopKState

    rank = ctx["rank"]
    for name, kw in (("flat exact", {"density": 0.3, "exact": True}),
                     ("flat approximate", {"density": 0.2}),
                     ("hierarchical", {"density": 0.3, "exact": True, "nodes": ctx["one_node"]}),
                     ("hierarchical two nodes", {"density": 0.25, "nodes": ctx["two_nodes"]}),
                     ("per model", {"density": 0.3, "exact": True, "per_model": 3}),
                     ("per model hierarchical", {"density": 0.3, "per_model": 3, "nodes": ctx["one_node"]})):
        runs = []
        for twin in (False, True):
            model = _complex_model(1, twin=twin, real=False)  # one bucket in both models
            st = TopKState(model, fallback=False, **kw)
            # no optimizer step: SGD rounds complex updates otherwise than real ones
            grads = _run_complex(model, st, 4, rank, train=False)
            runs.append((model, st, grads))
        (cm, cst, cg), (_, rst, rg) = runs
        assert cst.bucket_stats[0].mode == rst.bucket_stats[0].mode != "dense", (name, cst.bucket_stats)
        assert cst.bucket_stats[0] == rst.bucket_stats[0], (name, cst.bucket_stats[0], rst.bucket_stats[0])
        for t, (a, b) in enumerate(zip(cg, rg)):
            for i, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(_real(x), y), f"{name}: step {t}, parameter {i} differs from the real twin"
        # at least one complex gradient entry was partly left behind (a real test of sparsity)
        assert any((_real(x) == 0).any() for x in cg[-1][:3]), name
        csd, rsd = cst.state_dict(), rst.state_dict()
        assert csd["residuals"].keys() == rsd["residuals"].keys() and csd["residuals"], name
        params = list(cm.parameters())
        for key, r in rsd["residuals"].items():
            c = csd["residuals"][key]
            assert c.dtype == params[key].dtype and c.numel() == params[key].numel() and c.dim() == 1, \
                (name, key, c.dtype, c.shape)
            assert torch.equal(_real(c).reshape(-1), r), f"{name}: residual {key} is not the twin's"
        # a restored state continues bit for bit
        st2 = TopKState(cm, fallback=False, **kw)
        st2.load_state_dict(csd)
        sd2 = st2.state_dict()
        assert all(torch.equal(sd2["residuals"][k], v) for k, v in csd["residuals"].items()), name
        # bucket contents: a complex parameter's real view (2 elements an entry)
        grads = [_grads([tuple(_real(p).shape)], rank, 9, 5 + i)[0].reshape(-1) for i, p in enumerate(params)]
        st2.step = cst.step = 9
        out_a = _call(st2, params, grads)
        out_b = _call(cst, params, grads)
        for a, b in zip(out_a, out_b):
            assert torch.equal(a, b), f"{name}: a restored state differs"
    # a complex residual must come as the parameter's complex dtype
    model = _complex_model(1)
    st = TopKState(model, density=0.3, fallback=False)
    sd = st.state_dict()
    bad = {**sd, "residuals": {0: torch.zeros(30)}}
    _expect(ValueError, ["15 elements"], lambda: st.load_state_dict(bad), "real residual of a complex parameter")
    bad = {**sd, "residuals": {0: torch.zeros(15, dtype=torch.complex128)}}
    _expect(ValueError, ["torch.complex64", "torch.complex128"], lambda: st.load_state_dict(bad),
            "complex128 residual of a complex64 parameter")


def check_empty_bucket(ctx):
    """Parameters with no elements pass through, in every mode (fallback=False raised
    "expected 1 <= k <= n = 0" after the step counter advanced)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hfkern.distributed import TopKState, topk_hook

    rank = ctx["rank"]
    modes = (("flat", {"density": 0.5, "fallback": False}),
             ("flat fallback", {"density": 0.5}),
             ("warm-up", {"density": 0.5, "warmup_steps": 1, "fallback": False}),
             ("hierarchical", {"density": 0.5, "fallback": False, "nodes": ctx["one_node"]}),
             ("hierarchical two nodes", {"density": 0.5, "fallback": False, "nodes": ctx["two_nodes"]}),
             ("per model", {"density": 0.5, "fallback": False, "per_model": 2}),
             ("density 1", {"density": 1.0, "fallback": False, "exact": True}))
    for name, kw in modes:
        # a DDP model whose only parameter is empty
        model = _Scale(Params([torch.ones(2, 0)]))
        st = TopKState(model, **kw)
        ddp = DDP(model)
        ddp.register_comm_hook(st, topk_hook)
        for t in range(2):
            model.zero_grad(set_to_none=True)
            ddp(torch.tensor(float(rank + 1))).backward()
            grad = model.model.ps[0].grad
            assert grad is not None and grad.shape == (2, 0), (name, grad)
        assert st.step == 2, (name, st.step)
        assert st.bucket_stats[0].payload_bytes == 0, (name, st.bucket_stats[0])
        # an empty bucket after a real one (several buckets): the hierarchical bucket's deferred
        # node all-gather goes out from the empty last bucket's call
        shapes = [(6, 5), (2, 0)]
        model = Params([torch.zeros(2, 15), torch.zeros(2, 0)] if "per_model" in kw
                       else [torch.zeros(s) for s in shapes])
        params = list(model.parameters())
        st = TopKState(model, **kw)
        for step in range(2):
            g = _grads([tuple(p.shape) for p in params], rank, step, 7)
            buf0 = g[0].reshape(-1).clone()
            f0 = _hook(st, buf0, 0, False, [params[0]])
            f1 = _hook(st, torch.zeros(0), 1, True, [params[1]])
            out1 = f1.wait()
            assert out1.numel() == 0, name
            out0 = f0.wait()
            assert out0.shape == (30,) and torch.isfinite(out0).all(), name
        assert st.step == 2 and st.bucket_stats[1].payload_bytes == 0, (name, st.step, st.bucket_stats)


def _hook(state, buf, index, last, params):
    from hfkern.distributed import topk_hook

    return topk_hook(state, FakeBucket(buf, index, last, params))


class _Scale(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, c):
        return sum((p * c).sum() for p in self.model.parameters())


def check_process_group_argument(ctx):
    """process_group must be a ProcessGroup or None (an int raised AttributeError)."""
    from hfkern.distributed import TopKState

    model = Params([torch.zeros(4, 3)])
    for bad in (5, "world", object()):
        _expect(TypeError, ["TopKState: expected process_group to be a torch.distributed.ProcessGroup",
                            f"got {type(bad).__name__}"],
                lambda bad=bad: TopKState(model, process_group=bad), f"process_group={bad!r}")
    assert TopKState(model, process_group=dist.group.WORLD).world_size == WORLD


def check_load_state_dict_arguments(ctx):
    """load_state_dict takes a dict (a list raised AttributeError) whose residuals have their
    parameters' dtypes (they were cast), and changes nothing otherwise."""
    from hfkern.distributed import TopKState

    shapes = [(4, 3), (5,)]
    model = Params([torch.zeros(s) for s in shapes])
    st = TopKState(model, process_group=dist.group.WORLD, density=0.25, fallback=False)
    _call(st, list(model.parameters()), _grads(shapes, ctx["rank"], 0, 11))
    saved = st.state_dict()
    before = _snapshot(st)
    for bad in ([saved], None, "state", 5):
        _expect(TypeError, ["TopKState.load_state_dict: expected a dict", f"got {type(bad).__name__}"],
                lambda bad=bad: st.load_state_dict(bad), f"load_state_dict({type(bad).__name__})")
        _assert_unchanged(st, before, f"load_state_dict({type(bad).__name__})")
    for dtype in (torch.float64, torch.float16, torch.int32, torch.complex64):
        bad = {**saved, "step": 7, "residuals": {**saved["residuals"], 1: saved["residuals"][1].to(dtype)}}
        _expect(ValueError, ["parameter 1", "torch.float32", f"got {dtype}"],
                lambda bad=bad: st.load_state_dict(bad), f"residual of {dtype}")
        _assert_unchanged(st, before, f"residual of {dtype}")
    st.load_state_dict(saved)  # the right one still loads
    assert st.state_dict()["step"] == saved["step"]


CHECKS = [
    check_sparse_gradient_refused,
    check_failed_call_keeps_state,
    check_complex_dense_equals_ddp,
    check_complex_sparse_is_real_view,
    check_empty_bucket,
    check_process_group_argument,
    check_load_state_dict_arguments,
]


def worker(rank, world, out_dir, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from hfkern.distributed import node_groups

    # both are collective: every rank creates them, in this order
    ctx = {"rank": rank, "one_node": node_groups(world), "two_nodes": node_groups(1)}
    record = {}
    path = os.path.join(out_dir, f"rank{rank}.json")
    for check in CHECKS:
        try:
            check(ctx)
            record[check.__name__] = "ok"
        except Exception:  # noqa: BLE001 - recorded for the test to report; the other checks still run
            record[check.__name__] = traceback.format_exc()
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()


# ---- tests ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_topk_defects")
    fd, init_file = tempfile.mkstemp(dir=out)
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    ctx = mp.spawn(worker, args=(WORLD, str(out), init_file), nprocs=WORLD, join=False)
    return join_records(ctx, out, WORLD, _DEADLINE_S)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_distributed_defects(records, check):
    failures = {r: rec.get(check, f"not run: {rec['_failure']}") for r, rec in records.items()
                if rec.get(check) != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{msg}" for r, msg in failures.items())


@pytest.mark.parametrize("density, m, k", [(0.5, 10, 5), (0.01, 10, 1), (1.0, 10, 10), (1, 7, 7), (0.25, 10, 2),
                                           (0.5, 7, 4), (0.5, 1, 1), (1e-9, 3, 1), (0.5, 0, 0), (1.0, 0, 0)])
def test_k_for_values(density, m, k):
    got = k_for(density, m)
    assert got == k and type(got) is int, (density, m, got)


@pytest.mark.parametrize("density, m, exc, texts", [
    (0.5, -1, ValueError, ["expected m (the row length) to be an int >= 0", "got -1"]),
    (0.5, 10.0, TypeError, ["expected m (the row length) to be an int >= 0", "got float 10.0"]),
    (0.5, True, TypeError, ["got bool True"]),
    (0.5, None, TypeError, ["got NoneType None"]),
    (0.0, 10, ValueError, ["expected density in (0, 1]", "got 0.0"]),
    (-0.5, 10, ValueError, ["got -0.5"]),
    (1.5, 10, ValueError, ["got 1.5"]),
    (math.nan, 10, ValueError, ["got nan"]),
    (math.inf, 10, ValueError, ["got inf"]),
    ("0.1", 10, TypeError, ["expected density to be a real number in (0, 1]", "got str '0.1'"]),
    (True, 10, TypeError, ["got bool True"]),
    (None, 10, TypeError, ["got NoneType None"]),
])
def test_k_for_arguments(density, m, exc, texts):
    with pytest.raises(exc) as info:
        k_for(density, m)
    for t in texts:
        assert t in str(info.value) and str(info.value).startswith("k_for: "), str(info.value)
