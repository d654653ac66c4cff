"""hfkern.fuse: what a captured forward did wrong, silently or with a misleading error, before.

A reentrant checkpoint trains as torch trains it (its gradients were dropped); torch's own autograd
Functions that a traced-through forward would run without their backward are refused; reseeding
or reading the random state in forward, a torch.Generator and any object fx keeps as a graph
constant are refused at fuse time (they ran once at capture, or failed at the first call); a
dataclass returned by forward or by a layer run per model holds the B models' arrays (it held
escaped vmap tensors, or model 0's values); a slice of a Sequential runs its modules, and modules
that are not registered, tensor hooks in forward, and loops over pieces whose number the input
fixes are refused with what to do instead; loops over chunk/split/tensor_split pieces work; a
layer torch.vmap cannot run raises FuseError; a bare recurrent module is refused up front. Each
working case runs B separate torch models beside the fused model on fresh random inputs and
compares outputs, input and parameter gradients, and buffers.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn
from torch.nn.utils import parametrizations
from torch.testing import assert_close

import hfkern
from hfkern import FuseError

B = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _compare(fused, models, x_shape, calls=2, tensor=lambda out: out, input_grad=True):
    """For ``calls`` fresh inputs, compare ``fused`` with the separate ``models`` (modes as they
    are): outputs (``tensor(out)``), the input's gradient (inputs requiring grad where
    ``input_grad``) and every parameter's, and every buffer."""
    for _ in range(calls):
        for m in models:
            m.zero_grad(set_to_none=True)
        fused.zero_grad(set_to_none=True)
        x = torch.randn(len(models), *x_shape)
        xs = [x[b].clone().requires_grad_(input_grad) for b in range(len(models))]
        xf = x.clone().requires_grad_(input_grad)
        ref = torch.stack([tensor(m(xs[b])) for b, m in enumerate(models)])
        out = tensor(fused(xf))
        assert_close(out, ref, **TOL)
        assert out.requires_grad == ref.requires_grad
        if ref.requires_grad:
            weights = torch.randn_like(ref)
            (ref * weights).sum().backward()
            (out * weights).sum().backward()
        if input_grad:
            theirs = [t.grad for t in xs]
            if theirs[0] is None:
                assert xf.grad is None or not xf.grad.any()
            else:
                assert_close(xf.grad, torch.stack(theirs), **TOL)
        for name, p in fused.named_parameters():
            theirs = [m.get_parameter(name).grad for m in models]
            if theirs[0] is None:
                assert p.grad is None or not p.grad.any(), name
            else:
                assert p.grad is not None, name
                assert_close(p.grad, torch.stack(theirs), **TOL, msg=name)
        for name, buf in fused.named_buffers():
            assert_close(buf, torch.stack([m.get_buffer(name) for m in models]), **TOL, msg=name)


def _fused_and_copies(models, **kw):
    """The fused model of ``models`` and copies of them to run beside it."""
    copies = [copy.deepcopy(m) for m in models]
    return hfkern.fuse(models, **kw), copies


# ---- 1. reentrant checkpoints; torch's own autograd Functions ------------------------------------
class Reentrant(nn.Module):
    def __init__(self, kind="checkpoint"):
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.b = nn.Linear(6, 2)

    def forward(self, x):
        if self.kind == "checkpoint":
            h = cp.checkpoint(self.a, x, use_reentrant=True)
        elif self.kind == "sequential":
            h = cp.checkpoint_sequential(nn.Sequential(self.a, nn.Tanh(), self.a), 2, x, use_reentrant=True)
        else:  # a tuple output, and a list in it (which torch's Function returns unconnected)
            h, rest = cp.checkpoint(lambda t: (self.a(t), [t * 2]), x, use_reentrant=True)
            h = h + rest[0]
        return self.b(torch.tanh(self.bn(h)))


@pytest.mark.parametrize("kind", ["checkpoint", "sequential", "tuple"])
def test_a_reentrant_checkpoint_trains_as_torch_trains_it(kind):
    """torch's reentrant checkpoint is an autograd Function running its function under no_grad;
    traced through, nothing in it got a gradient. Captured as its function's call, every gradient is
    torch's (the batch norm after it, outside the checkpoint, keeps its statistics per model)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's: no input requires grad (the second case)
        fused, models = _fused_and_copies([Reentrant(kind) for _ in range(B)])
        _compare(fused, models, (5, 6))
        # An input that requires no grad: torch's Function leaves its outputs unconnected, so the
        # checkpointed layer gets no gradient (those after it do).
        _compare(fused, models, (5, 6), input_grad=False)
        assert fused.a.weight.grad is None or not fused.a.weight.grad.any()
        assert fused.b.weight.grad is not None and fused.b.weight.grad.any()
        with torch.no_grad():
            assert not fused(torch.randn(B, 5, 6, requires_grad=True)).requires_grad


class NonReentrant(Reentrant):
    def forward(self, x):
        h = cp.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False)
        return self.b(torch.tanh(self.bn(h)))


def test_a_non_reentrant_checkpoint_still_fuses():
    """torch's code reads the random state for the recomputation (allowed: not the model's own)."""
    torch.manual_seed(1)
    fused, models = _fused_and_copies([NonReentrant() for _ in range(B)])
    _compare(fused, models, (5, 6))


class NormCheckpointed(Reentrant):
    def forward(self, x):
        h = cp.checkpoint(lambda t: self.bn(self.a(t)), x, use_reentrant=self.kind == "reentrant")
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("kind", ["reentrant", "non-reentrant"])
def test_a_checkpoint_whose_function_updates_buffers_is_refused(kind):
    """torch recomputes the function in backward, updating the batch norm's running statistics a
    second time per step; the captured forward (no recomputation) updated them once."""
    with pytest.raises(FuseError, match=rf"forward runs a checkpoint \(torch\.utils\.checkpoint, "
                                        rf"use_reentrant={kind == 'reentrant'}\) whose function runs module 'bn' "
                                        r"\(BatchNorm1d\) in training.* at test_fuse_defects_9\.py:\d+"):
        hfkern.fuse([NormCheckpointed(kind) for _ in range(B)])


class MyLRN(nn.CrossMapLRN2d):
    """A subclass of a torch layer: its forward (torch's code) is traced, and applies torch's own
    autograd Function (_cross_map_lrn2d), whose forward traced through is not its backward."""


class WithLRN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 1)
        self.lrn = MyLRN(3)

    def forward(self, x):
        return self.lrn(self.conv(x))


def test_torch_functions_traced_through_are_refused_unless_known_right():
    torch.manual_seed(2)
    with pytest.raises(FuseError, match=r"applies torch's own autograd Function `torch\.nn\.modules\._functions\."
                                        r"CrossMapLRN2d`.*loop_modules"):
        hfkern.fuse([WithLRN() for _ in range(B)])
    fused, models = _fused_and_copies([WithLRN() for _ in range(B)], loop_modules=(MyLRN,))
    _compare(fused, models, (2, 2, 3, 3))


# ---- 2. the random state in forward ---------------------------------------------------------------
class Reseeds(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if self.how == "manual_seed":
            torch.manual_seed(7)
            noise = torch.randn_like(x)
        elif self.how == "random.manual_seed":
            torch.random.manual_seed(7)
            noise = torch.randn_like(x)
        elif self.how == "fork_rng":
            with torch.random.fork_rng():
                noise = torch.randn_like(x)
        elif self.how == "get_set":
            state = torch.get_rng_state()
            noise = torch.randn_like(x)
            torch.set_rng_state(state)
        else:
            torch.seed()
            noise = torch.randn_like(x)
        return self.fc(x) + noise


@pytest.mark.parametrize("how, call", [("manual_seed", "torch.manual_seed"),
                                       ("random.manual_seed", "torch.random.manual_seed"),
                                       ("fork_rng", "torch.random.fork_rng"),
                                       ("get_set", "torch.get_rng_state"), ("seed", "torch.seed")])
def test_reading_or_setting_the_random_state_in_forward_is_refused(how, call):
    """It ran once, at capture (the fused model then drew other numbers than torch's, and left the
    global state as torch would not)."""
    models = [Reseeds(how) for _ in range(B)]
    state = torch.get_rng_state()
    with pytest.raises(FuseError, match=rf"forward calls `{call}` at test_fuse_defects_9\.py:\d+.*"
                                        r"Seed before calling the model"):
        hfkern.fuse(models)
    assert torch.equal(torch.get_rng_state(), state)  # the capture did not reseed the caller's generator


# ---- 3. dataclasses ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: torch.Tensor
    steps: int = 3


@dataclasses.dataclass(frozen=True)
class HeadOut:
    logits: torch.Tensor
    scale: float = 2.0
    doubled: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "doubled", self.logits * 2)


class ReturnsDataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return Out(self.fc(x), torch.ones(2))


class Head(nn.Module):  # a layer of one's own run as a whole (vmap_modules / loop_modules)
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return HeadOut(self.fc(x).tanh())


class WithHead(nn.Module):
    def __init__(self, field):
        super().__init__()
        self.field = field
        self.body = nn.Linear(4, 4)
        self.head = Head()

    def forward(self, x):
        out = self.head(self.body(x))
        return out if self.field is None else getattr(out, self.field) * out.scale


def test_a_dataclass_returned_by_forward_holds_the_arrays():
    """It held tensors escaped from torch.vmap, which nothing could read."""
    torch.manual_seed(3)
    fused, models = _fused_and_copies([ReturnsDataclass() for _ in range(B)])
    _compare(fused, models, (5, 4), tensor=lambda out: out.logits)
    out = fused(torch.randn(B, 5, 4))
    assert type(out) is Out and out.steps == 3
    assert_close(out.extra, torch.ones(B, 2))  # as every output: B first, each model's copy
    assert out.logits.sum().isfinite()


@pytest.mark.parametrize("strategy", ["vmap", "loop"])
@pytest.mark.parametrize("field", [None, "logits", "doubled"])
def test_a_dataclass_returned_by_a_layer_run_per_model_holds_each_models_values(strategy, field):
    """Under vmap it held escaped tensors; in a loop over the models, model 0's values only."""
    torch.manual_seed(4)
    kw = {f"{strategy}_modules": (Head,)}
    fused, models = _fused_and_copies([WithHead(field) for _ in range(B)], **kw)
    if field is None:
        _compare(fused, models, (5, 4), tensor=lambda out: out.logits + out.doubled)
        out = fused(torch.randn(B, 5, 4))
        assert type(out) is HeadOut and out.scale == 2.0 and out.logits.shape == (B, 5, 3)
        assert_close(out.doubled, out.logits * 2)
    else:
        _compare(fused, models, (5, 4))


class Post(nn.Module):
    def forward(self, out):
        return out.logits * out.scale


class HeadThenPost(WithHead):
    def __init__(self):
        super().__init__(None)
        self.post = Post()

    def forward(self, x):
        return self.post(self.head(self.body(x)))


def test_a_dataclass_of_arrays_passed_to_a_layer_run_per_model_is_refused():
    """torch.vmap took it for one value: each model would have got every model's arrays."""
    torch.manual_seed(4)
    fused = hfkern.fuse([HeadThenPost() for _ in range(B)], vmap_modules=(Head, Post))
    with pytest.raises(FuseError, match=r"a HeadOut dataclass holding the B models' arrays .* pass its fields"):
        fused(torch.randn(B, 5, 4))


class Holder:  # neither a container nor a dataclass: one value for torch's pytree
    def __init__(self, t):
        self.t = t


class HolderHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return Holder(self.fc(x))


class WithHolderHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = HolderHead()

    def forward(self, x):
        return self.head(x).t * 2


@pytest.mark.parametrize("strategy", ["vmap", "loop"])
def test_an_object_holding_tensors_returned_by_a_layer_run_per_model_is_refused(strategy):
    """Under vmap its tensors escaped; in a loop every model got model 0's."""
    torch.manual_seed(4)
    fused = hfkern.fuse([WithHolderHead() for _ in range(B)], **{f"{strategy}_modules": (HolderHead,)})
    with pytest.raises(FuseError, match=r"the HolderHead module, run .* returns a Holder object holding tensors.*"
                                        r"namedtuples or dataclasses"):
        fused(torch.randn(B, 2, 4))


class ReturnsHolder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return Holder(self.fc(x))


def test_an_object_holding_tensors_returned_by_forward_is_refused_as_such():
    with pytest.raises(FuseError, match=r"an object that a captured graph cannot hold as a value .*Holder"):
        hfkern.fuse([ReturnsHolder() for _ in range(B)])


# ---- 4. generators and other objects fx keeps as graph constants -----------------------------------
class Generated(nn.Module):
    def __init__(self, own=True):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.own = own
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x):
        gen = self.gen if self.own else torch.Generator().manual_seed(3)
        return self.fc(x) + torch.randn(x.shape, generator=gen, dtype=x.dtype)


class HoldsSpec(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.spec = torch.utils._pytree.tree_flatten((1, 2))[1]

    def forward(self, x):
        return self.fc(x).to(self.spec)


def test_a_generator_in_forward_is_refused_at_fuse_time():
    """fuse took it, and the first call failed: 'FusedModel' object has no attribute '_opaque_obj0'."""
    torch.manual_seed(5)
    with pytest.raises(FuseError, match=r"forward passes a torch\.Generator \(held in attribute 'gen'\) to a call "
                                        r"at test_fuse_defects_9\.py:\d+.*Draw without `generator=`"):
        hfkern.fuse([Generated() for _ in range(B)])
    with pytest.raises(FuseError, match=r"torch\.Generator \(made in forward\)"):
        hfkern.fuse([Generated(own=False) for _ in range(B)])


def test_an_object_fx_keeps_as_a_graph_constant_is_refused_at_fuse_time():
    torch.manual_seed(6)
    with pytest.raises(FuseError, match=r"TreeSpec"):
        hfkern.fuse([HoldsSpec() for _ in range(B)])


# ---- 5. Sequential slices, modules that are not registered, tensor hooks ---------------------------
class Sliced(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))

    def forward(self, x):
        h = self.blocks[0](x)
        return self.blocks[1:](h) + self.blocks[-1](self.blocks[:-1](x))


def test_a_slice_of_a_sequential_runs_its_modules():
    """It was refused as 'an operation torch.fx cannot capture ... Write the branch with tensor ops'."""
    torch.manual_seed(7)
    fused, models = _fused_and_copies([Sliced() for _ in range(B)])
    _compare(fused, models, (5, 6))


class InList(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        if how == "list":
            self.extra = [nn.Linear(4, 4)]
        elif how == "dict":
            self.extra = {"a": nn.Linear(4, 4)}
        else:
            object.__setattr__(self, "extra", nn.Linear(4, 4))
        self.how = how

    def forward(self, x):
        extra = self.extra[0] if self.how == "list" else self.extra["a"] if self.how == "dict" else self.extra
        return extra(self.fc(x))


@pytest.mark.parametrize("how, held", [("list", r"held in the plain list attribute 'extra'"),
                                       ("dict", r"held in the plain dict attribute 'extra'"),
                                       ("setattr", (r"set as attribute 'extra' past nn\.Module's registration "
                                                    r"\(object\.__setattr__\)"))])
def test_a_module_that_is_not_registered_is_refused_by_name(how, held):
    with pytest.raises(FuseError, match=rf"forward calls a Linear module that is not registered as a submodule "
                                        rf"\({held}\) at test_fuse_defects_9\.py:\d+.*"
                                        r"nn\.ModuleList or nn\.ModuleDict"):
        hfkern.fuse([InList(how) for _ in range(B)])


class TensorHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        h.register_hook(lambda g: g / g.norm())
        return self.b(h)


def test_a_tensor_hook_registered_in_forward_is_refused_as_such():
    with pytest.raises(FuseError, match=r"tensor hooks registered in forward are not supported at "
                                        r"test_fuse_defects_9\.py:\d+: `h\.register_hook.*torch\.autograd\.Function"):
        hfkern.fuse([TensorHook() for _ in range(B)])


# ---- 6. loops over the pieces of a split ---------------------------------------------------------
class Pieces(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)
        if self.how == "chunk":
            pieces = h.chunk(3, dim=-1)
        elif self.how == "torch.chunk":
            pieces = torch.chunk(h, 3, -1)
        elif self.how == "split_sizes":
            pieces = h.split([2, 4], -1)
        elif self.how == "tensor_split":
            pieces = torch.tensor_split(h, 4, dim=-1)
        elif self.how == "split":
            pieces = h.split(2, -1)
        else:
            pieces = h.unbind(-1)
        return torch.stack([(c * (i + 1)).sum(-1) for i, c in enumerate(pieces)], -1)


@pytest.mark.parametrize("how", ["chunk", "torch.chunk", "split_sizes", "tensor_split"])
def test_iterating_over_pieces_whose_number_the_call_fixes_works(how):
    """It raised 'Proxy object cannot be iterated' (unpacking worked)."""
    torch.manual_seed(8)
    fused, models = _fused_and_copies([Pieces(how) for _ in range(B)])
    _compare(fused, models, (5, 6))


@pytest.mark.parametrize("how", ["split", "unbind"])
def test_iterating_over_pieces_whose_number_the_input_fixes_is_refused_as_such(how):
    with pytest.raises(FuseError, match=rf"forward iterates over the pieces of `{how}`, whose number depends on the "
                                        r"input's size .* at test_fuse_defects_9\.py:\d+.*Unpack a fixed number"):
        hfkern.fuse([Pieces(how) for _ in range(B)])


class ChunkOf(nn.Module):
    def forward(self, x):
        return torch.stack([c.sum(-1) for c in x.chunk(3, -1)], -1)


def test_a_chunk_that_gives_fewer_pieces_than_captured_raises():
    fused = hfkern.fuse([ChunkOf() for _ in range(B)])
    x = torch.randn(B, 2, 6)
    assert_close(fused(x), torch.stack([ChunkOf()(x[b]) for b in range(B)]))
    with pytest.raises(FuseError, match=r"captured as 3 pieces, and this input gives 2"):
        fused(torch.randn(B, 2, 4))  # torch.chunk(3) of 4 elements: 2 pieces of 2


# ---- 7. a layer torch.vmap cannot run ------------------------------------------------------------
class WithCrossMap(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 1)
        self.lrn = nn.CrossMapLRN2d(3)

    def forward(self, x):
        return self.lrn(self.conv(x))


class SpectralNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = parametrizations.spectral_norm(nn.Linear(4, 4))

    def forward(self, x):
        return self.a(x)


@pytest.mark.parametrize("make, cls, shape", [(WithCrossMap, "CrossMapLRN2d", (2, 2, 3, 3)),
                                              (SpectralNormed, "Linear", (5, 4))])
def test_a_layer_vmap_cannot_run_raises_fuse_error(make, cls, shape):
    """It raised a RuntimeError where a functional call vmap cannot run raises FuseError."""
    torch.manual_seed(9)
    fused = hfkern.fuse([make() for _ in range(B)])
    with pytest.raises(FuseError, match=rf"runs under torch\.vmap .* loop_modules=\({cls},\)") as info:
        fused(torch.randn(B, *shape))
    assert isinstance(info.value, RuntimeError)  # (what it raised before, still)
    fused, models = _fused_and_copies([make() for _ in range(B)], loop_modules=(getattr(nn, cls),))
    _compare(fused, models, shape)


# ---- 8. a bare recurrent module ----------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: nn.LSTM(4, 2, batch_first=True), lambda: nn.GRUCell(4, 2)])
@pytest.mark.parametrize("kw", [{}, {"loop_modules": (nn.LSTM, nn.GRUCell)}])
def test_a_bare_recurrent_module_is_refused_with_what_to_do(make, kw):
    """It was refused for assigning '_flat_weight_refs', or told to name its submodules' classes."""
    with pytest.raises(FuseError, match=r"the models are (LSTM|GRUCell) modules themselves.*Wrap it in a module "
                                        r"of your own"):
        hfkern.fuse([make() for _ in range(B)], **kw)


def test_a_bare_torch_layer_whose_forward_cannot_be_captured_says_to_wrap_it():
    with pytest.raises(FuseError, match=r"the models are CrossMapLRN2d modules themselves, whose forward cannot be "
                                        r"captured .*Wrap it in a module of your own"):
        hfkern.fuse([nn.CrossMapLRN2d(3) for _ in range(B)])
