"""A fused learning-rate sweep: 16 small CNNs on scikit-learn's digits, trained as one.

The 16 models differ only in their learning rate (log-spaced from 1e-3 to 1).
The model is a plain ``torch.nn`` CNN; ``hfkern.fuse`` turns 16 of them into one
array model, in which every layer runs once for all 16 models, and one
optimizer step updates all of them. For comparison the same
16 models (identical initial weights, same batches in the same order, same
number of steps) are then trained one after another as plain ``torch.nn``
models with ``torch.optim.SGD``, and the throughputs of the two are printed.

    python examples/digits_sweep.py            # full run
    python examples/digits_sweep.py --quick    # a short smoke run

The digits dataset ships with scikit-learn (1797 8x8 grey-scale images of the
digits 0-9), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import hfkern
from hfkern.nn.functional import cross_entropy
from hfkern.optim import SGD

MOMENTUM = 0.9
QUICK_EPOCHS = 2
QUICK_STEPS_PER_EPOCH = 3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, default=16, help="number of models in the sweep (default 16)")
    p.add_argument("--epochs", type=int, default=None,
                   help="training epochs; the first is a warm-up left out of the timings "
                        f"(default 20, or {QUICK_EPOCHS} with --quick)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step and model (default 64)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed for initialization and data order")
    p.add_argument("--save", metavar="PATH", default=None,
                   help="also write the measurements (with device, versions and date) as JSON to PATH")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK_EPOCHS} epochs of {QUICK_STEPS_PER_EPOCH} steps")
    args = p.parse_args(argv)
    if args.epochs is None:
        args.epochs = QUICK_EPOCHS if args.quick else 20
    if args.models < 1:
        p.error(f"--models must be >= 1, got {args.models}")
    if args.epochs < 2:
        p.error(f"--epochs must be >= 2 (the first epoch is a warm-up), got {args.epochs}")
    if args.batch_size < 2:
        p.error(f"--batch-size must be >= 2 (batch norm needs two samples), got {args.batch_size}")
    return args


def load_data(device: torch.device):
    """The digits as ``[N, 1, 8, 8]`` floats in [0, 1] and int64 labels, a fixed 75/25 split."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        torch.arange(len(y)).numpy(), test_size=0.25, random_state=0, stratify=digits.target
    )
    train_idx, test_idx = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
    return (x[train_idx].to(device), y[train_idx].to(device),
            x[test_idx].to(device), y[test_idx].to(device))


def cnn() -> nn.Sequential:
    """One CNN for ``[N, 1, 8, 8]`` images, ``[N, 10]`` logits: plain torch, nothing of hfkern."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),                        # 8x8 -> 4x4
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),                        # 4x4 -> 2x2
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, 10),
    )


def batch_plan(n: int, batch_size: int, epochs: int, steps_per_epoch: int | None, seed: int,
               device: torch.device) -> list[list[torch.Tensor]]:
    """Index batches for every epoch (a fresh shuffle each, last partial batch dropped)."""
    g = torch.Generator().manual_seed(seed)
    steps = n // batch_size if steps_per_epoch is None else min(steps_per_epoch, n // batch_size)
    plan = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        plan.append([perm[i * batch_size:(i + 1) * batch_size].to(device) for i in range(steps)])
    return plan


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_array(array, opt, x, y, plan, device, bar):
    """Train all models at once. Returns per-epoch seconds and the last epoch's mean losses ``[B]``."""
    B = array.B

    def step(xb, yb):
        losses = cross_entropy(array(hfkern.broadcast(xb, B)), yb)  # [B]
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        return losses.detach()

    # On CUDA the whole step replays as one CUDA graph after a few eager steps; on the CPU
    # capture_step runs it eagerly.
    idx0 = plan[0][0]
    step = hfkern.capture_step(step, x[idx0], y[idx0])
    times, epoch_loss = [], None
    for batches in plan:
        epoch_loss = torch.zeros(B, device=device)
        sync(device)
        t0 = time.perf_counter()
        for idx in batches:
            epoch_loss += step(x[idx], y[idx])
            bar.update()
        sync(device)
        times.append(time.perf_counter() - t0)
        bar.set_postfix(best_loss=f"{(epoch_loss / len(batches)).nan_to_num(float('inf')).min():.4f}")
    return times, epoch_loss / len(plan[-1])


def train_one(model, opt, x, y, plan, device, bar):
    """Train one plain torch model. Returns per-epoch seconds and the last epoch's mean loss."""
    times, epoch_loss = [], None
    for batches in plan:
        epoch_loss = torch.zeros((), device=device)
        sync(device)
        t0 = time.perf_counter()
        for idx in batches:
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            epoch_loss += loss.detach()
            bar.update()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, epoch_loss / len(plan[-1])


@torch.no_grad()
def array_accuracy(array, x, y) -> torch.Tensor:
    array.eval()
    logits = array(hfkern.broadcast(x, array.B))  # [B, N, 10]
    return (logits.argmax(-1) == y).float().mean(1)


@torch.no_grad()
def accuracy(model, x, y) -> float:
    model.eval()
    return (model(x).argmax(-1) == y).float().mean().item()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({torch.get_num_threads()} threads)"


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    console = Console()
    B = args.models
    torch.manual_seed(args.seed)

    x_train, y_train, x_test, y_test = load_data(device)
    plan = batch_plan(len(y_train), args.batch_size, args.epochs,
                      QUICK_STEPS_PER_EPOCH if args.quick else None, args.seed, device)
    steps = sum(len(b) for b in plan)
    lrs = torch.logspace(-3, 0, B).tolist()

    models = [cnn().to(device) for _ in range(B)]  # B independently initialized torch models
    array = hfkern.fuse(models)  # copies: the torch models keep their initial weights
    console.print(f"device: {device_name(device)}; {B} models, {args.epochs} epochs, "
                  f"{len(plan[0])} steps/epoch of {args.batch_size} samples "
                  f"({len(y_train)} train / {len(y_test)} test images)")

    opt = SGD(array.parameters(), lr=lrs, momentum=MOMENTUM)
    with tqdm(total=steps, desc=f"fused array ({B} models)", unit="step") as bar:
        array_times, array_loss = train_array(array, opt, x_train, y_train, plan, device, bar)
    array_acc = array_accuracy(array, x_test, y_test).tolist()
    array_loss = array_loss.tolist()

    seq_times, seq_acc = [], []
    with tqdm(total=B * steps, desc=f"{B} torch models, one by one", unit="step") as bar:
        for model, lr in zip(models, lrs):
            model.train()
            times, _ = train_one(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM),
                                 x_train, y_train, plan, device, bar)
            seq_times.append(times)
            seq_acc.append(accuracy(model, x_test, y_test))

    table = Table(title=f"Learning-rate sweep: {B} CNNs on digits, SGD momentum {MOMENTUM}")
    table.add_column("model", justify="right")
    table.add_column("lr", justify="right")
    table.add_column("train loss", justify="right")
    table.add_column("test acc", justify="right")
    table.add_column("test acc (torch)", justify="right")
    for b in range(B):
        table.add_row(str(b), f"{lrs[b]:.2e}", f"{array_loss[b]:.4f}", f"{array_acc[b]:.2%}",
                      f"{seq_acc[b]:.2%}")
    console.print(table)

    # Throughput over the same work: every model, every epoch after the warm-up one.
    samples = B * args.batch_size * sum(len(b) for b in plan[1:])
    array_s = sum(array_times[1:])
    seq_s = sum(sum(t[1:]) for t in seq_times)
    speed = Table(title=f"Training throughput on {device_name(device)} (epochs 2-{args.epochs})")
    speed.add_column("how", justify="left")
    speed.add_column("seconds", justify="right")
    speed.add_column("samples/s", justify="right")
    speed.add_row(f"hfkern array, {B} models fused", f"{array_s:.3f}", f"{samples / array_s:,.0f}")
    speed.add_row(f"torch, {B} models one by one", f"{seq_s:.3f}", f"{samples / seq_s:,.0f}")
    console.print(speed)
    console.print(f"speedup of the fused array: {seq_s / array_s:.2f}x on {device_name(device)}")
    if args.save:
        record = {
            "benchmark": "examples/digits_sweep.py",
            "date": datetime.date.today().isoformat(),
            "device": device_name(device),
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "hfkern": hfkern.__version__,
            "backend": hfkern.get_backend(),
            "models": B, "epochs": args.epochs, "batch_size": args.batch_size,
            "steps_per_epoch": len(plan[0]), "timed_epochs": args.epochs - 1,
            "fused_seconds": array_s, "serial_seconds": seq_s,
            "fused_samples_per_s": samples / array_s, "serial_samples_per_s": samples / seq_s,
            "speedup": seq_s / array_s,
            "per_model": [
                {"lr": lrs[b], "train_loss": array_loss[b], "test_acc": array_acc[b],
                 "test_acc_torch": seq_acc[b]}
                for b in range(B)
            ],
        }
        with open(args.save, "w") as f:
            json.dump(record, f, indent=1)
        console.print(f"measurements written to {args.save}")


if __name__ == "__main__":
    main()
