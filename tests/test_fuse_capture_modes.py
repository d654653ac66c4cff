"""hfkern.fuse and the modes a forward reads or changes itself: train/eval and grad mode.

* ``module.eval()`` / ``module.train(mode)`` / ``module.training = mode`` inside
  ``forward`` is recorded: the fused model's module (its array module, for a
  layer) changes mode at the same point of every call, as torch's does, and
  stays in that mode after the call. A change the fused model cannot make as
  torch does (a module inside a layer called as a whole; modules whose code is
  captured left in different modes where forward's code depends on the mode)
  is refused with a FuseError when fusing.
* ``torch.is_grad_enabled()`` read in ``forward`` is read when the fused model
  runs, so ``prev = torch.is_grad_enabled(); torch.set_grad_enabled(False); ...;
  torch.set_grad_enabled(prev)`` restores the caller's mode (no_grad,
  inference_mode or not), never the mode at capture. A Python branch on it
  cannot be one captured graph and is refused (GradModeBranch, a FuseError).
* ``torch.set_grad_enabled(mode)`` called as a function keeps no region open
  past the call.

Each case runs B separate torch models and the fused model side by side for
several calls with fresh inputs, under grad mode, ``no_grad`` and
``inference_mode``, and compares outputs, ``requires_grad``, the grad mode
after the call, every state entry (running statistics), the modules' modes and
gradients.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from _util import assert_fused_matches
from torch.testing import assert_close

import hfkern
from hfkern import FuseError, _capture

B = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}  # (a bias before a batch norm in training: a gradient of 0 up to rounding)
OUTER = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _modes(model: nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in model.named_modules()}


def _compare(make, x_shape=(5, 4), outer="grad", calls=3, train=None):
    """Fuse B models from ``make``; call both sides ``calls`` times under ``outer``; compare all.

    ``train``: the mode both sides are put in before every call (None: left as the calls leave it).
    """
    torch.manual_seed(0)
    models = [make() for _ in range(B)]
    refs = copy.deepcopy(models)
    fused = hfkern.fuse(models)
    for _ in range(calls):
        if train is not None:
            fused.train(train)
            for m in refs:
                m.train(train)
        x = torch.randn(B, *x_shape)
        xs = [x[b].clone().requires_grad_() for b in range(B)]
        xf = x.clone().requires_grad_()
        with OUTER[outer]():
            ref = [m(xs[b]) for b, m in enumerate(refs)]
            ref_mode = torch.is_grad_enabled()
        torch.set_grad_enabled(True)  # (a forward may leave the mode off, as torch's does)
        with OUTER[outer]():
            out = fused(xf)
            out_mode = torch.is_grad_enabled()
        torch.set_grad_enabled(True)
        assert out_mode == ref_mode, f"grad mode after the call: torch {ref_mode}, fused {out_mode}"
        assert out.requires_grad == ref[0].requires_grad
        assert_close(out.detach(), torch.stack([r.detach() for r in ref]), **TOL)
        if ref[0].requires_grad:
            w = torch.randn(B, *ref[0].shape)
            for b, r in enumerate(ref):
                (r * w[b]).sum().backward()
            (out * w).sum().backward()
            if all(t.grad is None for t in xs):
                assert xf.grad is None or not xf.grad.any(), "fused input gradient where torch has none"
            else:
                assert_close(xf.grad, torch.stack([t.grad for t in xs]), **TOL)
        assert_fused_matches(fused, refs, **TOL)
        theirs = _modes(refs[0])
        assert {k: v for k, v in _modes(fused).items() if k in theirs} == \
            {k: v for k, v in theirs.items() if k in _modes(fused)}, "train/eval modes after the call"
    unfused = hfkern.unfuse(fused)
    assert _modes(unfused[0]) == _modes(refs[0])
    return fused, refs


# ---- defect 1: train/eval mode set inside forward -------------------------------------------------
class _FcBn(nn.Module):
    """A linear layer and a batch norm; subclasses' forwards set modes in their own ways."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)


class _BNEval(_FcBn):
    """Batch-norm statistics kept frozen by forward itself."""

    def forward(self, x):
        self.bn.eval()
        return self.bn(self.fc(x))


class _DropoutOff(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        self.drop.train(False)
        return self.drop(self.fc(x))


class _TrainingFlag(_FcBn):
    def forward(self, x):
        self.bn.training = False
        return self.bn(self.fc(x))


class _ForceTrain(_FcBn):
    """Batch norm in training mode whatever the model's mode."""

    def forward(self, x):
        self.bn.train()
        return self.bn(self.fc(x))


class _RootEval(nn.Module):
    """The model switches itself to eval mode halfway through; its code reads its mode on both sides."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.bn2 = nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.bn(self.fc(x))
        if self.training:
            h = h * 2
        self.eval()
        h = self.bn2(h)
        return h + 1 if self.training else h - 1


class _Block(_FcBn):
    def forward(self, x):
        h = self.bn(self.fc(x))
        return h * 2 if self.training else h


class _FrozenBackbone(nn.Module):
    """A block of the model's own put in eval mode by forward (its code then always runs in eval)."""

    def __init__(self):
        super().__init__()
        self.backbone = _Block()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        self.backbone.eval()
        return self.head(self.backbone(x))


class _BlockEvalRestored(nn.Module):
    """A block run in eval mode, its mode restored after."""

    def __init__(self):
        super().__init__()
        self.block = _Block()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        was = self.block.training
        self.block.eval()
        h = self.block(x)
        self.block.train(was)
        h = self.bn(h)
        return h * 3 if self.block.training else h


MODE_CASES = [_BNEval, _DropoutOff, _TrainingFlag, _ForceTrain, _RootEval, _FrozenBackbone, _BlockEvalRestored]


@pytest.mark.parametrize("outer", list(OUTER))
@pytest.mark.parametrize("cls", MODE_CASES, ids=lambda c: c.__name__)
def test_mode_set_in_forward(cls, outer):
    fused, _ = _compare(cls, outer=outer)
    assert any(isinstance(n.target, _capture.SetMode) for g in fused._graphs.values() for n in g.nodes)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("cls", MODE_CASES, ids=lambda c: c.__name__)
def test_mode_set_in_forward_after_train_or_eval(cls, train):
    # model.train()/eval() before every call, as a training loop does: forward's change follows it
    _compare(cls, train=train)


def test_bn_eval_in_forward_keeps_statistics_and_mode():
    torch.manual_seed(0)
    models = [_BNEval() for _ in range(B)]
    fused = hfkern.fuse(models)
    before = fused.bn.running_mean.clone()
    fused(torch.randn(B, 5, 4))
    assert not fused.bn.training
    assert torch.equal(fused.bn.running_mean, before)
    assert fused.training  # the rest keeps its mode
    fused.train()  # as model.train() does in torch: the next forward switches it off again
    assert fused.bn.training
    fused(torch.randn(B, 5, 4))
    assert not fused.bn.training and torch.equal(fused.bn.running_mean, before)


def test_no_mode_records_without_mode_changes():
    # the common case: the fused forward has no extra calls
    fused = hfkern.fuse([_Block() for _ in range(B)])
    assert "train_mode" not in fused.code and "eval_mode" not in fused.code and "grad_mode" not in fused.code
    assert not any(isinstance(n.target, _capture.SetMode) for g in fused._graphs.values() for n in g.nodes)


def test_mode_change_with_pickle_and_deepcopy():
    torch.manual_seed(0)
    fused = hfkern.fuse([_RootEval() for _ in range(B)])
    twin = copy.deepcopy(fused)
    x = torch.randn(B, 5, 4)
    assert_close(twin(x), fused(x))
    assert not twin.training and not twin.bn.training


class _BackboneReadsMode(nn.Module):
    """Forward leaves its block in eval mode and reads its own mode: mixed modes the fused model
    cannot pick one captured forward for."""

    def __init__(self):
        super().__init__()
        self.backbone = _Block()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        self.backbone.eval()
        h = self.backbone(x)
        if self.training:
            h = h * 3
        return self.head(h)


def test_mode_change_leaving_mixed_modes_is_refused():
    with pytest.raises(FuseError, match=r"sets module 'backbone' to eval mode \(`\.eval\(\)`\).*"
                                        r"test_fuse_capture_modes\.py.*different modes"):
        hfkern.fuse([_BackboneReadsMode() for _ in range(B)])


class _InsideLayer(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        self.enc.layers[0].eval()
        return self.enc(x)


def test_mode_change_inside_an_array_module_is_refused():
    with pytest.raises(FuseError, match=r"sets module 'enc\.layers\.0' to eval mode.*inside module 'enc'"):
        hfkern.fuse([_InsideLayer() for _ in range(B)])


class _WholeLayerEval(_InsideLayer):
    def forward(self, x):
        self.enc.eval()
        return self.enc(x)


def test_mode_change_of_an_array_module_with_submodules():
    _compare(_WholeLayerEval, x_shape=(5, 8), calls=2)


class _ModeFromTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.fc.train(x.sum() > 0)
        return self.fc(x)


def test_mode_from_a_traced_value_is_refused():
    with pytest.raises(FuseError, match=r"train/eval mode to a traced value"):
        hfkern.fuse([_ModeFromTensor() for _ in range(B)])


# ---- defect 2: grad mode read in forward -----------------------------------------------------------
class _RestoreCall(nn.Module):
    """A frozen feature extractor: the grad mode switched off and restored by calls."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.g = nn.Linear(4, 4)

    def forward(self, x):
        prev = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        h = self.fc(x)
        torch.set_grad_enabled(prev)
        return self.g(h)


class _RestoreWith(nn.Module):
    """The caller's grad mode restored inside a no_grad region."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.g = nn.Linear(4, 4)

    def forward(self, x):
        prev = torch.is_grad_enabled()
        with torch.no_grad():
            h = self.fc(x)
            with torch.set_grad_enabled(prev):
                h = self.g(h) + h
        return h


class _ModeAsValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * (1 + torch.is_grad_enabled())


class _ModeInBlock(nn.Module):
    """The read in a block of the model's own, with a batch norm whose statistics advance."""

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            prev = torch.is_grad_enabled()
            torch.set_grad_enabled(False)
            h = self.bn(self.fc(x))
            torch.set_grad_enabled(prev)
            return h

    def __init__(self):
        super().__init__()
        self.inner = self.Inner()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.inner(x))


class _LeavesGradOff(nn.Module):
    """Switches grad mode off and leaves it off, as torch's set_grad_enabled call does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.g = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        torch.set_grad_enabled(False)
        return self.g(h)


GRAD_CASES = [_RestoreCall, _RestoreWith, _ModeAsValue, _ModeInBlock, _LeavesGradOff]


@pytest.mark.parametrize("outer", list(OUTER))
@pytest.mark.parametrize("cls", GRAD_CASES, ids=lambda c: c.__name__)
def test_grad_mode_read_in_forward(cls, outer):
    try:
        _compare(cls, outer=outer)
    finally:
        torch.set_grad_enabled(True)


@pytest.mark.parametrize("outer", list(OUTER))
def test_restoring_call_restores_the_callers_mode(outer):
    torch.manual_seed(0)
    fused = hfkern.fuse([_RestoreCall() for _ in range(B)])  # captured with grad mode on
    with OUTER[outer]():
        out = fused(torch.randn(B, 3, 4))
        assert torch.is_grad_enabled() == (outer == "grad")
    assert out.requires_grad == (outer == "grad")
    assert torch.is_grad_enabled()
    assert "set_grad_mode(True)" not in fused.code


def test_fused_under_no_grad_then_called_with_grad():
    # a capture made under no_grad (the first call of a pattern) serves calls with grad too
    torch.manual_seed(0)
    models = [_RestoreCall() for _ in range(B)]
    with torch.no_grad():
        fused = hfkern.fuse(models)
    out = fused(torch.randn(B, 3, 4))
    assert out.requires_grad and torch.is_grad_enabled()


def test_set_grad_enabled_call_keeps_no_region_open():
    torch.manual_seed(0)
    fused = hfkern.fuse([_RestoreCall() for _ in range(B)])
    depth = len(_capture.open_regions())
    for _ in range(5):
        fused(torch.randn(B, 3, 4))
    assert len(_capture.open_regions()) == depth


class _Branch(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if self.how == "if":
            if torch.is_grad_enabled():
                h = h * 2
        elif self.how == "not":
            if not torch.is_grad_enabled():
                h = h * 2
        elif self.how == "and":
            if self.training and torch.is_grad_enabled():
                h = h * 2
        elif self.how == "derived":
            prev = torch.is_grad_enabled()
            if prev == True:  # noqa: E712
                h = h * 2
        return h


@pytest.mark.parametrize("how", ["if", "not", "and", "derived"])
def test_branch_on_grad_mode_is_refused(how):
    with pytest.raises(_capture.GradModeBranch,
                       match=r"branches on `torch\.is_grad_enabled\(\)`.*test_fuse_capture_modes\.py"):
        hfkern.fuse([_Branch(how) for _ in range(B)])


def test_branch_on_grad_mode_is_refused_under_no_grad():
    with torch.no_grad(), pytest.raises(FuseError, match=r"branches on `torch\.is_grad_enabled\(\)`"):
        hfkern.fuse([_Branch("if") for _ in range(B)])


class _SetFromTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.set_grad_enabled(x.sum() > 0):
            return self.fc(x)


def test_set_grad_enabled_with_a_traced_value_is_refused():
    with pytest.raises(FuseError, match=r"`torch\.set_grad_enabled` with a traced value"):
        hfkern.fuse([_SetFromTensor() for _ in range(B)])


@pytest.mark.parametrize("grad", [True, False])
def test_capture_for_one_grad_mode(grad):
    # capture(..., grad_mode=...): the read is a Python value (a capture per grad mode)
    def leaf(m):
        return isinstance(m, nn.Linear)

    captured = _capture.capture(_Branch("if"), leaf, True, grad_mode=grad)
    assert captured.reads_grad_mode
    assert ("mul" in captured.graph.python_code("self").src) == grad
    assert torch.is_grad_enabled()
    assert not _capture.capture(_Block(), leaf, True).reads_grad_mode
    with pytest.raises(_capture.GradModeBranch):
        _capture.capture(_Branch("if"), leaf, True)


class _InnerBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if torch.is_grad_enabled():
            h = h * 2
        return h


class _OuterBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _InnerBranch()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.inner(x))


@pytest.mark.parametrize("outer", list(OUTER))
def test_branch_on_grad_mode_in_a_looped_module(outer):
    # the remedy the refusal names: the module's code runs per call (its branch too)
    with pytest.raises(_capture.GradModeBranch):
        hfkern.fuse([_OuterBranch() for _ in range(B)])
    torch.manual_seed(0)
    models = [_OuterBranch() for _ in range(B)]
    fused = hfkern.fuse(models, loop_modules=(_InnerBranch,))
    x = torch.randn(B, 5, 4)
    with OUTER[outer]():
        ref = torch.stack([m(x[b]) for b, m in enumerate(models)])
        out = fused(x)
    assert out.requires_grad == ref.requires_grad
    assert_close(out, ref, **TOL)
