"""What the sweep runner's loss and metric read in ``hp``: every fusible parameter, whichever
trial opened the array (NaN where a trial does not give it, each trial's seed for
``seed_param``); and the runner's and ``batch_indices``' seed and step arguments checked."""

from __future__ import annotations

import math

import pytest
import torch

import hfkern
from _util import import_sweep_extra

optuna = import_sweep_extra()  # before everything that imports it
import _sweep_cases as cases  # noqa: E402
import hfkern.sweep as hs  # noqa: E402
from hfkern.sweep._storage import SEED_ATTR  # noqa: E402
from test_sweep import new_study  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)


def space_with_weight(trial):
    """Trial 1 alone gives a loss weight ``w`` (a conditional fusible parameter)."""
    params = cases.space(trial)
    if trial.number == 1:
        params["w"] = 8.0
    return params


def test_every_fusible_parameter_reaches_the_loss_whichever_trial_opened_the_array():
    seen = []

    def loss(out, target, hp):
        seen.append({k: v.tolist() for k, v in hp.items()})
        w = torch.nan_to_num(hp["w"], nan=1.0)  # a trial without w: weight 1
        return hfkern.nn.functional.cross_entropy(out, target) * w

    study = new_study()
    cases.runner(study, space=space_with_weight, fusible=["lr", "momentum", "w"], loss=loss, B=2).run(n_trials=2)
    first = seen[0]
    assert sorted(first) == ["lr", "momentum", "seed", "w"]
    assert math.isnan(first["w"][0]) and first["w"][1] == 8.0  # trial 0 opened the array without w
    assert first["seed"] == [float(t.user_attrs[SEED_ATTR]) for t in study.trials]
    t0, t1 = study.trials
    want0 = cases.train_alone(t0.params, t0.user_attrs[SEED_ATTR])
    # A loss weighted by 8 under SGD (momentum included) is the unweighted loss at 8 times the lr.
    want1 = cases.train_alone({**t1.params, "lr": 8 * t1.params["lr"]}, t1.user_attrs[SEED_ATTR])
    cases.assert_close_curves(cases.curve(t0), want0, "trial 0")
    cases.assert_close_curves(cases.curve(t1), want1, "trial 1 (weighted by w = 8)", rel=1e-3)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(seed_param=5), TypeError, "seed_param must be a parameter name"),
    (dict(seed="a"), TypeError, "seed must be an int, got str"),
    (dict(seed=2.7), TypeError, "seed must be an int, got float"),
    (dict(seed=True), TypeError, "seed must be an int, got bool"),
    (dict(data_seed=None), TypeError, "data_seed must be an int, got NoneType"),
    (dict(device="not a device"), TypeError, "device must be a torch.device or a device string"),
])
def test_seed_and_device_arguments_are_checked_before_any_trial(kwargs, error, match):
    study = new_study()
    with pytest.raises(error, match=match):
        cases.runner(study, **kwargs)
    assert study.trials == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_a_cuda_device_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="device 'cuda' asked for, but CUDA is not available"):
        cases.runner(new_study(), device="cuda")


@pytest.mark.parametrize("args, error, match", [
    ((10, 0, 0), ValueError, "expected batch_size >= 1, got 0"),
    ((10, -1, 0), ValueError, "expected batch_size >= 1, got -1"),
    ((10, 3, -1), ValueError, "expected step >= 0, got -1"),
    ((10, 3, 1.5), TypeError, "expected step as an int, got float"),
    ((10, 3.0, 1), TypeError, "expected batch_size as an int, got float"),
    ((0, 3, 1), ValueError, "expected n >= 1, got 0"),
    ((10, 11, 0), ValueError, "expected batch_size <= n"),
    ((10, 3, 0, "s"), TypeError, "expected seed as an int, got str"),
])
def test_batch_indices_checks_its_arguments(args, error, match):
    with pytest.raises(error, match=match):
        hs.batch_indices(*args)


def test_batch_indices_of_numpy_ints_equal_those_of_ints():
    np = pytest.importorskip("numpy")
    assert torch.equal(hs.batch_indices(np.int64(50), np.int32(7), np.int64(9), np.int64(3)),
                       hs.batch_indices(50, 7, 9, 3))
