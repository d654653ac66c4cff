"""Loading the compiled extensions and what they were built for.

``load()`` gives ``hfkern._C`` (or, with ``emulated=True``, ``hfkern._C_emu``)
after checking that it was built from the same table layout as this Python
code; ``availability()`` says whether the CUDA backend can serve the current
device, and why not.
"""

from __future__ import annotations

import functools
import importlib
import re
from types import ModuleType

import torch

from .. import _multi_tensor as mt
from .._optim_specs import OPTIMIZER_SPECS

__all__ = ["DTYPE_CODES", "load", "architectures", "covering", "availability", "stream"]

# Element-type codes of the binding (csrc/include/hfkern/dtype_code.h).
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}

# What the binding's TILE_COLUMNS, ADDRESS_COLUMNS and MAX_GRAD_DIMS must say
# (csrc/include/hfkern/multi_tensor_step.h).
_TILE_COLUMNS = {
    "tensor": mt.COL_TENSOR, "model": mt.COL_MODEL, "offset": mt.COL_OFFSET, "grad": mt.COL_GRAD,
    "start": mt.COL_START, "length": mt.COL_LEN, "step": mt.COL_STEP, "gather": mt.COL_GATHER,
    "first": mt.COL_FIRST, "tiles": mt.COL_TILES, "columns": mt.COLS,
}
_ADDRESS_COLUMNS = {
    "param": mt.ADDR_P, "grad": mt.ADDR_G, "state0": mt.ADDR_S0, "state1": mt.ADDR_S1, "state2": mt.ADDR_S2,
    "step": mt.ADDR_STEP, "aligned": mt.ADDR_ALIGNED, "columns": mt.ADDR_COLS,
}

_BUILD_HINT = (
    "build it from a source checkout with nvcc on the PATH: HFKERN_BUILD_CUDA=1 pip install "
    "--no-build-isolation -e . (README.md, 'Building wheels for your GPUs')"
)


@functools.cache
def load(emulated: bool = False) -> ModuleType:
    """``hfkern._C`` (``hfkern._C_emu`` with ``emulated``); ImportError when it is not
    built, RuntimeError when it was built from other sources than this package."""
    name = "hfkern._C_emu" if emulated else "hfkern._C"
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        what = "HFKERN_BUILD_EMU=1" if emulated else "HFKERN_BUILD_CUDA=1"
        raise ImportError(f"the compiled extension {name} could not be loaded ({e}); "
                          + _BUILD_HINT.replace("HFKERN_BUILD_CUDA=1", what)) from e
    built = (dict(getattr(module, "TILE_COLUMNS", {})), dict(getattr(module, "ADDRESS_COLUMNS", {})),
             getattr(module, "MAX_GRAD_DIMS", None))
    expected = (_TILE_COLUMNS, _ADDRESS_COLUMNS, mt.MAX_GRAD_DIMS)
    if built != expected:
        raise RuntimeError(
            f"{name} was built from other sources than this hfkern: its tile columns, address columns "
            f"and gather dims are {built}, expected {expected}; rebuild it"
        )
    rows = {spec.name: spec.rows for spec in OPTIMIZER_SPECS}
    for opt, built in dict(module.OPTIMIZER_ROWS).items():
        if tuple(built) != rows.get(opt):
            raise RuntimeError(
                f"{name} reads the hyperparameter rows {tuple(built)} for {opt}, but hfkern._optim_specs "
                f"declares {rows.get(opt)}; rebuild it"
            )
    return module


def architectures(spec: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(sass, ptx)``: the compute capabilities (``90`` for sm_90) a
    ``CMAKE_CUDA_ARCHITECTURES`` string such as ``"80-real;90"`` builds machine code
    and PTX for (a bare entry builds both)."""
    sass: list[int] = []
    ptx: list[int] = []
    for entry in filter(None, re.split(r"[;,\s]+", spec)):
        m = re.fullmatch(r"(\d+)(?:-(real|virtual))?", entry)
        if m is None:
            raise ValueError(f"unexpected CUDA architecture entry {entry!r} in {spec!r}")
        arch, kind = int(m.group(1)), m.group(2)
        if kind != "virtual":
            sass.append(arch)
        if kind != "real":
            ptx.append(arch)
    return tuple(sorted(set(sass))), tuple(sorted(set(ptx)))


def covering(capability: tuple[int, int], sass: tuple[int, ...], ptx: tuple[int, ...]) -> str | None:
    """What in a build runs on a device of ``capability`` (major, minor): machine code
    of the same major version and a minor version no newer than the device's, else
    PTX of a version no newer than the device's (compiled by the driver on first
    use); None when nothing does."""
    major, minor = capability
    cc = major * 10 + minor
    fits = [a for a in sass if a // 10 == major and a % 10 <= minor]
    if fits:
        return f"SASS sm_{max(fits)}"
    jit = [a for a in ptx if a <= cc]
    if jit:
        return f"PTX compute_{max(jit)} (compiled by the driver on first use)"
    return None


def _describe(sass: tuple[int, ...], ptx: tuple[int, ...]) -> str:
    parts = []
    if sass:
        parts.append("SASS " + ", ".join(f"sm_{a}" for a in sass))
    if ptx:
        parts.append("PTX " + ", ".join(f"compute_{a}" for a in ptx))
    return "; ".join(parts) or "no architecture"


def build_info() -> dict:
    """The compiled architectures and whether the current device is covered:
    ``{"sass": [...], "ptx": [...], "device": "sm_90" | None, "covered_by": str | None}``
    (empty when ``hfkern._C`` is not built)."""
    try:
        module = load()
    except (ImportError, RuntimeError):
        return {}
    sass, ptx = architectures(module.CUDA_ARCHITECTURES)
    info: dict = {"sass": list(sass), "ptx": list(ptx), "device": None, "covered_by": None}
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        info["device"] = f"sm_{cap[0]}{cap[1]}"
        info["covered_by"] = covering(cap, sass, ptx)
    return info


def availability() -> tuple[bool, str]:
    """(available, reason) of the CUDA backend for the current device."""
    try:
        module = load()
    except (ImportError, RuntimeError) as e:
        return False, str(e)
    sass, ptx = architectures(module.CUDA_ARCHITECTURES)
    built = f"hfkern._C ({_describe(sass, ptx)})"
    runtime = module.runtime_info()
    if runtime["error"]:
        return False, f"{built}: its CUDA runtime cannot reach a device: {runtime['error']}"
    if not torch.cuda.is_available():
        return False, f"{built}: torch.cuda.is_available() is False"
    cap = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    by = covering(cap, sass, ptx)
    if by is None:
        return False, (
            f"{built} has no code for {name} (sm_{cap[0]}{cap[1]}); rebuild it for this device, "
            f"e.g. HFKERN_CUDA_ARCHS={cap[0]}{cap[1]}"
        )
    version = runtime["runtime_version"]
    return True, f"{built}, CUDA runtime {version // 1000}.{version % 1000 // 10}, on {name} via {by}"


def stream(device: torch.device) -> int:
    """The handle of torch's current stream on ``device`` (0 for a CPU tensor: the emulator)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.current_stream(device).cuda_stream
