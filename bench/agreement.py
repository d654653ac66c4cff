"""How closely an array follows B separate torch models: measured, not promised.

hfkern computes for model b what torch computes for model b alone, but not
always in the same order: a fused kernel or a grouped convolution sums a
reduction in another order than B separate calls, and a per-model learning
rate read from a tensor rounds once where torch's Python float rounds
elsewhere. This script measures the resulting float32 differences:

* ``optimizer``: each hfkern optimizer against B ``torch.optim`` optimizers of
  the same class, fed identical gradients for ``--steps`` steps (no model in the
  loop, so only the update arithmetic differs);
* ``training``: a small CNN (conv, batch norm, pooling, linear) trained as an
  array against the same B models trained one by one with ``torch.optim.SGD``,
  on a shared (``hfkern.broadcast``) input, and the array on the shared input
  against the same array on B stacked copies of it.

For each it prints the largest difference of any parameter entry relative to
the largest magnitude of that parameter (``max |a - b| / max |b|``) and whether
the two runs are bit-identical.

    python bench/agreement.py                  # CPU, float32, 10 steps
    python bench/agreement.py --device cuda --steps 100 --out agreement.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hfkern  # noqa: E402
import hfkern.nn as hnn  # noqa: E402
import hfkern.nn.functional as HF  # noqa: E402
from hfkern import optim as hoptim  # noqa: E402

# Optimizer configurations: the feature each one exercises, with per-model values.
OPTIMIZERS = {
    "SGD": dict(lr=[0.1, 0.03, 0.01], momentum=0.9, weight_decay=1e-4, nesterov=True),
    "Adam": dict(lr=[1e-2, 3e-3, 1e-3], betas=(0.9, 0.999), weight_decay=1e-4),
    "AdamW": dict(lr=[1e-2, 3e-3, 1e-3], weight_decay=1e-2, amsgrad=True),
    "Adagrad": dict(lr=[0.1, 0.03, 0.01], lr_decay=1e-3, weight_decay=1e-4),
    "Adadelta": dict(lr=[1.0, 0.5, 0.1], rho=0.9, weight_decay=1e-4),
    "RMSprop": dict(lr=[1e-2, 3e-3, 1e-3], alpha=0.99, momentum=0.9, centered=True),
}
SHAPES = [(33, 17), (64,), (5, 3, 3, 3)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = b.abs().max().item()
    return (a - b).abs().max().item() / (den if den > 0 else 1.0)


def optimizer_agreement(name: str, steps: int, device: torch.device) -> dict:
    kw = OPTIMIZERS[name]
    B = len(kw["lr"])
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(B, *s, generator=g) for s in SHAPES]
    grads = [[torch.randn(B, *s, generator=g) for s in SHAPES] for _ in range(steps)]
    array = [nn.Parameter(t.clone().to(device)) for t in init]
    opt = getattr(hoptim, name)(array, **kw)
    separate = [[nn.Parameter(t[b].clone().to(device)) for t in init] for b in range(B)]
    torch_kw = [{k: (v[b] if isinstance(v, list) else v) for k, v in kw.items()} for b in range(B)]
    opts = [getattr(torch.optim, name)(ps, **k) for ps, k in zip(separate, torch_kw)]
    for step in range(steps):
        for p, gr in zip(array, grads[step]):
            p.grad = gr.to(device)
        opt.step()
        for b, (ps, o) in enumerate(zip(separate, opts)):
            for p, gr in zip(ps, grads[step]):
                p.grad = gr[b].to(device)
            o.step()
    worst, identical = 0.0, True
    for i, p in enumerate(array):
        for b in range(B):
            ref = separate[b][i].detach()
            worst = max(worst, _rel(p.detach()[b], ref))
            identical &= torch.equal(p.detach()[b], ref)
    return {"what": "optimizer", "name": name, "B": B, "steps": steps, "max_rel_diff": worst,
            "bit_identical": bool(identical)}


def _array_cnn(B: int) -> nn.Sequential:
    return nn.Sequential(
        hnn.Conv2d(1, 4, 3, padding=1, B=B), hnn.BatchNorm2d(4, B=B), nn.ReLU(), hnn.MaxPool2d(2, B=B),
        hnn.Conv2d(4, 6, 3, B=B), hnn.BatchNorm2d(6, B=B), nn.ReLU(), hnn.AvgPool2d(2, B=B),
        hnn.Flatten(B=B), hnn.Linear(6 * 2 * 2, 5, B=B), nn.ReLU(), hnn.Linear(5, 3, B=B),
    )


def _separate(array: nn.Sequential, B: int) -> list[nn.Sequential]:
    per_layer = [m.to_modules() if isinstance(m, hnn.ArrayModule) else [m] * B for m in array]
    return [nn.Sequential(*(layer[b] for layer in per_layer)) for b in range(B)]


def training_agreement(steps: int, device: torch.device) -> list[dict]:
    B, lrs = 3, [0.3, 0.1, 0.02]
    torch.manual_seed(0)
    shared = _array_cnn(B).to(device)
    stacked = _array_cnn(B).to(device)
    stacked.load_state_dict(shared.state_dict())
    models = [m.to(device) for m in _separate(shared, B)]
    opt_shared = hoptim.SGD(shared.parameters(), lr=lrs, momentum=0.9)
    opt_stacked = hoptim.SGD(stacked.parameters(), lr=lrs, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m, lr in zip(models, lrs)]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(9, 1, 12, 12, generator=g).to(device)
        y = torch.randint(0, 3, (9,), generator=g).to(device)
        for net, opt, inp in ((shared, opt_shared, hfkern.broadcast(x, B)),
                              (stacked, opt_stacked, x.expand(B, *x.shape).contiguous())):
            opt.zero_grad()
            HF.cross_entropy(net(inp), y).sum().backward()
            opt.step()
        for m, o in zip(models, opts):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    rows = []
    for other, label in ((None, "array (shared input) vs B separate torch models"),
                         (stacked, "array: shared input vs B stacked copies")):
        worst, identical = 0.0, True
        for k, v in shared.state_dict().items():
            if not v.is_floating_point():
                continue
            if other is None:
                idx, key = k.split(".", 1)
                refs = [models[b][int(idx)].state_dict()[key] for b in range(B)]
            else:
                refs = list(other.state_dict()[k])
            for b in range(B):
                worst = max(worst, _rel(v[b], refs[b]))
                identical &= torch.equal(v[b], refs[b])
        rows.append({"what": "training", "name": label, "B": B, "steps": steps, "max_rel_diff": worst,
                     "bit_identical": bool(identical)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows = [optimizer_agreement(n, args.steps, device) for n in OPTIMIZERS]
    rows += training_agreement(args.steps, device)
    print(f"torch {torch.__version__}, device {device}, float32, {args.steps} steps")
    for r in rows:
        same = "bit-identical" if r["bit_identical"] else f"max rel diff {r['max_rel_diff']:.1e}"
        print(f"  {r['what']:9s} {r['name']:50s} {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "device": str(device), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
