"""Sparse gradient communication: bytes between nodes and step time per DDP hook.

Four processes train one model with DistributedDataParallel on Gloo, as two
"nodes" of two ranks. Each configuration is one way of reducing gradients:

* ``dense``: DDP's own all-reduce (no hook);
* ``powersgd``: torch's PowerSGD hook (rank 1, error feedback, 2 dense steps first);
* ``flat@d`` / ``hier@d``: :func:`hfkern.distributed.topk_hook` at density d, the
  flat all-gather or the hierarchical exchange (dense inside a node).

Between nodes (``--rates``): the two nodes are two network namespaces joined by
a veth pair; ``tc`` puts a token bucket (tbf) of the given rate on both ends, so
every byte from one node to the other crosses a real, rate-limited link, and
the veth counters measure the bytes that crossed (TCP/IP headers included).
Ranks of one node talk over their namespace's local route, unlimited. ``none``
runs the same namespaces without a limit. ``--no-netns`` puts all four
processes on the host's loopback instead (no limit, and no inter-node byte
count: the rows then carry only the hook's payload).

Rows: the median step time after warm-up (the slowest rank's time of each step),
inter-node bytes per step measured on the veth pair, and for the top-k hook the
payload it handed to collectives per step and rank. The machine's cores are
shared by the four processes (one thread each); the step time therefore
includes compute slowed by that sharing, and the ratios between hooks at a
given rate are what a run shows.

    python bench/bench_comm.py                          # the full run (root: ip netns, tc)
    python bench/bench_comm.py --rates 100mbit --workloads resnet18 --densities 0.01
    python bench/bench_comm.py --smoke --no-netns       # seconds; proves the code paths
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD, NODE_SIZE = 4, 2
NS = ("hfk_node0", "hfk_node1")
VETH = ("hfk_v0", "hfk_v1")
ADDR = ("10.231.7.1", "10.231.7.2")


# ---- the network between the two nodes --------------------------------------------------------
def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def netns_up() -> None:
    netns_down()
    for ns in NS:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
    _sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, dev, addr in zip(NS, VETH, ADDR):
        _sh("ip", "link", "set", dev, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")


def netns_down() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def set_rate(rate: str) -> None:
    """A tbf of ``rate`` on both ends of the veth pair (``none``: no qdisc)."""
    for ns, dev in zip(NS, VETH):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                       capture_output=True)
        if rate != "none":
            # burst of 64 KiB and a 100 ms queue: the limit, not the queue, sets the rate
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", rate, "burst", "64kb", "latency", "100ms")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, rate: str, use_netns: bool, out_file: str) -> None:
    port = 29500 + os.getpid() % 1000 if use_netns else _free_port()
    procs = []
    for rank in range(WORLD):
        node = rank // NODE_SIZE
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=VETH[node] if use_netns else "lo")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank),
               "--master", f"{ADDR[0] if use_netns else '127.0.0.1'}:{port}", "--rate", rate,
               "--out-file", out_file, "--workloads", args.workloads, "--densities", args.densities,
               "--modes", args.modes, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--size", args.size] + (["--netns"] if use_netns else [])
        if use_netns:
            cmd = ["ip", "netns", "exec", NS[node]] + cmd
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"bench_comm: workers exited with {codes}")


# ---- one worker (one rank) -------------------------------------------------------------------
def _veth_bytes(use_netns: bool, rank: int) -> int:
    """Bytes this node's end of the veth pair has sent (read by local rank 0)."""
    if not use_netns or rank % NODE_SIZE != 0:
        return 0
    with open(f"/sys/class/net/{VETH[rank // NODE_SIZE]}/statistics/tx_bytes") as f:
        return int(f.read())


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench.models import WORKLOADS
    from hfkern.distributed import TopKState, node_groups, topk_hook

    torch.set_num_threads(1)
    rank = args.rank
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    nodes = node_groups(NODE_SIZE)
    rows = []
    modes = []
    for mode in args.modes.split(","):
        if mode in ("flat", "hier"):
            modes += [f"{mode}@{d}" for d in args.densities.split(",")]
        else:
            modes.append(mode)
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        batch = w.batch(args.size, seed=rank)
        lo, hi = w.lr
        lr = (lo * hi) ** 0.5
        for mode in modes:
            torch.manual_seed(0)
            model = w.build("net", args.size)
            ddp = DDP(model)
            state = None
            if mode == "powersgd":
                state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                               start_powerSGD_iter=2, use_error_feedback=True)
                ddp.register_comm_hook(state, powersgd.powerSGD_hook)
            elif mode != "dense":
                kind, density = mode.split("@")
                state = TopKState(model, density=float(density), warmup_steps=1,
                                  nodes=nodes if kind == "hier" else None)
                ddp.register_comm_hook(state, topk_hook)
            opt_name, opt_kw = w.optimizer
            opt_cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[opt_name]
            opt = opt_cls(ddp.parameters(), lr=lr, **opt_kw)

            def apply(net, *inputs, per_model=False):
                return ddp(*inputs).unsqueeze(0)

            def update(net, losses):
                opt.zero_grad(set_to_none=True)
                losses.sum().backward()
                opt.step()

            times, losses = [], []
            for i in range(args.warmup + args.steps):
                if i == args.warmup:
                    dist.barrier()
                    veth0 = _veth_bytes(args.netns, rank)
                    payload0 = getattr(state, "payload_bytes", 0)
                t0 = time.perf_counter()
                loss = w.step(apply, update, batch)
                times.append(time.perf_counter() - t0)
                losses.append(float(loss.sum()))
            veth = _veth_bytes(args.netns, rank) - veth0
            payload = getattr(state, "payload_bytes", 0) - payload0
            stats = None
            if isinstance(state, TopKState):
                stats = {str(i): s.mode for i, s in sorted(state.bucket_stats.items())}
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, (times[args.warmup:], veth, payload))
            if rank == 0:
                step_max = [max(g[0][i] for g in gathered) for i in range(args.steps)]
                inter = sum(g[1] for g in gathered)
                row = {
                    "workload": name, "size": args.size, "mode": mode, "rate": args.rate,
                    "netns": args.netns, "parameters": sum(p.numel() for p in model.parameters()),
                    "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                    "step_s_median": statistics.median(step_max),
                    "step_s": step_max,
                    "inter_node_bytes_per_step": inter / args.steps if args.netns else None,
                    "hook_payload_bytes_per_step_per_rank": (
                        [g[2] / args.steps for g in gathered] if isinstance(state, TopKState) else None),
                    "bucket_modes": stats,
                    "last_loss": losses[-1],
                }
                rows.append(row)
                print(f"{name:15s} {args.rate:8s} {mode:12s} step {row['step_s_median'] * 1e3:8.1f} ms  "
                      f"inter-node {0 if inter is None else inter / args.steps / 1e6:8.3f} MB/step",
                      flush=True)
            ddp = model = opt = state = None  # (freed before the next mode; the closures above read them)
    if rank == 0:
        with open(args.out_file, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def summary(result: dict) -> str:
    """A markdown table of a result file: per workload and rate, each hook's median
    step time and inter-node bytes, and both relative to the dense all-reduce."""
    meta, rows = result["meta"], result["rows"]
    out = [f"# Sparse gradient communication, {meta['date']}", "",
           f"`{meta['command']}`; torch {meta['torch']}, {meta['backend']}, {meta['topology']}; "
           f"{meta['device']}.", "", f"Network: {meta['network']}.", "",
           f"Timing: {meta['timing']}, {meta['steps']} steps after {meta['warmup']} warm-up steps. "
           "The cores were also shared with other work on the machine, so step times are noisy; "
           "the bytes are exact counts.", "",
           "| workload | rate | hook | step (ms) | vs dense | inter-node MB/step | vs dense |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    dense = {(r["workload"], r["rate"]): r for r in rows if r["mode"] == "dense"}
    for r in rows:
        d = dense.get((r["workload"], r["rate"]))
        t = r["step_s_median"] * 1e3
        b = r["inter_node_bytes_per_step"]
        rt = f"{r['step_s_median'] / d['step_s_median']:.2f}" if d else ""
        rb = f"{b / d['inter_node_bytes_per_step']:.3f}" if d and b is not None else ""
        out.append(f"| {r['workload']} ({r['parameters']:,} parameters) | {r['rate']} | {r['mode']} | "
                   f"{t:.0f} | {rt} | {'' if b is None else f'{b / 1e6:.3f}'} | {rb} |")
    return "\n".join(out) + "\n"


# ---- driver ----------------------------------------------------------------------------------
def _meta(args, use_netns: bool) -> dict:
    import torch

    return {
        "benchmark": "bench/bench_comm.py",
        "date": datetime.date.today().isoformat(),
        "device": f"cpu ({platform.processor() or platform.machine()}), {os.cpu_count()} cores shared by "
                  f"{WORLD} processes (one thread each)",
        "torch": torch.__version__, "python": platform.python_version(), "kernel": platform.release(),
        "backend": "gloo",
        "topology": f"{WORLD // NODE_SIZE} nodes x {NODE_SIZE} ranks",
        "network": ("two network namespaces joined by a veth pair, tc tbf (burst 64kb, latency 100ms) "
                    "on both ends at the row's rate; intra-node traffic on the namespace's local route"
                    if use_netns else "all ranks on the host loopback, no rate limit"),
        "size": args.size, "steps": args.steps, "warmup": args.warmup,
        "timing": "median over the timed steps of the slowest rank's step time (forward, backward "
                  "with the hook, optimizer step)",
        "inter_node_bytes": "veth tx_bytes of both ends over the timed steps / steps (frames, TCP/IP "
                            "headers included)" if use_netns else None,
        "powersgd": "matrix_approximation_rank=1, start_powerSGD_iter=2, error feedback",
        "topk": "hfkern.distributed.topk_hook, approximate selection, warmup_steps=1, fallback on",
        "command": "python " + " ".join(sys.argv),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="resnet18,transformer_lm")
    p.add_argument("--densities", default="0.1,0.01,0.001")
    p.add_argument("--modes", default="dense,powersgd,flat,hier")
    p.add_argument("--rates", default="100mbit,none", help="inter-node rates for tc tbf; 'none': no limit")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--size", default="cpu", help="bench.models size: cpu, smoke or full")
    p.add_argument("--no-netns", action="store_true", help="all ranks on the host loopback, no limit")
    p.add_argument("--smoke", action="store_true", help="smoke sizes, 2 steps, one density")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--name", default=None)
    p.add_argument("--summarize", metavar="JSON", help="write the markdown summary of a result file and exit")
    # worker arguments
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--rate", default="none", help=argparse.SUPPRESS)
    p.add_argument("--out-file", help=argparse.SUPPRESS)
    p.add_argument("--netns", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.summarize:
        with open(args.summarize) as f:
            md = summary(json.load(f))
        with open(os.path.splitext(args.summarize)[0] + ".md", "w") as f:
            f.write(md)
        print(md)
        return
    if args.smoke:
        args.size, args.steps, args.warmup, args.densities = "smoke", 2, 3, "0.1"
    use_netns = not args.no_netns
    rates = args.rates.split(",") if use_netns else ["none"]
    rows = []
    tmp = os.path.join(args.out, f".bench_comm_{os.getpid()}.json")
    os.makedirs(args.out, exist_ok=True)
    try:
        if use_netns:
            netns_up()
        for rate in rates:
            if use_netns:
                set_rate(rate)
            launch(args, rate, use_netns, tmp)
            with open(tmp) as f:
                rows += json.load(f)
    finally:
        if use_netns:
            netns_down()
        if os.path.exists(tmp):
            os.remove(tmp)
    result = {"meta": _meta(args, use_netns), "rows": rows}
    name = args.name or f"comm_cpu-{os.cpu_count()}cores_{result['meta']['date']}"
    if args.smoke:
        name = args.name or "comm_smoke"
    path = os.path.join(args.out, name + ".json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(summary(result))
    print(f"wrote {path} and its .md summary")


if __name__ == "__main__":
    main()
