"""Where one benchmark case spends its time: the device kernels per implementation.

Runs the cases bench_kernels.py would run (same shapes, inputs and
implementations) under ``torch.profiler`` and prints, per implementation, the
device kernels of one call sorted by total time, with the call's summed device
time and its wall time. This answers "which kernel makes implementation X slower
than Y" without a GPU profiler installed.

    python bench/profile_case.py --ops conv --filter layer3.conv --B 8 --dtypes bf16 \\
        --directions fwd+bwd --impls torch,grouped_nchw
    python bench/profile_case.py --smoke --ops conv --impls torch      # tiny, on the CPU

Options are bench_kernels.py's case selection (``--ops``, ``--filter``, ``--B``,
``--dtypes``, ``--directions``, ``--impls``, ``--quick``, ``--smoke``) plus
``--calls`` (profiled calls per implementation, after one warm-up call) and
``--top`` (kernels listed per implementation).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import bench_kernels as bk


def _device_time_us(evt) -> float:
    # torch renamed cuda_time_total to device_time_total; read whichever exists.
    for name in ("device_time_total", "cuda_time_total", "self_device_time_total"):
        v = getattr(evt, name, None)
        if v:
            return float(v)
    return 0.0


def profile_impl(impl, data: dict, direction: str, device: torch.device, calls: int, top: int) -> str:
    with impl.context():
        fn, _ = bk.build_fn(impl, data, direction)
        fn()  # compile, autotune, pick algorithms
        if device.type == "cuda":
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1e3 / calls
    events = prof.key_averages()
    if device.type == "cuda":
        kernels = [e for e in events if _device_time_us(e) > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        kernels = [e for e in events if e.key.startswith("aten::") or "triton" in e.key]
    kernels.sort(key=lambda e: _device_time_us(e) if device.type == "cuda" else e.self_cpu_time_total,
                 reverse=True)
    total_us = sum(_device_time_us(e) for e in kernels) / calls if device.type == "cuda" else None
    lines = [f"  {impl.name}: wall {wall_ms:.3f} ms per call"
             + (f", device kernels {total_us / 1e3:.3f} ms per call" if total_us is not None else "")]
    for e in kernels[:top]:
        us = (_device_time_us(e) if device.type == "cuda" else e.self_cpu_time_total) / calls
        lines.append(f"    {us:9.1f} us  x{e.count // calls:<3d} {e.key[:110]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=5, help="profiled calls per implementation (default 5)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per implementation (default 12)")
    own, rest = p.parse_known_args(argv)
    args = bk.parse_args(rest)
    cases = bk.plan(args)
    if not cases:
        print("no case matches the selection", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as bench_kernels.py runs
    torch.manual_seed(0)
    for case in cases:
        family = bk.FAMILIES[case.op]
        data = family.make_data(case.shape, case.B, bk.DTYPES[case.dtype], device, case.direction != "fwd")
        print(f"{case.label()}  [{case.shape.describe()}]")
        for impl in family.make_impls(case.shape, args.impls or family.impl_names()):
            try:
                print(profile_impl(impl, data, case.direction, device, own.calls, own.top), flush=True)
            except Exception as e:  # noqa: BLE001  (one failing implementation must not stop the others)
                print(f"  {impl.name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
