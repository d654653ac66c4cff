import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

import hfkern
from hfkern import _backend, _evidence


@pytest.fixture(autouse=True)
def _restore_backend():
    previous = _backend._default, _backend._default_source
    _backend._resolved.clear()
    yield
    _backend._default, _backend._default_source = previous
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
        _backend._default = "torch"
        with pytest.raises(RuntimeError, match="'torch' was requested but has no implementation of hfkern::test_only_op"):
            _backend.resolve("test_only_op", torch.device("cpu"))
        _backend._default = "auto"
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
        _backend._default = "auto"
        _backend.resolve("test_only_op", torch.device("cpu"))()
        _backend.resolve("test_only_op", torch.device("cuda"))()  # auto: cuda is not auto-eligible
        _backend._default = "cuda"
        _backend.resolve("test_only_op", torch.device("cuda"))()
        assert calls == ["torch", "torch", "cuda"]
    finally:
        del _backend._registry["test_only_op"]


def _pretend_evidence(monkeypatch, *records, device="NVIDIA H200"):
    """``auto`` sees ``records`` as the committed evidence, on a CUDA device named ``device``."""
    monkeypatch.setattr(_evidence, "EVIDENCE", tuple(records))
    monkeypatch.setattr(_backend, "_device_name", lambda device_type: device if device_type == "cuda" else "cpu")
    _backend._resolved.clear()


def _record(op="test_only_op", backend="cuda", device="H200"):
    return _evidence.Evidence(op, backend, device, "bench/results/train_h200.json", "ResNet-18 step 1.4x")


def test_auto_passes_over_a_backend_for_dtypes_it_does_not_serve(monkeypatch):
    calls = []
    _backend.register("test_only_op", "torch", lambda: calls.append("torch"))
    _backend.register("test_only_op", "cuda", lambda: calls.append("cuda"),
                      dtypes=(torch.float32, torch.bfloat16))
    monkeypatch.setitem(_backend._availability, "cuda", lambda: (True, "pretend"))
    _pretend_evidence(monkeypatch, _record())
    cuda = torch.device("cuda")
    try:
        _backend._default = "auto"
        _backend.resolve("test_only_op", cuda, torch.float32)()
        _backend.resolve("test_only_op", cuda, torch.float64)()  # not served: the next eligible
        _backend.resolve("test_only_op", cuda, torch.bfloat16)()
        _backend.resolve("test_only_op", cuda)()  # no dtype given: any
        assert calls == ["cuda", "torch", "cuda", "cuda"]
        assert "other dtypes go to the next eligible backend" in hfkern.backend_info()["ops"]["test_only_op"]["cuda"]
        # An explicit request is never redirected: the implementation sees the call.
        _backend._default = "cuda"
        _backend.resolve("test_only_op", cuda, torch.float64)()
        assert calls[-1] == "cuda"
    finally:
        del _backend._registry["test_only_op"]


def test_auto_needs_a_committed_training_step_result(monkeypatch):
    """An auto-eligible GPU implementation is chosen only where a record cites a committed
    training-step result for it on this device class; otherwise auto takes the torch path."""
    calls = []
    _backend.register("test_only_op", "torch", lambda: calls.append("torch"))
    _backend.register("test_only_op", "triton", lambda: calls.append("triton"))
    _backend.register("test_only_op", "cuda", lambda: calls.append("cuda"))
    for name in ("triton", "cuda"):
        monkeypatch.setitem(_backend._availability, name, lambda: (True, "pretend"))
    cuda = torch.device("cuda")
    try:
        _backend._default = "auto"
        for records, expected in (((), "torch"),
                                  ((_record(device="H100"),), "torch"),  # another device class
                                  ((_record(op="other_op"),), "torch"),
                                  ((_record(backend="triton"),), "triton"),
                                  ((_record(backend="triton"), _record()), "cuda")):  # preference order
            _pretend_evidence(monkeypatch, *records)
            _backend.resolve("test_only_op", cuda)()
            assert calls[-1] == expected, records
            why = hfkern.backend_info()["ops"]["test_only_op"]["cuda"]
            if expected == "torch":
                assert "no committed training-step result shows the step faster with cuda or triton on " \
                       "'NVIDIA H200'" in why
            else:
                assert why.startswith(f"{expected} (auto: bench/results/train_h200.json shows the training step "
                                      "faster with it on H200")
            assert hfkern.backend_info()["evidence"] == [dict(vars(r)) for r in records]
        _backend._default = "triton"  # an explicit request needs no evidence
        _backend.resolve("test_only_op", cuda)()
        assert calls[-1] == "triton"
    finally:
        del _backend._registry["test_only_op"]
        _backend._resolved.clear()


def test_auto_says_which_implementations_it_never_chooses(monkeypatch):
    calls = []
    _backend.register("test_only_op", "torch", lambda: calls.append("torch"))
    _backend.register("test_only_op", "cuda", lambda: calls.append("cuda"), auto=False)
    monkeypatch.setitem(_backend._availability, "cuda", lambda: (True, "pretend"))
    _pretend_evidence(monkeypatch, _record())          # evidence does not make it eligible
    try:
        _backend._default = "auto"
        _backend.resolve("test_only_op", torch.device("cuda"))()
        assert calls == ["torch"]
        why = hfkern.backend_info()["ops"]["test_only_op"]["cuda"]
        assert "cuda registered with auto=False (chosen only when requested)" in why, why
    finally:
        del _backend._registry["test_only_op"]
        _backend._resolved.clear()


def test_auto_on_cuda_takes_the_torch_path_for_every_op_without_evidence(monkeypatch):
    _backend._load_packages()
    for name in ("triton", "cuda"):
        monkeypatch.setitem(_backend._availability, name, lambda: (True, "pretend"))
    _pretend_evidence(monkeypatch, *_evidence.EVIDENCE)
    _backend._default = "auto"
    for op, impls in _backend._registry.items():
        if "torch" not in impls:
            continue
        backend, why = _backend._choose(op, "cuda")
        record = next((r for r in _evidence.EVIDENCE if r.op == op and r.backend == backend), None)
        assert backend == "torch" or record is not None, (op, backend, why)


def test_evidence_records_cite_committed_results():
    _backend._load_packages()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for record in _evidence.EVIDENCE:
        assert record.backend in ("triton", "cuda"), record
        assert record.backend in _backend._registry.get(record.op, {}), record
        assert _backend._registry[record.op][record.backend].auto, record  # numerically eligible too
        assert record.result.startswith("bench/results/") and os.path.isfile(os.path.join(root, record.result))


def test_auto_logs_choice_once(caplog):
    _backend._logged_auto.clear()
    _backend._resolved.clear()
    _backend._default = "auto"
    with caplog.at_level(logging.DEBUG, logger="hfkern"):
        for _ in range(3):
            _backend.resolve("array_conv", torch.device("cpu"))
    msgs = [r.getMessage() for r in caplog.records if "array_conv" in r.getMessage()]
    assert len(msgs) == 1 and "torch backend" in msgs[0]


def _import_hfkern(value, code="import hfkern"):
    import os
    env = {k: v for k, v in os.environ.items() if k != "HFKERN_BACKEND"}
    if value is not None:
        env["HFKERN_BACKEND"] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


_SHOW = "import hfkern; print(hfkern.get_backend(), hfkern.backend_info()['source'])"


def test_environment_variable_selects():
    done = _import_hfkern("torch", _SHOW)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torch", "HFKERN_BACKEND"]
    done = _import_hfkern("", _SHOW)  # set to nothing: as unset
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["auto", "default"]


def test_environment_variable_is_validated_at_import_like_set_backend():
    # What set_backend says, with the variable named, raised by the import itself.
    with pytest.raises(ValueError) as bad_name:
        hfkern.set_backend("foo")
    done = _import_hfkern("foo")
    expected = str(bad_name.value).replace("backend must", "HFKERN_BACKEND must", 1)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == f"ValueError: {expected}"
    for name in ("cuda", "triton"):
        ok, _ = _backend._availability[name]()
        if ok:
            continue
        with pytest.raises(RuntimeError) as unavailable:
            hfkern.set_backend(name)
        done = _import_hfkern(name)
        assert done.returncode != 0
        assert done.stderr.strip().splitlines()[-1] == (
            f"RuntimeError: HFKERN_BACKEND={name!r}: {unavailable.value}"
        )


def test_set_backend_rejects_non_strings():
    with pytest.raises(TypeError, match="backend must be a str.*got int 1"):
        hfkern.set_backend(1)
    with pytest.raises(TypeError, match="backend must be a str.*got NoneType None"):
        with hfkern.use_backend(None):
            pass


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
        _backend._default = "torch"
        assert _backend.resolve("test_only_op", torch.device("cpu"))(16.0) == 4.0
    finally:
        del _backend._registry["test_only_op"]


def test_cpu_tensors_take_the_torch_path_under_gpu_backends(monkeypatch):
    calls = []
    _backend.register("test_only_op", "torch", lambda: calls.append("torch"))
    _backend.register("test_only_op", "triton", lambda: calls.append("triton"), device_types=("cuda",))
    monkeypatch.setitem(_backend._availability, "triton", lambda: (True, "pretend"))
    try:
        _backend._default = "triton"
        _backend.resolve("test_only_op", torch.device("cpu"))()
        _backend.resolve("test_only_op", torch.device("cuda"))()
        assert calls == ["torch", "triton"]
    finally:
        del _backend._registry["test_only_op"]


# ---- per-context selection ---------------------------------------------------

@pytest.fixture
def torch_and_pretend_cuda(monkeypatch):
    """A test-only op served by torch and by a pretend-available cuda backend."""
    _backend.register("test_only_op", "torch", lambda: "torch")
    _backend.register("test_only_op", "cuda", lambda: "cuda", auto=False)
    monkeypatch.setitem(_backend._availability, "cuda", lambda: (True, "pretend"))
    yield torch.device("cuda")
    del _backend._registry["test_only_op"]


def test_use_backend_is_per_thread(torch_and_pretend_cuda):
    device = torch_and_pretend_cuda
    _backend._default = "auto"
    both_inside = threading.Barrier(2, timeout=10)
    torch_left = threading.Event()
    seen, errors = {}, []

    def worker(name):
        try:
            with hfkern.use_backend(name):
                both_inside.wait()
                seen[name] = (hfkern.get_backend(), _backend.resolve("test_only_op", device)())
                both_inside.wait()
                if name == "cuda":  # leave in the order that would restore the wrong one
                    torch_left.wait(10)
            if name == "torch":
                torch_left.set()
            seen[name + " after"] = hfkern.get_backend()
        except Exception as e:  # noqa: BLE001  (re-raised in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("torch", "cuda")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert seen == {"torch": ("torch", "torch"), "cuda": ("cuda", "cuda"),
                    "torch after": "auto", "cuda after": "auto"}
    assert hfkern.get_backend() == "auto"


def test_threads_see_the_process_default_not_another_threads_block(torch_and_pretend_cuda):
    device = torch_and_pretend_cuda
    hfkern.set_backend("torch")
    seen = []
    with hfkern.use_backend("cuda"):
        assert _backend.resolve("test_only_op", device)() == "cuda"
        t = threading.Thread(target=lambda: seen.append(
            (hfkern.get_backend(), _backend.resolve("test_only_op", device)())))
        t.start()
        t.join(10)
        hfkern.set_backend("auto")  # the process default changes; the block still wins here
        assert hfkern.get_backend() == "cuda"
    assert seen == [("torch", "torch")]
    assert hfkern.get_backend() == "auto" and hfkern.backend_info()["source"] == "set_backend"
    with hfkern.use_backend("torch"):
        assert hfkern.backend_info()["source"] == "use_backend"


# The ops whose backend a backward must follow, and a pretend "cuda" backend
# serving them on CPU tensors with spies of their torch implementations.
_FORWARD_OPS = ("array_conv", "array_layer_norm", "array_rms_norm", "array_embedding")
_BACKWARD_OPS = ("array_conv_input_grad", "array_conv_weight_grad", "array_layer_norm_backward",
                 "array_rms_norm_backward", "array_embedding_backward")


@pytest.fixture
def pretend_cuda_on_cpu(monkeypatch):
    ran = []
    monkeypatch.setitem(_backend._availability, "cuda", lambda: (True, "pretend"))
    # CPU tensors otherwise always take the torch path under a GPU backend.
    monkeypatch.setattr(_backend, "_GPU_BACKENDS", ("triton",))
    for op in _FORWARD_OPS + _BACKWARD_OPS:
        impl = _backend._registry[op]["torch"].load()

        def spy(*args, _op=op, _impl=impl):
            ran.append(_op)
            return _impl(*args)

        _backend.register(op, "cuda", spy, device_types=("cpu",), auto=False)
    yield ran
    for op in _FORWARD_OPS + _BACKWARD_OPS:
        del _backend._registry[op]["cuda"]
    _backend._resolved.clear()


def _forward_every_family():
    from hfkern.ops.conv import array_conv
    from hfkern.ops.embedding import array_embedding
    from hfkern.ops.layer_norm import array_layer_norm, array_rms_norm

    x = torch.randn(2, 3, 2, 5, 5, requires_grad=True)
    w = torch.randn(2, 4, 2, 3, 3, requires_grad=True)
    table = torch.randn(2, 7, 3, requires_grad=True)
    y = array_conv(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)  # [2, 3, 4, 3, 3]
    y = array_layer_norm(y, None, None, 2, 1e-5)[0]
    y = array_rms_norm(y, None, 1, 1e-5)[0]
    e = array_embedding(table, torch.randint(0, 7, (2, 3, 4, 3)))
    return (y * e).sum(), [x, w, table]


@pytest.mark.parametrize("where", ["after_the_block", "on_another_thread"])
def test_backward_runs_on_the_backend_of_its_forward(pretend_cuda_on_cpu, where):
    ran = pretend_cuda_on_cpu
    with hfkern.use_backend("cuda"):
        loss, leaves = _forward_every_family()
    assert ran == list(_FORWARD_OPS)
    ran.clear()
    if where == "after_the_block":
        torch.autograd.grad(loss, leaves)
    else:  # a thread with a selection of its own
        errors = []

        def backward():
            try:
                with hfkern.use_backend("torch"):
                    torch.autograd.grad(loss, leaves)
            except Exception as e:  # noqa: BLE001  (re-raised in the main thread)
                errors.append(e)

        t = threading.Thread(target=backward)
        t.start()
        t.join(60)
        assert not errors, errors
    assert sorted(ran) == sorted(_BACKWARD_OPS)

    # and the other way round: a torch forward keeps its torch backward
    ran.clear()
    loss, leaves = _forward_every_family()
    with hfkern.use_backend("cuda"):
        torch.autograd.grad(loss, leaves)
    assert ran == []


def test_double_backward_runs_on_the_backend_of_its_forward(pretend_cuda_on_cpu):
    from hfkern.ops.conv import array_conv

    ran = pretend_cuda_on_cpu
    x = torch.randn(2, 3, 2, 5, 5, requires_grad=True)
    w = torch.randn(2, 4, 2, 3, 3, requires_grad=True)
    with hfkern.use_backend("cuda"):
        y = array_conv(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    ran.clear()
    gx.square().sum().backward()
    # input_grad's adjoints: a conv (for grad_out) and a weight gradient (for w)
    assert "array_conv" in ran and "array_conv_weight_grad" in ran
    assert w.grad is not None


def test_import_hfkern_does_not_import_triton():
    # Kernel packages load when a backend is first considered for a CUDA tensor.
    # (torch itself may import triton when a custom op first runs; hfkern.triton
    # must still stay unloaded for CPU tensors.)
    code = ("import sys, torch, hfkern\n"
            "loaded = [m for m in ('triton', 'hfkern.triton') if m in sys.modules]\n"
            "assert not loaded, loaded\n"
            "hfkern.nn.LayerNorm(4, B=2)(torch.randn(2, 3, 4))\n"
            "assert 'hfkern.triton' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture
def pretend_backend_package(tmp_path, monkeypatch):
    """A package of backend modules that register themselves, as hfkern/triton's do."""
    pkg = tmp_path / "pretend_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_shared.py").write_text("raise AssertionError('underscore modules are not family modules')\n")
    (pkg / "family_a.py").write_text(
        "from hfkern import _backend\n"
        "@_backend.implements('test_only_op', 'cuda', device_types=('cpu',), auto=False)\n"
        "def impl():\n"
        "    return 'family_a'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(_backend.BACKEND_PACKAGES, "cuda", "pretend_kernels")
    monkeypatch.delitem(_backend._packages, "cuda", raising=False)
    _backend.register("test_only_op", "torch", lambda: "torch")
    yield
    del _backend._registry["test_only_op"]
    _backend._packages.pop("cuda", None)
    sys.modules.pop("pretend_kernels.family_a", None)
    sys.modules.pop("pretend_kernels", None)


def test_backend_modules_register_themselves_when_first_considered(pretend_backend_package, monkeypatch):
    assert "cuda" not in _backend._registry["test_only_op"]
    monkeypatch.setitem(_backend._availability, "cuda", lambda: (_backend._load_package("cuda") == "", "pretend"))
    monkeypatch.setattr(_backend, "_GPU_BACKENDS", ())  # let the pretend backend serve CPU tensors
    assert _backend.resolve("test_only_op", torch.device("cpu"))() == "torch"  # auto: not eligible
    with hfkern.use_backend("cuda"):
        assert _backend.resolve("test_only_op", torch.device("cpu"))() == "family_a"
    assert _backend._packages["cuda"] == ""


def test_a_broken_backend_package_is_unavailable_with_its_reason(pretend_backend_package, tmp_path):
    (tmp_path / "pretend_kernels" / "family_b.py").write_text("import a_module_that_does_not_exist\n")
    reason = _backend._load_package("cuda")
    assert "pretend_kernels could not be imported" in reason and "a_module_that_does_not_exist" in reason
    ok, why = _backend._cuda_available()
    assert not ok and why == reason


# ---- per-op choices ------------------------------------------------------------------

def test_per_op_choices_canonical_string_round_trips():
    hfkern.set_backend("Torch", ops={"hfkern::sgd_step_": "auto", "adam_step_": "AUTO", "array_conv": "torch"})
    assert hfkern.get_backend() == "torch,adam_step_=auto,sgd_step_=auto"  # sorted; same-as-base dropped
    assert hfkern.backend_info()["requested"] == hfkern.get_backend()
    again = hfkern.get_backend()
    hfkern.set_backend(again)
    assert hfkern.get_backend() == again
    with hfkern.use_backend(" auto , array_conv = torch"):
        assert hfkern.get_backend() == "auto,array_conv=torch"
        assert hfkern.backend_info()["source"] == "use_backend"
    assert hfkern.get_backend() == again
    hfkern.set_backend("auto", ops={"array_conv": "auto"})
    assert hfkern.get_backend() == "auto"


def test_per_op_choices_resolve_per_op(monkeypatch):
    calls = []
    for op in ("test_only_op", "test_other_op"):
        _backend.register(op, "torch", lambda op=op: calls.append((op, "torch")))
        _backend.register(op, "cuda", lambda op=op: calls.append((op, "cuda")))
    monkeypatch.setitem(_backend._availability, "cuda", lambda: (True, "pretend"))
    cuda = torch.device("cuda")
    try:
        with hfkern.use_backend("torch", ops={"test_only_op": "cuda"}):
            _backend.resolve("test_only_op", cuda)()
            _backend.resolve("test_other_op", cuda)()
            assert _backend.current("test_only_op", cuda) == "cuda"
            info = hfkern.backend_info()["ops"]
            assert info["test_only_op"]["cuda"].startswith("cuda (requested explicitly")
            assert info["test_other_op"]["cuda"].startswith("torch (requested explicitly")
            _backend.resolve("test_only_op", torch.device("cpu"))()  # CPU tensors: the torch path
        with hfkern.use_backend("cuda", ops={"test_only_op": "torch"}):
            _backend.resolve("test_only_op", cuda)()
            _backend.resolve("test_other_op", cuda)()
        _backend.resolve("test_only_op", cuda)()  # outside: the default (auto, no evidence: torch)
        assert calls == [("test_only_op", "cuda"), ("test_other_op", "torch"), ("test_only_op", "torch"),
                         ("test_only_op", "torch"), ("test_other_op", "cuda"), ("test_only_op", "torch")]
        # A per-op auto is auto's rule for that op, evidence included.
        _pretend_evidence(monkeypatch, _record())
        with hfkern.use_backend("torch", ops={"test_only_op": "auto"}):
            _backend.resolve("test_only_op", cuda)()
            _backend.resolve("test_other_op", cuda)()
        assert calls[-2:] == [("test_only_op", "cuda"), ("test_other_op", "torch")]
    finally:
        for op in ("test_only_op", "test_other_op"):
            del _backend._registry[op]
        _backend._resolved.clear()


@pytest.mark.parametrize("name, ops, error, match", [
    ("torch,nope=torch", None, ValueError, r"backend: no hfkern op 'nope'; forward ops: \[.*'adam_step_'"),
    ("torch", {"nope": "torch"}, ValueError, r"ops: no hfkern op 'nope'"),
    ("torch,array_conv_input_grad=torch", None, ValueError,
     "hfkern::array_conv_input_grad runs on the backend its forward op ran"),
    ("torch", {"array_batch_norm_backward": "torch"}, ValueError, "runs on the backend its forward op ran"),
    ("torch,adam_step_", None, ValueError, "expected per-op choices as op=backend after the backend, got 'adam_step_'"),
    ("torch,adam_step_=cudnn", None, ValueError, r"backend for adam_step_ must be one of .*got 'cudnn'"),
    ("torch", {"adam_step_": 3}, TypeError, "backend for adam_step_ must be a str.*got int 3"),
    ("torch", {3: "torch"}, TypeError, "expected op names as str, got int 3"),
    ("torch", [("adam_step_", "torch")], TypeError, "ops must be a mapping of op names to backends, got list"),
    ("cudnn,adam_step_=torch", None, ValueError, r"backend must be one of .*got 'cudnn'"),
])
def test_per_op_choices_are_validated_before_anything_changes(name, ops, error, match):
    before = hfkern.get_backend()
    with pytest.raises(error, match=match):
        hfkern.set_backend(name, ops=ops)
    with pytest.raises(error, match=match):
        with hfkern.use_backend(name, ops=ops):
            pass
    assert hfkern.get_backend() == before


def test_per_op_choice_of_a_backend_without_the_op(monkeypatch):
    _backend.register("test_only_op", "torch", lambda: None)
    monkeypatch.setitem(_backend._availability, "cuda", lambda: (True, "pretend"))
    try:
        with pytest.raises(ValueError, match=r"hfkern backend 'cuda' has no implementation of "
                                             r"hfkern::test_only_op; registered: \['torch'\]"):
            hfkern.set_backend("torch", ops={"test_only_op": "cuda"})
    finally:
        del _backend._registry["test_only_op"]


def test_per_op_choice_of_an_unavailable_backend():
    for name in ("cuda", "triton"):
        ok, reason = _backend._availability[name]()
        if ok:
            continue
        with pytest.raises(RuntimeError, match=f"backend for sgd_step_={name!r}: hfkern backend {name!r} "
                                               "is not available"):
            hfkern.set_backend("torch", ops={"sgd_step_": name})


def test_environment_variable_takes_per_op_choices():
    done = _import_hfkern("torch, sgd_step_=auto", _SHOW)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torch,sgd_step_=auto", "HFKERN_BACKEND"]
    done = _import_hfkern("torch,array_conv_weight_grad=torch")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "ValueError: HFKERN_BACKEND: hfkern::array_conv_weight_grad runs on the backend its forward op ran; "
        "choose the backend of the forward op instead")


def test_per_op_choice_reaches_the_eager_paths():
    # CPU: every choice serves through the torch path, but a per-op "auto" must leave the
    # op's eager path on (it asks the same registry) and the results unchanged.
    from hfkern.ops import conv as conv_ops

    x = torch.randn(2, 3, 4, 5, 5)
    w = torch.randn(2, 6, 4, 3, 3)
    with hfkern.use_backend("torch", ops={"array_conv": "auto"}):
        assert _backend.eager_torch("array_conv", x.device)
        y = conv_ops.conv(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    torch.testing.assert_close(y, conv_ops.array_conv(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
