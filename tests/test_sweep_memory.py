"""max_array_size: predictions against measured peaks on the CPU, the fit's arithmetic
on free memory, the confirmation's bisection, and argument errors."""

import dataclasses
import math

import pytest
import torch
from torch import nn

import hfkern
from hfkern.sweep import _memory
from hfkern.sweep._memory import max_array_size, measure_step_peak


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 10))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))


def cnn_batch():
    return torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))


def mlp_batch(kind: str = "labels"):
    x = torch.randn(13, 32)
    if kind == "labels":
        return x, torch.randint(0, 10, (13,))
    if kind == "float targets":
        return x, torch.randn(13, 10)
    return x  # inputs only


MODELS = {"cnn": (cnn, cnn_batch), "mlp": (mlp, mlp_batch)}


def param_bytes(factory) -> int:
    return sum(p.numel() * p.element_size() for p in factory().parameters())


@pytest.fixture(scope="module")
def fits():
    """One default fit (sizes (2, 4, 8), Adam) per model, shared by the tests that only read it."""
    torch.manual_seed(0)
    return {name: max_array_size(factory, make_batch(), device="cpu") for name, (factory, make_batch)
            in MODELS.items()}


# ---- predictions against measurements ------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(MODELS))
def test_prediction_within_10_percent_of_measured_peak(fits, name):
    factory, make_batch = MODELS[name]
    result = fits[name]
    assert sorted(result.measured) == [2, 4, 8]
    for B in (12, 16):
        peak = measure_step_peak(factory, make_batch(), B, device="cpu")
        error = result.predict(B) / peak - 1
        assert abs(error) < 0.10, f"{name} B={B}: predicted {result.predict(B):.0f} bytes, measured {peak}"


@pytest.mark.parametrize("kind", ["float targets", "inputs only"])
def test_prediction_with_the_other_default_losses(kind):
    # mse_loss for floating targets, the mean square of the output without targets.
    result = max_array_size(mlp, mlp_batch(kind), device="cpu", sizes=(2, 4))
    peak = measure_step_peak(mlp, mlp_batch(kind), 10, device="cpu")
    assert abs(result.predict(10) / peak - 1) < 0.10, (kind, result.predict(10), peak)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_model_bytes_cover_parameters_gradients_and_adam_state(fits, name):
    factory, _ = MODELS[name]
    # Per model, a step with Adam holds at least its parameters, their gradients
    # and the two moment estimates.
    assert fits[name].per_model_bytes >= 4 * param_bytes(factory)


def test_measured_peaks_grow_with_B(fits):
    for result in fits.values():
        peaks = [result.measured[B] for B in sorted(result.measured)]
        assert all(a < b for a, b in zip(peaks, peaks[1:])), result.measured


# ---- the step and the optimizer --------------------------------------------------------------------

def test_custom_step_fn_and_optimizer_are_used(fits):
    seen = []
    made = []

    def step(model, optimizer, batch):
        seen.append((model.B, optimizer))
        x, y = batch
        losses = hfkern.nn.functional.cross_entropy(model(hfkern.broadcast(x, model.B)), y)
        optimizer.zero_grad()
        losses.sum().backward()
        optimizer.step()

    def sgd(params):
        made.append(hfkern.optim.SGD(params, lr=0.1))
        return made[-1]

    result = max_array_size(mlp, mlp_batch(), step_fn=step, device="cpu", optimizer=sgd, sizes=(2, 4))
    # The warm-up at the smallest size, then each size; two steps each, with that window's optimizer.
    assert [B for B, _ in seen] == [2, 2, 2, 2, 4, 4]
    assert len(made) == 3
    assert [opt for _, opt in seen] == [made[0], made[0], made[1], made[1], made[2], made[2]]
    # Plain SGD keeps no state; Adam keeps two tensors per parameter.
    assert fits["mlp"].per_model_bytes - result.per_model_bytes >= 2 * param_bytes(mlp) * 0.95


def test_custom_step_fn_takes_any_batch():
    def step(model, optimizer, batch):
        assert isinstance(batch, dict) and batch["x"].device.type == "cpu"
        out = model(hfkern.broadcast(batch["x"], model.B))
        optimizer.zero_grad()
        hfkern.nn.functional.cross_entropy(out, batch["y"]).sum().backward()
        optimizer.step()

    x, y = mlp_batch()
    result = max_array_size(mlp, {"x": x, "y": y}, step_fn=step, device="cpu", sizes=(2, 3))
    assert result.per_model_bytes > 0 and result.B >= 1


def test_random_state_is_left_alone():
    # Building the B models draws their initial weights; the caller's next fuse()
    # must not depend on whether max_array_size ran before it.
    batch = mlp_batch()
    torch.manual_seed(123)
    max_array_size(mlp, batch, device="cpu", sizes=(1, 2))
    measure_step_peak(mlp, batch, 2, device="cpu")
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(3))


# ---- the prediction from free memory ----------------------------------------------------------------

MiB = 1 << 20


def test_predicted_B_follows_free_memory(monkeypatch):
    monkeypatch.setattr(_memory, "_free_bytes", lambda device: 10 * MiB)
    result = max_array_size(mlp, mlp_batch(), device="cpu", memory_fraction=0.5)
    assert result.free_bytes == 10 * MiB
    assert result.budget_bytes == 5 * MiB
    assert result.B == math.floor((5 * MiB - result.fixed_bytes) / result.per_model_bytes)
    assert 1 <= result.B < result.max_B
    assert result.predict(result.B) <= result.budget_bytes < result.predict(result.B + 1)
    assert not result.confirmed and result.device == torch.device("cpu")


def linear_peaks(monkeypatch, fixed=1000, per_model=300):
    """Replace the measurement by exact peaks ``fixed + per_model * B``; returns the B asked for."""
    asked = []

    def measure(factory, batch, B, step_fn, make_optimizer, device):
        asked.append(B)
        return fixed + per_model * B

    monkeypatch.setattr(_memory, "_measure_window", measure)
    return asked


@pytest.mark.parametrize("free, fraction, expected", [
    (10_000, 0.9, 26),        # floor((9000 - 1000) / 300)
    (2500, 1.0, 5),           # 1000 + 300 * 5 == 2500 exactly: fits
    (2499, 1.0, 4),
    (1299, 1.0, 0),           # not even one model
    (500, 1.0, 0),            # not even the fixed part
])
def test_formula_on_exact_peaks(monkeypatch, free, fraction, expected):
    asked = linear_peaks(monkeypatch)
    monkeypatch.setattr(_memory, "_free_bytes", lambda device: free)
    result = max_array_size(mlp, mlp_batch(), device="cpu", memory_fraction=fraction, sizes=(8, 2, 4, 4))
    assert asked == [2, 2, 4, 8]  # the warm-up at the smallest size, then each distinct size
    assert result.measured == {2: 1600, 4: 2200, 8: 3400}
    assert result.fixed_bytes == pytest.approx(1000) and result.per_model_bytes == pytest.approx(300)
    assert result.B == result.predicted_B == expected
    assert result.fits == (expected > 0)
    assert int(result) == expected


def test_max_B_caps_the_prediction(monkeypatch):
    linear_peaks(monkeypatch)
    monkeypatch.setattr(_memory, "_free_bytes", lambda device: 10**12)
    result = max_array_size(mlp, mlp_batch(), device="cpu", max_B=100)
    assert result.B == 100
    assert result.predicted_B == math.floor((0.9 * 10**12 - 1000) / 300)
    assert str(result).startswith(f"B = 100 (max_B; the budget allows {result.predicted_B}; ")


def test_peaks_that_do_not_grow_raise(monkeypatch):
    linear_peaks(monkeypatch, fixed=5000, per_model=0)
    with pytest.raises(RuntimeError, match=r"does not grow with B.*\{2: 5000, 4: 5000, 8: 5000\}"):
        max_array_size(mlp, mlp_batch(), device="cpu")


def test_free_cpu_memory_is_plausible():
    free = _memory._free_bytes(torch.device("cpu"))
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < free <= total


# ---- the confirmation's bisection (CUDA runs it; the search itself is device-free) ----------------

@pytest.mark.parametrize("limit, known_good", [
    (limit, known_good) for limit in (0, 1, 2, 7, 8, 9, 37, 99, 100, 150) for known_good in (0, 1, 8)
    if known_good <= limit  # known_good is a size that ran
])
def test_largest_that_runs(limit, known_good):
    tried = []

    def runs(B):
        tried.append(B)
        return B <= limit

    found = _memory._largest_that_runs(runs, 100, known_good)
    assert found == min(limit, 100)
    assert tried[0] == 100
    assert len(tried) <= 1 + math.ceil(math.log2(100 - known_good)) + 1


# ---- the result ------------------------------------------------------------------------------------

def test_str_and_int(fits, monkeypatch):
    result = fits["cnn"]
    assert int(result) == result.B
    text = str(result)
    assert text.startswith(f"B = {result.B} (")
    assert "not confirmed on cpu" in text and "fixed + " in text and " per model, budget " in text
    assert " free)" in text

    linear_peaks(monkeypatch)
    monkeypatch.setattr(_memory, "_free_bytes", lambda device: 2 * 1024**3)
    small = max_array_size(mlp, mlp_batch(), device="cpu", memory_fraction=0.5, max_B=10**9)
    assert str(small) == (f"B = {small.B} (predicted, not confirmed on cpu): 1000 B fixed + 300 B per "
                          "model, budget 1.0 GiB (0.5 of 2.0 GiB free)")
    monkeypatch.setattr(_memory, "_free_bytes", lambda device: 1200)
    none = max_array_size(mlp, mlp_batch(), device="cpu")
    assert int(none) == 0 and not none.fits
    assert str(none).startswith("B = 0 (not one model fits the budget on cpu): 1000 B fixed + 300 B per model")


def test_result_is_frozen_and_predict_checks_B(fits):
    result = fits["mlp"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.B = 3
    assert result.predict(0) == result.fixed_bytes
    with pytest.raises(ValueError, match="expected B >= 0, got -1"):
        result.predict(-1)
    with pytest.raises(TypeError, match="got str '3'"):
        result.predict("3")


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (-2048, "-2.0 KiB"),
                                     (5 * 1024**3, "5.0 GiB"), (3 * 1024**5, "3072.0 TiB")])
def test_format_bytes(n, text):
    assert _memory._format_bytes(n) == text


# ---- argument errors, raised before any measurement ---------------------------------------------------

X, Y = mlp_batch()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(factory=3), TypeError, r"factory must be a callable returning one torch.nn.Module, got int 3"),
    (dict(factory=nn.Linear(2, 2)), TypeError, r"got a torch.nn.Module instance \(Linear\)"),
    (dict(step_fn="step"), TypeError, r"step_fn must be a callable .* or None, got str 'step'"),
    (dict(optimizer="adam"), TypeError, r"optimizer must be a callable .* or None, got str 'adam'"),
    (dict(memory_fraction=0), ValueError, r"memory_fraction must be in \(0, 1\], got 0"),
    (dict(memory_fraction=1.5), ValueError, r"memory_fraction must be in \(0, 1\], got 1.5"),
    (dict(memory_fraction=float("nan")), ValueError, r"memory_fraction must be in \(0, 1\], got nan"),
    (dict(memory_fraction="0.9"), TypeError, r"memory_fraction must be a float in \(0, 1\], got str '0.9'"),
    (dict(sizes=(4,)), ValueError, r"at least two distinct B .*got \[4\]"),
    (dict(sizes=(2, 2)), ValueError, r"at least two distinct B .*got \[2, 2\]"),
    (dict(sizes=(0, 2)), ValueError, r"sizes must hold ints >= 1, got 0 in \(0, 2\)"),
    (dict(sizes=(2.0, 4)), TypeError, r"sizes must hold ints >= 1, got float 2.0"),
    (dict(sizes=4), TypeError, r"sizes must be a sequence .*got int 4"),
    (dict(max_B=0), ValueError, r"max_B must be >= 1, got 0"),
    (dict(max_B=2.5), TypeError, r"max_B must be an int >= 1, got float 2.5"),
    (dict(device="meta"), ValueError, r"expected a 'cpu' or 'cuda' device, got meta"),
    (dict(device=3), TypeError, r"device must be a torch.device, a str or None, got int 3"),
    (dict(example_batch=[X]), TypeError, r"\(inputs, targets\) pair of tensors, got list of \(Tensor\)"),
    (dict(example_batch=(X, Y, Y)), TypeError, r"got tuple of \(Tensor, Tensor, Tensor\)"),
    (dict(example_batch="x"), TypeError, r"an inputs tensor or an \(inputs, targets\) pair of tensors, got str"),
])
def test_invalid_arguments(monkeypatch, kwargs, error, match):
    def measure(*args):
        raise AssertionError("measured before the arguments were checked")

    monkeypatch.setattr(_memory, "_measure_window", measure)
    call = dict(factory=mlp, example_batch=(X, Y), device="cpu") | kwargs
    with pytest.raises(error, match="max_array_size: .*" + match):
        max_array_size(**call)


def test_invalid_measure_arguments(monkeypatch):
    monkeypatch.setattr(_memory, "_measure_window", lambda *args: pytest.fail("measured"))
    with pytest.raises(ValueError, match="measure_step_peak: B must be >= 1, got 0"):
        measure_step_peak(mlp, (X, Y), 0, device="cpu")
    with pytest.raises(TypeError, match="measure_step_peak: B must be an int >= 1, got bool True"):
        measure_step_peak(mlp, (X, Y), True, device="cpu")


def test_cuda_requested_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"expected an available device, got cuda.*is_available\(\) is False"):
        max_array_size(mlp, (X, Y), device="cuda")


# ---- on a GPU: the prediction confirmed by a step -----------------------------------------------------

@pytest.mark.gpu
def test_confirmed_on_cuda():
    x, y = cnn_batch()
    result = max_array_size(cnn, (x, y), device="cuda", max_B=48)
    assert result.device.type == "cuda" and result.device.index is not None
    assert result.confirmed and result.B == 48  # a small CNN: far below an accelerator's memory
    assert "confirmed on cuda:" in str(result)
    for B in (12, 16):
        peak = measure_step_peak(cnn, (x, y), B, device="cuda")
        assert abs(result.predict(B) / peak - 1) < 0.10, (B, result.predict(B), peak)
