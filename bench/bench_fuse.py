"""What whole-model fusion costs: a model fused by ``hfkern.fuse`` against the same model
written by hand with ``hfkern.nn``, and against B torch models run one after another.

The model is the digits CNN of ``examples/digits_sweep.py`` (conv, batch norm,
ReLU, max-pool twice, flatten, linear; ``[N, 1, 8, 8]`` images). One training
step of B models (forward, cross-entropy, backward, SGD-momentum step with a
learning rate per model) is timed for:

* ``fused``: ``hfkern.fuse([cnn() for _ in range(B)])``, the plain torch model
  captured and rewritten, with ``hfkern.optim.SGD``;
* ``hand_written``: the same layers as ``hfkern.nn`` array modules in an
  ``nn.Sequential`` (what a user wrote before ``fuse``), with ``hfkern.optim.SGD``;
* ``serial``: B ``torch.nn`` models and B ``torch.optim.SGD``, one after another;
* ``vmap``: one torch model's code over stacked parameters with
  ``torch.func.functional_call`` under ``torch.vmap``, and ``hfkern.optim.SGD``.

The implementations are timed in interleaved rounds (each round times every
one of them for ``--steps`` steps, after warm-up), so that a drift of the
machine's speed reaches all alike; the median over rounds is reported, with
the ratio to ``hand_written``. Denormal numbers are flushed to zero on the CPU:
many steps on one batch drive gradients towards zero, and denormal arithmetic
would otherwise slow whichever implementation has run longest.

    python bench/bench_fuse.py                         # B = 16, batch 64
    python bench/bench_fuse.py --B 4 16 --rounds 15 --save bench/results/fuse_<device>_<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import hfkern  # noqa: E402
import hfkern.nn as hnn  # noqa: E402
from digits_sweep import cnn  # noqa: E402
from hfkern.nn.functional import cross_entropy  # noqa: E402

IMPLS = ("fused", "hand_written", "serial", "vmap")


def hand_written(B: int) -> nn.Sequential:
    return nn.Sequential(
        hnn.Conv2d(1, 16, 3, padding=1, B=B), hnn.BatchNorm2d(16, B=B), nn.ReLU(), hnn.MaxPool2d(2, B=B),
        hnn.Conv2d(16, 32, 3, padding=1, B=B), hnn.BatchNorm2d(32, B=B), nn.ReLU(), hnn.MaxPool2d(2, B=B),
        hnn.Flatten(B=B), hnn.Linear(32 * 2 * 2, 10, B=B),
    )


def make_step(impl: str, B: int, device: torch.device):
    """A function running one training step of B models on ``(x [N, 1, 8, 8], y [N])``."""
    lrs = torch.logspace(-3, -1, B).tolist()
    if impl in ("fused", "hand_written"):
        array = (hfkern.fuse([cnn() for _ in range(B)]) if impl == "fused" else hand_written(B)).to(device)
        opt = hfkern.optim.SGD(array.parameters(), lr=lrs, momentum=0.9)

        def step(x, y):
            losses = cross_entropy(array(hfkern.broadcast(x, B)), y)
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
        return step
    if impl == "serial":
        models = [cnn().to(device) for _ in range(B)]
        opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m, lr in zip(models, lrs)]

        def step(x, y):
            for m, o in zip(models, opts):
                loss = F.cross_entropy(m(x), y)
                o.zero_grad()
                loss.backward()
                o.step()
        return step
    if impl == "vmap":
        models = [cnn().to(device) for _ in range(B)]
        base = cnn().to("meta")
        params = {k: torch.stack([m.get_parameter(k).detach() for m in models]).requires_grad_()
                  for k, _ in base.named_parameters()}
        buffers = {k: torch.stack([m.get_buffer(k) for m in models]) for k, _ in base.named_buffers()}
        opt = hfkern.optim.SGD(list(params.values()), lr=lrs, momentum=0.9)

        def one(p, b, x, y):
            return F.cross_entropy(torch.func.functional_call(base, (p, b), (x,)), y)

        losses_of = torch.vmap(one, in_dims=(0, 0, None, None), randomness="different")

        def step(x, y):
            losses = losses_of(params, buffers, x, y)
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
        return step
    raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(B: int, batch: int, steps: int, rounds: int, warmup: int, impls, device) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(batch, 1, 8, 8, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    runners, errors = {}, {}
    for impl in impls:
        try:
            runners[impl] = make_step(impl, B, device)
            for _ in range(warmup):
                runners[impl](x, y)
        except Exception as e:  # noqa: BLE001 - a baseline torch cannot run is reported, not fatal
            errors[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            runners.pop(impl, None)
    times = {impl: [] for impl in runners}
    for _ in range(rounds):
        for impl, run in runners.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                run(x, y)
            sync(device)
            times[impl].append((time.perf_counter() - t0) / steps)
    med = {impl: statistics.median(t) for impl, t in times.items()}
    ref = med.get("hand_written")
    rows = []
    for impl in impls:
        if impl in errors:
            rows.append({"impl": impl, "error": errors[impl]})
            continue
        rows.append({
            "impl": impl, "B": B, "batch": batch, "median_step_ms": 1e3 * med[impl],
            "min_step_ms": 1e3 * min(times[impl]), "samples_per_s": B * batch / med[impl],
            "vs_hand_written": None if ref is None else med[impl] / ref,
        })
    return {"B": B, "rows": rows}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--B", type=int, nargs="+", default=[16])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="steps per timed sample (default 5)")
    p.add_argument("--rounds", type=int, default=11, help="interleaved samples per implementation")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--save", metavar="PATH", help="write the results (device, versions, date) as JSON")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    # Many steps on one batch drive gradients towards zero; on a CPU, denormal
    # numbers would then slow whichever implementation has run longest.
    torch.set_flush_denormal(True)
    results = [measure(B, args.batch_size, args.steps, args.rounds, args.warmup, args.impls, device)
               for B in args.B]
    print(f"digits CNN training step, {device_name(device)}, torch {torch.__version__}, "
          f"backend {hfkern.get_backend()}, batch {args.batch_size}, median of {args.rounds} rounds "
          f"of {args.steps} steps")
    print(f"{'B':>4} {'impl':<13} {'ms/step':>9} {'samples/s':>11} {'vs hand-written':>16}")
    for r in results:
        for row in r["rows"]:
            if "error" in row:
                print(f"{r['B']:>4} {row['impl']:<13} {'-':>9} {'-':>11}   {row['error']}")
                continue
            ratio = "" if row["vs_hand_written"] is None else f"{row['vs_hand_written']:.3f}x"
            print(f"{r['B']:>4} {row['impl']:<13} {row['median_step_ms']:>9.2f} "
                  f"{row['samples_per_s']:>11,.0f} {ratio:>16}")
    if args.save:
        record = {
            "benchmark": "bench/bench_fuse.py", "date": datetime.date.today().isoformat(),
            "device": device_name(device), "python": platform.python_version(),
            "torch": torch.__version__, "hfkern": hfkern.__version__, "backend": hfkern.get_backend(),
            "batch_size": args.batch_size, "steps": args.steps, "rounds": args.rounds,
            "results": results,
        }
        with open(args.save, "w") as f:
            json.dump(record, f, indent=1)
        print(f"written to {args.save}")


if __name__ == "__main__":
    main()
