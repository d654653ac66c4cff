"""hfkern.elastic's allocator: solve time of allocate() for 10..200 jobs on 16..128 devices.

Jobs are random but plausible (seeded): step-time models from a small MLP (a few ms per step) to
a large transformer (hundreds of ms), synchronization that is negligible for some and dominant
for others, cross-node latency, overlap exponents 1..3, batch-size ladders of 4..7 powers of two,
half of them arrays of up to 8 trials, some with memory limits and device bounds.

For each case the solve is timed ``--repeats`` times after ``--warmup`` untimed solves and the
median, the minimum and the 90th percentile are reported (wall clock of the whole call,
validation included). The elastic case (batch size and B chosen by the optimizer) is the main
one; the GPU-only case (batch size and B fixed at the defaults) is reported beside it.

    python bench/bench_elastic_optimizer.py --out bench/results/elastic_optimizer_cpu_DATE/results.json

prints a table and writes every number with the machine, versions and date (and the table as
``results.md`` next to the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time

import numpy as np
import scipy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hfkern.elastic._model import Efficiency, Job, ThroughputModel  # noqa: E402
from hfkern.elastic._optimizer import allocate  # noqa: E402

CASES = [  # (jobs, gpus, gpus_per_node)
    (10, 64, 8), (50, 64, 8), (100, 64, 8), (200, 64, 8),
    (100, 16, 8), (100, 128, 8),
]


def make_jobs(n: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        scale = 10 ** rng.uniform(-0.5, 1.5)             # 0.3x .. 30x a mid-size CNN
        model = ThroughputModel(
            alpha_grad=0.005 * scale * rng.uniform(0.5, 2),
            beta_grad=2e-4 * scale * rng.uniform(0.5, 2),
            alpha_sync=0.01 * scale ** 0.5 * rng.uniform(0.2, 3),
            beta_sync=0.002 * scale ** 0.5 * rng.uniform(0, 2),
            alpha_net=rng.uniform(0.005, 0.1),
            gamma=rng.choice([1.0, 1.5, 2.0, 3.0]))
        b0 = rng.choice([32, 64, 128, 256])
        batch_sizes = tuple(b0 * 2 ** k for k in range(rng.randint(4, 7)))
        arrays = (1,) if rng.random() < 0.5 else (1, 2, 4, 8)
        min_gpus = rng.choice([1, 1, 1, 2])
        max_gpus = rng.choice([None, None, 8, 16, 32])
        jobs.append(Job(
            f"job{i}", model, Efficiency(b0, 10 ** rng.uniform(2, 4.5)), batch_sizes, arrays,
            max_gpus=max_gpus, min_gpus=min_gpus,
            max_local_batch=rng.choice([None, None, 256, 512, 1024]),
            default_B=arrays[-1], requested_gpus=min_gpus))
    return jobs


def time_case(jobs, gpus, gpn, *, batch, arrays, warmup, repeats):
    for _ in range(warmup):
        allocate(jobs, gpus, gpus_per_node=gpn, batch=batch, arrays=arrays)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sol = allocate(jobs, gpus, gpus_per_node=gpn, batch=batch, arrays=arrays)
        times.append(time.perf_counter() - t0)
    times.sort()
    running = sum(1 for a in sol.allocations.values() if a.gpus > 0)
    return {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * times[0],
        "p90_ms": 1e3 * times[min(len(times) - 1, int(0.9 * len(times)))],
        "objective": sol.objective,
        "gpus_used": sol.gpus_used,
        "jobs_running": running,
    }


def machine() -> dict:
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
    }
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = os.getloadavg()
    return info


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here (and the table as results.md beside it)")
    args = p.parse_args(argv)

    info = machine()
    rows = []
    for n, gpus, gpn in CASES:
        jobs = make_jobs(n, args.seed + n)
        for mode, (batch, arrays) in (("elastic", ("elastic", "elastic")), ("gpu-only", ("fixed", "fixed"))):
            r = time_case(jobs, gpus, gpn, batch=batch, arrays=arrays, warmup=args.warmup, repeats=args.repeats)
            rows.append({"jobs": n, "gpus": gpus, "gpus_per_node": gpn, "mode": mode, **r})

    head = "| jobs | GPUs | mode | median ms | min ms | p90 ms | running | GPUs used |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['jobs']} | {r['gpus']} | {r['mode']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | "
                     f"{r['p90_ms']:.2f} | {r['jobs_running']} | {r['gpus_used']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        result = {
            "benchmark": "hfkern.elastic allocate() solve time",
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": info,
            "settings": {"warmup": args.warmup, "repeats": args.repeats, "seed": args.seed,
                         "objective": "speedup", "gpus_per_node": 8},
            "results": rows,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        md = os.path.join(os.path.dirname(os.path.abspath(args.out)), "results.md")
        with open(md, "w") as f:
            f.write(f"allocate() solve time, {info.get('cpu_model', info['processor'])} "
                    f"({info['cpu_count']} cores), numpy {info['numpy']}, {result['date']}; "
                    f"median of {args.repeats} after {args.warmup} warm-up solves; load average at start "
                    f"{info.get('load_average_at_start', 'unknown')} (on a shared machine the medians include "
                    f"other processes' contention; min is the least disturbed)\n\n{table}\n")
    return rows


if __name__ == "__main__":
    main()
