"""The weight gradient of the CPU's 1x1 array convolutions: oneDNN's grouped convolution
backward against the batched matmul and sum the torch path uses (hfkern/ops/conv.py,
``_pointwise_weight_grad``), side by side, interleaved.

The layers are the 1x1 stride-1 layers of bench/families/conv.py (MobileNetV2 for
CIFAR) that the torch path runs as batched matmuls (``_pointwise``), and PointNet's
point-wise Conv1d layers (bench/models at the ``full`` and ``cpu`` sizes), as B
models' ``[N, B, C, *S]`` arrays. Medians of ``--rounds`` interleaved rounds.

    python bench/bench_pointwise_wgrad.py --B 8 --threads 1 --out bench/results/NAME
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.families.conv import SHAPES  # noqa: E402
from hfkern.ops.conv import _pointwise, _pointwise_weight_grad  # noqa: E402

# PointNet's point-wise layers (C_in, C_out) over P points, at the full and cpu sizes
# (bench/models: width 64 / 16, 2500 / 256 points, batch 32 / 16).
_POINTNET = {"full": (32, 2500, [(3, 64), (64, 64), (64, 128), (128, 1024)]),
             "cpu": (16, 256, [(3, 16), (16, 16), (16, 32), (32, 256)])}


def _layers() -> list[tuple[str, int, int, int, tuple[int, ...]]]:
    """(name, N, C_in, C_out, spatial) of every layer measured."""
    out = [(f"{s.model}/{s.layer}", s.N, s.C_in, s.C_out, (s.H, s.W)) for s in SHAPES
           if s.kernel == 1 and s.stride == 1 and s.groups == 1 and not s.transposed and s.H is not None]
    for size, (N, P, chans) in _POINTNET.items():
        out += [(f"pointnet-{size}/conv{i + 1}", N, ci, co, (P,)) for i, (ci, co) in enumerate(chans)]
    return out


def _time(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", nargs="+", default=None,
                    help="only the layers whose name contains one of these (e.g. pointnet-cpu)")
    ap.add_argument("--out", required=True, help="write <out>.md and <out>.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, rows = args.B, []
    for name, N, ci, co, spatial in _layers():
        if args.layers and not any(part in name for part in args.layers):
            continue
        x = torch.randn(N, B, ci, *spatial).transpose(0, 1)  # [B, N, C, *S] in [N, B, C, *S] memory
        grad = torch.randn(N, B, co, *spatial).transpose(0, 1)
        weight = torch.empty(B, co, ci, *([1] * len(spatial)))
        ones, zeros = [1] * len(spatial), [0] * len(spatial)
        if not _pointwise(x, weight, ones, zeros, ones, False, 1):
            continue  # the grouped convolution's own weight gradient, as before
        xg, gg = x.transpose(0, 1).reshape(N, B * ci, *spatial), grad.transpose(0, 1).reshape(N, B * co, *spatial)
        flat = weight.view(B * co, ci, *weight.shape[3:])

        def conv():
            return torch.ops.aten.convolution_backward(gg, xg, flat, None, ones, zeros, ones, False, zeros, B,
                                                       [False, True, False])[1]

        def matmul():
            return _pointwise_weight_grad(grad, x)

        # sums of N * prod(S) products of standard normals: rounding grows with their count
        terms = N * math.prod(spatial)
        torch.testing.assert_close(matmul().view(weight.shape), conv().view(weight.shape), rtol=1e-4,
                                   atol=1e-6 * terms)
        once = max(_time(conv, 1), _time(matmul, 1))
        reps = max(1, int(20 / max(once, 1e-3)))  # about 20 ms of each per round
        times = {"grouped_conv": [], "matmul_sum": []}
        for _ in range(args.rounds):
            times["grouped_conv"].append(_time(conv, reps))
            times["matmul_sum"].append(_time(matmul, reps))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(dict(layer=name, N=N, C_in=ci, C_out=co, spatial=list(spatial), **{f"{k}_ms": v for k, v in med.items()},
                         speedup=med["grouped_conv"] / med["matmul_sum"]))
        print(f"{name:36s} {ci:4d}->{co:<4d} {'x'.join(map(str, spatial)):>6s}  grouped conv {med['grouped_conv']:8.2f} ms"
              f"  matmul+sum {med['matmul_sum']:8.2f} ms  {rows[-1]['speedup']:.2f}x", flush=True)
    meta = dict(benchmark="bench/bench_pointwise_wgrad.py", argv=sys.argv[1:] if argv is None else argv,
                date=time.strftime("%Y-%m-%d"), device=f"cpu ({platform.machine()}, {args.threads} thread{'s' if args.threads != 1 else ''})",
                torch=torch.__version__, python=platform.python_version(), B=B, rounds=args.rounds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# Weight gradient of the CPU's 1x1 array convolutions: {meta['device']}, {meta['date']}", "",
             f"torch {meta['torch']}, Python {meta['python']}; B = {B}; median of {args.rounds} interleaved rounds; "
             f"command: `python bench/bench_pointwise_wgrad.py {' '.join(meta['argv'])}`", "",
             "| layer | C_in -> C_out | spatial | grouped conv (ms) | matmul + sum (ms) | speedup |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['layer']} | {r['C_in']} -> {r['C_out']} | {'x'.join(map(str, r['spatial']))} | "
              f"{r['grouped_conv_ms']:.2f} | {r['matmul_sum_ms']:.2f} | {r['speedup']:.2f}x |" for r in rows]
    total = [sum(r[k] for r in rows) for k in ("grouped_conv_ms", "matmul_sum_ms")]
    lines += ["", f"All layers: {total[0]:.1f} ms against {total[1]:.1f} ms ({total[0] / total[1]:.2f}x)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
