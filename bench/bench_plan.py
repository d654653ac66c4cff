"""hfkern.plan on the published workloads: the cost model's accuracy and the measured Pareto set.

For each workload of bench/models (at ``--size``), this

1. fits the cost model from measured steps at B = ``--profile-B`` (default 1, 2, 4, 8, and 16
   on CUDA: ``hfkern.plan.default_profile_B``), and keeps those profiles in ``plan.json``;
2. measures configurations it was not fitted on (a larger B; recomputation of
   half the blocks; two micro-batches for models without batch norm) and
   reports predicted against measured step time and peak memory;
3. searches the Pareto set for ``--trials`` trials of ``--steps`` steps over
   B = 1..``--max-B`` (the search time is reported) and measures every plan of
   the set (its step time and peak), so that the measured front stands beside
   the predicted one;
4. picks a memory budget at which plain fusion (no recomputation) fits fewer
   models than the plan does, and measures both.

On the CPU, the process runs under fixed glibc malloc thresholds (it starts
itself again with ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``
set; ``--system-malloc`` keeps the defaults). By default glibc gives each
allocation above a threshold its own mapping, whose pages fault in at first
touch, and raises that threshold as large blocks are freed: a step's large
activations then cost page faults or not depending on what the process did
before, and the same step measured 0.47 s in a fresh process and 0.30 s after
a cost-model fit (PointNet, B = 12, cpu size; 0.19 s under the fixed
thresholds). Fixed thresholds keep every allocation on the heap, so the fit
and the checks measure under one condition.

Strategies measured side by side are timed in interleaved rounds
(``hfkern.plan.profile_together``, as the cost model's profiles of one B are),
so that a device whose speed drifts (this CPU has fast and slow spells of a
few steps) slows all of them alike.

    python bench/bench_plan.py --size cpu --out bench/results/plan_cpu-2threads_DATE

writes ``plan.json`` (every number, device, versions, date, the backend each
hfkern op resolved to), a plot per
workload (``<workload>.png``: time for all trials against peak memory,
predicted and measured) and prints a summary table.

Workloads whose step is not one model's ``loss(model(x), y)``: BERT-small's
three inputs are stacked into one ``[N, 3, S]`` tensor by a wrapper; DCGAN is
planned for its discriminator (real and generated-looking images against
labels), since its generator's step needs the discriminator.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hfkern  # noqa: E402
import hfkern.plan as hp  # noqa: E402
from bench.models import WORKLOADS, mean_cross_entropy  # noqa: E402
from bench.report import recorded_path  # noqa: E402


class _Bert(nn.Module):
    """BERT-small taking ``[N, 3, S]``: ids, token types and attention mask stacked."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x[:, 0], x[:, 1], x[:, 2])


def _bce(prob: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-model binary cross-entropy of ``[B, N]`` probabilities against shared ``[N]`` labels."""
    return F.binary_cross_entropy(prob.reshape(prob.shape[0], -1), target.expand(prob.shape[0], -1),
                                  reduction="none").mean(1)


def case(name: str, size: str):
    """(factory, (x, y), loss_fn, optimizer factory, micro-batch counts) of a workload."""
    w = WORKLOADS[name]
    batch = w.batch(size)
    opt_name, opt_kw = w.optimizer
    lr = math.sqrt(w.lr[0] * w.lr[1])
    cls = {"sgd": hfkern.optim.SGD, "adam": hfkern.optim.Adam, "adamw": hfkern.optim.AdamW}[opt_name]
    optimizer = lambda params: cls(params, lr=lr, **opt_kw)  # noqa: E731
    if name == "bert_small":
        ids, types, attention, labels = batch
        return (lambda: _Bert(w.build("net", size)), (torch.stack([ids, types, attention], 1), labels),
                mean_cross_entropy, optimizer, (1, 2))
    if name == "dcgan":
        real, _ = batch
        x = torch.cat([real[: len(real) // 2], torch.tanh(torch.randn_like(real[len(real) // 2:]))])
        y = torch.cat([torch.ones(len(real) // 2), torch.zeros(len(real) - len(real) // 2)])
        return lambda: w.build("D", size), (x, y), _bce, optimizer, (1,)
    x, y = batch
    nll = name == "pointnet"
    loss = (lambda out, t: mean_cross_entropy(out, t, nll=True)) if nll else mean_cross_entropy
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in w.build("net", size).modules())
    return lambda: w.build("net", size), (x, y), loss, optimizer, ((1,) if has_bn else (1, 2))


def measure(factory, batch, strategies, loss, optimizer, device, steps):
    """[(step seconds, peak bytes)] of each strategy, their steps timed in interleaved rounds
    (hfkern.plan.profile_together: a drifting device slows them alike)."""
    profiles = hp.profile_together(factory, batch, strategies, optimizer=optimizer, loss_fn=loss, device=device,
                                   steps=steps, warmup=2, measure_blocks=False)
    return [(p.step_time, p.peak) for p in profiles]


def profile_record(p: hp.Profile) -> dict:
    """One profile of the fit as JSON (``hfkern.plan.fit_profiles`` refits from these)."""
    out = dataclasses.asdict(p)
    out["strategy"] = p.strategy.label
    out["strategy_fields"] = {**dataclasses.asdict(p.strategy), "recompute": list(p.strategy.recompute)}
    return out


def rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def run_workload(name: str, args, device) -> dict:
    factory, batch, loss, optimizer, mbs = case(name, args.size)
    t0 = time.perf_counter()
    model = hp.fit_cost_model(factory, batch, optimizer=optimizer, loss_fn=loss, device=device,
                              B_values=args.profile_B, precisions=args.precisions, micro_batches=mbs,
                              arrays=args.arrays, steps=args.profile_steps)
    fit_s = time.perf_counter() - t0
    blocks = model.blocks
    # The blocks that save the most, recomputed: half of them.
    saved = model.step_cost(args.check_B, "fp32", 1, "auto").blocks
    heavy = tuple(b.name for b in sorted(saved, key=lambda b: -b.saved)[: max(1, len(saved) // 2)])
    checks = [hp.Strategy(B=args.check_B), hp.Strategy(B=args.check_B, recompute=heavy)]
    if 2 in mbs:
        checks.append(hp.Strategy(B=args.check_B, micro_batches=2))
    checks += [hp.Strategy(B=args.check_B, precision=p) for p in args.precisions if p != "fp32"]
    checks += [hp.Strategy(B=args.check_B, arrays=k) for k in args.arrays if k > 1]
    accuracy = []
    for s, (mt, mm) in zip(checks, measure(factory, batch, checks, loss, optimizer, device, args.profile_steps)):
        pt, pm = model.predict(s)
        accuracy.append(dict(strategy=s.label, predicted_step_s=pt, measured_step_s=mt, time_error=rel(pt, mt),
                             predicted_peak=pm, measured_peak=mm, memory_error=rel(pm, mm)))
    t0 = time.perf_counter()
    front = hp.search(model, trials=args.trials, steps=args.steps, B_values=range(1, args.max_B + 1),
                      precisions=args.precisions, micro_batches=mbs, arrays=args.arrays, memory_formats=("auto",))
    search_s = time.perf_counter() - t0
    # Every plan of the set, measured (at most --measure of them, spread over the front).
    pick = front if len(front) <= args.measure else [front[round(i * (len(front) - 1) / (args.measure - 1))]
                                                      for i in range(args.measure)]
    measured = []
    pick_measured = measure(factory, batch, [p.strategy for p in pick], loss, optimizer, device, args.profile_steps)
    for p, (mt, mm) in zip(pick, pick_measured):
        # A measured step of a plan is one step of all its arrays in flight together.
        rounds = math.ceil(args.trials / (p.B * p.arrays))
        measured.append(dict(strategy=p.strategy.label, B=p.B, recompute=list(p.recompute),
                             micro_batches=p.micro_batches, precision=p.precision, arrays=p.arrays,
                             predicted_time=p.time, predicted_peak=p.peak_memory,
                             predicted_step_s=p.arrays * p.step_time, measured_time=rounds * args.steps * mt,
                             measured_peak=mm, measured_step_s=mt))
    # A budget where recomputation fits more models than plain fusion: the least memory any plan
    # with recomputation needs at the largest B one reaches; plain fusion's largest B within it,
    # plain fusion being that plan without its recomputation (same precision, micro-batches,
    # arrays and layout), so that the difference is recomputation's alone.
    more = None
    with_rc = [p for p in front if p.recompute]
    if with_rc:
        top = max(p.B for p in with_rc)
        p_rc = min((p for p in with_rc if p.B == top), key=lambda p: p.peak_memory)
        budget = p_rc.peak_memory * 1.001

        def plain_at(B):
            return dataclasses.replace(p_rc.strategy, B=B, recompute=())

        fitting = [B for B in range(1, args.max_B + 1) if model.predict(plain_at(B))[1] <= budget]
        plain_B = max(fitting, default=0)
        if 0 < plain_B < p_rc.B:
            plain = plain_at(plain_B)
            (t_rc, m_rc), (t_pl, m_pl) = measure(factory, batch, [p_rc.strategy, plain], loss, optimizer, device,
                                                 args.profile_steps)
            more = dict(budget=budget, plain=plain.label, plain_B=plain_B, plain_step_s=t_pl, plain_peak=m_pl,
                        plan=p_rc.strategy.label, plan_B=p_rc.B, plan_step_s=t_rc, plan_peak=m_rc,
                        per_model_step_cost=(t_rc / p_rc.B) / (t_pl / plain_B) - 1)
    result = dict(workload=name, blocks=blocks, fit_seconds=fit_s, search_seconds=search_s, accuracy=accuracy,
                  front=[dict(strategy=p.strategy.label, B=p.B, recompute=list(p.recompute),
                              micro_batches=p.micro_batches, precision=p.precision, arrays=p.arrays,
                              predicted_time=p.time, predicted_peak=p.peak_memory)
                         for p in front], measured_front=measured, more_models=more,
                  profiles=[profile_record(p) for p in model.profiles])
    if args.out:
        plot(result, args.trials, args.steps, os.path.join(args.out, f"{name}.png"),
             f"{name} ({args.size} size) on {device}")
    return result


def plot(result: dict, trials: int, steps: int, path: str, title: str) -> None:
    """A workload's plot from its results: the predicted front, the measured plans beside their
    predictions, and, where recomputation fits more models, that budget and the plan best()
    takes within it (else the fastest plan) marked as chosen."""
    front = []
    for f in result["front"]:
        B, arrays = f["B"], f.get("arrays", 1)
        per_step = f["predicted_time"] / (math.ceil(trials / (B * arrays)) * steps * arrays)
        front.append(hp.Plan(B, f.get("precision", "fp32"), f["micro_batches"], arrays, "auto",
                             tuple(f["recompute"]), per_step, f["predicted_peak"], f["predicted_time"]))
    by_label = {p.strategy.label: p for p in front}
    more = result["more_models"]
    budget = more["budget"] if more else None
    pset = hp.PlanSet(front, None, trials, steps, budget, result["search_seconds"], result["fit_seconds"], None)
    chosen = pset.best() if budget is not None else min(front, key=lambda p: p.time)
    pset.plot(path, title=title, chosen=chosen,
              measured=[(by_label[m["strategy"]], m["measured_time"], m["measured_peak"])
                        for m in result["measured_front"] if m["strategy"] in by_label])


def replot(directory: str) -> None:
    """Draw the plots of a results directory again from its plan.json (no measuring)."""
    with open(os.path.join(directory, "plan.json")) as f:
        record = json.load(f)
    a = record["args"]
    for r in record["workloads"]:
        plot(r, a["trials"], a["steps"], os.path.join(directory, f"{r['workload']}.png"),
             f"{r['workload']} ({a['size']} size) on {a['device']}")


def resolved_backends(device: torch.device) -> dict:
    """The backend each hfkern op resolves to on ``device`` and why (``auto`` picks per op by
    hfkern/_evidence.py's records): the kernels the cost model's numbers hold for."""
    info = hfkern.backend_info()
    return {"requested": info["requested"], "ops": {op: row[device.type] for op, row in info["ops"].items()}}


# Every allocation on the heap, nothing given back to the system while the benchmark runs.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(16 << 30)}


def steady_malloc(args) -> dict[str, str] | None:
    """Start this benchmark again under STEADY_MALLOC where it times the CPU on glibc and is not
    already under it; returns the malloc settings in force (None: the system's)."""
    if args.system_malloc or args.device != "cpu" or platform.libc_ver()[0] != "glibc":
        return None
    if any(os.environ.get(k) != v for k, v in STEADY_MALLOC.items()):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **STEADY_MALLOC})
    return dict(STEADY_MALLOC)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="cpu", choices=["cpu", "full", "smoke"])
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile-B", type=int, nargs="+", default=None,
                    help="array sizes profiled; default hfkern.plan.default_profile_B: 1 2 4 8, and 16 on CUDA")
    ap.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=None,
                    help="default: fp32 and bf16 on CUDA, fp32 on the CPU (as hfkern.plan)")
    ap.add_argument("--arrays", type=int, nargs="+", default=None,
                    help="arrays in flight searched and profiled; default: 1 and 2 on CUDA, 1 on the CPU")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--check-B", type=int, default=12, help="B of the accuracy checks (not fitted)")
    ap.add_argument("--max-B", type=int, default=16)
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--measure", type=int, default=6, help="plans of the front measured, at most")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="directory for plan.json and the plots")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds after which no further workload is started")
    ap.add_argument("--system-malloc", action="store_true",
                    help="on the CPU, keep glibc's default malloc thresholds (see the module's docstring)")
    ap.add_argument("--replot", metavar="DIR", default=None,
                    help="draw DIR's plots again from its plan.json, measuring nothing")
    args = ap.parse_args(argv)
    if args.replot:
        replot(args.replot)
        return
    cuda = args.device.startswith("cuda")
    args.precisions = args.precisions or (["fp32", "bf16"] if cuda else ["fp32"])
    args.arrays = args.arrays or ([1, 2] if cuda else [1])
    args.profile_B = args.profile_B or list(hp.default_profile_B(args.device))
    malloc = steady_malloc(args) if argv is None else None  # a call from Python keeps its process
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    backends = resolved_backends(device)
    results = []
    started = time.monotonic()
    for name in args.workloads:
        if args.time_budget is not None and time.monotonic() - started > args.time_budget:
            print(f"{name}: not started (--time-budget {args.time_budget:.0f} s spent)", flush=True)
            continue
        r = run_workload(name, args, device)
        results.append(r)
        acc = "; ".join(f"{a['strategy']}: time {a['time_error']:+.0%}, memory {a['memory_error']:+.0%}"
                        for a in r["accuracy"])
        print(f"{name}: {len(r['front'])} plans, search {r['search_seconds'] * 1e3:.1f} ms; {acc}", flush=True)
        if r["more_models"]:
            m = r["more_models"]
            print(f"  within {m['budget'] / 2**20:.1f} MiB: plain fusion B = {m['plain_B']}, with recomputation "
                  f"B = {m['plan_B']} ({m['plan']}); per-model step time {m['per_model_step_cost']:+.0%}")
        if args.out:  # after every workload: a run stopped later keeps what it measured
            record = dict(benchmark="bench/bench_plan.py", date=datetime.date.today().isoformat(),
                          device=(torch.cuda.get_device_name(device) if device.type == "cuda"
                                  else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"),
                          python=platform.python_version(), torch=torch.__version__, hfkern=hfkern.__version__,
                          malloc=malloc, backends=backends, args={**vars(args), "out": recorded_path(args.out)},
                          workloads=results)
            with open(os.path.join(args.out, "plan.json"), "w") as f:
                json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
