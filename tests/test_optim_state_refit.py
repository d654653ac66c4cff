"""An array optimizer's state checked against its parameters before a step changes anything:
state made before ``module.double()`` follows the parameter (as torch's optimizers keep
stepping), and a state that no longer fits its parameter raises with every group untouched."""

from __future__ import annotations

import pytest
import torch

import hfkern.nn as hnn
import hfkern.optim as HO

B = 3


def torch_models(array: hnn.Linear) -> list[torch.nn.Linear]:
    return [array.extract_model(b) for b in range(B)]


@pytest.mark.parametrize("name, kw", [("SGD", dict(lr=0.1, momentum=0.9)), ("Adam", dict(lr=0.01)),
                                      ("Adagrad", dict(lr=0.1, initial_accumulator_value=0.5))])
def test_state_follows_parameters_converted_to_float64_after_a_step(name, kw):
    torch.manual_seed(0)
    array = hnn.Linear(5, 4, B=B)
    models = torch_models(array)
    # Two groups, the first without state for SGD (no momentum): a later group's refit must not
    # come after an earlier group's update.
    groups = lambda bias, weight: [{"params": [bias], **({"momentum": 0.0} if name == "SGD" else {})},  # noqa: E731
                                   {"params": [weight]}]
    opt = getattr(HO, name)(groups(array.bias, array.weight), **kw)
    refs = [getattr(torch.optim, name)(groups(m.bias, m.weight), **kw) for m in models]
    for step in range(4):
        if step == 2:  # after state was made in float32
            array.double()
            for m, ref in zip(models, refs):
                m.double()
                for state in ref.state.values():  # torch's Adam cannot step float32 state on float64
                    state.update({k: v.double() for k, v in state.items() if k != "step"})
        dtype = torch.float64 if step >= 2 else torch.float32
        x = torch.randn(B, 7, 5, dtype=dtype)
        opt.zero_grad()
        array(x).pow(2).sum().backward()
        opt.step()
        for b, (m, ref) in enumerate(zip(models, refs)):
            ref.zero_grad()
            m(x[b]).pow(2).sum().backward()
            ref.step()
    assert array.weight.dtype == torch.float64
    assert all(v.dtype == (torch.float32 if k == "step" else torch.float64)
               for state in opt.state.values() for k, v in state.items())
    for b, m in enumerate(models):
        torch.testing.assert_close(array.weight[b], m.weight, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(array.bias[b], m.bias, rtol=1e-6, atol=1e-7)


def test_a_state_that_no_longer_fits_raises_before_any_group_steps():
    torch.manual_seed(1)
    array = hnn.Linear(5, 4, B=B)
    opt = HO.SGD([{"params": [array.bias]}, {"params": [array.weight]}], lr=0.1, momentum=0.9)
    array(torch.randn(B, 2, 5)).sum().backward()
    opt.step()
    with torch.no_grad():
        array.weight.data = torch.randn(B, 4, 6)  # replaced by a parameter of another shape
    array.weight.grad = torch.randn(B, 4, 6)
    array.bias.grad = torch.randn(B, 4)
    before = [array.bias.detach().clone(), opt.state[array.bias]["momentum_buffer"].clone()]
    with pytest.raises(ValueError, match=r"state 'momentum_buffer' of shape \[3, 4, 5\] does not fit its "
                                         r"parameter of shape \[3, 4, 6\]"):
        opt.step()
    assert torch.equal(array.bias, before[0])  # the first group did not step
    assert torch.equal(opt.state[array.bias]["momentum_buffer"], before[1])


def test_a_groups_initial_accumulator_value_starts_its_sum():
    """Documented: a group's own value is used (torch.optim.Adagrad ignores it)."""
    array = hnn.Linear(2, 2, B=B)
    opt = HO.Adagrad([{"params": [array.weight]}, {"params": [array.bias], "initial_accumulator_value": 2.0}],
                     lr=0.1, initial_accumulator_value=0.5)
    array.weight.grad, array.bias.grad = torch.randn(B, 2, 2), torch.randn(B, 2)
    opt.step()
    torch.testing.assert_close(opt.state[array.weight]["sum"], 0.5 + array.weight.grad ** 2)
    torch.testing.assert_close(opt.state[array.bias]["sum"], 2.0 + array.bias.grad ** 2)
