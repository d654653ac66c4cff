"""Convergence check: a ResNet-18 array trained with three learning rates against the
same three models trained one by one with torch, on the same data.

The three models start from the same weights in both runs (model b built under
seed b), see the same sequence of synthetic CIFAR-sized batches (a new batch
every step, from a fixed seed) and take SGD steps (momentum, weight decay) with
learning rates ``--lrs``. The array is ``hfkern.fuse`` of the three models with
``hfkern.optim.SGD``; the reference is three ``torch.nn`` models with three
``torch.optim.SGD``. Every step's loss of every model is recorded.

Training is chaotic: a rounding difference grows step by step, so no fixed
tolerance holds for 50 steps, not even between two float32 runs of torch itself.
The yardstick is float32's own error: the same three torch models are trained
in float64 too, and at step s the float32 tolerance is ``--factor`` (3) times
the largest relative loss difference between torch's float32 and float64 runs
up to step s (at least ``--floor``, 1e-6). The check passes when, at every step,
the array's losses differ from torch's float32 losses by at most that: the
array is as close to torch as float32 arithmetic lets torch be to itself. A
wrong fused computation shows at the first steps, where float32's error is
1e-7.

    python bench/convergence.py                       # size "cpu" on a CPU, "full" on CUDA
    python bench/convergence.py --size full --steps 50 --out bench/results

Writes ``convergence_resnet18_<device>_<date>.json`` (the losses of the three
runs, the largest relative difference per step, the tolerance, device, versions)
and ``.png`` (needs matplotlib); exits 1 when the losses differ by more than the
tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import json  # noqa: E402

import torch  # noqa: E402

import hfkern  # noqa: E402
from bench.models import WORKLOADS, mean_cross_entropy  # noqa: E402
from bench.train_throughput import environment  # noqa: E402


def batches(size: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of the ResNet-18 workload's shapes with something to learn: each
    image is its class's fixed random template plus as much noise, so the losses fall."""
    w = WORKLOADS["resnet18"]
    out = []
    for s in range(steps):
        noise, y = w.batch(size, seed=1000 + s)
        if s == 0:
            templates = torch.randn(10, *noise.shape[1:], generator=torch.Generator().manual_seed(7))
        out.append((templates[y] + noise, y))
    return out


def train(size: str, lrs: list[float], data, device: torch.device, fused: bool,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-step losses ``[steps, len(lrs)]`` of the ResNet-18 models trained as an array
    (``fused``) or one by one, in ``dtype``."""
    w = WORKLOADS["resnet18"]
    _, opt_kwargs = w.optimizer
    models = []
    for b in range(len(lrs)):
        torch.manual_seed(b)
        models.append(w.build("net", size).to(device, dtype))
    batches = [(x.to(device, dtype), y.to(device)) for x, y in data]
    steps = len(batches)
    losses = torch.empty(steps, len(lrs), dtype=torch.float64)
    if fused:
        array = hfkern.fuse(models)
        opt = hfkern.optim.SGD(array.parameters(), lr=lrs, **opt_kwargs)
        for s, (x, y) in enumerate(batches):
            loss = mean_cross_entropy(array(hfkern.broadcast(x, len(lrs))), y)
            opt.zero_grad()
            loss.sum().backward()
            opt.step()
            losses[s] = loss.detach().double().cpu()
        return losses
    opts = [torch.optim.SGD(m.parameters(), lr=lr, **opt_kwargs) for m, lr in zip(models, lrs)]
    for s, (x, y) in enumerate(batches):
        for b, (m, opt) in enumerate(zip(models, opts)):
            loss = mean_cross_entropy(m(x).unsqueeze(0), y)
            opt.zero_grad()
            loss.sum().backward()
            opt.step()
            losses[s, b] = loss.item()
    return losses


def plot(record: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(6.4, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    steps = range(1, record["steps"] + 1)
    for b, lr in enumerate(record["lrs"]):
        line, = ax.plot(steps, [r[b] for r in record["serial"]], label=f"torch, lr={lr:g}")
        ax.plot(steps, [r[b] for r in record["array"]], linestyle="--", marker=".", markersize=3,
                color=line.get_color(), label=f"hfkern array, lr={lr:g}")
    ax.set_ylabel("training loss")
    ax.set_title(f"ResNet-18 ({record['size']}): 3 models, one by one vs one array\n"
                 f"{record['environment']['device']}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax2.semilogy(steps, [max(d, 1e-12) for d in record["max_rel_diff"]], label="array vs torch fp32")
    ax2.semilogy(steps, [max(d, 1e-12) for d in record["torch_fp32_error"]], linewidth=0.8,
                 label="torch fp32 vs fp64")
    ax2.semilogy(steps, record["tolerance"], color="gray", linestyle=":", label="tolerance")
    ax2.set_xlabel("step")
    ax2.set_ylabel("max rel. loss diff")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("full", "cpu", "smoke"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lrs", type=float, nargs=3, default=[0.01, 0.003, 0.001])
    p.add_argument("--factor", type=float, default=3.0, help="tolerance: this times float32's own error so far")
    p.add_argument("--floor", type=float, default=1e-6, help="the smallest tolerance (relative)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", help="file stem (default convergence_resnet18_<device>_<date>)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    size = args.size or ("full" if device.type == "cuda" else "cpu")
    if device.type == "cuda":
        # TF32 would make both runs' convolutions differ by 1e-3 relative from the first step.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        torch.set_flush_denormal(True)
    data = batches(size, args.steps)
    exact = train(size, args.lrs, data, device, fused=False, dtype=torch.float64)
    serial = train(size, args.lrs, data, device, fused=False)
    array = train(size, args.lrs, data, device, fused=True)
    rel = ((array - serial).abs() / serial.abs()).amax(dim=1)
    # float32's own error: how far torch's float32 run is from the float64 run
    err_torch = ((serial - exact).abs() / exact.abs()).amax(dim=1)
    err_array = ((array - exact).abs() / exact.abs()).amax(dim=1)
    tol = (args.factor * err_torch.cummax(0).values).clamp_min(args.floor)
    env = environment(device, torch.get_num_threads())
    record = {"benchmark": "bench/convergence.py", "environment": env, "workload": "resnet18", "size": size,
              "steps": args.steps, "lrs": args.lrs, "factor": args.factor, "floor": args.floor,
              "tolerance": tol.tolist(), "float64": exact.tolist(),
              "serial": serial.tolist(), "array": array.tolist(), "max_rel_diff": rel.tolist(),
              "torch_fp32_error": err_torch.tolist(), "array_fp32_error": err_array.tolist(),
              "passed": bool((rel <= tol).all())}
    dev = "cpu" if device.type != "cuda" else env["device"].replace("NVIDIA ", "").split()[0].lower()
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name or f"convergence_resnet18_{dev}_{env['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    files = [stem + ".json"] + ([stem + ".png"] if plot(record, stem + ".png") else [])
    over = (rel > tol).nonzero().flatten().tolist()
    ratio = (rel / tol).max().item()
    print(f"ResNet-18 ({size}) on {env['device']}: {args.steps} steps, lrs {args.lrs}; array vs torch float32: "
          f"largest relative loss difference {rel.max().item():.2e} (step {int(rel.argmax()) + 1}), "
          f"{rel[0].item():.2e} at step 1; torch float32 vs float64 up to {err_torch.max().item():.2e}; "
          + (f"within the float32 tolerance at every step (at most {ratio:.2f} of it)" if not over
             else f"OVER the float32 tolerance at steps {[s + 1 for s in over]}"))
    print("final losses, torch:", [f"{v:.4f}" for v in serial[-1].tolist()],
          "array:", [f"{v:.4f}" for v in array[-1].tolist()])
    print("written: " + ", ".join(files))
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
