"""hfkern.amp.GradScaler against B torch.amp.GradScaler, one per model, on CPU."""

from __future__ import annotations

import io
import math
import pickle

import pytest
import torch
from torch import nn

import hfkern.nn as hnn
import hfkern.optim as hoptim
import hfkern.utils as hutils
from hfkern.amp import GradScaler

B = 3
STEPS = 15
POISONED = {2, 3, 7, 11}  # steps at which model 1 overflows
POISONED_MODEL = 1
INIT_SCALES = [2.0**10, 2.0**12, 2.0**8]
SCALER_ARGS = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
LRS = [0.0625, 0.03125, 0.125]  # exact in float32, the precision hfkern.optim stores them in


def _f32(x):
    return float(torch.tensor(x, dtype=torch.float32))


# torch's Adam gets the float32-rounded hyperparameters hfkern's Adam stores.
TORCH_ADAM = dict(betas=(_f32(0.9), _f32(0.999)), eps=_f32(1e-8))


def _models():
    """B torch models and the array model made from them (two Linear layers around a Tanh)."""
    torch_models = [nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)) for _ in range(B)]
    array = nn.Sequential(
        hnn.Linear.from_modules([m[0] for m in torch_models]),
        nn.Tanh(),
        hnn.Linear.from_modules([m[2] for m in torch_models]),
    )
    return array, torch_models


def _param_groups(model, n_optimizers):
    """The parameters of ``model`` (array or torch) split over ``n_optimizers`` optimizers."""
    first, last = model[0], model[2]
    if n_optimizers == 1:
        return [list(first.parameters()) + list(last.parameters())]
    return [list(first.parameters()), list(last.parameters())]


def _poison_vector(step):
    """Per-model factors on the losses: inf for the poisoned model at a poisoned step."""
    v = torch.ones(B)
    if step in POISONED:
        v[POISONED_MODEL] = math.inf
    return v


def _poison_grads_(params, step, b=None):
    """NaN into the first gradient of the poisoned model (of its array slice when b is None)."""
    if step not in POISONED:
        return
    if b is None:
        params[0].grad[POISONED_MODEL, 0, 0] = math.nan
    elif b == POISONED_MODEL:
        params[0].grad[0, 0] = math.nan


def _run(poison, n_optimizers, clip, steps=STEPS, check_each_step=None):
    """Train the array model and the B torch models side by side; returns everything."""
    array, torch_models = _models()
    groups = _param_groups(array, n_optimizers)
    opts = [hoptim.Adam(g, lr=LRS, **TORCH_ADAM) for g in groups]
    scaler = GradScaler("cpu", init_scale=INIT_SCALES, B=B, **SCALER_ARGS)
    ref_opts = [[torch.optim.Adam(g, lr=LRS[b], **TORCH_ADAM) for g in _param_groups(m, n_optimizers)]
                for b, m in enumerate(torch_models)]
    ref_scalers = [torch.amp.GradScaler("cpu", init_scale=INIT_SCALES[b], **SCALER_ARGS) for b in range(B)]
    skipped = []
    for step in range(steps):
        x = torch.randn(B, 5, 4)
        target = torch.randn(B, 5, 2)
        for o in opts:
            o.zero_grad()
        losses = ((array(x) - target) ** 2).mean(dim=(1, 2))  # [B]
        if poison == "inf_loss":
            losses = losses * _poison_vector(step)
        scaler.scale(losses).sum().backward()
        if poison == "nan_grad":
            _poison_grads_(groups[0], step)
        if clip:
            for o in opts:
                scaler.unscale_(o)
            for g in groups:  # per optimizer: a NaN in one optimizer's gradients stays there
                hutils.clip_grad_norm_(g, [0.05, 0.1, 0.2])
        for o in opts:
            scaler.step(o)
        scaler.update()
        skipped.append([o.last_skipped.clone() for o in opts])

        for b, (model, ropts, rscaler) in enumerate(zip(torch_models, ref_opts, ref_scalers)):
            for o in ropts:
                o.zero_grad()
            loss = ((model(x[b]) - target[b]) ** 2).mean()
            if poison == "inf_loss":
                loss = loss * _poison_vector(step)[b]
            rscaler.scale(loss).backward()
            if poison == "nan_grad":
                _poison_grads_(_param_groups(model, n_optimizers)[0], step, b)
            if clip:
                for o in ropts:
                    rscaler.unscale_(o)
                for g in _param_groups(model, n_optimizers):
                    torch.nn.utils.clip_grad_norm_(g, [0.05, 0.1, 0.2][b])
            for o in ropts:
                rscaler.step(o)
            rscaler.update()
        if check_each_step is not None:
            check_each_step(step, scaler, ref_scalers)
            # The gradients each optimizer stepped with: unscaled by each model's own scale.
            for b, model in enumerate(torch_models):
                if b == POISONED_MODEL and step in POISONED:
                    continue
                for k, q in model.named_parameters():
                    ours = array.get_parameter(k).grad[b]
                    # (the array's batched matmuls round differently from torch's per-model ones: an
                    # element far below the gradient's largest differs by rounding of those)
                    torch.testing.assert_close(ours, q.grad, rtol=1e-5, atol=1e-6 * max(1.0, q.grad.abs().max().item()),
                                               msg=lambda m: f"step {step} model {b} {k}.grad: {m}")
    return array, torch_models, opts, scaler, ref_scalers, skipped


def _assert_scales_match(step, scaler, ref_scalers):
    expected = torch.tensor([s.get_scale() for s in ref_scalers], dtype=torch.float32)
    assert torch.equal(scaler.get_scale(), expected), (step, scaler.get_scale(), expected)
    trackers = torch.tensor([s._get_growth_tracker() for s in ref_scalers], dtype=torch.int32)
    assert torch.equal(scaler._get_growth_tracker(), trackers), step


def _assert_params_match(array, torch_models, **tol):
    array_sd = array.state_dict()
    for b, m in enumerate(torch_models):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(array_sd[k][b], v, msg=lambda msg: f"model {b} {k}: {msg}", **tol)


@pytest.mark.parametrize("poison", ["inf_loss", "nan_grad"])
@pytest.mark.parametrize("n_optimizers", [1, 2])
@pytest.mark.parametrize("clip", [False, True])
def test_training_matches_torch_scalers(poison, n_optimizers, clip):
    torch.manual_seed(1)
    array, torch_models, opts, scaler, ref_scalers, skipped = _run(
        poison, n_optimizers, clip, check_each_step=_assert_scales_match
    )
    # Agreement to rounding: the array Linear's batched matmuls and the Adam op round
    # differently from torch's per-model kernels.
    _assert_params_match(array, torch_models, rtol=1e-6, atol=1e-6)
    for step, per_opt in enumerate(skipped):
        for i, last in enumerate(per_opt):
            # A NaN in the first optimizer's gradients skips that optimizer only (as torch's
            # scaler skips per optimizer); an inf loss reaches every gradient of the model.
            hit = step in POISONED and (poison == "inf_loss" or i == 0)
            expected = torch.zeros(B, dtype=torch.bool)
            expected[POISONED_MODEL] = hit
            assert torch.equal(last, expected), (step, i, last)
    steps = opts[0].state[opts[0].param_groups[0]["params"][0]]["step"]
    assert steps.tolist() == [STEPS, STEPS - len(POISONED), STEPS]


def test_poisoned_model_scale_backs_off_alone():
    torch.manual_seed(2)
    history = []

    def record(step, scaler, ref_scalers):
        history.append(scaler.get_scale())

    _run("inf_loss", 1, False, check_each_step=record)
    prev = torch.tensor(INIT_SCALES)
    for step, scale in enumerate(history):
        if step in POISONED:
            assert float(scale[POISONED_MODEL]) == float(prev[POISONED_MODEL]) * 0.5, step
        for b in range(B):
            if b != POISONED_MODEL:  # never backs off; grows every growth_interval steps
                expected = prev[b] * 2 if (step + 1) % 3 == 0 else prev[b]
                assert float(scale[b]) == float(expected), (step, b)
        prev = scale
    assert float(history[-1][POISONED_MODEL]) < INIT_SCALES[POISONED_MODEL]


def test_clean_models_unchanged_by_a_poisoned_model():
    """Models 0 and 2 train bitwise as they do when model 1 never overflows."""
    torch.manual_seed(3)
    clean, *_ = _run(None, 1, True, steps=8)
    torch.manual_seed(3)
    poisoned, *_ = _run("inf_loss", 1, True, steps=8)
    for (k, a), c in zip(poisoned.state_dict().items(), clean.state_dict().values()):
        for b in (0, 2):
            assert torch.equal(a[b], c[b]), (k, b)
        assert not torch.equal(a[POISONED_MODEL], c[POISONED_MODEL]), k


@pytest.mark.parametrize("growth_factor, backoff_factor", [(2.0, 0.5), (1.7, 0.3)])
def test_update_matches_torch_per_model(growth_factor, backoff_factor):
    """Scale arithmetic (rounding, growth past float32's range) against torch's kernel."""
    init = [2.0**126 * 1.5, 3.0, 1e-3]
    g = torch.Generator().manual_seed(4)
    overflow = torch.rand(24, B, generator=g) < 0.3
    p = nn.Parameter(torch.randn(B, 3))
    opt = hoptim.SGD([p], lr=0.0)
    args = dict(growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=2)
    scaler = GradScaler("cpu", init_scale=init, B=B, **args)
    refs = [torch.amp.GradScaler("cpu", init_scale=init[b], **args) for b in range(B)]
    ref_params = [nn.Parameter(torch.randn(3)) for _ in range(B)]
    ref_opts = [torch.optim.SGD([q], lr=0.0) for q in ref_params]
    for step in range(overflow.size(0)):
        scaler.scale(torch.ones(B))
        grad = torch.randn(B, 3, generator=g)
        grad[overflow[step], 1] = math.inf
        p.grad = grad.clone()
        scaler.step(opt)
        scaler.update()
        for b in range(B):
            refs[b].scale(torch.ones(()))
            ref_params[b].grad = grad[b].clone()
            refs[b].step(ref_opts[b])
            refs[b].update()
        _assert_scales_match(step, scaler, refs)
        assert torch.equal(opt.last_skipped, overflow[step])


def test_unscale_divides_each_model_by_its_scale():
    p = nn.Parameter(torch.randn(B, 4, 2))
    opt = hoptim.Adam([p])
    scaler = GradScaler("cpu", init_scale=[2.0, 3.0, 1024.0], B=B)
    scaled = scaler.scale(torch.ones(B))
    assert torch.equal(scaled, torch.tensor([2.0, 3.0, 1024.0]))
    grad = torch.randn(B, 4, 2)
    p.grad = grad.clone()
    scaler.unscale_(opt)
    inv = torch.tensor([2.0, 3.0, 1024.0]).double().reciprocal().float().view(B, 1, 1)
    assert torch.equal(p.grad, grad * inv)
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert torch.equal(found[p.device], torch.zeros(B, dtype=torch.bool))


def test_scale_outputs():
    scaler = GradScaler("cpu", init_scale=[2.0, 4.0, 0.5], B=B)
    s = torch.tensor([2.0, 4.0, 0.5])
    x = torch.randn(B, 2, 3)
    assert torch.equal(scaler.scale(x), x * s.view(B, 1, 1))
    out = scaler.scale([torch.ones(B), (x, torch.ones(B, 1))])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert torch.equal(out[0], s) and torch.equal(out[1][0], x * s.view(B, 1, 1))
    assert torch.equal(out[1][1], s.view(B, 1))
    assert list(scaler.scale(iter([torch.ones(B)])))[0].tolist() == s.tolist()
    for dtype in (torch.float64, torch.bfloat16):
        y = torch.randn(B, 5, dtype=dtype)
        got = scaler.scale(y)
        assert got.dtype == dtype
        for b in range(B):  # as torch's scaler scales a loss of this dtype
            ref = torch.amp.GradScaler("cpu", init_scale=float(s[b]))
            assert torch.equal(got[b], ref.scale(y[b]))
    # Gradients flow through, scaled per model.
    w = torch.randn(B, requires_grad=True)
    scaler.scale(w * 1.0).sum().backward()
    assert torch.equal(w.grad, s)


def test_update_new_scale():
    scaler = GradScaler("cpu", B=B)
    scaler.scale(torch.ones(B))
    scaler.update(8.0)
    assert scaler.get_scale().tolist() == [8.0] * B
    scaler.update([1.0, 2.0, 3.0])
    assert scaler.get_scale().tolist() == [1.0, 2.0, 3.0]
    scaler.update(torch.tensor([5.0, 6.0, 7.0]))
    assert scaler.get_scale().tolist() == [5.0, 6.0, 7.0]
    scaler.update(torch.tensor([9.0]))
    assert scaler.get_scale().tolist() == [9.0] * B
    assert scaler._get_growth_tracker().tolist() == [0] * B


def _train_some(scaler, steps, seed):
    torch.manual_seed(seed)
    p = nn.Parameter(torch.ones(B, 3))
    opt = hoptim.SGD([p], lr=0.1)
    for step in range(steps):
        loss = (p * torch.randn(B, 3)).sum(1) * _poison_vector(step)
        scaler.scale(loss).sum().backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return p


def test_state_dict_round_trip():
    args = dict(init_scale=[64.0, 128.0, 256.0], growth_factor=3.0, backoff_factor=0.25, growth_interval=2)
    scaler = GradScaler("cpu", B=B, **args)
    _train_some(scaler, 5, seed=5)
    sd = scaler.state_dict()
    assert set(sd) == set(torch.amp.GradScaler("cpu").state_dict())
    assert sd["scale"].shape == (B,) and sd["scale"].dtype == torch.float32
    assert sd["_growth_tracker"].shape == (B,) and sd["_growth_tracker"].dtype == torch.int32
    assert sd["scale"][POISONED_MODEL] != sd["scale"][0]  # model 1 backed off at step 2 and 3
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    for fresh, init_first in ((GradScaler("cpu", B=B), False), (GradScaler("cpu", B=B), True)):
        if init_first:  # loading into a scaler whose tensors exist already
            fresh.scale(torch.ones(B))
        fresh.load_state_dict(loaded)
        assert torch.equal(fresh.get_scale(), sd["scale"])
        assert torch.equal(fresh._get_growth_tracker(), sd["_growth_tracker"])
        assert (fresh.get_growth_factor(), fresh.get_backoff_factor(), fresh.get_growth_interval()) == (3.0, 0.25, 2)
        # Both continue identically.
        a = _train_some(fresh, 6, seed=6)
        copy = pickle.loads(pickle.dumps(scaler))
        b = _train_some(copy, 6, seed=6)
        assert torch.equal(a, b) and torch.equal(fresh.get_scale(), copy.get_scale())
    # torch's format (one value for every model) loads too.
    ref = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=7)
    fresh = GradScaler("cpu", B=B)
    fresh.load_state_dict(ref.state_dict())
    assert fresh.get_scale().tolist() == [32.0] * B and fresh.get_growth_interval() == 7


def test_disabled():
    scaler = GradScaler("cpu", enabled=False, B=B)
    assert not scaler.is_enabled()
    x = torch.randn(B)
    assert scaler.scale(x) is x
    p = nn.Parameter(torch.randn(B, 2))
    p.grad = torch.full((B, 2), math.inf)
    opt = hoptim.SGD([p], lr=0.1)
    scaler.unscale_(opt)
    scaler.step(opt)  # steps every model, as optimizer.step() would
    scaler.update()
    assert not torch.isfinite(p).any()
    assert scaler.state_dict() == {}
    assert torch.equal(scaler.get_scale(), torch.ones(B))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_cuda_without_cuda_disables_itself():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = GradScaler(B=B)
    assert not scaler.is_enabled()


def test_no_device_value_is_read_on_the_host():
    """On the meta device a value read raises: scale/unscale_/step/update must never need one."""
    params = [nn.Parameter(torch.empty(B, 3, 2, device="meta")), nn.Parameter(torch.empty(B, device="meta"))]
    opt = hoptim.Adam(params, lr=LRS)
    opt.step()  # validates the hyperparameters (on the host) once
    scaler = GradScaler("meta", init_scale=INIT_SCALES, B=B)
    for _ in range(2):
        for p in params:
            p.grad = torch.empty_like(p)
        scaled = scaler.scale(torch.empty(B, device="meta"))
        assert scaled.device.type == "meta"
        scaler.unscale_(opt)
        hutils.clip_grad_norm_(params, [1.0, 2.0, 3.0])
        scaler.step(opt)
        scaler.update()
        assert opt.last_skipped.device.type == "meta"
    with pytest.raises(NotImplementedError):  # the check above can fail: a read does raise
        scaler.get_scale()


def test_bad_arguments():
    with pytest.raises(TypeError):
        GradScaler("cpu")  # B is required
    with pytest.raises(ValueError, match="B must be >= 1"):
        GradScaler("cpu", B=0)
    with pytest.raises(TypeError, match="B must be an int"):
        GradScaler("cpu", B=2.0)
    with pytest.raises(ValueError, match="device"):
        GradScaler("nonsense", B=B)
    with pytest.raises(TypeError, match="enabled"):
        GradScaler("cpu", enabled=1, B=B)
    for kwargs, match in [
        (dict(growth_factor=1.0), r"growth_factor must be finite and > 1.0, got 1.0"),
        (dict(growth_factor=math.inf), "growth_factor"),
        (dict(backoff_factor=1.0), r"backoff_factor must be finite and in \(0.0, 1.0\), got 1.0"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval must be >= 1, got 0"),
        (dict(init_scale=[1.0, 2.0]), "init_scale must have one value per model"),
        (dict(init_scale=-1.0), "init_scale must be >= 0"),
        (dict(init_scale=math.nan), "init_scale must not be NaN"),
    ]:
        with pytest.raises(ValueError, match=match):
            GradScaler("cpu", B=B, **kwargs)
    with pytest.raises(TypeError, match="growth_interval"):
        GradScaler("cpu", growth_interval=2.5, B=B)
    with pytest.raises(TypeError, match="growth_factor"):
        GradScaler("cpu", growth_factor="2", B=B)

    scaler = GradScaler("cpu", B=B)
    p = nn.Parameter(torch.randn(B, 2))
    opt = hoptim.SGD([p], lr=0.1)
    p.grad = torch.randn(B, 2)
    for call in (lambda: scaler.unscale_(opt), lambda: scaler.step(opt), lambda: scaler.update()):
        with pytest.raises(RuntimeError, match="before any scale"):
            call()
    with pytest.raises(ValueError, match=r"leading \(array\) dim B=3.*\[2\]"):
        scaler.scale(torch.ones(2))
    with pytest.raises(ValueError, match=r"B=3.*\[\]"):
        scaler.scale(torch.tensor(1.0))
    with pytest.raises(ValueError, match="Tensor or an iterable"):
        scaler.scale([torch.ones(B), 3.0])
    scaler.scale(torch.ones(B))
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()
    ref_opt = torch.optim.SGD([nn.Parameter(torch.randn(B, 2))], lr=0.1)
    with pytest.raises(TypeError, match="must accept skip"):
        scaler.step(ref_opt)
    with pytest.raises(ValueError, match="B=3 models but the optimizer has B=2"):
        q = nn.Parameter(torch.randn(2, 2))
        q.grad = torch.randn(2, 2)
        scaler.step(hoptim.SGD([q], lr=0.1))
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: None)
    scaled = p.grad.clone()
    with pytest.raises(ValueError, match=r"skip must be a \[B\]=\[3\] bool tensor, got a tensor of shape \[2\]"):
        scaler.step(opt, skip=torch.zeros(2, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"skip must be a \[B\]=\[3\] bool tensor, got list"):
        scaler.step(opt, skip=[True, False, False])
    with pytest.raises(TypeError, match=r"got a tensor of shape \[3\] and dtype torch.float32"):
        scaler.step(opt, skip=torch.zeros(3))
    assert torch.equal(p.grad, scaled)  # refused before unscale_: the gradients are still scaled
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt, skip=torch.tensor([True, False, False]))
    assert opt.last_skipped.tolist() == [True, False, False]
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="pickled"):
        pickle.dumps(scaler)
    scaler.update()
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(torch.ones(2))
    with pytest.raises(ValueError, match="new_scale must be >= 0"):
        scaler.update(-1.0)
    with pytest.raises(ValueError, match="new_scale must have one value per model"):
        scaler.update([1.0, 2.0])
    half = nn.Parameter(torch.randn(B, 2, dtype=torch.float16))
    half.grad = torch.randn(B, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="FP16"):
        scaler.unscale_(hoptim.SGD([half], lr=0.1))
    with pytest.raises(RuntimeError, match="empty"):
        scaler.load_state_dict({})
    good = scaler.state_dict()
    with pytest.raises(ValueError, match="missing"):
        scaler.load_state_dict({"scale": 1.0})
    with pytest.raises(ValueError, match="scale must have one value per model"):
        scaler.load_state_dict({**good, "scale": torch.ones(4)})
    with pytest.raises(ValueError, match="_growth_tracker must hold ints >= 0"):
        scaler.load_state_dict({**good, "_growth_tracker": [0, -1, 2]})
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler.load_state_dict({**good, "backoff_factor": 2.0})
    assert torch.equal(scaler.get_scale(), good["scale"])  # rejected loads changed nothing
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(0.5)
