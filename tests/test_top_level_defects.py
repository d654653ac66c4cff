"""Defects of top-level entry points: max_array_size (the caller's inputs, an active
profiler, grad modes, device strings, a module as step_fn), the backend registry's
package loading across threads and its logging, topk_capacity's and topk_select's
arguments and autograd, is_shared's and broadcast's errors."""

import logging
import threading
import types

import numpy as np
import pytest
import torch
from torch import nn

import hfkern
from hfkern import _backend
from hfkern.sweep import _memory
from hfkern.sweep._memory import max_array_size, measure_step_peak


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batch():
    return torch.randn(5, 8), torch.randint(0, 4, (5,))


def no_measuring(monkeypatch):
    def measure(*args):
        raise AssertionError("measured before the arguments were checked")

    monkeypatch.setattr(_memory, "_measure_window", measure)


# ---- 1. max_array_size leaves the caller's example batch alone ------------------------------------

def test_max_array_size_writes_no_gradient_into_the_callers_inputs():
    x, y = batch()
    x.requires_grad_(True)
    x0, y0 = x.detach().clone(), y.clone()
    result = max_array_size(mlp, (x, y), device="cpu", sizes=(2, 4))
    assert result.per_model_bytes > 0
    assert x.grad is None and x.requires_grad and x.is_leaf
    assert torch.equal(x.detach(), x0) and torch.equal(y, y0)
    measure_step_peak(mlp, (x, y), 2, device="cpu")
    assert x.grad is None


def test_default_step_gets_a_detached_shared_input(monkeypatch):
    x, y = batch()
    x.requires_grad_(True)
    seen = []
    default_step = _memory.default_step

    def step(model, optimizer, b):
        seen.append(b)
        default_step(model, optimizer, b)

    monkeypatch.setattr(_memory, "default_step", step)
    max_array_size(mlp, (x, y), device="cpu", sizes=(2, 4))
    assert seen
    for inputs, _ in seen:
        # Not the caller's tensor, and not requiring grad: the shared-input path applies.
        assert inputs is not x and not inputs.requires_grad
        assert hfkern._array.shares_work(hfkern.broadcast(inputs, 2))


def test_custom_step_gets_a_new_leaf_that_requires_grad_as_the_callers_input():
    x, y = batch()
    x.requires_grad_(True)
    seen = []

    def step(model, optimizer, b):
        inputs, targets = b
        seen.append(inputs)
        out = model(hfkern.broadcast(inputs, model.B))
        losses = hfkern.nn.functional.cross_entropy(out, targets)
        # A gradient penalty differentiates with respect to the inputs.
        (g,) = torch.autograd.grad(losses.sum(), inputs, create_graph=True)
        optimizer.zero_grad()
        (losses.sum() + g.square().sum()).backward()
        optimizer.step()

    max_array_size(mlp, (x, y), step_fn=step, device="cpu", sizes=(2, 4))
    assert seen and all(t is not x and t.is_leaf and t.requires_grad for t in seen)
    assert x.grad is None


# ---- 2. an active profiler ------------------------------------------------------------------------

def test_max_array_size_refuses_to_run_inside_a_profiler_and_leaves_it_recording(monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    no_measuring(monkeypatch)
    a = torch.randn(16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(a, a)
        with pytest.raises(RuntimeError, match=r"max_array_size: measures CPU memory with torch's profiler"
                                               r".*cannot run inside another profiling session"):
            max_array_size(mlp, batch(), device="cpu", sizes=(2, 4))
        with pytest.raises(RuntimeError, match=r"measure_step_peak: .*another profiling session"):
            measure_step_peak(mlp, batch(), 2, device="cpu")
        torch.linalg.inv(a + 16 * torch.eye(16))
    names = {e.key for e in prof.key_averages()}
    assert "aten::mm" in names and any("linalg_inv" in n for n in names)


def test_max_array_size_runs_after_the_profiler_ended():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):
        pass
    assert max_array_size(mlp, batch(), device="cpu", sizes=(2, 4)).per_model_bytes > 0


# ---- 3. loading a backend package from two threads ------------------------------------------------

def test_backend_package_load_waits_for_another_threads_import(monkeypatch):
    entered, release, imported = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def import_module(name):
        assert name == "pretend.kernels"
        entered.set()
        # The importing thread's own nested call (a module's imports) returns at once.
        seen["reentrant"] = _backend._load_package("pretend")
        release.wait(30)
        imported.set()
        return types.SimpleNamespace()  # no __path__: no family modules

    fake_importlib = types.SimpleNamespace(
        import_module=import_module, util=types.SimpleNamespace(find_spec=lambda name: object()))
    monkeypatch.setattr(_backend, "importlib", fake_importlib)
    monkeypatch.setitem(_backend.BACKEND_PACKAGES, "pretend", "pretend.kernels")
    monkeypatch.setattr(_backend, "_packages", dict(_backend._packages))

    def first():
        seen["first"] = _backend._load_package("pretend")

    def second():
        seen["second"] = _backend._load_package("pretend")
        seen["second saw the import finished"] = imported.is_set()

    t1 = threading.Thread(target=first, daemon=True)
    t1.start()
    assert entered.wait(30)
    t2 = threading.Thread(target=second, daemon=True)
    t2.start()
    t2.join(0.5)  # the second thread arrives while the first one imports
    release.set()
    t1.join(30)
    t2.join(30)
    assert not t1.is_alive() and not t2.is_alive()
    assert seen == {"reentrant": "", "first": "", "second": "", "second saw the import finished": True}


def test_backend_info_from_two_threads_agrees():
    # The public symptom (the import is real here: whatever it finds, both threads agree).
    results = []
    barrier = threading.Barrier(2)

    def call():
        barrier.wait(30)
        results.append(hfkern.backend_info()["backends"]["triton"]["reason"])

    threads = [threading.Thread(target=call, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 2 and results[0] == results[1]
    assert "no hfkern op has a Triton implementation" not in results[0]


# ---- 4. grad modes of the caller --------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_max_array_size_measures_a_training_step_under_the_callers_grad_mode(mode):
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    x, y = batch()
    with context():
        if mode == "inference_mode":
            x, y = batch()  # inference tensors
        result = max_array_size(mlp, (x, y), device="cpu", sizes=(2, 4))
        peak = measure_step_peak(mlp, (x, y), 2, device="cpu")
        assert not torch.is_grad_enabled()
        assert torch.is_inference_mode_enabled() == (mode == "inference_mode")
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert result.per_model_bytes > 0 and result.B >= 1 and peak > 0
    reference = max_array_size(mlp, batch(), device="cpu", sizes=(2, 4))
    assert result.measured == reference.measured


# ---- 5. device strings ----------------------------------------------------------------------------

# ids: "gpu" alone would be the keyword that marks a test as needing a GPU (conftest).
@pytest.mark.parametrize("device", ["gpu", "CPU", "", "cpu:x"], ids=lambda d: f"device={d!r}")
def test_bad_device_strings_are_value_errors_naming_the_function(monkeypatch, device):
    no_measuring(monkeypatch)
    with pytest.raises(ValueError, match=rf"^max_array_size: expected a device .*got {device!r}"):
        max_array_size(mlp, batch(), device=device)
    with pytest.raises(ValueError, match=rf"^measure_step_peak: expected a device .*got {device!r}"):
        measure_step_peak(mlp, batch(), 2, device=device)


@pytest.mark.parametrize("device", [0, b"cpu", ["cpu"]])
def test_device_of_a_wrong_type_is_a_type_error(monkeypatch, device):
    no_measuring(monkeypatch)
    with pytest.raises(TypeError, match=r"^max_array_size: device must be a torch.device, a str or None"):
        max_array_size(mlp, batch(), device=device)


# ---- 6. topk_capacity's arguments -----------------------------------------------------------------

@pytest.mark.parametrize("exact", ["no", None, 2, 0, [0], np.bool_(True)])
def test_topk_capacity_checks_exact_as_topk_select_does(exact):
    with pytest.raises(TypeError, match=r"^topk_capacity: expected exact to be a bool, got "):
        hfkern.topk_capacity(4, exact)
    with pytest.raises(TypeError, match=r"^topk_select: expected exact to be a bool, got "):
        hfkern.topk_select(torch.randn(10), 4, exact=exact)


@pytest.mark.parametrize("k, error", [(True, TypeError), (4.0, TypeError), (np.int64(4), TypeError),
                                      (0, ValueError), (-3, ValueError), (2**31, ValueError)])
def test_topk_capacity_checks_k_as_topk_select_does(k, error):
    with pytest.raises(error, match=r"^topk_capacity: expected k"):
        hfkern.topk_capacity(k)
    with pytest.raises(error, match=r"^topk_select: expected"):
        hfkern.topk_select(torch.randn(10), k)


def test_topk_capacity_valid_arguments():
    assert hfkern.topk_capacity(4) == 5 and hfkern.topk_capacity(4, True) == 4
    assert hfkern.topk_capacity(2**31 - 1, exact=True) == 2**31 - 1


# ---- 7 and 8. is_shared's and broadcast's errors ----------------------------------------------------

@pytest.mark.parametrize("value", [None, [1, 2], np.zeros(3)])
def test_is_shared_of_a_non_tensor_is_a_type_error(value):
    with pytest.raises(TypeError, match=rf"^is_shared: expected a torch.Tensor, got {type(value).__name__}$"):
        hfkern.is_shared(value)


def test_broadcast_errors_name_broadcast():
    x = torch.randn(3)
    with pytest.raises(ValueError, match=r"^broadcast: B must be >= 1, got 0$"):
        hfkern.broadcast(x, 0)
    with pytest.raises(TypeError, match=r"^broadcast: B must be an int >= 1, got float 2.0$"):
        hfkern.broadcast(x, 2.0)
    assert hfkern.is_shared(hfkern.broadcast(x, 2))


# ---- 9. a module passed for a callable ------------------------------------------------------------

def test_module_as_step_fn_gets_advice_for_a_step(monkeypatch):
    no_measuring(monkeypatch)
    with pytest.raises(TypeError) as info:
        max_array_size(mlp, batch(), step_fn=nn.Linear(2, 2), device="cpu")
    message = str(info.value)
    assert message.startswith("max_array_size: step_fn must be a callable step_fn(model, optimizer, batch), "
                              "got a torch.nn.Module instance (Linear)")
    assert "makes one" not in message and "lambda: Linear" not in message
    assert "runs one training step" in message
    with pytest.raises(TypeError) as info:
        max_array_size(mlp, batch(), optimizer=nn.Linear(2, 2), device="cpu")
    assert "lambda: Linear" not in str(info.value) and "lambda params:" in str(info.value)
    # The factory keeps its advice.
    with pytest.raises(TypeError, match=r"factory must be .*\(Linear\); pass a callable that makes one, "
                                        r"e.g. lambda: Linear\(...\)"):
        max_array_size(nn.Linear(2, 2), batch(), device="cpu")


# ---- 10. topk_select is not differentiated ----------------------------------------------------------

def test_topk_select_results_do_not_require_grad():
    w = nn.Parameter(torch.randn(3, 50))
    for out in (hfkern.topk_select(w, 5), hfkern.TopK(*torch.ops.hfkern.topk_select(w * 2, 5, True, 0))):
        assert all(not t.requires_grad and t.grad_fn is None for t in out)
    ref = hfkern.topk_select(w.detach(), 5)
    assert all(torch.equal(a, b) for a, b in zip(hfkern.topk_select(w, 5), ref))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_topk_select_of_a_tensor_requiring_grad(backend):
    w = nn.Parameter(torch.randn(3, 50))
    fn = torch.compile(lambda t: hfkern.topk_select(t * 1.5, 5, seed=7), backend=backend, fullgraph=True)
    out = fn(w)
    ref = hfkern.topk_select(w.detach() * 1.5, 5, seed=7)
    assert all(torch.equal(a, b) and not a.requires_grad for a, b in zip(out, ref))


# ---- 11. what is logged, and how often ----------------------------------------------------------------

def test_auto_choice_is_logged_once_per_op_device_type_and_dtype(monkeypatch, caplog):
    monkeypatch.setattr(_backend, "_logged_auto", set())
    monkeypatch.setattr(_backend, "_resolved", {})
    caplog.set_level(logging.DEBUG, logger="hfkern")
    with hfkern.use_backend("auto"):
        for dtype in (torch.float32, torch.float16, torch.float32):
            hfkern.topk_select(torch.randn(2, 10).to(dtype), 3)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hfkern::topk_select on cpu")]
    assert len(logged) == 2
    assert "(op, device type, data dtype)" in " ".join(_backend.__doc__.split())
