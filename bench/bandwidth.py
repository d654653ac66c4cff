"""Timers and the device's measured ceilings: copy bandwidth and matmul rate.

Every bandwidth figure the kernel benchmark reports is compared with the copy
bandwidth measured here (one large device-to-device copy, bytes read plus
bytes written over the median time), and every FLOP/s figure with the rate of
a large matrix product in the same dtype, so "fraction of the ceiling" means
fraction of what this device demonstrably does, not of a datasheet number.

    python bench/bandwidth.py                 # measure on CUDA and print
    python bench/bandwidth.py --out c.json    # also save (bench_kernels.py --ceilings c.json)
    python bench/bandwidth.py --smoke         # tiny sizes on the CPU
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from typing import Callable

import torch

DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# The rate a float32 product actually runs at depends on the TF32 flags; the
# ceilings carry both, keyed like this.
MATMUL_KEYS = ("fp32", "tf32", "bf16", "fp16")


class CpuTimer:
    """Median wall time of ``fn`` in ms over ``reps`` calls (fewer if they take
    longer than ``max_seconds``), after ``warmup`` untimed calls."""

    name = "perf_counter"

    def __init__(self, reps: int = 5, max_seconds: float = 1.0, warmup: int = 1):
        self.reps = reps
        self.max_seconds = max_seconds
        self.warmup = warmup

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        start = time.perf_counter()
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if time.perf_counter() - start > self.max_seconds:
                break
        return 1e3 * statistics.median(times)


class CudaTimer:
    """Median device time of ``fn`` in ms (``triton.testing.do_bench``).

    do_bench times each call between CUDA events after a warm-up of
    ``warmup_ms`` and repeats for ``rep_ms``; it rewrites a 256 MB buffer before
    every timed call, so no call finds the previous call's data in L2. Without
    Triton the same protocol runs on torch's CUDA events.
    """

    def __init__(self, warmup_ms: float = 10.0, rep_ms: float = 40.0):
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        self._do_bench = do_bench
        # Triton releases before return_mode existed give the median as the 0.5 quantile.
        self._median_kw = {"return_mode": "median"}
        if do_bench is not None and "return_mode" not in inspect.signature(do_bench).parameters:
            self._median_kw = {"quantiles": [0.5]}
        self.name = "do_bench" if do_bench is not None else "cuda_events"

    def __call__(self, fn: Callable[[], object]) -> float:
        if self._do_bench is not None:
            ms = self._do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, **self._median_kw)
            return float(ms[0] if isinstance(ms, (list, tuple)) else ms)
        return _event_median(fn, self.warmup_ms, self.rep_ms)


class GraphTimer:
    """Median device time of ``fn`` in ms with the launch overhead taken out.

    ``fn`` runs a few times on a side stream (compiling, autotuning and picking
    cuDNN algorithms there), is then captured once into a CUDA graph, and the
    graph's replays are timed with the same protocol as ``cuda_events`` (a
    256 MB buffer rewritten before every timed replay). What remains is the
    kernels' own time, back to back: the figure to hold against the device's
    ceilings. ``CudaTimer`` is the eager figure a Python training loop sees.
    Code that synchronizes with the host cannot be captured and raises.
    """

    name = "cuda_graph"

    def __init__(self, warmup_ms: float = 10.0, rep_ms: float = 40.0, warmup_calls: int = 3):
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.warmup_calls = warmup_calls

    def __call__(self, fn: Callable[[], object]) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_calls):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        try:
            return _event_median(graph.replay, self.warmup_ms, self.rep_ms)
        finally:
            del graph
            torch.cuda.synchronize()


TIMERS = ("do_bench", "cuda_graph")


def make_cuda_timer(name: str, warmup_ms: float = 10.0, rep_ms: float = 40.0):
    """The CUDA timer called ``name`` (one of :data:`TIMERS`)."""
    if name == "do_bench":
        return CudaTimer(warmup_ms, rep_ms)
    if name == "cuda_graph":
        return GraphTimer(warmup_ms, rep_ms)
    raise ValueError(f"timer must be one of {TIMERS}, got {name!r}")


def _event_median(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    n = max(1, int(rep_ms / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def make_timer(device: torch.device, warmup_ms: float = 10.0, rep_ms: float = 40.0):
    return CudaTimer(warmup_ms, rep_ms) if device.type == "cuda" else CpuTimer()


def copy_bandwidth(device: torch.device, timer, nbytes: int) -> dict:
    """GB/s of ``dst.copy_(src)`` for an ``nbytes`` buffer, counting read plus write."""
    n = nbytes // 4
    # Random data, not zeros: zeros can run faster than real data does.
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    moved = 2 * n * 4
    return {"bytes": moved, "ms": ms, "gbps": moved / (ms * 1e-3) / 1e9}


def matmul_tflops(device: torch.device, key: str, timer, n: int) -> dict:
    """TFLOP/s (2*n^3 FLOPs per product) of an n x n x n matmul in ``key``'s dtype.

    ``"fp32"`` runs with TF32 off, ``"tf32"`` with it on; the global flag is
    restored afterwards.
    """
    dtype = torch.float32 if key in ("fp32", "tf32") else DTYPE_NAMES[key]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = key == "tf32"
    try:
        ms = timer(lambda: torch.mm(a, b))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    flops = 2 * n**3
    return {"n": n, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}


def measure_ceilings(device: torch.device, timer, *, smoke: bool = False) -> dict:
    """Copy bandwidth (GB/s) and matmul rate per dtype (TFLOP/s) of ``device``.

    Returns ``{"copy_gbps": float, "copy": {...}, "matmul_tflops": {key: float},
    "matmul": {key: {...}}, "errors": {what: message}}``. On CUDA the copy
    moves 2 GiB (far past L2) and the products are 8192^3; ``smoke`` uses tiny
    sizes. A ceiling that fails to measure is left out and its error recorded.
    """
    copy_bytes = 16 * 2**20 if smoke or device.type != "cuda" else 2**30
    n = 128 if smoke else (8192 if device.type == "cuda" else 1024)
    out: dict = {"copy_gbps": None, "copy": None, "matmul_tflops": {}, "matmul": {}, "errors": {}}
    try:
        out["copy"] = copy_bandwidth(device, timer, copy_bytes)
        out["copy_gbps"] = out["copy"]["gbps"]
    except Exception as e:  # noqa: BLE001  (a missing ceiling must not stop the benchmark)
        out["errors"]["copy"] = f"{type(e).__name__}: {e}"
    keys = MATMUL_KEYS if device.type == "cuda" else ("fp32", "bf16")
    for key in keys:
        try:
            out["matmul"][key] = matmul_tflops(device, key, timer, n)
            out["matmul_tflops"][key] = out["matmul"][key]["tflops"]
        except Exception as e:  # noqa: BLE001
            out["errors"][f"matmul_{key}"] = f"{type(e).__name__}: {e}"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Measure the device's copy bandwidth and matmul ceilings.")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--out", metavar="PATH", help="write the ceilings as JSON to PATH")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    c = measure_ceilings(device, make_timer(device), smoke=args.smoke)
    c["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {c['device']}")
    if c["copy_gbps"] is not None:
        print(f"copy bandwidth: {c['copy_gbps']:.0f} GB/s (read + write, {c['copy']['bytes'] / 1e9:.2f} GB "
              f"in {c['copy']['ms']:.3f} ms)")
    for key, tf in c["matmul_tflops"].items():
        print(f"matmul {key}: {tf:.1f} TFLOP/s (n={c['matmul'][key]['n']})")
    for what, err in c["errors"].items():
        print(f"{what}: failed: {err}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(c, f, indent=1)
    return 0 if c["copy_gbps"] is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
