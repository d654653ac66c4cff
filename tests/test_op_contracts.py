"""Argument contracts of the ``hfkern::*`` ops: what each op (and its fake) rejects, and that
it rejects it before anything changes.

Every check is asked of the real op and of its fake (under ``FakeTensorMode``), which must
raise the same error with the same message; an in-place op that raises leaves every tensor
it was given as it was. A tensor on the meta device among CPU tensors stands for "another
device": the dispatcher then picks the op's fake kernel for the whole call, which must not
return as if it had run.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

import hfkern  # noqa: F401  (registers the ops)
from hfkern._dtypes import acc_dtype
from hfkern._optim_specs import ADAM_SPEC, OPTIMIZER_SPECS, SGD_SPEC
from hfkern.ops import batch_norm as obn
from hfkern.ops import conv as oconv
from hfkern.ops import embedding as oemb
from hfkern.ops import layer_norm as oln
from hfkern.ops import optim as oopt

ops = torch.ops.hfkern
META = torch.device("meta")


def _fake_call(fn, *args):
    with FakeTensorMode() as mode:
        fake = tree_map(lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a, args)
        return fn(*fake)


def _raises_alike(fn, args, exc, match):
    """``fn(*args)`` raises ``exc`` matching ``match``, and so does ``fn`` on fake copies of
    ``args``, with the same message; returns the message."""
    with pytest.raises(exc, match=match) as real:
        fn(*args)
    with pytest.raises(exc) as fake:
        _fake_call(fn, *args)
    assert str(fake.value) == str(real.value)
    return str(real.value)


def _snapshot(args):
    return [t.clone() for t in _tensors(args)]


def _tensors(args):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_tensors(a))
    return out


def _unchanged(args, before):
    after = [t for t in _tensors(args)]
    assert len(after) == len(before)
    for t, b in zip(after, before):
        if t.device.type != "meta":
            assert torch.equal(t, b)


# ---- array_conv (+ its gradient ops) ------------------------------------------------

CONV2D = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)  # stride, padding, dilation, transposed, output_padding, groups


def test_conv_rejects_weight_of_other_models_whose_channels_add_up():
    """B * C_in of x equals the weight's C_in: the grouped convolution would have run over
    every model's channels together."""
    x, w = torch.randn(2, 3, 4, 5, 5), torch.randn(1, 6, 8, 3, 3)
    msg = _raises_alike(ops.array_conv, (x, w, None, *CONV2D), ValueError, r"expected x of shape \[B=1, N, C_in=8")
    assert "got [2, 3, 4, 5, 5]" in msg
    with pytest.raises(ValueError, match=r"expected x of shape \[B=1"):
        oconv.conv(x, w, None, *CONV2D)  # the modules' entry point


@pytest.mark.parametrize("weight_shape, match", [
    ((3, 6, 4, 3, 3), r"expected x of shape \[B=3, N, C_in=4"),   # other B
    ((2, 6, 5, 3, 3), r"expected x of shape \[B=2, N, C_in=5"),   # other C_in
    ((2, 6, 2, 3, 3), r"expected x of shape \[B=2, N, C_in=2"),   # C_in/groups * groups != C_in
])
def test_conv_rejects_x_that_does_not_fit_the_weight(weight_shape, match):
    x, w = torch.randn(2, 3, 4, 5, 5), torch.randn(*weight_shape)
    _raises_alike(ops.array_conv, (x, w, None, *CONV2D), ValueError, match)
    with pytest.raises(ValueError, match=match):
        oconv.conv(x, w, None, *CONV2D)


def test_conv_rejects_shared_and_transposed_inputs_that_do_not_fit():
    w = torch.randn(2, 6, 4, 3, 3)
    _raises_alike(ops.array_conv, (torch.randn(3, 5, 5, 5), w, None, *CONV2D), ValueError,
                  r"expected x of shape \[N, C_in=4, \*s\] \(shared\)")
    wt = torch.randn(2, 4, 3, 3, 3)  # transposed: [B, C_in, C_out/groups, *k]
    tr = ([1, 1], [0, 0], [1, 1], True, [0, 0], 1)
    _raises_alike(ops.array_conv, (torch.randn(2, 3, 6, 5, 5), wt, None, *tr), ValueError,
                  r"expected x of shape \[B=2, N, C_in=4, \*s\] .*transposed")
    ops.array_conv(torch.randn(2, 3, 4, 5, 5), wt, None, *tr)  # fits


@pytest.mark.parametrize("bias_shape", [(2, 5), (1, 6), (12,)])
def test_conv_rejects_bias_of_another_shape(bias_shape):
    x, w = torch.randn(2, 3, 4, 5, 5), torch.randn(2, 6, 4, 3, 3)
    _raises_alike(ops.array_conv, (x, w, torch.randn(*bias_shape), *CONV2D), ValueError,
                  r"expected bias of shape \[B=2, C_out=6\]")


def test_conv_rejects_dtypes_and_devices_other_than_the_weights():
    x, w, b = torch.randn(2, 3, 4, 5, 5), torch.randn(2, 6, 4, 3, 3), torch.randn(2, 6)
    _raises_alike(ops.array_conv, (x.double(), w, b, *CONV2D), TypeError,
                  r"expected x of the weight's dtype \(torch.float32\), got torch.float64")
    _raises_alike(ops.array_conv, (x, w, b.double(), *CONV2D), TypeError, "expected bias of the weight's dtype")
    with pytest.raises(TypeError, match="expected x of the weight's dtype"):
        oconv.conv(x.double(), w, b, *CONV2D)
    # a weight on another device: the call reaches the fake kernel, which must not return
    _raises_alike(ops.array_conv, (x, w.to(META), b.to(META), *CONV2D), ValueError,
                  r"expected x on the weight's device \(meta\), got x on cpu")
    _raises_alike(ops.array_conv, (x, w, b.to(META), *CONV2D), ValueError, "expected bias on the weight's device")


def test_conv_gradient_ops_check_their_operands_against_the_weight():
    x, w = torch.randn(2, 3, 4, 5, 5), torch.randn(2, 6, 4, 3, 3)
    gy = torch.randn(2, 3, 6, 3, 3)
    ops.array_conv_input_grad(gy, w, list(x.shape), *CONV2D)
    ops.array_conv_weight_grad(gy, x, w, *CONV2D)
    for bad_gy in (torch.randn(1, 3, 6, 3, 3), torch.randn(2, 3, 5, 3, 3), torch.randn(2, 3, 6, 4, 4),
                   torch.randn(2, 2, 6, 3, 3)):
        _raises_alike(ops.array_conv_input_grad, (bad_gy, w, list(x.shape), *CONV2D), ValueError,
                      r"expected grad_out of the convolution's output shape \[2, 3, 6, 3, 3\]")
        _raises_alike(ops.array_conv_weight_grad, (bad_gy, x, w, *CONV2D), ValueError,
                      r"expected grad_out of the convolution's output shape \[2, 3, 6, 3, 3\]")
    _raises_alike(ops.array_conv_input_grad, (gy, w, [3, 3, 4, 5, 5], *CONV2D), ValueError,
                  r"expected input_size of shape \[B=2, N, C_in=4")
    _raises_alike(ops.array_conv_weight_grad, (gy, torch.randn(1, 3, 8, 5, 5), w, *CONV2D), ValueError,
                  r"expected x of shape \[B=2, N, C_in=4")
    _raises_alike(ops.array_conv_weight_grad, (gy.double(), x, w, *CONV2D), TypeError,
                  "expected grad_out of the weight's dtype")


def test_conv_under_autocast_still_runs_on_mixed_input_dtypes():
    """The entry point checks the dtypes the op receives: after autocast's cast."""
    x, w, b = torch.randn(2, 3, 4, 5, 5), torch.randn(2, 6, 4, 3, 3), torch.randn(2, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = oconv.conv(x, w, b, *CONV2D)
        y2 = oconv.conv(y, torch.randn(2, 6, 6, 1, 1), None, *CONV2D)  # bfloat16 input, float32 weight
        y3 = ops.array_conv(y, torch.randn(2, 6, 6, 1, 1), None, *CONV2D)
    assert y.dtype == y2.dtype == y3.dtype == torch.bfloat16


# ---- array_embedding (+ backward ops, renorm) ----------------------------------------

@pytest.mark.parametrize("B_idx", [1, 2, 4])
def test_embedding_rejects_indices_of_another_B(B_idx):
    w = torch.randn(3, 7, 4)
    idx = torch.randint(0, 7, (B_idx, 5))
    _raises_alike(ops.array_embedding, (w, idx), ValueError,
                  rf"expected indices of shape \[B, \*\] with B = 3 .*got \[{B_idx}, 5\]")
    with pytest.raises(ValueError, match="with B = 3"):
        oemb.embedding(w, idx)  # the modules' entry point
    before = w.clone()
    with pytest.raises(ValueError, match="with B = 3"):
        ops.array_embedding_renorm_(w, idx, 1.0, 2.0)
    assert torch.equal(w, before)


def test_embedding_accepts_shared_indices():
    w = torch.randn(3, 7, 4)
    idx = torch.randint(0, 7, (5,))
    out = ops.array_embedding(w, idx.expand(3, 5))
    assert torch.equal(out, torch.stack([w[b, idx] for b in range(3)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool])
def test_embedding_rejects_indices_of_other_dtypes(dtype):
    w = torch.randn(3, 7, 4)
    idx = torch.randint(0, 2, (3, 5)).to(dtype)
    _raises_alike(ops.array_embedding, (w, idx), TypeError,
                  rf"expected indices of dtype torch.int64 or torch.int32, got {dtype}")


def test_embedding_rejects_weight_of_other_ranks_and_devices():
    _raises_alike(ops.array_embedding, (torch.randn(7, 4), torch.randint(0, 7, (7, 5))), ValueError,
                  r"expected weight of shape \[B, V, D\], got \[7, 4\]")
    w = torch.randn(3, 7, 4)
    _raises_alike(ops.array_embedding, (w, torch.randint(0, 7, (3, 5), device=META)), ValueError,
                  r"expected indices on weight's device \(cpu\), got indices on meta")


@pytest.mark.parametrize("op", ["array_embedding_backward", "array_embedding_sparse_backward"])
def test_embedding_backward_ops_check_grad_out_against_indices(op):
    fn = getattr(ops, op)
    extra = (False,) if op == "array_embedding_backward" else ()
    idx = torch.randint(0, 7, (3, 5))
    fn(torch.randn(3, 5, 4), idx, 7, -1, *extra)
    for bad in (torch.randn(2, 5, 4), torch.randn(3, 6, 4), torch.randn(3, 5)):
        _raises_alike(fn, (bad, idx, 7, -1, *extra), ValueError,
                      r"expected grad_out of shape \[\*indices.shape, D\] = \[3, 5\] \+ \[D\]")
    _raises_alike(fn, (torch.randn(3, 5, 4), idx.float(), 7, -1, *extra), TypeError, "expected indices of dtype")
    _raises_alike(fn, (torch.randn(3, 5, 4), idx.to(META), 7, -1, *extra), ValueError,
                  r"expected indices on grad_out's device \(cpu\)")


# ---- optimizer steps ---------------------------------------------------------------

def _step_args(spec, B=3, dtype=torch.float32):
    """Valid arguments of ``spec``'s op: two parameters, every state list filled where its
    option may be on (flags False), in ``spec.args`` order."""
    params = [torch.randn(B, 4, 3, dtype=dtype), torch.randn(B, 5, dtype=dtype)]
    def state():
        return [torch.rand(p.shape, dtype=acc_dtype(dtype)) for p in params]

    args = {"params": params, "grads": [torch.randn_like(p) for p in params], "skip": None,
            "steps": [torch.tensor([0.0, 3.0, 1.0][:B]), torch.tensor([2.0, 2.0, 0.0][:B])],
            "hypers": torch.rand(len(spec.rows), B) * 0.5 + 0.1}
    for arg, _, when in spec.states:
        args[arg] = [] if when in spec.flags else state()
    for flag in spec.flags:
        args[flag] = False
    return [args[a] for a in spec.args]


SPECS = {spec.op: spec for spec in OPTIMIZER_SPECS}


def _spec_list(spec, args, name):
    return args[spec.args.index(name)]


def _written_lists(spec):
    return ["params", *[a for a, _, when in spec.states if when not in spec.flags], "steps"]


@pytest.mark.parametrize("op", list(SPECS))
def test_step_rejects_an_expanded_tensor_before_writing_anything(op):
    spec = SPECS[op]
    for name in _written_lists(spec):
        args = _step_args(spec)
        lst = _spec_list(spec, args, name)
        lst[1] = lst[1][:1].expand_as(lst[1])  # every model's slice is one memory
        before = _snapshot(args)
        msg = _raises_alike(getattr(ops, op), args, ValueError, rf"expected {name}\[1\] in dense memory")
        assert "strides [0" in msg
        _unchanged(args, before)
        with pytest.raises(ValueError, match=rf"expected {name}\[1\] in dense memory"):
            oopt.run_step(spec, *args)  # the optimizers' eager path, no dispatcher
        _unchanged(args, before)


def test_step_accepts_expanded_gradients_and_channels_last_parameters():
    """Only what the step writes must be free of overlap; dense layouts other than
    contiguous pass."""
    args = _step_args(ADAM_SPEC)
    args[1][1] = args[1][1][:1].expand_as(args[1][1])
    p = torch.randn(3, 4, 3, 5, 5).contiguous(memory_format=torch.channels_last_3d)
    for i in (0, 2, 3):
        args[i][0] = torch.zeros_like(p) if i else p
    args[1][0] = torch.randn_like(p)
    ops.adam_step_(*args)
    assert args[-7][0].tolist() == [1.0, 4.0, 2.0]  # steps advanced


@pytest.mark.parametrize("op", list(SPECS))
def test_step_rejects_a_tensor_on_another_device_before_writing_anything(op):
    spec = SPECS[op]
    lists = ["grads", *_written_lists(spec)]
    for name in lists:
        args = _step_args(spec)
        lst = _spec_list(spec, args, name)
        lst[-1] = lst[-1].to(META)
        before = _snapshot(args)
        msg = _raises_alike(getattr(ops, op), args, ValueError,
                            rf"expected every tensor on one device \(params\[0\]'s, cpu\), got {name}\[1\] on meta")
        _unchanged(args, before)
        with pytest.raises(ValueError) as e:
            oopt.run_step(spec, *args)
        assert str(e.value) == msg
        _unchanged(args, before)
    args = _step_args(spec)
    i = spec.args.index("hypers")
    args[i] = args[i].to(META)
    before = _snapshot(args)
    _raises_alike(getattr(ops, op), args, ValueError, "got hypers on meta")
    with pytest.raises(ValueError, match="got hypers on meta"):
        oopt.run_step(spec, *args)
    _unchanged(args, before)


@pytest.mark.parametrize("spec", [SGD_SPEC, ADAM_SPEC], ids=lambda s: s.op)
def test_step_rejects_a_0d_parameter_with_its_value_error(spec):
    args = _step_args(spec)
    for name in ("params", "grads", *[a for a, _, w in spec.states if w not in spec.flags]):
        lst = _spec_list(spec, args, name)
        lst[0] = torch.tensor(1.0)
    _raises_alike(getattr(ops, spec.op), args, ValueError,
                  r"expected every parameter of shape \[B, \.\.\.\] \(array dim first\), got \[\] at index 0")
    sgd = (
        [torch.tensor(1.)], [torch.tensor(1.)], [], [], torch.zeros(4, 1), False, False, False, None)
    _raises_alike(ops.sgd_step_, sgd, ValueError, r"expected every parameter of shape \[B, \.\.\.\]")


# ---- batch norm --------------------------------------------------------------------

B, N, C = 3, 4, 5


def _bn_args(x, **kw):
    args = {"weight": torch.ones(B, C), "bias": None, "running_mean": torch.zeros(B, C),
            "running_var": torch.ones(B, C), "num_batches_tracked": None, "training": True, "momentum": 0.1,
            "eps": 1e-5}
    args.update(kw)
    return (x, *args.values())


@pytest.mark.parametrize("where", ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"])
@pytest.mark.parametrize("entry", ["op", "function", "function_gelu"])
def test_batch_norm_rejects_a_tensor_on_another_device_before_writing(where, entry):
    x = torch.randn(B, N, C, 3)
    t = torch.ones(B, dtype=torch.long) if where == "num_batches_tracked" else torch.ones(B, C)
    args = _bn_args(x, **{where: t.to(META)})
    before = _snapshot(args)
    if entry == "op":
        _raises_alike(ops.array_batch_norm, args, ValueError,
                      rf"expected {where} on x's device \(cpu\), got {where} on meta")
    else:
        act = ("gelu",) if entry == "function_gelu" else ()
        with pytest.raises(ValueError, match=rf"expected {where} on x's device \(cpu\)"):
            obn.array_batch_norm(*args, *act)
    _unchanged(args, before)


def test_batch_norm_backward_rejects_a_tensor_on_another_device():
    x = torch.randn(B, N, C, 3)
    _, mean, rstd = ops.array_batch_norm(*_bn_args(x))
    _raises_alike(ops.array_batch_norm_backward, (torch.randn_like(x), x, None, mean.to(META), rstd, True,
                                                  [True, False, False]), ValueError, "expected mean on x's device")
    _raises_alike(ops.array_batch_norm_backward, (torch.randn_like(x).to(META), x, None, mean, rstd, True,
                                                  [True, False, False]), ValueError, "expected grad_y on x's device")


@pytest.mark.parametrize("entry", ["op", "function"])
def test_batch_norm_rejects_expanded_running_statistics_before_writing(entry):
    x = torch.randn(B, N, C, 3)
    args = _bn_args(x, running_var=torch.ones(1, C).expand(B, C))
    before = _snapshot(args)
    fn = ops.array_batch_norm if entry == "op" else obn.array_batch_norm
    with pytest.raises(ValueError, match=r"expected running_var in dense memory .*strides \[0, 1\]"):
        fn(*args)
    _unchanged(args, before)
    if entry == "op":
        _raises_alike(fn, args, ValueError, "expected running_var in dense memory")


def _x_layout(layout):
    if layout == "array_conv":  # [N, B, C, H, W] memory: the grouped view is free
        return torch.randn(N, B, C, 3, 3).transpose(0, 1)
    if layout == "contiguous":  # [B, N, C, H, W]: torch's batch norm on a copy of the grouped view
        return torch.randn(B, N, C, 3, 3)
    return torch.randn(B, N, C)  # a linear layer's output


@pytest.mark.parametrize("layout", ["array_conv", "contiguous", "linear"])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("entry", ["op", "function", "function_gelu"])
def test_batch_norm_updates_noncontiguous_running_statistics_where_they_lie(layout, momentum, entry):
    x = _x_layout(layout)
    nbt = torch.full((B,), 3, dtype=torch.long)
    base_m, base_v = torch.rand(C, B), torch.rand(C, B) + 0.5
    rm, rv = base_m.t(), base_v.t()  # [B, C], not contiguous
    rm_c, rv_c = rm.contiguous(), rv.contiguous()
    initial = rm_c.clone()
    act = ("gelu",) if entry == "function_gelu" else ()
    fn = ops.array_batch_norm if entry == "op" else obn.array_batch_norm
    y, mean, rstd = fn(x, None, None, rm, rv, nbt, True, momentum, 1e-5, *act)
    y_c, mean_c, rstd_c = fn(x, None, None, rm_c, rv_c, nbt, True, momentum, 1e-5, *act)
    assert torch.equal(y, y_c) and torch.equal(mean, mean_c) and torch.equal(rstd, rstd_c)
    assert torch.equal(rm, rm_c) and torch.equal(rv, rv_c)
    assert torch.equal(base_m.t(), rm_c) and torch.equal(base_v.t(), rv_c)  # written where they lie
    assert not torch.equal(rm_c, initial)  # (the statistics did move)


# ---- layer norm and RMS norm ---------------------------------------------------------

def test_layer_norm_backward_rejects_grad_y_and_statistics_of_other_shapes():
    x, w = torch.randn(3, 4, 6), torch.randn(3, 6)
    _, m, r = ops.array_layer_norm(x, w, None, 1, 1e-5)
    mask = [True, True, False]
    for gy in (torch.randn(1, 4, 6), torch.randn(3, 4, 1), torch.randn(4, 6)):
        _raises_alike(ops.array_layer_norm_backward, (gy, x, w, m, r, 1, mask), ValueError,
                      r"expected grad_y of x's shape \[3, 4, 6\], got")
    gy = torch.randn_like(x)
    _raises_alike(ops.array_layer_norm_backward, (gy, x, w, m[:, :1], r, 1, mask), ValueError,
                  r"expected mean of shape \[3, 4\] .*got \[3, 1\]")
    _raises_alike(ops.array_layer_norm_backward, (gy, x, w, m, r.reshape(12), 1, mask), ValueError,
                  r"expected rstd of shape \[3, 4\]")
    _raises_alike(ops.array_layer_norm_backward, (gy, x, w, m, r.to(META), 1, mask), ValueError,
                  r"expected rstd on x's device \(cpu\), got rstd on meta")


def test_rms_norm_backward_rejects_grad_y_and_statistics_of_other_shapes():
    x, w = torch.randn(3, 4, 6), torch.randn(3, 6)
    _, r = ops.array_rms_norm(x, w, 1, 1e-5)
    for gy in (torch.randn(3, 4, 1), torch.randn(1, 4, 6)):
        _raises_alike(ops.array_rms_norm_backward, (gy, x, w, r, 1, [True, True]), ValueError,
                      r"expected grad_y of x's shape \[3, 4, 6\]")
    _raises_alike(ops.array_rms_norm_backward, (torch.randn_like(x), x, w, r[:1], 1, [True, True]), ValueError,
                  r"expected rstd of shape \[3, 4\]")


def test_norms_reject_parameters_on_another_device():
    x, w = torch.randn(3, 4, 6), torch.randn(3, 6)
    _raises_alike(ops.array_layer_norm, (x, w.to(META), None, 1, 1e-5), ValueError,
                  r"expected weight on x's device \(cpu\), got weight on meta")
    _raises_alike(ops.array_layer_norm, (x, w, w.to(META), 1, 1e-5), ValueError, "expected bias on x's device")
    _raises_alike(ops.array_rms_norm, (x, w.to(META), 1, 1e-5), ValueError, "expected weight on x's device")
    with pytest.raises(ValueError, match="expected weight on x's device"):
        oln.layer_norm(x, w.to(META), None, 1, 1e-5)
    with pytest.raises(ValueError, match="expected weight on x's device"):
        oln.rms_norm(x, w.to(META), 1, 1e-5)


def test_valid_calls_still_pass_opcheck():
    x, w = torch.randn(2, 3, 4, 5, 5), torch.randn(2, 6, 4, 3, 3)
    torch.library.opcheck(ops.array_conv, (x, w, torch.randn(2, 6), *CONV2D))
    torch.library.opcheck(ops.array_embedding, (torch.randn(3, 7, 4), torch.randint(0, 7, (3, 5))))
    xb = torch.randn(3, 4, 6)
    _, m, r = ops.array_layer_norm(xb, None, None, 1, 1e-5)
    torch.library.opcheck(ops.array_layer_norm_backward, (torch.randn_like(xb), xb, None, m, r, 1,
                                                          [True, False, False]))
