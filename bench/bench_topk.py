"""Top-k selection benchmark: hfkern.topk_select (approximate and exact) against torch.topk.

Gradient sparsification selects the k = density * n entries of largest
magnitude of a flat gradient each step. For every size n and density, this
times, on one device:

* ``torch.topk``: ``torch.topk(x.abs(), k)`` (the values and indices of a full
  top-k, what a top-k compressor without hfkern calls);
* ``<backend>/approx``: ``hfkern.topk_select(x, k)`` under ``use_backend(backend)``
  for every backend that serves the device (torch on a CPU; torch, triton and
  cuda on a GPU where available): k to 1.25 k entries, compacted in index order;
* ``<backend>/exact``: ``hfkern.topk_select(x, k, exact=True)``.

Per row: the median time (ms) after warm-up (and the fastest call, ``min_ms``), the achieved count and its
ratio to k, the number of counting passes the threshold search made (approximate
and, for the backends without torch.topk, exact mode) and the rate in GB/s of
reading x once (n * element size / time). x is ``torch.randn`` (a Gaussian
gradient); ``--input cauchy`` draws a heavy-tailed one. The copy time of x
(``clone``) is recorded per size as the memory-bandwidth ceiling.

    python bench/bench_topk.py                                   # 1e5..1e8, densities 0.1/0.01/0.001
    python bench/bench_topk.py --sizes 1e5,1e6,1e7 --reps 5      # a CPU run
    python bench/bench_topk.py --time-budget 120 --out bench/results

Timing: CUDA: ``triton.testing.do_bench`` medians (its warm-up and L2 flush);
CPU: ``time.perf_counter`` around each call, median of ``--reps`` after one
warm-up call. Results go to ``<out>/topk_<device>_<date>.json``, rewritten after
every size (``report.run_cases``): a run stopped by a time limit's SIGINT keeps the
sizes it finished, and ``meta`` says why it stopped.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hfkern  # noqa: E402
from bench import report  # noqa: E402
from hfkern import _backend, _topk  # noqa: E402


def environment(device: torch.device) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "hfkern": hfkern.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        # other work on a shared machine shows here (CPU timings are only as quiet as it)
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


class PassCounter:
    """Counts the counting passes of the threshold search (wraps the shared search)."""

    def __init__(self):
        self.passes = 0
        self._original = _topk.find_threshold

    def __enter__(self):
        original = self._original

        def counted(bits, spec, k, cap, seed, count_ge):
            def count(*args):
                self.passes += 1
                return count_ge(*args)

            return original(bits, spec, k, cap, seed, count)

        _topk.find_threshold = counted
        return self

    def __exit__(self, *exc):
        _topk.find_threshold = self._original


def timer(device: torch.device, reps: int):
    if device.type == "cuda":
        import triton.testing

        def cuda_time(fn) -> tuple[float, float]:
            return tuple(float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode=mode))
                         for mode in ("median", "min"))

        return cuda_time

    def cpu_time(fn) -> tuple[float, float]:
        fn()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), min(times)

    return cpu_time


def backends_for(device: torch.device) -> list[str]:
    names = []
    for name in _backend.BACKENDS:
        if device.type == "cpu" and name != "torch":
            continue  # CPU tensors always take the torch path
        if _backend._availability[name]()[0]:
            names.append(name)
    return names


def make_input(n: int, kind: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(n)
    if kind == "cauchy":
        x = torch.empty(n).cauchy_(generator=g)
    else:
        x = torch.randn(n, generator=g)
    return x.to(device=device, dtype=dtype)


# A row's fields, in the order the JSON keeps them.
COLUMNS = ["n", "density", "k", "dtype", "input", "copy_ms", "impl", "status", "ms", "min_ms", "count",
           "count_over_k", "passes", "gbps"]


@dataclass(frozen=True)
class Size:
    """One size n: every density and implementation (report.run_cases's case)."""

    n: int

    def label(self) -> str:
        return f"n={self.n}"


def run_size(n: int, args, device: torch.device, measure, backends: list[str]) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    rows = []
    x = make_input(n, args.input, device, dtype)
    copy_ms = measure(lambda: x.clone())[0]
    gbps = lambda ms: n * x.element_size() / (ms * 1e-3) / 1e9  # noqa: E731
    for density in args.densities:
        k = max(1, round(density * n))
        base = dict(n=n, density=density, k=k, dtype=args.dtype, input=args.input, copy_ms=copy_ms, status="ok")
        ms, min_ms = measure(lambda: torch.topk(x.abs(), k))
        rows.append(dict(base, impl="torch.topk", ms=ms, min_ms=min_ms, count=k, count_over_k=1.0, passes=None,
                         gbps=gbps(ms)))
        print(f"n={n:>10} density={density:<6} k={k:>9} torch.topk        {ms:10.3f} ms", flush=True)
        for backend in backends:
            for exact in (False, True):
                with hfkern.use_backend(backend):
                    with PassCounter() as counter:
                        out = hfkern.topk_select(x, k, exact=exact, seed=0)
                    count = int(out.count)
                    ms, min_ms = measure(lambda: hfkern.topk_select(x, k, exact=exact, seed=0))
                impl = f"{backend}/{'exact' if exact else 'approx'}"
                # the torch path's exact mode uses torch.topk, not the search
                passes = None if (exact and backend == "torch") else counter.passes
                rows.append(dict(base, impl=impl, ms=ms, min_ms=min_ms, count=count, count_over_k=count / k,
                                 passes=passes, gbps=gbps(ms)))
                print(f"n={n:>10} density={density:<6} k={k:>9} {impl:<17} {ms:10.3f} ms  "
                      f"count/k={count / k:.4f} passes={passes}", flush=True)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1e5,1e6,1e7,1e8",
                   type=lambda s: [int(float(v)) for v in s.split(",")], help="row lengths n")
    p.add_argument("--densities", default="0.1,0.01,0.001",
                   type=lambda s: [float(v) for v in s.split(",")])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--input", default="randn", choices=["randn", "cauchy"])
    p.add_argument("--reps", type=int, default=5, help="timed calls per case on the CPU (median)")
    p.add_argument("--time-budget", type=float, default=None, help="start no new size after this many seconds")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--name", default=None, help="file name without .json (default topk_<device>_<date>)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # A time limit's SIGINT stops the run and writes what it has; a process started in the
    # background by a shell inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    device = torch.device(args.device)
    env = environment(device)
    if args.name is None:
        kind = "cpu-%dthreads" % torch.get_num_threads() if args.device == "cpu" else \
            env["device"].lower().replace("nvidia ", "").replace(" ", "-")
        args.name = f"topk_{kind}_{env['date']}"
    meta = {**env, "settings": vars(args) | {"device": str(device)}, "skipped_cases": 0, "finished": False}
    # The JSON is rewritten after every row: a run killed after its time limit keeps the sizes done.
    writer = report.RowWriter(args.out, args.name, meta, columns=COLUMNS, with_csv=False)
    writer.write_json(complete=False)
    measure = timer(device, args.reps)
    backends = backends_for(device)
    report.run_cases([Size(n) for n in args.sizes], lambda size: run_size(size.n, args, device, measure, backends),
                     writer, meta, args.time_budget, time.monotonic(), device, "{:.3f}")
    print(f"wrote {writer.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
