"""A call hfkern.nn refuses changes nothing: an integer input under autocast is refused by the
module's own dtype check (as outside autocast), and a batch norm call that its op refuses (a bad
buffer, forward-mode AD through the autograd Function) leaves num_batches_tracked and the
running statistics as they were."""
import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import hfkern.nn as hn

B = 2


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def _assert_state(m, before):
    after = m.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


@pytest.mark.parametrize("make,shape", [
    (lambda: hn.BatchNorm2d(3, B=B), (B, 4, 3, 2, 2)),
    (lambda: hn.BatchNorm1d(3, B=B, activation="gelu"), (B, 4, 3)),
    (lambda: hn.Linear(5, 6, B=B), (B, 4, 5)),
    (lambda: hn.Conv1d(3, 2, 3, B=B), (B, 4, 3, 7)),
    (lambda: hn.LayerNorm(5, B=B), (B, 4, 5)),
])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_a_non_floating_input_under_autocast_is_refused_before_anything_changes(make, shape, dtype):
    m = make().train()
    before = _state(m)
    x = torch.ones(shape, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(TypeError, match=f"floating-point dtype under autocast.*got {dtype}"):
        m(x)
    _assert_state(m, before)
    # a floating input still runs under autocast, as before
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(torch.randn(shape))


@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
@pytest.mark.parametrize("bad", ["expanded running_mean", "float num_batches_tracked"])
def test_a_batch_norm_call_its_op_refuses_is_not_counted(activation, bad):
    m = hn.BatchNorm1d(5, B=B, activation=activation).train()
    if bad == "expanded running_mean":
        m.running_mean = torch.zeros(1, 5).expand(B, 5)
    else:
        m.num_batches_tracked = torch.zeros(B)
    before = _state(m)
    with pytest.raises((TypeError, ValueError), match="running_mean|num_batches_tracked"):
        m(torch.randn(B, 4, 5))
    _assert_state(m, before)


def test_forward_ad_through_the_batch_norm_function_is_refused_before_the_running_statistics_change():
    m = hn.BatchNorm1d(5, B=B, activation="gelu", dtype=torch.float64).train()
    before = _state(m)
    x = torch.randn(B, 4, 5, dtype=torch.float64)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
        m(fwAD.make_dual(x, torch.randn_like(x)))
    _assert_state(m, before)


def test_forward_ad_where_torch_autograd_serves_the_batch_norm_still_works():
    # training without an activation: torch's batch norm on the grouped view, its own forward AD
    m = hn.BatchNorm1d(5, B=B, dtype=torch.float64).train()
    x, t = torch.randn(B, 4, 5, dtype=torch.float64), torch.randn(B, 4, 5, dtype=torch.float64)
    a, b, c = (copy.deepcopy(m) for _ in range(3))
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(a(fwAD.make_dual(x, t))).tangent
    eps = 1e-6
    with torch.no_grad():
        fd = (b(x + eps * t) - c(x - eps * t)) / (2 * eps)
    torch.testing.assert_close(tangent, fd, rtol=1e-6, atol=1e-6)
