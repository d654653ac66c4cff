"""Compile every hfkern Triton kernel for a GPU architecture on a machine without a GPU.

    python tests/triton/offline_compile.py --arch 90 --arch 80
    python tests/triton/offline_compile.py --arch 90 --first-config --resources
    python tests/triton/offline_compile.py --arch 90 --first-config --float16 first   # the test's run

The interpreter tests check what the kernels compute; this checks that they
compile, for every launch configuration the autotuner may pick, as Triton's
GPU compiler (and ptxas) sees them. A kernel can run in the interpreter and
still be rejected by the compiler (a dot of unsupported shapes, a constexpr
misuse, a type that does not lower), and a config can need more shared memory
than the device has.

How it works:

1. Every module of ``hfkern.triton`` is imported with ``TRITON_INTERPRET`` unset,
   so its kernels are JIT functions as on a GPU. Then ``TRITON_INTERPRET=1`` is
   set, so the launchers take their interpreter paths and accept CPU tensors.
2. ``JITFunction.run`` is replaced by a recorder and each op family's
   ``compile_calls`` (bench/families) call the launchers on small CPU tensors
   covering their code paths (dtypes, layouts, flags): each launch is
   recorded, nothing runs. With every family selected, every autotuned kernel
   must have been launched.
3. Each recorded launch is compiled, for each architecture and each config of
   its autotuner, by ``JITFunction.warmup`` under a stand-in driver that names
   the target. Binding, specialization (pointer alignment, integer
   divisibility) and code generation are Triton's own; identical
   specializations are compiled once.

Exit status 0 when every kernel was launched, everything compiled and every
kernel has at least one config within the device's shared memory; the report
lists failures first.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

if __name__ == "__main__":  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Shared memory per block (opt-in maximum) by compute capability, in bytes.
SMEM_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}


@dataclass
class Launch:
    """One recorded kernel launch: the JIT function, its arguments and its tuner."""

    kernel: Any
    args: tuple
    kwargs: dict
    tuned: Any  # hfkern.triton._common.Tuned, or None for a kernel launched bare
    where: str  # what the driver was doing when it launched

    @property
    def dtype(self) -> str:
        """The dtype of the first floating-point tensor argument (the data), with
        the dot precision of float32 where the kernel takes one (ieee or tf32)."""
        for a in self.args:
            if hasattr(a, "is_floating_point") and a.is_floating_point():
                name = str(a.dtype).removeprefix("torch.")
                bound = dict(zip(self.kernel.arg_names, self.args), **self.kwargs)
                if name == "float32" and "PRECISION" in bound:
                    name += "/" + bound["PRECISION"]
                return name
        return "-"


@dataclass
class Result:
    kernel: str
    arch: int
    config: str
    where: str
    dtype: str
    ok: bool
    seconds: float
    shared: int = 0
    error: str = ""
    regs: int = -1  # registers per thread and stack bytes (spills), with --resources
    stack: int = -1


@dataclass
class Report:
    results: list[Result] = field(default_factory=list)

    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    def unfit(self) -> list[tuple[str, int]]:
        """(kernel, arch) pairs where no compiled config fits the shared memory."""
        fits: dict[tuple[str, int, str], bool] = {}
        for r in self.results:
            if r.ok:
                key = (r.kernel, r.arch, r.where)
                fits[key] = fits.get(key, False) or r.shared <= SMEM_LIMIT.get(r.arch, 101_376)
        return sorted({(k, a) for (k, a, _), ok in fits.items() if not ok})


# ---- a driver that only names a target ----------------------------------------


class _TargetDriver:
    """Enough of a Triton driver for ``JITFunction.warmup``: the current target.

    The device id is the architecture, so each target gets its own kernel cache.
    """

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.arch = arch
        self.target = GPUTarget("cuda", arch, 32)

    def is_active(self) -> bool:
        return True

    def get_current_device(self) -> int:
        return self.arch

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def _target(arch: int) -> Iterator[None]:
    from triton.runtime.driver import driver

    previous = driver._active
    driver.set_active(_TargetDriver(arch))
    try:
        yield
    finally:
        driver._active = previous


# ---- recording launches -------------------------------------------------------


def _import_kernels() -> dict[int, Any]:
    """Import every module of hfkern.triton, its kernels as JIT functions; {id(jit function): Tuned}."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or "triton" in sys.modules:
        raise RuntimeError("import this module before triton, with TRITON_INTERPRET unset")
    import hfkern.triton
    from hfkern.triton import _common

    modules = [importlib.import_module(f"hfkern.triton.{info.name}")
               for info in pkgutil.iter_modules(hfkern.triton.__path__)]
    tuners: dict[int, Any] = {}
    for module in modules:
        for value in vars(module).values():
            for item in value.values() if isinstance(value, dict) else [value]:
                if isinstance(item, _common.Tuned):
                    tuners[id(item.kernel)] = item
    os.environ["TRITON_INTERPRET"] = "1"  # the launchers' paths; the kernels stay compiled
    return tuners


@contextlib.contextmanager
def _recording(tuners: dict[int, Any], launches: list[Launch], where: list[str]) -> Iterator[None]:
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, dict(kwargs), tuners.get(id(self)), where[0]))

    JITFunction.run = record
    try:
        yield
    finally:
        JITFunction.run = original


# ---- the launchers' code paths --------------------------------------------------


def _families() -> dict[str, Any]:
    """The op families that describe launcher calls (bench/families), by name."""
    bench = str(Path(__file__).resolve().parents[2] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import families

    return {name: f for name, f in families.discover().items() if f.compile_calls}


# ---- compiling ----------------------------------------------------------------


def _config_label(config) -> str:
    parts = [f"{k}={v}" for k, v in config.kwargs.items()]
    return ", ".join(parts + [f"warps={config.num_warps}", f"stages={config.num_stages}"])


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) of a kernel's cubin, as
    cuobjdump (shipped with Triton) reports them; a stack means spills."""
    from triton.backends.nvidia import compiler as nv

    tool = Path(nv.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if not m:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {out[-500:]}")
    return int(m.group(1)), int(m.group(2))


def _print_resources(results: list[Result]) -> None:
    """Most registers and stack of each kernel config and data dtype over its
    launches, per arch."""
    rows: dict[tuple, list[int]] = {}
    for r in results:
        if r.ok and r.regs >= 0:
            row = rows.setdefault((r.arch, r.kernel, r.dtype, r.config), [0, 0, 0, 0])
            row[0] = max(row[0], r.regs)
            row[1] = max(row[1], r.stack)
            row[2] = max(row[2], r.shared)
            row[3] += 1
    print(f"{'arch':6s} {'kernel':30s} {'dtype':12s} {'config':52s} {'regs':>4s} {'stack':>6s} "
          f"{'smem':>7s} launches")
    for (arch, kernel, dtype, config), (regs, stack, shared, n) in sorted(rows.items()):
        flag = "  spills" if stack else ""
        print(f"sm_{arch:<3d} {kernel:30s} {dtype:12s} {config:52s} {regs:4d} {stack:6d} {shared:7d} "
              f"{n:4d}{flag}")


def compile_all(launches: list[Launch], archs: list[int], *, first_config: bool, resources: bool,
                log: Callable[[str], None]) -> Report:
    report = Report()
    t_start = time.perf_counter()
    for arch in archs:
        with _target(arch):
            for i, launch in enumerate(launches):
                if i and i % 50 == 0:
                    log(f"sm_{arch}: {i} of {len(launches)} launches, "
                        f"{time.perf_counter() - t_start:.0f} s")
                configs = ([None] if launch.tuned is None else
                           launch.tuned.configs[:1] if first_config else launch.tuned.configs)
                name = launch.kernel.fn.__name__
                for config in configs:
                    # By name: torch's wrap_triton passes every argument positionally.
                    kwargs = dict(zip(launch.kernel.arg_names, launch.args), **launch.kwargs)
                    label = "as launched"
                    if config is not None:
                        for key in launch.tuned.interpret_config.all_kwargs():
                            kwargs.pop(key, None)
                        kwargs.update(config.all_kwargs())
                        label = _config_label(config)
                    t0 = time.perf_counter()
                    try:
                        compiled = launch.kernel.warmup(grid=(1,), **kwargs)
                    except Exception as e:  # noqa: BLE001  (the report lists every failure)
                        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
                        report.results.append(Result(name, arch, label, launch.where, launch.dtype, False,
                                                     time.perf_counter() - t0, error=msg[-2000:]))
                        log(f"FAILED sm_{arch} {name} [{label}] ({launch.where}): {msg[-600:]}")
                        continue
                    regs, stack = _resources(compiled.asm["cubin"]) if resources else (-1, -1)
                    report.results.append(Result(name, arch, label, launch.where, launch.dtype, True,
                                                 time.perf_counter() - t0,
                                                 shared=int(compiled.metadata.shared), regs=regs,
                                                 stack=stack))
    return report


def first_float16(launches: list[Launch]) -> list[Launch]:
    """``launches`` without the float16 launches that a bfloat16 launch mirrors (same kernel,
    same label but for the dtype), except each kernel's first. The kernels load and store
    16-bit data and compute in float32 alike for float16 and bfloat16 (their dots take either
    as 16-bit operands), so the bfloat16 launch compiles the same code path, and the first
    float16 launch compiles the type itself."""
    def twin(launch: Launch) -> tuple[int, str]:
        return id(launch.kernel), launch.where.replace("bfloat16", "*").replace("float16", "*")

    mirrored = {twin(x) for x in launches if x.dtype == "bfloat16"}
    seen: set[int] = set()
    kept = []
    for launch in launches:
        if launch.dtype == "float16" and twin(launch) in mirrored:
            if id(launch.kernel) in seen:
                continue
            seen.add(id(launch.kernel))
        kept.append(launch)
    return kept


def record(tuners: dict[int, Any], families: dict[str, Any], log: Callable[[str], None]) -> list[Launch]:
    """Make the compile calls of ``families`` on CPU tensors and return their recorded launches."""
    import torch

    torch.manual_seed(0)
    launches: list[Launch] = []
    where = [""]
    with _recording(tuners, launches, where):
        for family in families.values():
            for label, call in family.compile_calls():
                where[0] = label
                before = len(launches)
                call()
                if len(launches) == before:
                    raise RuntimeError(f"{label}: no kernel was launched")
    log(f"recorded {len(launches)} launches of "
        f"{len({id(x.kernel) for x in launches})} kernels over {', '.join(families)}")
    return launches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append",
                        help="compute capability as a number (90: H100/H200, 80: A100); repeatable; "
                             "default 90 and 80")
    parser.add_argument("--ops", default=None,
                        help="comma-separated op families (bench/families; default: every one with compile "
                             "calls)")
    parser.add_argument("--first-config", action="store_true",
                        help="compile only the first config of each autotuner (faster)")
    parser.add_argument("--resources", action="store_true",
                        help="print the registers, stack (spills) and shared memory of each kernel "
                             "config, the most over its launches")
    parser.add_argument("--float16", choices=("all", "first"), default="all",
                        help="compile every float16 launch, or only each kernel's first and those no "
                             "bfloat16 launch mirrors (it takes the same code path; faster)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use TRITON_CACHE_DIR as set (default: a fresh temporary cache, so "
                             "everything is compiled)")
    args = parser.parse_args(argv)
    archs = args.arch or [90, 80]
    # Kernels first: the families import hfkern, and Triton must see its kernels
    # defined with TRITON_INTERPRET unset.
    tuners = _import_kernels()
    families = _families()
    ops = [o for o in args.ops.split(",") if o] if args.ops else list(families)
    unknown = sorted(set(ops) - set(families))
    if unknown:
        parser.error(f"unknown ops {unknown}; expected some of {list(families)}")

    cache = None
    if not args.keep_cache:
        cache = tempfile.mkdtemp(prefix="hfkern-triton-cache-")
        os.environ["TRITON_CACHE_DIR"] = cache
    try:
        t0 = time.perf_counter()
        launches = record(tuners, {op: families[op] for op in ops}, print)
        if args.float16 == "first":
            kept = first_float16(launches)
            print(f"--float16 first: {len(launches) - len(kept)} float16 launches left out")
            launches = kept
        # A kernel that no compile call reaches would go unchecked.
        launched = {id(x.kernel) for x in launches}
        missed = sorted(f"{t.kernel.fn.__module__}.{t.kernel.fn.__name__}" for k, t in tuners.items()
                        if k not in launched)
        missed = missed if set(ops) == set(families) else []
        for name in missed:
            print(f"NOT LAUNCHED: {name}: no compile_calls of a family in bench/families reach it")
        report = compile_all(launches, archs, first_config=args.first_config, resources=args.resources,
                             log=print)
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)

    import triton

    compiled = [r for r in report.results if r.ok]
    print(f"triton {triton.__version__}: {len(compiled)} of {len(report.results)} compiles succeeded "
          f"for sm_{', sm_'.join(map(str, archs))} in {time.perf_counter() - t0:.0f} s")
    if args.resources:
        _print_resources(compiled)
    unfit = report.unfit()
    for kernel, arch in unfit:
        print(f"NO CONFIG FITS: {kernel} needs more than sm_{arch}'s {SMEM_LIMIT.get(arch)} bytes "
              f"of shared memory in every config")
    return 0 if not report.failures() and not unfit and not missed else 1


if __name__ == "__main__":
    sys.exit(main())
