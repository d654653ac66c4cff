"""hfkern.distributed.TopKState: numeric arguments take what k_for takes (any real density, any
integral count; not bools), stored as plain Python numbers; a rank outside the process group
gets a ValueError saying so. One process, a world-size-1 Gloo group."""

from __future__ import annotations

import datetime
import math
import os
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist_topk_cases import FakeBucket
from torch import nn

from hfkern.distributed import TopKState, k_for, topk_hook

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with Gloo")


@pytest.fixture(scope="module", autouse=True)
def world(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a default process group is already initialized in this process")
    init_file = os.path.join(tmp_path_factory.mktemp("topk_args"), "store")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model():
    return nn.Linear(4, 4)


def _stacked():
    m = nn.Module()
    m.w = nn.Parameter(torch.zeros(4, 3))
    return m


@pytest.mark.parametrize("density", [np.float32(0.1), np.float64(0.25), np.float16(0.5), Fraction(1, 10), 1,
                                     np.int64(1), 0.5])
def test_density_takes_any_real_number(density):
    st = TopKState(_model(), density=density)
    assert type(st.density) is float and st.density == float(density)
    assert k_for(st.density, 100) == k_for(density, 100)


@pytest.mark.parametrize("bad, error, match", [
    (True, TypeError, r"TopKState: density must be a real number in \(0, 1\], got bool True"),
    (np.bool_(True), TypeError, r"density must be a real number in \(0, 1\], got bool"),
    ("0.1", TypeError, r"density must be a real number in \(0, 1\], got str '0.1'"),
    (1 + 0j, TypeError, r"density must be a real number in \(0, 1\], got complex"),
    (torch.tensor(0.1), TypeError, r"density must be a real number in \(0, 1\], got Tensor"),
    (0, ValueError, r"density must be in \(0, 1\], got 0"),
    (np.float32(1.5), ValueError, r"density must be in \(0, 1\], got np.float32\(1.5\)|got 1.5"),
    (Fraction(3, 2), ValueError, r"density must be in \(0, 1\], got Fraction\(3, 2\)"),
    (math.nan, ValueError, r"density must be in \(0, 1\], got nan"),
])
def test_density_refusals_name_expected_and_got(bad, error, match):
    with pytest.raises(error, match=match):
        TopKState(_model(), density=bad)


def test_integer_arguments_take_numpy_integers():
    st = TopKState(_stacked(), density=0.5, per_model=np.int64(4), warmup_steps=np.int64(10), seed=np.uint8(3))
    assert (st.per_model, st.warmup_steps, st.seed) == (4, 10, 3)
    assert type(st.per_model) is int and type(st.warmup_steps) is int and type(st.seed) is int


@pytest.mark.parametrize("name, bad, error, match", [
    ("per_model", 4.0, TypeError, r"TopKState: per_model must be an int >= 1, got float 4.0"),
    ("per_model", True, TypeError, r"TopKState: per_model must be an int >= 1, got bool True"),
    ("per_model", np.int64(0), ValueError, r"TopKState: per_model must be >= 1, got 0"),
    ("warmup_steps", np.float64(10), TypeError, r"TopKState: warmup_steps must be an int >= 0, got float64"),
    ("warmup_steps", np.bool_(False), TypeError, r"TopKState: warmup_steps must be an int >= 0, got bool"),
    ("warmup_steps", np.int32(-1), ValueError, r"TopKState: warmup_steps must be >= 0, got -1"),
    ("seed", "1", TypeError, r"TopKState: seed must be an int >= 0, got str '1'"),
])
def test_integer_refusals_name_expected_and_got(name, bad, error, match):
    with pytest.raises(error, match=match):
        TopKState(_stacked(), density=0.5, **{name: bad})


def test_density_schedule_pairs_take_numpy_numbers():
    st = TopKState(_model(), density_schedule=[(np.int64(0), np.float32(0.5)), (np.int32(5), Fraction(1, 4))])
    assert st._schedule == [(0, 0.5), (5, 0.25)]
    assert all(type(s) is int and type(d) is float for s, d in st._schedule)
    assert st.density_at(0) == 0.5 and st.density_at(7) == 0.25


def _hook_once(st, param):
    g = torch.arange(1.0, 13.0).flip(0)
    param.grad = None
    return topk_hook(st, FakeBucket(g.clone(), 0, True, [param])).wait()


def test_callable_schedule_returning_numpy_floats_runs_the_hook():
    m = _stacked()
    st = TopKState(m, density_schedule=lambda step: np.float32(0.25), fallback=False)
    assert type(st.density_at(0)) is float and st.density_at(0) == 0.25
    out = _hook_once(st, m.w)  # refused with "must be a float" before the fix
    assert out.shape == (12,) and st.step == 1 and torch.count_nonzero(out) >= 1
    bad = TopKState(m, density_schedule=lambda step: "0.25")
    with pytest.raises(TypeError, match=r"density_schedule\(0\): density must be a real number in \(0, 1\], "
                                        r"got str '0.25'"):
        bad.density_at(0)


def test_rank_outside_the_process_group_is_a_value_error():
    # what torch.distributed.new_group returns to ranks that are not in the group
    placeholder = dist.GroupMember.NON_GROUP_MEMBER
    with pytest.raises(ValueError, match=r"TopKState: this rank \(0 of the world\) is not in the process group"):
        TopKState(_model(), process_group=placeholder)
    for bad in (5, -5, "world"):  # other non-groups stay TypeErrors
        with pytest.raises(TypeError, match="expected process_group to be a torch.distributed.ProcessGroup"):
            TopKState(_model(), process_group=bad)
    assert TopKState(_model(), process_group=dist.group.WORLD).world_size == 1
