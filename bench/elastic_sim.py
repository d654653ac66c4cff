"""Fixed, GPU-only elastic and hfkern (GPU + batch size + B) elastic scheduling on generated traces.

For each offered load of ``--loads`` and each seed of ``--seeds`` this draws a
trace of ``--jobs`` jobs (:func:`hfkern.elastic._trace.generate_trace`: Poisson
arrivals, Philly-like GPU requests, log-normal durations, six workload
archetypes; the same jobs at every load, only the arrival times scale) and runs
it on a ``--gpus``-device cluster (``--gpus-per-node`` per node) under the three
policies of :mod:`hfkern.elastic._simulator`:

* ``fixed``: FIFO with EASY backfilling, each job at its requested GPUs;
* ``gpu``: the autoscaler, device counts elastic, batch size and B fixed;
* ``hfkern``: the autoscaler, devices, batch size and B elastic.

Each simulation runs until every job finished. Reported per run: jobs completed
by the end of the arrival window (the *horizon*: the trace's last arrival) and
in total, makespan, mean / median / p99 job completion time (JCT) of all jobs,
the censored mean JCT at the horizon, GPU utilization (allocated GPU-seconds /
capacity, up to the horizon and up to the makespan), restarts, solver time and
the simulator's bookkeeping checks. At ``--heavy-load`` the traces are also run
with ``default_batch="memory"`` (users fill GPU memory, so a fixed-batch job
cannot shrink below its request), a sensitivity case.

    python bench/elastic_sim.py --out bench/results/elastic_sim_DATE

writes ``results.json`` (every number to 7 significant digits, seeds,
parameters, command, date, versions; per-job records at the heavy load),
``summary.md`` (the tables printed), and plots:
``load.png`` (completed jobs and mean JCT against load), ``jct_cdf.png`` (JCT
CDF at the heavy load, all seeds pooled) and ``utilization.png`` (allocated
fraction of the cluster over time at the heavy load, first seed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hfkern  # noqa: E402
from hfkern.elastic._simulator import POLICIES, simulate  # noqa: E402
from hfkern.elastic._trace import generate_trace  # noqa: E402

_METRIC_KEYS = ("completed", "makespan", "jct_mean", "jct_median", "jct_p99", "jct_censored_mean", "wait_mean",
                "utilization", "productive_utilization", "restarts", "preemptions")



def _save(fig, out_dir: str, name: str) -> str:
    """Lay out, write (120 dpi) and close a figure; returns its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _clean(x):
    """JSON-safe: NaN and infinities become None, numpy scalars Python numbers."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return float(f"{x:.7g}") if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def _run_one(trace, args, record_jobs: bool) -> dict:
    out = {}
    for policy in POLICIES:
        res = simulate(trace, policy, gpus=args.gpus, gpus_per_node=args.gpus_per_node, interval=args.interval,
                       restart_cost=args.restart_cost)
        full = res.metrics()
        at_h = res.metrics(by=trace.span)
        tl = np.array(res.timeline, dtype=np.float64)
        if len(tl) > 1:
            dt = np.diff(np.append(tl[:, 0], res.end_time))
            active = float(np.sum((tl[:, 2] + tl[:, 3]) * dt) / max(res.end_time, 1e-300))
        else:
            active = 0.0
        out[policy] = dict(
            full={k: full[k] for k in _METRIC_KEYS},
            at_horizon=dict(horizon=trace.span, completed=at_h["completed"], arrived=at_h["arrived"],
                            jct_censored_mean=at_h["jct_censored_mean"], utilization=at_h["utilization"],
                            productive_utilization=at_h["productive_utilization"]),
            mean_active_jobs=active, end_time=res.end_time, events=res.events,
            solver_seconds=res.solver_seconds, wall_seconds=res.wall_seconds,
            decisions=dict(res.decisions), checks=res.checks,
            jobs=[r.to_dict() for r in res.jobs.values()] if record_jobs else None,
            _result=res)
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(xs)) if xs else float("nan")


def _aggregate(runs: list[dict]) -> dict:
    """Mean over seeds per policy, and hfkern's ratios to the other two."""
    agg = {}
    for p in POLICIES:
        agg[p] = dict(completed_at_horizon=_mean([r[p]["at_horizon"]["completed"] for r in runs]),
                      jct_mean_h=_mean([r[p]["full"]["jct_mean"] / 3600 for r in runs]),
                      jct_median_h=_mean([r[p]["full"]["jct_median"] / 3600 for r in runs]),
                      jct_p99_h=_mean([r[p]["full"]["jct_p99"] / 3600 for r in runs]),
                      jct_censored_mean_h=_mean([r[p]["at_horizon"]["jct_censored_mean"] / 3600 for r in runs]),
                      makespan_h=_mean([r[p]["full"]["makespan"] / 3600 for r in runs]),
                      utilization_at_horizon=_mean([r[p]["at_horizon"]["utilization"] for r in runs]),
                      utilization_to_makespan=_mean([r[p]["full"]["utilization"] for r in runs]),
                      mean_active_jobs=_mean([r[p]["mean_active_jobs"] for r in runs]))
    ratios = {}
    for base in ("fixed", "gpu"):
        ratios[f"completed_hfkern_over_{base}"] = _mean(
            [r["hfkern"]["at_horizon"]["completed"] / max(r[base]["at_horizon"]["completed"], 1) for r in runs])
        for k in ("jct_mean", "jct_median", "jct_p99"):
            ratios[f"{k}_{base}_over_hfkern"] = _mean([r[base]["full"][k] / r["hfkern"]["full"][k] for r in runs])
    agg["ratios"] = ratios
    return agg


def _table(title: str, by_load: dict) -> str:
    lines = [f"### {title}", "",
             "| load | policy | completed by horizon | mean JCT (h) | median JCT (h) | p99 JCT (h) | "
             "censored mean JCT (h) | makespan (h) | util. to horizon | mean active jobs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for load, agg in by_load.items():
        for p in POLICIES:
            a = agg[p]
            lines.append(f"| {load} | {p} | {a['completed_at_horizon']:.1f} | {a['jct_mean_h']:.3f} | "
                         f"{a['jct_median_h']:.3f} | {a['jct_p99_h']:.2f} | {a['jct_censored_mean_h']:.3f} | "
                         f"{a['makespan_h']:.1f} | {a['utilization_at_horizon']:.3f} | {a['mean_active_jobs']:.1f} |")
    lines += ["", "| load | completed hfkern/gpu | completed hfkern/fixed | mean JCT gpu/hfkern | "
              "median JCT gpu/hfkern | mean JCT fixed/hfkern | median JCT fixed/hfkern |",
              "|---|---|---|---|---|---|---|"]
    for load, agg in by_load.items():
        r = agg["ratios"]
        lines.append(f"| {load} | {r['completed_hfkern_over_gpu']:.2f} | {r['completed_hfkern_over_fixed']:.2f} | "
                     f"{r['jct_mean_gpu_over_hfkern']:.2f} | {r['jct_median_gpu_over_hfkern']:.2f} | "
                     f"{r['jct_mean_fixed_over_hfkern']:.2f} | {r['jct_median_fixed_over_hfkern']:.2f} |")
    return "\n".join(lines) + "\n"


def _plots(out_dir: str, loads, by_load: dict, heavy_runs: list[dict], heavy_load: float, args) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"fixed": "tab:gray", "gpu": "tab:blue", "hfkern": "tab:red"}
    labels = {"fixed": "fixed (FIFO + backfill)", "gpu": "GPU-only elastic", "hfkern": "hfkern: GPU + batch + B"}
    files = []

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for p in POLICIES:
        ax[0].plot(loads, [by_load[str(x)][p]["completed_at_horizon"] for x in loads], "o-", color=colors[p],
                   label=labels[p])
        ax[1].plot(loads, [by_load[str(x)][p]["jct_mean_h"] for x in loads], "o-", color=colors[p], label=labels[p])
    ax[0].set_xlabel("offered load (requested GPU-time / capacity)")
    ax[0].set_ylabel(f"jobs completed by the last arrival (of {args.jobs})")
    ax[1].set_xlabel("offered load (requested GPU-time / capacity)")
    ax[1].set_ylabel("mean JCT (hours)")
    ax[1].set_yscale("log")
    for a in ax:
        a.grid(alpha=0.3)
    ax[0].legend()
    fig.suptitle(f"{args.gpus} GPUs ({args.gpus_per_node}/node), {args.jobs} jobs, mean of seeds {args.seeds}")
    files.append(_save(fig, out_dir, "load.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for p in POLICIES:
        jct = np.sort(np.concatenate([[j["jct"] / 3600 for j in r[p]["jobs"] if j["jct"] is not None]
                                      for r in heavy_runs]))
        ax.step(jct, np.arange(1, len(jct) + 1) / len(jct), where="post", color=colors[p], label=labels[p])
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(f"JCT CDF at load {heavy_load} ({len(heavy_runs)} seeds pooled)")
    ax.grid(alpha=0.3)
    ax.legend()
    files.append(_save(fig, out_dir, "jct_cdf.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    first = heavy_runs[0]
    t_max = max(first[p]["end_time"] for p in POLICIES)
    for p in POLICIES:
        t, u = first[p]["_result"].utilization_series(args.util_bin, until=t_max)
        ax.step(t / 3600, u, where="post", color=colors[p], label=labels[p])
    ax.axvline(first["horizon"] / 3600, color="k", ls=":", lw=1, label="last arrival")
    ax.set_xlabel("time (hours)")
    ax.set_ylabel(f"allocated fraction of the cluster ({args.util_bin / 60:.0f}-min bins)")
    ax.set_title(f"Utilization over time at load {heavy_load}, seed {args.seeds[0]}")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    files.append(_save(fig, out_dir, "utilization.png"))
    return files


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--loads", type=_floats, default=[0.5, 1.0, 1.5, 2.0, 3.0])
    ap.add_argument("--heavy-load", type=float, default=2.0, help="load of the CDF/utilization plots")
    ap.add_argument("--seeds", type=_ints, default=[0, 1, 2])
    ap.add_argument("--interval", type=float, default=60.0, help="autoscaler tick (s)")
    ap.add_argument("--restart-cost", type=float, default=30.0, help="seconds without progress per restart")
    ap.add_argument("--util-bin", type=float, default=1800.0, help="bin of the utilization plot (s)")
    ap.add_argument("--no-sensitivity", action="store_true", help="skip the default_batch='memory' case")
    args = ap.parse_args(argv)
    if args.heavy_load not in args.loads:
        ap.error(f"--heavy-load {args.heavy_load} must be one of --loads {args.loads}")
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()

    runs: dict[str, list[dict]] = {}
    traces: dict[str, list[dict]] = {}
    for load in args.loads:
        for seed in args.seeds:
            trace = generate_trace(args.jobs, seed=seed, load=load, cluster_gpus=args.gpus,
                                   gpus_per_node=args.gpus_per_node)
            r = _run_one(trace, args, record_jobs=(load == args.heavy_load))
            r["horizon"] = trace.span
            r["seed"] = seed
            runs.setdefault(str(load), []).append(r)
            traces.setdefault(str(load), []).append(dict(seed=seed, params=dict(trace.params),
                                                         summary=trace.summary(),
                                                         offered_load=trace.offered_load(args.gpus)))
            bad = [p for p in POLICIES if not r[p]["checks"]["ok"]]
            print(f"load {load} seed {seed}: " + "  ".join(
                f"{p} done@h {r[p]['at_horizon']['completed']:3d} JCT {r[p]['full']['jct_mean'] / 3600:6.2f}h"
                f" ({r[p]['wall_seconds']:.1f}s)" for p in POLICIES) + (f"  CHECKS FAILED: {bad}" if bad else ""),
                flush=True)
    by_load = {k: _aggregate(v) for k, v in runs.items()}

    sens = {}
    if not args.no_sensitivity:
        sruns = []
        for seed in args.seeds:
            trace = generate_trace(args.jobs, seed=seed, load=args.heavy_load, cluster_gpus=args.gpus,
                                   gpus_per_node=args.gpus_per_node, default_batch="memory")
            r = _run_one(trace, args, record_jobs=False)
            r["horizon"] = trace.span
            r["seed"] = seed
            sruns.append(r)
            print(f"[default_batch=memory] load {args.heavy_load} seed {seed}: " + "  ".join(
                f"{p} done@h {r[p]['at_horizon']['completed']:3d} JCT {r[p]['full']['jct_mean'] / 3600:6.2f}h"
                for p in POLICIES), flush=True)
        sens = {str(args.heavy_load): _aggregate(sruns)}
        sens_runs = sruns
    else:
        sens_runs = []

    files = _plots(args.out, args.loads, by_load, runs[str(args.heavy_load)], args.heavy_load, args)
    all_ok = all(r[p]["checks"]["ok"] for v in runs.values() for r in v for p in POLICIES) and \
        all(r[p]["checks"]["ok"] for r in sens_runs for p in POLICIES)

    summary = (f"# Elastic scheduling simulation ({args.gpus} GPUs, {args.gpus_per_node} per node, {args.jobs} jobs, "
               f"seeds {args.seeds})\n\nHorizon = the trace's last arrival; JCT over all jobs (run to completion); "
               f"means over seeds.\n\n" + _table("Default traces (typical default batch sizes)", by_load))
    if sens:
        summary += "\n" + _table("Sensitivity: default batch fills GPU memory", sens)
    summary += f"\nBookkeeping checks all ok: {all_ok}\n"
    print(summary)

    def strip(r):
        return {k: ({kk: vv for kk, vv in v.items() if kk != "_result"} if isinstance(v, dict) else v)
                for k, v in r.items()}

    import matplotlib
    import scipy
    record = dict(
        benchmark="bench/elastic_sim.py",
        command="python " + " ".join(["bench/elastic_sim.py"] + (sys.argv[1:] if argv is None else list(argv))),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        device=f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        versions=dict(python=platform.python_version(), numpy=np.__version__, scipy=scipy.__version__,
                      matplotlib=matplotlib.__version__, hfkern=hfkern.__version__),
        parameters=dict(gpus=args.gpus, gpus_per_node=args.gpus_per_node, jobs=args.jobs, loads=args.loads,
                        heavy_load=args.heavy_load, seeds=args.seeds, interval_s=args.interval,
                        restart_cost_s=args.restart_cost, objective="speedup", backfill="easy",
                        oracle_remaining=False, horizon="last arrival of each trace"),
        checks_all_ok=all_ok,
        aggregate=by_load, sensitivity_memory_default_batch=sens,
        traces=traces,
        runs={k: [strip(r) for r in v] for k, v in runs.items()},
        sensitivity_runs=[strip(r) for r in sens_runs],
        plots=[os.path.basename(f) for f in files],
        wall_seconds=time.perf_counter() - t_start)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(_clean(record), f, indent=1)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(summary)
    print(f"wrote {args.out}/results.json, summary.md, {', '.join(os.path.basename(x) for x in files)} "
          f"in {record['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
