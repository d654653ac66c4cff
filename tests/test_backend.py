import logging
import subprocess
import sys

import pytest
import torch

import hfkern
from hfkern import _backend


@pytest.fixture(autouse=True)
def _restore_backend():
    previous = _backend._selected
    _backend._resolved.clear()
    yield
    _backend._selected = previous
    _backend._resolved.clear()


def test_default_is_auto_and_torch_serves_cpu():
    info = hfkern.backend_info()
    assert info["requested"] in ("auto", "torch")
    assert info["backends"]["torch"]["available"]
    assert info["ops"]["array_conv"]["cpu"].startswith("torch")
    assert "torch" in info["ops"]["array_conv"]["registered"]


def test_unavailable_backends_raise_with_reason():
    for name in ("triton", "cuda"):
        ok, reason = _backend._availability[name]()
        if ok:
            continue
        with pytest.raises(RuntimeError, match=f"backend '{name}' is not available: "):
            hfkern.set_backend(name)
        assert hfkern.backend_info()["backends"][name]["reason"] == reason


def test_bad_backend_name():
    with pytest.raises(ValueError, match="backend must be one of .*got 'cudnn'"):
        hfkern.set_backend("cudnn")


def test_set_backend_and_use_backend():
    hfkern.set_backend("torch")
    assert hfkern.get_backend() == "torch"
    assert hfkern.backend_info()["source"] == "set_backend"
    with hfkern.use_backend("auto"):
        assert hfkern.get_backend() == "auto"
    assert hfkern.get_backend() == "torch"


def test_explicit_backend_without_implementation_raises():
    _backend.register("test_only_op", "triton", lambda: None, device_types=("cuda",))
    try:
        _backend._selected = "torch"
        with pytest.raises(RuntimeError, match="'torch' was requested but has no implementation of hfkern::test_only_op"):
            _backend.resolve("test_only_op", torch.device("cpu"))
        _backend._selected = "auto"
        with pytest.raises(RuntimeError, match="no available hfkern backend serves hfkern::test_only_op on cpu"):
            _backend.resolve("test_only_op", torch.device("cpu"))
    finally:
        del _backend._registry["test_only_op"]


def test_auto_skips_backends_not_marked_auto(monkeypatch):
    calls = []
    _backend.register("test_only_op", "torch", lambda: calls.append("torch"))
    _backend.register("test_only_op", "cuda", lambda: calls.append("cuda"), auto=False)
    monkeypatch.setitem(_backend._availability, "cuda", lambda: (True, "pretend"))
    try:
        _backend._selected = "auto"
        _backend.resolve("test_only_op", torch.device("cpu"))()
        _backend.resolve("test_only_op", torch.device("cuda"))()  # auto: cuda is not auto-eligible
        _backend._selected = "cuda"
        _backend.resolve("test_only_op", torch.device("cuda"))()
        assert calls == ["torch", "torch", "cuda"]
    finally:
        del _backend._registry["test_only_op"]


def test_auto_passes_over_a_backend_for_dtypes_it_does_not_serve(monkeypatch):
    calls = []
    _backend.register("test_only_op", "torch", lambda: calls.append("torch"))
    _backend.register("test_only_op", "cuda", lambda: calls.append("cuda"),
                      dtypes=(torch.float32, torch.bfloat16))
    monkeypatch.setitem(_backend._availability, "cuda", lambda: (True, "pretend"))
    cuda = torch.device("cuda")
    try:
        _backend._selected = "auto"
        _backend.resolve("test_only_op", cuda, torch.float32)()
        _backend.resolve("test_only_op", cuda, torch.float64)()  # not served: the next eligible
        _backend.resolve("test_only_op", cuda, torch.bfloat16)()
        _backend.resolve("test_only_op", cuda)()  # no dtype given: any
        assert calls == ["cuda", "torch", "cuda", "cuda"]
        assert "other dtypes go to the next eligible backend" in hfkern.backend_info()["ops"]["test_only_op"]["cuda"]
        # An explicit request is never redirected: the implementation sees the call.
        _backend._selected = "cuda"
        _backend.resolve("test_only_op", cuda, torch.float64)()
        assert calls[-1] == "cuda"
    finally:
        del _backend._registry["test_only_op"]


def test_auto_logs_choice_once(caplog):
    _backend._logged_auto.clear()
    _backend._resolved.clear()
    _backend._selected = "auto"
    with caplog.at_level(logging.DEBUG, logger="hfkern"):
        for _ in range(3):
            _backend.resolve("array_conv", torch.device("cpu"))
    msgs = [r.getMessage() for r in caplog.records if "array_conv" in r.getMessage()]
    assert len(msgs) == 1 and "torch backend" in msgs[0]


def test_environment_variable_selects_and_validates():
    code = "import hfkern; print(hfkern.get_backend(), hfkern.backend_info()['source'])"
    out = subprocess.run([sys.executable, "-c", code], env={**_env(), "HFKERN_BACKEND": "torch"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["torch", "HFKERN_BACKEND"]
    bad = subprocess.run([sys.executable, "-c", code], env={**_env(), "HFKERN_BACKEND": "nope"},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "HFKERN_BACKEND must be one of" in bad.stderr


def _env():
    import os
    return {k: v for k, v in os.environ.items() if k != "HFKERN_BACKEND"}


def test_broadcast_is_zero_copy_view():
    x = torch.randn(4, 5)
    xb = hfkern.broadcast(x, 3)
    assert xb.shape == (3, 4, 5) and xb.stride(0) == 0 and xb.data_ptr() == x.data_ptr()
    assert hfkern.is_shared(xb) and not hfkern.is_shared(x)
    with pytest.raises(ValueError, match="B must be >= 1"):
        hfkern.broadcast(x, 0)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        hfkern.broadcast([1.0], 2)


def test_lazy_registration_imports_on_first_use():
    _backend.register("test_only_op", "torch", "math:sqrt")
    try:
        _backend._selected = "torch"
        assert _backend.resolve("test_only_op", torch.device("cpu"))(16.0) == 4.0
    finally:
        del _backend._registry["test_only_op"]


def test_cpu_tensors_take_the_torch_path_under_gpu_backends(monkeypatch):
    calls = []
    _backend.register("test_only_op", "torch", lambda: calls.append("torch"))
    _backend.register("test_only_op", "triton", lambda: calls.append("triton"), device_types=("cuda",))
    monkeypatch.setitem(_backend._availability, "triton", lambda: (True, "pretend"))
    try:
        _backend._selected = "triton"
        _backend.resolve("test_only_op", torch.device("cpu"))()
        _backend.resolve("test_only_op", torch.device("cuda"))()
        assert calls == ["torch", "triton"]
    finally:
        del _backend._registry["test_only_op"]
