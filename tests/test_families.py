"""Every op family's ops, from the samples its descriptor in bench/families gives:
``torch.library.opcheck`` on the torch path, and every other registered backend
that can run here against the torch implementation on the same inputs.

A new family (one module in bench/families with ``samples``) is tested here
without an edit. Without a GPU the triton implementations run in Triton's
interpreter on CPU tensors; it has no bf16 arithmetic, so the samples are
float32.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

import hfkern  # noqa: F401  (registers torch.ops.hfkern.*)
from hfkern import _backend

_BENCH = str(Path(__file__).resolve().parents[1] / "bench")
sys.path.insert(0, _BENCH)
try:
    import families
finally:
    sys.path.remove(_BENCH)

# Other backends register their implementations when their package is imported;
# the parametrization below needs them registered.
_LOAD_ERRORS = {b: _backend._load_package(b) for b in _backend.BACKEND_PACKAGES}

FAMILIES = {name: f for name, f in families.discover().items() if f.samples}
# (family, index of the sample, op name); the inputs are made again in each test
SAMPLES = [(name, i, op) for name, f in FAMILIES.items() for i, (op, _) in enumerate(f.samples("cpu"))]
BACKEND_CASES = [(name, i, op, backend) for name, i, op in SAMPLES
                 for backend in sorted(_backend._registry.get(op, {})) if backend != "torch"]

# rtol, atol by dtype: float32 differs from the torch path only in summation order
TOL = {
    torch.float64: dict(rtol=1e-7, atol=1e-9),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
}


def _sample(family: str, index: int, device) -> tuple[str, tuple]:
    for i, sample in enumerate(FAMILIES[family].samples(device)):
        if i == index:
            return sample
    raise IndexError(f"{family} has no sample {index}")


def _copy(value):
    """A copy of every tensor in ``value`` with the same sizes, strides and offset
    (clone() would make a strided or expanded tensor contiguous)."""
    if isinstance(value, torch.Tensor):
        out = torch.empty(0, dtype=value.dtype, device=value.device)
        out.set_(value.untyped_storage().clone(), value.storage_offset(), value.shape, value.stride())
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _ids(case) -> str:
    return "-".join(map(str, case))


def test_every_family_is_sampled_and_every_backend_package_loads():
    assert SAMPLES, "no family has samples"
    for name in FAMILIES:
        ops = {op for family, _, op in SAMPLES if family == name}
        unknown = sorted(op for op in ops if not hasattr(torch.ops.hfkern, op))
        assert not unknown, f"{name} samples ops that hfkern does not define: {unknown}"
    pytest.importorskip("triton")
    assert _LOAD_ERRORS["triton"] == "", _LOAD_ERRORS["triton"]


@pytest.mark.parametrize("case", SAMPLES, ids=_ids)
def test_opcheck_torch_path(case):
    family, index, op = case
    name, args = _sample(family, index, "cpu")
    assert name == op
    torch.library.opcheck(getattr(torch.ops.hfkern, op).default, args)


def _device(backend: str) -> str:
    """Where ``backend``'s implementations can run in this process, or skip."""
    ok, why = _backend._availability[backend]()
    if ok and torch.cuda.is_available():
        return "cuda"
    if backend == "triton" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "cpu"
    pytest.skip(f"the {backend} backend cannot run here: {why}")


@pytest.fixture
def ieee_fp32():
    # float32 is compared at float32 tolerances, so no TF32 on either side.
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


@pytest.mark.parametrize("case", BACKEND_CASES, ids=_ids)
def test_backend_matches_torch(case, ieee_fp32):
    family, index, op, backend = case
    device = _device(backend)
    _, args = _sample(family, index, device)
    want_args, got_args = _copy(args), _copy(args)
    want = _backend._registry[op]["torch"].load()(*want_args)
    got = _backend._registry[op][backend].load()(*got_args)
    # outputs, then every argument after the call: what an in-place op wrote
    got, want = _tensors(got) + _tensors(got_args), _tensors(want) + _tensors(want_args)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, **TOL.get(w.dtype, {}), equal_nan=True,
                                   msg=lambda m, i=i: f"tensor {i}: {m}")
