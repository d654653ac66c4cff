"""The bounds README.md states for how closely an array follows B separate torch
models (measured by bench/agreement.py, which this runs)."""

import importlib
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture(scope="module")
def agreement():
    sys.path.insert(0, BENCH)
    try:
        yield importlib.import_module("agreement")
    finally:
        sys.path.remove(BENCH)
        sys.modules.pop("agreement", None)


# README: "bit-identical" for SGD, at most 1.1e-7 for Adam/AdamW/Adagrad/Adadelta and
# 3.7e-7 for RMSprop on this CPU; the bounds leave room for other CPUs' vector units.
OPTIMIZER_BOUNDS = {"SGD": 1e-7, "Adam": 5e-7, "AdamW": 5e-7, "Adagrad": 5e-7,
                    "Adadelta": 5e-7, "RMSprop": 2e-6}


@pytest.mark.parametrize("name", sorted(OPTIMIZER_BOUNDS))
def test_optimizer_follows_torch_within_float32_rounding(agreement, name):
    row = agreement.optimizer_agreement(name, steps=10, device=torch.device("cpu"))
    assert row["max_rel_diff"] <= OPTIMIZER_BOUNDS[name], row


def test_cnn_training_follows_separate_models_within_float32_rounding(agreement):
    rows = agreement.training_agreement(steps=10, device=torch.device("cpu"))
    assert len(rows) == 2
    for row in rows:
        assert row["max_rel_diff"] <= 1e-5, row
