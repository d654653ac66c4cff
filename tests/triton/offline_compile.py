"""Compile every hfkern Triton kernel for a GPU architecture on a machine without a GPU.

    python tests/triton/offline_compile.py --arch 90 --arch 80
    python tests/triton/offline_compile.py --arch 90 --first-config --resources

The interpreter tests check what the kernels compute; this checks that they
compile, for every launch configuration the autotuner may pick, as Triton's
GPU compiler (and ptxas) sees them. A kernel can run in the interpreter and
still be rejected by the compiler (a dot of unsupported shapes, a constexpr
misuse, a type that does not lower), and a config can need more shared memory
than the device has.

How it works:

1. ``hfkern.triton`` is imported with ``TRITON_INTERPRET`` unset, so its kernels
   are JIT functions as on a GPU. Then ``TRITON_INTERPRET=1`` is set, so the
   launchers take their interpreter paths and accept CPU tensors.
2. ``JITFunction.run`` is replaced by a recorder and the launchers are called
   on small CPU tensors covering their code paths (dtypes, layouts, flags):
   each launch is recorded, nothing runs.
3. Each recorded launch is compiled, for each architecture and each config of
   its autotuner, by ``JITFunction.warmup`` under a stand-in driver that names
   the target. Binding, specialization (pointer alignment, integer
   divisibility) and code generation are Triton's own; identical
   specializations are compiled once.

Exit status 0 when everything compiled and every kernel has at least one
config within the device's shared memory; the report lists failures first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
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
    """Import hfkern.triton's kernels as JIT functions; {id(jit function): Tuned}."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or "triton" in sys.modules:
        raise RuntimeError("import this module before triton, with TRITON_INTERPRET unset")
    from hfkern.triton import _common, conv, embedding, layer_norm, optim

    tuners: dict[int, Any] = {}
    for module in (conv, embedding, layer_norm, optim):
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


def _conv_calls(torch) -> Iterator[tuple[str, Callable[[], Any]]]:
    from hfkern.triton import conv

    B, N = 3, 2

    def case(nd, transposed, groups, shared, dtype, *, ci=4, co=6, stride=2, dilation=1, padding=1):
        sp = (7, 6)[-nd:]
        k = (3, 2)[-nd:]
        x = (torch.randn(N, ci, *sp, dtype=dtype) if shared
             else torch.randn(N, B, ci, *sp, dtype=dtype).transpose(0, 1))
        w = (torch.randn(B, ci, co // groups, *k, dtype=dtype) if transposed
             else torch.randn(B, co, ci // groups, *k, dtype=dtype))
        geom = ([stride] * nd, [padding] * nd, [dilation] * nd, transposed,
                [1 if transposed and stride > 1 else 0] * nd, groups)
        return x, w, torch.randn(B, co, dtype=dtype), geom

    variants = [
        # nd, transposed, groups, shared, stride, dilation
        (2, False, 1, False, 1, 1),
        (2, False, 2, False, 2, 2),
        (2, False, 1, True, 1, 1),  # shared input, groups 1: B weights folded into one GEMM
        (2, False, 2, True, 2, 1),
        (2, True, 1, False, 2, 1),  # phased
        (2, True, 2, False, 2, 2),  # transposed, dilated: masked taps
        (2, True, 1, True, 1, 1),
        (1, False, 1, False, 2, 1),
    ]
    torch.backends.cudnn.allow_tf32 = False  # fp32 as IEEE here; TF32 in the last case
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for nd, transposed, groups, shared, stride, dilation in variants:
            x, w, b, geom = case(nd, transposed, groups, shared, dtype, stride=stride, dilation=dilation)
            name = f"conv{nd}d{' transposed' if transposed else ''} g{groups}{' shared' if shared else ''} " \
                   f"s{stride} d{dilation} {dtype}"

            def calls(x=x, w=w, b=b, geom=geom):
                y = conv.array_conv(x, w, b, *geom)
                conv.array_conv_input_grad(torch.randn_like(y), w, list(x.shape), *geom)
                conv.array_conv_weight_grad(torch.randn_like(y), x, w, *geom)

            yield name, calls
    # fp32 with TF32 allowed (torch's default for convolutions)
    x, w, b, geom = case(2, False, 1, False, torch.float32)

    def tf32():
        before = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = True
        try:
            conv.array_conv(x, w, b, *geom)
        finally:
            torch.backends.cudnn.allow_tf32 = before

    yield "conv2d tf32", tf32


def _layer_norm_calls(torch) -> Iterator[tuple[str, Callable[[], Any]]]:
    from hfkern.triton import layer_norm as ln

    B = 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        # a short row held whole, and one long enough to be swept in blocks
        for D in (48, 20_000):
            x = torch.randn(B, 5, D, dtype=dtype)
            w = torch.randn(B, D, dtype=dtype)
            b = torch.randn(B, D, dtype=dtype)
            for rms in (False, True):
                for affine in (True, False):
                    def calls(x=x, w=w if affine else None, b=b if affine else None, rms=rms):
                        gy = torch.randn_like(x)
                        if rms:
                            y, rstd = ln.array_rms_norm(x, w, 1, 1e-5)
                            for mask in ([True, True], [False, True], [True, False]):
                                ln.array_rms_norm_backward(gy, x, w, rstd, 1, mask)
                        else:
                            y, mean, rstd = ln.array_layer_norm(x, w, b, 1, 1e-5)
                            for mask in ([True, True, True], [False, True, True], [True, False, False]):
                                ln.array_layer_norm_backward(gy, x, w, mean, rstd, 1, mask)

                    yield f"{'rms' if rms else 'layer'} norm D={D}{' affine' if affine else ''} {dtype}", calls
    # a transposed layout ([N, B, D] memory) and a 2-D normalized shape
    x = torch.randn(5, B, 8, 6).transpose(0, 1)
    yield "layer norm strided, 2-D shape", lambda: ln.array_layer_norm(x, torch.randn(B, 8, 6), None, 2, 1e-5)


def _embedding_calls(torch) -> Iterator[tuple[str, Callable[[], Any]]]:
    from hfkern.triton import embedding as emb

    B, V = 3, 50
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for D in (24, 1000):
            w = torch.randn(B, V, D, dtype=dtype)
            for idx_dtype in (torch.int64, torch.int32):
                for shared in (False, True):
                    # more hits per model than a chunk: rows of V=50 repeat past it
                    shape = (5, 30)
                    idx = torch.randint(0, V, (1 if shared else B, *shape), dtype=idx_dtype)
                    idx[..., :20] = 7
                    idx = idx.expand(B, *shape)

                    def calls(w=w, idx=idx, D=D, shape=shape):
                        emb.array_embedding(w, idx)
                        gy = torch.randn(B, *shape, D, dtype=w.dtype)
                        for scale in (False, True):
                            emb.array_embedding_backward(gy, idx, V, 3, scale)

                    yield f"embedding D={D} {idx_dtype}{' shared' if shared else ''} {dtype}", calls


def _optim_calls(torch) -> Iterator[tuple[str, Callable[[], Any]]]:
    from hfkern.triton import optim

    B = 3
    flag_sets = {
        "sgd": [dict(nesterov=n, maximize=m, has_weight_decay=wd, momentum=mo)
                for n, m, wd, mo in [(False, False, False, False), (False, False, True, True),
                                     (True, True, True, True)]],
        "adam": [dict(amsgrad=a, maximize=m, decoupled_weight_decay=d, has_weight_decay=wd)
                 for a, m, d, wd in [(False, False, False, False), (True, True, False, True),
                                     (False, False, True, True)]],
        "adagrad": [dict(maximize=m, has_weight_decay=wd) for m, wd in [(False, False), (True, True)]],
        "adadelta": [dict(maximize=m, has_weight_decay=wd) for m, wd in [(False, False), (True, True)]],
        "rmsprop": [dict(centered=c, maximize=m, has_weight_decay=wd, momentum=mo)
                    for c, m, wd, mo in [(False, False, False, False), (True, True, True, True)]],
    }
    rows = {"sgd": 4, "adam": 5, "adagrad": 4, "adadelta": 4, "rmsprop": 5}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        state = torch.float64 if dtype == torch.float64 else torch.float32
        for name, flag_list in flag_sets.items():
            for flags in flag_list:
                for skip in (None, torch.zeros(B, dtype=torch.bool)):
                    params = [torch.randn(B, 37, 11, dtype=dtype), torch.randn(B, dtype=dtype)]
                    grads = [torch.randn_like(p) for p in params]
                    zeros = lambda: [torch.zeros_like(p, dtype=state) for p in params]  # noqa: E731
                    steps = [torch.zeros(B) for _ in params]
                    hypers = torch.rand(rows[name], B, dtype=state)
                    f = dict(flags)
                    momentum = f.pop("momentum", None)
                    if name == "sgd":
                        args = (params, grads, zeros() if momentum else [], steps if momentum else [], hypers)
                    elif name == "adam":
                        args = (params, grads, zeros(), zeros(), zeros() if f["amsgrad"] else [], steps, hypers)
                    elif name == "adagrad":
                        args = (params, grads, zeros(), steps, hypers)
                    elif name == "adadelta":
                        args = (params, grads, zeros(), zeros(), steps, hypers)
                    else:
                        args = (params, grads, zeros(), zeros() if f["centered"] else [],
                                zeros() if momentum else [], steps, hypers)
                    step = getattr(optim, f"{name}_step_")

                    def calls(step=step, args=args, f=f, skip=skip):
                        step(*args, *f.values(), skip)

                    label = ",".join(k for k, v in flags.items() if v) or "plain"
                    yield f"{name} [{label}]{' skip' if skip is not None else ''} {dtype}", calls
        yield f"nonfinite_models {dtype}", lambda dtype=dtype: optim.nonfinite_models(
            [torch.randn(B, 37, 11, dtype=dtype), torch.randn(B, dtype=dtype)])


DRIVERS = {"conv": _conv_calls, "layer_norm": _layer_norm_calls, "embedding": _embedding_calls,
           "optim": _optim_calls}


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


def record(ops: list[str], log: Callable[[str], None]) -> list[Launch]:
    """Call the launchers of ``ops`` on CPU tensors and return their recorded launches."""
    tuners = _import_kernels()
    import torch

    torch.manual_seed(0)
    launches: list[Launch] = []
    where = [""]
    with _recording(tuners, launches, where):
        for op in ops:
            for label, call in DRIVERS[op](torch):
                where[0] = label
                before = len(launches)
                call()
                if len(launches) == before:
                    raise RuntimeError(f"{label}: no kernel was launched")
    log(f"recorded {len(launches)} launches of "
        f"{len({id(x.kernel) for x in launches})} kernels over {', '.join(ops)}")
    return launches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append",
                        help="compute capability as a number (90: H100/H200, 80: A100); repeatable; "
                             "default 90 and 80")
    parser.add_argument("--ops", default=",".join(DRIVERS), help="comma-separated: " + ", ".join(DRIVERS))
    parser.add_argument("--first-config", action="store_true",
                        help="compile only the first config of each autotuner (faster)")
    parser.add_argument("--resources", action="store_true",
                        help="print the registers, stack (spills) and shared memory of each kernel "
                             "config, the most over its launches")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use TRITON_CACHE_DIR as set (default: a fresh temporary cache, so "
                             "everything is compiled)")
    args = parser.parse_args(argv)
    archs = args.arch or [90, 80]
    ops = [o for o in args.ops.split(",") if o]
    unknown = sorted(set(ops) - set(DRIVERS))
    if unknown:
        parser.error(f"unknown ops {unknown}; expected some of {list(DRIVERS)}")

    cache = None
    if not args.keep_cache:
        cache = tempfile.mkdtemp(prefix="hfkern-triton-cache-")
        os.environ["TRITON_CACHE_DIR"] = cache
    try:
        t0 = time.perf_counter()
        launches = record(ops, print)
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
    return 0 if not report.failures() and not unfit else 1


if __name__ == "__main__":
    sys.exit(main())
