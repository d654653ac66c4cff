"""A step that raises changes no model: every param group's arguments are checked before the
first group steps, and an expanded (stride-0) parameter is refused when the optimizer is made."""
import pytest
import torch

import hfkern.optim as HO

B = 3


def _params():
    torch.manual_seed(0)
    return torch.nn.Parameter(torch.randn(B, 4)), torch.nn.Parameter(torch.randn(B, 2))


@pytest.mark.parametrize("cls", [HO.SGD, HO.Adam, HO.RMSprop])
@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_a_later_group_that_fails_leaves_the_earlier_groups_untouched(cls, bad):
    p0, p1 = _params()
    kwargs = {"momentum": 0.9} if cls is HO.SGD else {}
    opt = cls([{"params": [p0]}, {"params": [p1]}], lr=0.1, **kwargs)
    p0.grad, p1.grad = torch.randn(B, 4), torch.randn(B, 2)
    opt.step()                                       # state exists: a retry must not step twice
    before = p0.detach().clone()
    state = {k: v.clone() for k, v in opt.state[p0].items()}
    p0.grad = torch.randn(B, 4)
    if bad == "shape":
        p1.grad.data = torch.randn(B, 3)             # torch refuses `p.grad = ...` of another shape
    else:
        p1.grad_dtype = None
        p1.grad = torch.randn(B, 2, dtype=torch.float64)
    with pytest.raises((ValueError, TypeError), match="grad"):
        opt.step()
    assert torch.equal(p0.detach(), before)
    for k, v in opt.state[p0].items():
        assert torch.equal(v, state[k]), k
    # fixed, the step runs as one eager step of both groups would
    p1.grad = torch.randn(B, 2)
    ref = cls([{"params": [q := torch.nn.Parameter(before.clone())]}], lr=0.1, **kwargs)
    ref.state[q] = {k: v.clone() for k, v in state.items()}
    q.grad = p0.grad.clone()
    opt.step()
    ref.step()
    torch.testing.assert_close(p0.detach(), q.detach(), rtol=0, atol=0)


def test_an_expanded_parameter_is_refused_when_the_optimizer_is_made():
    p = torch.nn.Parameter(torch.randn(1, 2).expand(B, 2))
    with pytest.raises(ValueError, match="dense memory.*strides \\[0, 1\\]"):
        HO.Adam([p], lr=0.1)
    opt = HO.SGD([torch.nn.Parameter(torch.randn(B, 2))], lr=0.1)
    with pytest.raises(ValueError, match="dense memory"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1
