"""hfkern.fuse on idioms of everyday torch code that need more than an op's array form.

Tensors made in forward that are not the models' own values (``torch.arange(n).type_as(x)``,
``torch.zeros(x.size(0), 8)``: one tensor for every model, until array values are written into
them), every output with B first, reductions over an empty dim list, per-model 0-d fill values,
boolean-mask assignment, ``torch.autograd.grad`` and ``detach_`` in forward, ``moveaxis``, torch's
keyword spellings, and the constructs whose result's size depends on the values (refused with a
FuseError naming the construct and the user's line). Each case runs B torch models one by one and
the fused model (float64, B = 1 and 3) and compares outputs, input and parameter gradients and
state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils._pytree import tree_flatten

import hfkern
from hfkern import fusion

TOL = {"rtol": 1e-9, "atol": 1e-10}


def _compare(make, inputs, Bs=(1, 3), modes=("train",), calls=2, shared=False):
    """Fuse B models from ``make``; ``inputs``: per-model shapes (float) or ``("long", shape, n)``.
    ``shared``: the float inputs as one tensor for every model (hfkern.broadcast)."""
    for B in Bs:
        for mode in modes:
            torch.manual_seed(0)
            models = [make().double().train(mode == "train") for _ in range(B)]
            fused = hfkern.fuse(models)
            for _ in range(calls):
                per_model, given, leaves = [[] for _ in range(B)], [], []
                for spec in inputs:
                    if isinstance(spec, tuple) and spec and spec[0] == "long":
                        x = torch.randint(0, spec[2], (B, *spec[1]))
                        given.append(x)
                        for b in range(B):
                            per_model[b].append(x[b])
                    elif shared:
                        x = torch.randn(*spec, dtype=torch.float64, requires_grad=True)
                        given.append(hfkern.broadcast(x, B))
                        leaves.append((x, None))
                        for b in range(B):
                            per_model[b].append(x)
                    else:
                        x = torch.randn(B, *spec, dtype=torch.float64)
                        mine = x.clone().requires_grad_()
                        theirs = [x[b].clone().requires_grad_() for b in range(B)]
                        given.append(mine)
                        leaves.append((mine, theirs))
                        for b in range(B):
                            per_model[b].append(theirs[b])
                refs = [m(*per_model[b]) for b, m in enumerate(models)]
                out = fused(*given)
                got, spec = tree_flatten(out)
                want = [tree_flatten(r)[0] for r in refs]
                assert tree_flatten(refs[0])[1] == spec
                loss_f, loss_r = 0, 0
                w = torch.Generator().manual_seed(1)
                for i, o in enumerate(got):
                    if not isinstance(o, torch.Tensor):
                        assert o == want[0][i]
                        continue
                    ref = torch.stack([r[i] for r in want])
                    assert o.shape == ref.shape, (B, mode, i)
                    assert_close(o.detach(), ref.detach(), **TOL, msg=f"B={B} {mode} out[{i}]")
                    assert o.requires_grad == ref.requires_grad
                    if ref.requires_grad:
                        weight = torch.randn(ref.shape, generator=w, dtype=ref.dtype)
                        loss_f = loss_f + (o * weight).sum()
                        loss_r = loss_r + (ref * weight).sum()
                if not isinstance(loss_r, torch.Tensor):
                    continue
                if shared:
                    xs = [x for x, _ in leaves]
                    want_g = torch.autograd.grad(loss_r, xs, retain_graph=True, allow_unused=True)
                    got_g = torch.autograd.grad(loss_f, xs, retain_graph=True, allow_unused=True)
                    for a, b_ in zip(got_g, want_g):
                        assert (a is None) == (b_ is None)
                        if a is not None:
                            assert_close(a, b_, **TOL)
                for p in fused.parameters():
                    p.grad = None
                for m in models:
                    m.zero_grad(set_to_none=True)
                loss_f.backward()
                loss_r.backward()
                if not shared:
                    for mine, theirs in leaves:
                        if theirs[0].grad is None:
                            assert mine.grad is None or not mine.grad.any()
                        else:
                            assert_close(mine.grad, torch.stack([t.grad for t in theirs]), **TOL)
                for name, p in models[0].named_parameters():
                    got_p = fused.get_parameter(name).grad
                    for b, m in enumerate(models):
                        theirs = m.get_parameter(name).grad
                        if theirs is None:
                            assert got_p is None or not got_p[b].any(), name
                        else:
                            assert_close(got_p[b], theirs, **TOL, msg=f"{name}.grad[{b}]")
                state = fused.state_dict()
                for b, m in enumerate(models):
                    for k, v in m.state_dict().items():
                        assert_close(state[k][b], v, **TOL, msg=f"{k}[{b}]")


def _model(forward, width=6, **extra):
    """A model with a linear ``fc`` (``width`` in and out) and ``forward(self, *inputs)``."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(width, width)
            for name, value in extra.items():
                if isinstance(value, nn.Parameter):
                    self.register_parameter(name, nn.Parameter(torch.randn_like(value)))
                else:
                    self.register_buffer(name, value.clone())

    Net.forward = forward
    return Net


# ---- tensors that are the same for every model ----------------------------------------------------
def test_a_tensor_converted_to_an_array_values_dtype_is_one_tensor_for_every_model():
    # .type_as(x)/.to(x) take a dtype and device from x: the result has no B dim (with T == B the
    # fused model added model b's position b to every position)
    def forward(self, x):
        pos = torch.arange(x.size(1)).type_as(x)
        return self.fc(x) + pos + torch.arange(x.size(1)).to(x) * 2

    _compare(_model(forward, width=3), [(4, 3)])


class _Rope(nn.Module):
    """Llama-style rotary embedding: ``torch.arange(T).type_as(self.inv_freq)`` (a buffer)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)))

    def forward(self, x):
        x = self.fc(x)
        t = torch.arange(x.shape[-2], device=x.device).type_as(self.inv_freq)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()


@pytest.mark.parametrize("T", [3, 5])
def test_rotary_embedding(T):
    _compare(_Rope, [(2, T, 4)])


def test_every_output_has_B_first():
    def forward(self, x):
        return self.fc(x), torch.zeros(x.size(0), 2), torch.ones(5), x.size(0), x.shape

    for B in (1, 3):
        fused = hfkern.fuse(_model(forward, width=3), B)
        y, zeros, ones, n, shape = fused(torch.randn(B, 4, 3))
        assert (y.shape, zeros.shape, ones.shape) == ((B, 4, 3), (B, 4, 2), (B, 5))
        assert not zeros.any() and bool((ones == 1).all())
        ones[0] += 1  # each model's own copy
        assert bool((ones[1:] == 1).all())
        assert n == 4 and type(shape) is torch.Size and shape == (4, 3)
    _compare(_model(forward, width=3), [(4, 3)])


@pytest.mark.parametrize("case", ["scatter", "setitem", "add_", "view_copy", "mixed"])
def test_in_place_writes_of_array_values_into_a_tensor_made_from_sizes(case):
    # a factory sized by the input makes one tensor for every model; written with per-model values, it
    # becomes each model's own where it is made
    def forward(self, x, y):
        h = self.fc(x)
        if case == "scatter":  # one-hot targets
            onehot = torch.zeros(y.size(0), 6, dtype=x.dtype).scatter_(1, y.unsqueeze(1), 1.0)
            return (h.log_softmax(-1) * onehot).sum(-1)
        if case == "setitem":  # padding into a larger tensor
            out = torch.zeros(x.size(0), 8, dtype=x.dtype)
            flat = out.view(-1)  # a view made before the write sees it
            out[:, 1:7] = h
            return out, flat
        if case == "add_":
            out = torch.zeros(x.shape, dtype=x.dtype)
            return out.add_(h * 2)
        if case == "view_copy":
            out = torch.ones(x.size(0), 8, dtype=x.dtype)
            out[:, :6].copy_(h)
            return out
        # one written with values every model shares stays one tensor (no copies)
        causal = torch.full((x.size(0), x.size(0)), float("-inf"), dtype=x.dtype).triu_(1)
        out = torch.empty(x.size(0), 6, dtype=x.dtype)
        out.copy_((h @ h.transpose(0, 1) + causal).softmax(-1) @ h)
        return out

    _compare(_model(forward), [(4, 6), ("long", (4,), 6)])
    if case == "mixed":
        assert hfkern.fuse(_model(forward), 2).code.count("_per_model_copies(") == 1


# ---- reductions, fills, masks ---------------------------------------------------------------------
def test_an_empty_dim_list_reduces_every_dim_of_one_model():
    def forward(self, x):
        y = self.fc(x)
        return y.sum(dim=()) + x.amax(dim=[]) + torch.mean(y, ()), y.sum([], keepdim=True)

    _compare(_model(forward, width=5), [(4, 5)])


def test_fill_values_per_model():
    # a scalar parameter and a per-model 0-d value as masked_fill's and fill_'s value
    def forward(self, x):
        y = self.fc(x)
        a = y.masked_fill(y < 0, self.fill)
        b = torch.masked_fill(y, (x > 0)[0], self.fill * 2)  # a lower-rank mask
        c = y * 1
        c.masked_fill_(y > 0.3, self.fill)
        self.peak.fill_(y.detach().abs().max())  # a buffer updated in forward
        d = torch.empty_like(y).fill_(self.fill)
        return a + b + c + d + y / self.peak

    make = _model(forward, fill=nn.Parameter(torch.tensor(0.5)), peak=torch.zeros(()))
    _compare(make, [(4, 6)], modes=("train", "eval"))


def test_boolean_mask_assignment():
    def forward(self, x):
        y = self.fc(x)
        y[y < 0] = 0  # a Python value
        z = self.fc(x) * 1
        z[z > 0.5] = self.v  # a per-model 0-d value
        w = self.fc(x) * 1
        w[w.sum(-1) > 0] = self.row  # rows selected by a lower-rank mask, one value per model
        u = self.fc(x) * 1
        u[u.sum(-1) < 0] = torch.ones(6, dtype=x.dtype)  # the same row for every model
        q = self.fc(x) * 1
        q[(q > 0,)] = torch.tensor(1.5, dtype=x.dtype)
        return y + z + w + u + q + torch.where(x > 0, x, y)  # (a three-argument where)

    make = _model(forward, v=nn.Parameter(torch.tensor(0.2)), row=nn.Parameter(torch.randn(6)))
    _compare(make, [(4, 6)])


# ---- autograd in forward ---------------------------------------------------------------------------
class _Energy(nn.Module):
    """Forces as the gradient of an energy, with ``create_graph=True`` (trained through)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.bn = nn.BatchNorm1d(5)
        self.out = nn.Linear(5, 1)

    def forward(self, x):
        x = x.detach().requires_grad_(True)
        e = self.out(self.bn(self.fc(x)).tanh()).sum()
        forces, = torch.autograd.grad(e, x, create_graph=True)
        return -forces, e


class _Penalty(nn.Module):
    """Gradient penalties: per-model grad_outputs, with respect to the input and a weight."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        y = self.out(self.fc(x).tanh())
        gx, gw = torch.autograd.grad(outputs=y, inputs=[x, self.fc.weight], grad_outputs=y.detach() * 2,
                                     create_graph=True, retain_graph=True)
        g2, = torch.autograd.grad(y.sum(), x, create_graph=True, retain_graph=True)
        g3, = torch.autograd.grad([y], [x], grad_outputs=[torch.ones(2, dtype=y.dtype).expand_as(y)],
                                  create_graph=True)
        return y, gx.square().sum() + gw.square().sum() + g2 + g3


@pytest.mark.parametrize("shared", [False, True])
def test_autograd_grad_in_forward(shared):
    _compare(_Energy, [(4, 6)], modes=("train", "eval"), shared=shared)
    _compare(_Penalty, [(4, 6)], shared=shared)


def test_detach_in_place():
    def forward(self, x):
        target = self.fc(x).detach_()  # the array linear's output is a view: detached for later readers
        h = self.fc(x) * 1
        h.detach_()
        return x * target + self.fc(x) + h

    _compare(_model(forward), [(4, 6)])


def test_moveaxis_and_movedim():
    def forward(self, x):
        y = self.fc(x)
        return y.moveaxis(1, 0) + torch.movedim(y, (0, 1), (1, 0)) + torch.moveaxis(y, -1, 0)

    _compare(_model(forward), [(6, 6)])


# ---- torch's keyword spellings ---------------------------------------------------------------------
_SPELLINGS = {
    "x.chunk(chunks=2, dim=-1)": lambda x: x.chunk(chunks=2, dim=-1)[1],
    "torch.chunk(x, chunks=2, axis=-1)": lambda x: torch.chunk(x, chunks=2, axis=-1)[0],
    "x.split(split_size=4, dim=-1)": lambda x: x.split(split_size=4, dim=-1)[1],
    "torch.reshape(x, shape=(-1,))": lambda x: torch.reshape(x, shape=(-1,)),
    "x.reshape(shape=(-1, 3))": lambda x: x.reshape(shape=(-1, 3)),
    "x.view(size=(-1,))": lambda x: x.view(size=(-1,)),
    "x.permute(dims=(1, 0))": lambda x: x.permute(dims=(1, 0)),
    "x[:, :1].expand(size=(4, 6))": lambda x: x[:, :1].expand(size=(4, 6)),
    "torch.matmul(x, other=x.mT)": lambda x: torch.matmul(x, other=x.mT),
    "torch.bmm(x[None], mat2=x.mT[None])": lambda x: torch.bmm(x[None], mat2=x.mT[None]),
    "x.sum(axis=1)": lambda x: x.sum(axis=1),
    "torch.mean(x, axis=(0, 1), keepdim=True)": lambda x: torch.mean(x, axis=(0, 1), keepdim=True),
    "x.max(axis=1).values": lambda x: x.max(axis=1).values,
    "x.argmax(axis=1)": lambda x: x.argmax(axis=1).to(x.dtype),
    "x.cumsum(axis=0)": lambda x: x.cumsum(axis=0),
    "torch.cat([x, x], axis=1)": lambda x: torch.cat([x, x], axis=1),
    "torch.stack([x, x], axis=1)": lambda x: torch.stack([x, x], axis=1),
    "torch.concatenate([x, x], axis=0)": lambda x: torch.concatenate([x, x], axis=0),
    "x.unsqueeze(axis=1)": lambda x: x.unsqueeze(axis=1),
    "x.swapaxes(axis0=0, axis1=1)": lambda x: x.swapaxes(axis0=0, axis1=1),
    "x.narrow(axis=1, start=1, length=2)": lambda x: x.narrow(axis=1, start=1, length=2),
}


@pytest.mark.parametrize("spelling", list(_SPELLINGS))
def test_torch_keyword_spellings(spelling, monkeypatch):
    fn = _SPELLINGS[spelling]

    def forward(self, x):
        return fn(self.fc(x))

    _compare(_model(forward), [(4, 6)], calls=1)
    vmapped = []
    monkeypatch.setattr(fusion, "_vmap_call", lambda *a, **k: vmapped.append(a[0]))
    hfkern.fuse(_model(forward), 2)(torch.randn(2, 4, 6))
    assert not vmapped, "the array translation takes torch's spelling"


# ---- refused: sizes that depend on the values --------------------------------------------------------
@pytest.mark.parametrize("construct, fn", [
    ("torch.where\\(condition\\)", lambda x: torch.where(x > 0)[0]),
    ("torch.nonzero", lambda x: torch.nonzero(x)),
    ("torch.argwhere", lambda x: torch.argwhere(x > 0)),
    ("torch.unique", lambda x: torch.unique(x.argmax(-1)).double()),
    ("torch.masked_select", lambda x: torch.masked_select(x, x > 0)),
    ("F.one_hot` without `num_classes", lambda x: F.one_hot(x.argmax(-1)).double()),
])
def test_results_sized_by_values_are_refused(construct, fn):
    def forward(self, x):
        return fn(self.fc(x))

    with pytest.raises(hfkern.FuseError, match=f"{construct}.*size depends on a tensor's values at "
                                               r"test_fuse_idioms.py:\d+: "):
        hfkern.fuse(_model(forward), 2)


def test_boolean_mask_indexing_is_refused_naming_the_line():
    def forward(self, x):
        y = self.fc(x)
        return y[y > 0].sum()

    fused = hfkern.fuse(_model(forward), 2)
    with pytest.raises(hfkern.FuseError, match=r"boolean-mask indexing `x\[mask\]` at test_fuse_idioms.py:\d+: "
                                               r"`return y\[y > 0\].sum\(\)`.*own forward \(Net\)"):
        fused(torch.randn(2, 4, 6))


def test_a_call_vmap_cannot_run_raises_fuse_error_naming_it():
    def forward(self, x):
        y = self.fc(x)
        return y * torch.equal(y, x)

    fused = hfkern.fuse(_model(forward), 2)
    with pytest.raises(hfkern.FuseError, match=r"`torch.equal` at test_fuse_idioms.py:\d+: "
                                               r"`return y \* torch.equal\(y, x\)`.*runs under torch.vmap"):
        fused(torch.randn(2, 4, 6))


def test_capture_errors_name_the_users_line():
    def forward(self, x):
        y = torch.zeros(4, 8)
        y[:, 1:7] = x
        return y

    with pytest.raises(hfkern.FuseError, match=r"at test_fuse_idioms.py:\d+: `y\[:, 1:7\] = x`"):
        hfkern.fuse(_model(forward), 2)
