"""Where one training step of the digits CNN array spends its CPU time, op by op.

The step is bench_fuse.py's: B digits CNNs (``examples/digits_sweep.py``'s
``cnn()``: conv, batch norm, ReLU, max-pool twice, flatten, linear) on one
``[N, 1, 8, 8]`` batch shared by the models (``hfkern.broadcast``),
``hfkern.nn.functional.cross_entropy`` summed over the models, backward, and
an optimizer step with a learning rate per model. The array is either the
hand-written ``hfkern.nn`` model (``--model hand_written``) or
``hfkern.fuse([cnn() for _ in range(B)])`` (``--model fused``), stepped by
``hfkern.optim.SGD(momentum=0.9)`` or ``hfkern.optim.Adam`` (``--optim``).

``--baseline`` profiles the reference the array path is measured against, the
original HFTA's way of fusing the same models: torch's own modules on the
grouped layout ``[N, B*C, H, W]`` (one grouped conv, one BatchNorm2d over
``B*C`` channels, ReLU and max-pool on contiguous memory, the input repeated
``B`` times along the channels), a batched-matmul linear layer, torch's
cross-entropy over the ``B*N`` rows (mean, times B: the sum of the per-model
means) and an optimizer written as HFTA writes it: plain in-place torch ops per
stacked parameter, the per-model hyperparameters as ``[B, 1, ..., 1]`` tensors
broadcast along the array dim (:class:`HftaSGD`, :class:`HftaAdam`).

For the chosen variant the script profiles ``--steps`` steps after
``--warmup`` with ``torch.profiler`` and prints, per op, its calls, self CPU
time per step and per call (the ``--top`` ops by self time, and always the ops
named by ``--show``). With ``--compare`` it then times the training steps of
the array (hand-written and fused) and of the baseline, for the chosen
optimizer, and their optimizer steps alone, in interleaved rounds (each round
runs every variant for ``--steps-per-round`` steps, so that a drift of a
shared machine's speed reaches all alike), and reports the median, minimum and
maximum over ``--rounds`` rounds. On a shared machine a round is counted as
quiet when other processes kept at most ``--quiet`` CPUs busy meanwhile (read
from ``/proc/stat``); the median over the quiet rounds is reported apart.
Denormals are flushed to zero (a long run on one batch drives gradients
towards them, and denormal arithmetic would slow whichever variant has run
longest), and torch runs ``--threads`` threads.

    python bench/profile_step.py                                  # hand-written array, SGD, B=16, batch 64
    python bench/profile_step.py --optim adam --model fused
    python bench/profile_step.py --baseline --optim adam          # the HFTA-style reference
    python bench/profile_step.py --optim adam --compare --rounds 21 --label after --save results.json
    PYTHONPATH=../other-checkout python bench/profile_step.py --optim adam --compare --label before \\
        --save results.json                                       # the hfkern of another tree

``--save PATH`` writes the run (profile, comparison, device, versions, date,
``--label``) as JSON; a record already at PATH gets the run added, so the runs
of two checkouts (before and after a change) land in one file.
``--steps 0`` skips the profile (a comparison alone). ``--summarize PATH``
pools such a record's runs by label: per variant the median step time with its
quartiles, the median over quiet rounds, the median ratio to the baseline's
step of the same round (a machine's drift cancels in it), the optimizer step,
and the profiled calls per step of the ops that differ between the variants; it
prints the table and stores it in the record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# hfkern is imported from PYTHONPATH when it names a tree (to profile another
# checkout with this script), else from the installed package or this tree.
sys.path.insert(0, os.path.join(ROOT, "examples"))
if ROOT not in sys.path:
    sys.path.append(ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import hfkern  # noqa: E402
from bench_fuse import hand_written  # noqa: E402
from digits_sweep import cnn  # noqa: E402
from hfkern.nn.functional import cross_entropy  # noqa: E402

MODELS = ("hand_written", "fused")
OPTIMS = ("sgd", "adam")
# Always listed: the ops the profile is read for (activation, reductions, fills).
SHOW = ("aten::clamp_min", "aten::threshold_backward", "aten::sum", "aten::fill_")


# ---- the HFTA-style reference ------------------------------------------------------

class HftaLinear(nn.Module):
    """B linear layers as one batched matmul: ``[B, N, in] -> [B, N, out]``."""

    def __init__(self, B: int, in_features: int, out_features: int):
        super().__init__()
        bound = 1 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(B, out_features, in_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(B, out_features).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias.unsqueeze(1), x, self.weight.transpose(1, 2))


class HftaCNN(nn.Module):
    """B digits CNNs on the grouped layout: activations ``[N, B*C, H, W]``, contiguous."""

    def __init__(self, B: int):
        super().__init__()
        self.B = B
        self.features = nn.Sequential(
            nn.Conv2d(B, B * 16, 3, padding=1, groups=B), nn.BatchNorm2d(B * 16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(B * 16, B * 32, 3, padding=1, groups=B), nn.BatchNorm2d(B * 32), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.fc = HftaLinear(B, 32 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N, 1, H, W]``, one batch for every model -> logits ``[B, N, 10]``."""
        N = x.size(0)
        y = self.features(x.repeat(1, self.B, 1, 1))               # [N, B*32, 2, 2]
        return self.fc(y.view(N, self.B, -1).transpose(0, 1))      # [B, N, 128] -> [B, N, 10]


def _per_model(value, B: int, like: torch.Tensor) -> torch.Tensor:
    """A float or B floats as a ``[B, 1]`` tensor, broadcasting along a ``[B, -1]`` view."""
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).expand(B).clone().view(B, 1)


def _models(t: torch.Tensor, B: int) -> torch.Tensor:
    """A stacked tensor (``[B, ...]`` or grouped ``[B*C, ...]``) as ``[B, -1]``: model b is row b."""
    return t.view(B, -1)


class HftaSGD(torch.optim.Optimizer):
    """SGD with momentum as HFTA writes it: in-place ops per stacked parameter, the
    per-model lr and momentum as tensors broadcast along the array dim."""

    def __init__(self, params, B: int, lr, momentum=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum))
        self.B = B

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                grad = _models(p.grad, self.B)
                if not state:
                    state["lr"] = _per_model(group["lr"], self.B, p)
                    state["momentum"] = _per_model(group["momentum"], self.B, p)
                    state["momentum_buffer"] = grad.clone()  # torch starts from the first gradient
                else:
                    state["momentum_buffer"].mul_(state["momentum"]).add_(grad)
                _models(p, self.B).addcmul_(state["momentum_buffer"], state["lr"], value=-1)


class HftaAdam(torch.optim.Optimizer):
    """Adam as HFTA writes it: in-place ops per stacked parameter, every per-model
    hyperparameter (lr, betas, eps, weight decay) a tensor broadcast along the
    array dim, one step count per parameter."""

    def __init__(self, params, B: int, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))
        self.B = B

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                param, grad = _models(p, self.B), _models(p.grad, self.B)
                if not state:
                    state["step"] = 0
                    for k in ("lr", "eps", "weight_decay"):
                        state[k] = _per_model(group[k], self.B, p)
                    state["beta1"], state["beta2"] = (_per_model(b, self.B, p) for b in group["betas"])
                    state["decay"] = bool((state["weight_decay"] != 0).any())  # decided on the host
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                beta1, beta2 = state["beta1"], state["beta2"]
                if state["decay"]:
                    grad = grad.addcmul(param, state["weight_decay"])
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).addcmul_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad * (1 - beta2))
                if group["amsgrad"]:
                    torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
                    exp_avg_sq = state["max_exp_avg_sq"]
                bias_correction1 = 1 - beta1 ** state["step"]
                bias_correction2 = 1 - beta2 ** state["step"]
                denom = (exp_avg_sq.sqrt() / bias_correction2.sqrt()).add_(state["eps"])
                param.addcdiv_(exp_avg * (-state["lr"] / bias_correction1), denom)


# ---- the steps ------------------------------------------------------------------

VARIANTS = MODELS + ("baseline",)


def make_step(variant: str, optim: str, B: int):
    """``(step, optimizer)``: ``step(x, y)`` runs one training step of B models on
    ``x [N, 1, 8, 8]``, ``y [N]``; ``variant`` is ``hand_written``, ``fused`` or ``baseline``."""
    lrs = torch.logspace(-3, -1, B).tolist()
    if variant == "baseline":
        model = HftaCNN(B)
        opt = (HftaSGD(model.parameters(), B, lr=lrs, momentum=0.9) if optim == "sgd"
               else HftaAdam(model.parameters(), B, lr=lrs))

        def step(x, y):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(B * x.size(0), -1), y.repeat(B)) * B
            opt.zero_grad()
            loss.backward()
            opt.step()
        return step, opt
    if variant not in MODELS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    model = hfkern.fuse([cnn() for _ in range(B)]) if variant == "fused" else hand_written(B)
    opt = (hfkern.optim.SGD(model.parameters(), lr=lrs, momentum=0.9) if optim == "sgd"
           else hfkern.optim.Adam(model.parameters(), lr=lrs))

    def step(x, y):
        losses = cross_entropy(model(hfkern.broadcast(x, B)), y)
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
    return step, opt


def data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.rand(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)


def profile_variant(variant: str, optim: str, B: int, batch: int, steps: int, warmup: int) -> dict:
    """Calls and self CPU time per step of every op, over ``steps`` profiled steps."""
    torch.manual_seed(0)
    x, y = data(batch)
    step, _ = make_step(variant, optim, B)
    for _ in range(warmup):
        step(x, y)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step(x, y)
        wall = (time.perf_counter() - t0) / steps
    ops = [
        {"name": e.key, "calls_per_step": e.count / steps,
         "self_cpu_us_per_step": round(e.self_cpu_time_total / steps, 1)}
        for e in prof.key_averages()
    ]
    ops.sort(key=lambda o: -o["self_cpu_us_per_step"])
    return {"variant": variant, "optim": optim, "B": B, "batch": batch, "steps": steps,
            "profiled_step_ms": round(1e3 * wall, 3), "ops": ops,
            "all_ops_self_cpu_us_per_step": round(sum(o["self_cpu_us_per_step"] for o in ops), 1)}


def listed(p: dict, top: int, show) -> list[dict]:
    """The ops of profile ``p`` worth reading: the ``top`` by self time and those in ``show``."""
    return [o for i, o in enumerate(p["ops"]) if i < top or o["name"] in show]


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (Linux), to tell what others ran."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _timed(fn, n: int) -> tuple[float, float | None]:
    """Seconds per call of ``fn`` over ``n`` calls, and the CPU seconds other processes
    used meanwhile (per wall second; None where the machine does not say)."""
    busy0, own0, t0 = _busy_seconds(), time.process_time(), time.perf_counter()
    for _ in range(n):
        fn()
    wall, own, busy1 = time.perf_counter() - t0, time.process_time() - own0, _busy_seconds()
    others = None if busy0 is None or busy1 is None else max(0.0, busy1 - busy0 - own) / wall
    return wall / n, others


def compare(optim: str, B: int, batch: int, rounds: int, steps: int, warmup: int,
            quiet: float) -> list[dict]:
    """Interleaved timing of every variant's training step and of its optimizer step alone.

    Each round times ``steps`` training steps of each variant, then ``steps``
    optimizer steps of each (on the gradients the last training step left),
    the variants in turn forwards and backwards.
    A round during which other processes kept more than ``quiet`` CPUs busy
    counts as disturbed; medians are reported over all rounds and over the
    undisturbed ones.
    """
    x, y = data(batch)
    runners = {}
    for v in VARIANTS:
        torch.manual_seed(0)
        runners[v] = make_step(v, optim, B)
        for _ in range(warmup):
            runners[v][0](x, y)
    samples = {v: {"step": [], "optimizer": [], "others": []} for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]  # no variant always runs first
        for v in order:
            step = runners[v][0]
            t, others = _timed(lambda: step(x, y), steps)
            samples[v]["step"].append(t)
            samples[v]["others"].append(others)
        for v in order:
            samples[v]["optimizer"].append(_timed(runners[v][1].step, steps)[0])

    def ms(values):
        return round(1e3 * statistics.median(values), 3) if values else None

    rows = []
    for v, s in samples.items():
        calm = [t for t, o in zip(s["step"], s["others"]) if o is not None and o <= quiet]
        rows.append({
            "variant": v, "optim": optim, "B": B, "batch": batch,
            "median_step_ms": ms(s["step"]), "min_step_ms": round(1e3 * min(s["step"]), 3),
            "max_step_ms": round(1e3 * max(s["step"]), 3),
            "quiet_rounds": len(calm), "median_quiet_step_ms": ms(calm),
            "median_optimizer_step_ms": ms(s["optimizer"]),
            "step_ms": [round(1e3 * t, 3) for t in s["step"]],
            "optimizer_step_ms": [round(1e3 * t, 4) for t in s["optimizer"]],
            "others_cpus": [None if o is None else round(o, 2) for o in s["others"]],
        })
    base = next(r for r in rows if r["variant"] == "baseline")
    for r in rows:
        r["step_vs_baseline"] = round(r["median_step_ms"] / base["median_step_ms"], 4)
        r["optimizer_vs_baseline"] = round(r["median_optimizer_step_ms"] / base["median_optimizer_step_ms"], 4)
    return rows


# ---- output -----------------------------------------------------------------------

def format_profile(p: dict, top: int, show) -> str:
    lines = [f"{p['variant']} / {p['optim']}: B={p['B']}, batch {p['batch']}, {p['steps']} profiled steps, "
             f"{p['profiled_step_ms']:.2f} ms/step under the profiler",
             f"  {'op':<52} {'calls/step':>10} {'self us/step':>13} {'us/call':>9}"]
    for o in listed(p, top, show):
        per_call = o["self_cpu_us_per_step"] / o["calls_per_step"]
        lines.append(f"  {o['name'][:52]:<52} {o['calls_per_step']:>10.1f} "
                     f"{o['self_cpu_us_per_step']:>13.1f} {per_call:>9.1f}")
    lines.append(f"  {'(all ops)':<52} {'':>10} {p['all_ops_self_cpu_us_per_step']:>13.1f}")
    return "\n".join(lines)


def format_compare(rows: list[dict], rounds: int, steps: int) -> str:
    lines = [f"{rows[0]['optim']} steps, median (min, max) of {rounds} interleaved rounds of {steps} steps; "
             "'quiet': the rounds other processes did not disturb",
             f"  {'variant':<13} {'step ms':>8} {'min':>7} {'max':>7} {'quiet ms':>9} {'(n)':>4} "
             f"{'vs base':>8} {'optimizer ms':>13} {'vs base':>8}"]
    for r in rows:
        quiet = "-" if r["median_quiet_step_ms"] is None else f"{r['median_quiet_step_ms']:.2f}"
        lines.append(
            f"  {r['variant']:<13} {r['median_step_ms']:>8.2f} {r['min_step_ms']:>7.2f} {r['max_step_ms']:>7.2f} "
            f"{quiet:>9} {r['quiet_rounds']:>4} {r['step_vs_baseline']:>7.3f}x "
            f"{r['median_optimizer_step_ms']:>13.3f} {r['optimizer_vs_baseline']:>7.3f}x")
    return "\n".join(lines)


def device_name() -> str:
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def save(path: str, run: dict) -> None:
    """Write ``run`` to ``path``, added to the runs a record already there holds
    (so that runs of several checkouts, e.g. before and after a change, share a file)."""
    record = {"benchmark": "bench/profile_step.py", "runs": []}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("benchmark") != record["benchmark"]:
            raise SystemExit(f"{path} holds no bench/profile_step.py record; not overwriting it")
        record = old
    record["runs"].append(run)
    write(path, record)


# A list or object holding no list or object (an op's row, per-round samples)
_LEAF = re.compile(r"[\[{][^\[\]{}]*[\]}]")


def write(path: str, record: dict) -> None:
    """``record`` as indented JSON, every innermost list or object on one line."""
    text = _LEAF.sub(lambda m: " ".join(m.group(0).split()), json.dumps(record, indent=1))
    with open(path, "w") as f:
        f.write(text + "\n")


def summarize(record: dict) -> dict:
    """Every run of a saved record pooled by label: per (optimizer, variant) the median
    step and optimizer-step times over all rounds of all runs (and over the quiet
    rounds), and per profiled (variant, optimizer) the counts of the ops in ``SHOW``
    and the self time per call of ReLU and its backward."""
    steps: dict[tuple, dict] = {}
    profiles: dict[tuple, dict] = {}
    for run in record["runs"]:
        label = run["label"]
        rows = run.get("compare", [])
        base = next((r for r in rows if r["variant"] == "baseline"), None)
        for r in rows:
            acc = steps.setdefault((label, r["optim"], r["variant"]),
                                   {"step": [], "quiet": [], "optimizer": [], "ratio": []})
            acc["step"] += r["step_ms"]
            acc["optimizer"] += r["optimizer_step_ms"]
            acc["quiet"] += [t for t, o in zip(r["step_ms"], r["others_cpus"])
                             if o is not None and o <= run["args"]["quiet"]]
            acc["ratio"] += [t / b for t, b in zip(r["step_ms"], base["step_ms"])]  # same round: drift cancels
        if "profile" not in run:
            continue
        prof = run["profile"]
        ops = {o["name"]: o for o in prof["ops"]}
        acc = profiles.setdefault((label, prof["optim"], prof["variant"]), {"counts": {}, "us_per_call": {}})
        for name in SHOW:
            if name in ops:
                acc["counts"][name] = ops[name]["calls_per_step"]
                acc["us_per_call"].setdefault(name, []).append(
                    ops[name]["self_cpu_us_per_step"] / ops[name]["calls_per_step"])

    labels = list(dict.fromkeys(run["label"] for run in record["runs"]))

    def order(item):  # labels as they first come, optimizers and variants as this script lists them
        (label, optim, variant), _ = item
        return labels.index(label), OPTIMS.index(optim), VARIANTS.index(variant)

    def med(values):
        return round(statistics.median(values), 3) if values else None

    def quantile(values, q):
        return round(statistics.quantiles(values, n=4)[round(q * 4) - 1], 3) if len(values) > 1 else None

    return {
        "steps": [{"label": k[0], "optim": k[1], "variant": k[2], "samples": len(v["step"]),
                   "median_step_ms": med(v["step"]), "p25_step_ms": quantile(v["step"], 0.25),
                   "p75_step_ms": quantile(v["step"], 0.75), "median_vs_baseline": med(v["ratio"]),
                   "quiet_samples": len(v["quiet"]), "median_quiet_step_ms": med(v["quiet"]),
                   "median_optimizer_step_ms": med(v["optimizer"])}
                  for k, v in sorted(steps.items(), key=order)],
        "profiles": [{"label": k[0], "optim": k[1], "variant": k[2], "calls_per_step": v["counts"],
                      "median_self_us_per_call": {n: med(t) for n, t in v["us_per_call"].items()}}
                     for k, v in sorted(profiles.items(), key=order)],
    }


def format_summary(summary: dict) -> str:
    lines = ["step times pooled over the runs, ms: median [quartiles] of all rounds, median of the quiet "
             "ones, median ratio to the baseline's step in the same round; the optimizer step alone",
             f"  {'label':<10} {'optim':<5} {'variant':<13} {'step':>8} {'[p25, p75]':>16} {'(n)':>4} "
             f"{'quiet':>7} {'(n)':>4} {'vs base':>8} {'optimizer':>10}"]
    for r in summary["steps"]:
        quiet = "-" if r["median_quiet_step_ms"] is None else f"{r['median_quiet_step_ms']:.2f}"
        spread = "-" if r["p25_step_ms"] is None else f"[{r['p25_step_ms']:.2f}, {r['p75_step_ms']:.2f}]"
        lines.append(f"  {r['label']:<10} {r['optim']:<5} {r['variant']:<13} {r['median_step_ms']:>8.2f} "
                     f"{spread:>16} {r['samples']:>4} {quiet:>7} {r['quiet_samples']:>4} "
                     f"{r['median_vs_baseline']:>7.3f}x {r['median_optimizer_step_ms']:>10.3f}")
    lines += ["profiles: calls per step; self us per call of ReLU and its backward (median over runs)",
              f"  {'label':<10} {'optim':<5} {'variant':<13} {'sum':>4} {'fill_':>6} {'clamp_min':>10} "
              f"{'thr_bwd':>8}"]
    for r in summary["profiles"]:
        calls, per_call = r["calls_per_step"], r["median_self_us_per_call"]
        lines.append(f"  {r['label']:<10} {r['optim']:<5} {r['variant']:<13} {calls.get('aten::sum', 0):>4.0f} "
                     f"{calls.get('aten::fill_', 0):>6.0f} {per_call.get('aten::clamp_min', 0):>10.1f} "
                     f"{per_call.get('aten::threshold_backward', 0):>8.1f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--B", type=int, default=16, help="models in the array (default 16)")
    p.add_argument("--batch", type=int, default=64, help="samples per step and model (default 64)")
    p.add_argument("--optim", choices=OPTIMS, default="sgd")
    p.add_argument("--model", choices=MODELS, default="hand_written", help="the array to profile")
    p.add_argument("--baseline", action="store_true", help="profile the HFTA-style reference instead")
    p.add_argument("--steps", type=int, default=20, help="profiled steps (default 20; 0: no profile)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="ops listed, by self CPU time (default 25)")
    p.add_argument("--show", nargs="*", default=list(SHOW), help="ops listed whatever their time")
    p.add_argument("--compare", action="store_true",
                   help="also time the steps of hand_written, fused and baseline, interleaved")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds of --compare (default 15)")
    p.add_argument("--steps-per-round", type=int, default=10)
    p.add_argument("--quiet", type=float, default=0.25,
                   help="CPUs other processes may keep busy in an undisturbed round (default 0.25)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--label", default="", help="a name for this run in the saved record (e.g. before, after)")
    p.add_argument("--save", metavar="PATH",
                   help="write the run (device, versions, date) as JSON; an existing record gets it added")
    p.add_argument("--summarize", metavar="PATH",
                   help="only print (and store in it) the summary of the runs a saved record holds")
    args = p.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            record = json.load(f)
        record["summary"] = summarize(record)
        print(format_summary(record["summary"]))
        write(args.summarize, record)
        return record
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    print(f"digits CNN training step, {device_name()}, torch {torch.__version__}, "
          f"hfkern {hfkern.__version__}, backend {hfkern.get_backend()}")
    run = {
        "label": args.label, "date": datetime.date.today().isoformat(), "device": device_name(),
        "python": platform.python_version(), "torch": torch.__version__, "hfkern": hfkern.__version__,
        "backend": hfkern.get_backend(),
        "args": {k: v for k, v in vars(args).items() if k not in ("save", "summarize")},
    }
    if args.steps > 0:
        variant = "baseline" if args.baseline else args.model
        prof = profile_variant(variant, args.optim, args.B, args.batch, args.steps, args.warmup)
        print(format_profile(prof, args.top, set(args.show)))
        run["profile"] = {**prof, "ops": listed(prof, args.top, set(args.show))}  # what the table lists
    if args.compare:
        rows = compare(args.optim, args.B, args.batch, args.rounds, args.steps_per_round, args.warmup,
                       args.quiet)
        print()
        print(format_compare(rows, args.rounds, args.steps_per_round))
        run["compare"] = rows
    if args.save:
        save(args.save, run)
        print(f"written to {args.save}")
    return run


if __name__ == "__main__":
    main()
