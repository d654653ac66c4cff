"""One training step of a published workload in two or more checkouts of hfkern, side by side.

Each checkout (a source tree with its extension built, e.g. ``git worktree add ../before
<rev>``, the built ``hfkern/_C*.so`` copied in where the C++ sources did not change) gets
a worker process that imports hfkern from that tree and builds the step of
``bench/train_throughput.py`` (``Runner``: the same models, batch, optimizer and seeds in
every tree); rounds of ``--steps`` steps then run in turn, checkout after checkout, so
that drift of the machine falls on all of them alike. Reports the median time per step
and the ratio to the first checkout; ``--out`` also writes a Markdown table and JSON.

    python bench/compare_checkouts.py --roots ../before . --workloads resnet18 pointnet \\
        --size smoke --B 8 --mode array --rounds 9 --steps 5 --threads 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _worker(root: str, conn, spec: dict, threads: int) -> None:
    # This checkout's hfkern and bench, not the ones of the tree that started the worker.
    sys.path[:] = [root] + [p for p in sys.path if os.path.abspath(p or ".") not in (ROOT, root)]
    for name in [m for m in sys.modules if m == "bench" or m.startswith(("bench.", "hfkern"))]:
        del sys.modules[name]
    import torch

    torch.set_num_threads(threads)
    from bench.train_throughput import Runner

    import hfkern

    if not Path(hfkern.__file__).resolve().is_relative_to(Path(root).resolve()):
        conn.send(("error", f"imported hfkern from {hfkern.__file__}, not from {root}"))
        return
    runner = Runner(spec)
    for _ in range(3):  # warm-up: state, caches, allocator
        runner.step()
    conn.send(("ready", None))
    while (steps := conn.recv()) is not None:
        t0, t1 = runner.run(steps)
        conn.send(("time", (t1 - t0) / steps))


def _revision(root: str) -> str:
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return out + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def compare(roots: list[str], spec: dict, rounds: int, steps: int, threads: int) -> list[float]:
    """Median seconds per step of each checkout, measured in interleaved rounds."""
    ctx = mp.get_context("spawn")
    workers = []
    try:
        for root in roots:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(os.path.abspath(root), child, spec, threads), daemon=True)
            proc.start()
            workers.append((proc, parent))
        for (proc, conn), root in zip(workers, roots):
            kind, value = conn.recv()
            if kind != "ready":
                raise RuntimeError(f"{root}: {value}")
        times: list[list[float]] = [[] for _ in roots]
        for _ in range(rounds):
            for (proc, conn), t in zip(workers, times):
                conn.send(steps)
                t.append(conn.recv()[1])
        return [statistics.median(t) for t in times]
    finally:
        for proc, conn in workers:
            if proc.is_alive():
                conn.send(None)
                proc.join(timeout=30)


def main(argv: list[str] | None = None) -> int:
    from bench.train_throughput import MODES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--roots", nargs="+", required=True, help="source trees; the first is the reference")
    p.add_argument("--workloads", nargs="+", default=["resnet18"])
    p.add_argument("--size", default="smoke", help="workload size (bench/models): smoke, cpu, full")
    p.add_argument("--B", type=int, default=8)
    # Runner takes any mode it does not know for the plain array: a misspelt mode would time
    # that under the name given.
    p.add_argument("--mode", default="array", choices=[m for m in MODES if m != "concurrent"],
                   help="a train_throughput.py mode (concurrent is B processes, not one step)")
    p.add_argument("--backend", default="torch", help="the array modes' backend")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="write <out>.md and <out>.json")
    args = p.parse_args(argv)
    if len(args.roots) < 2:
        p.error("expected at least two --roots")
    revisions = [_revision(r) for r in args.roots]
    rows = []
    for workload in args.workloads:
        spec = dict(workload=workload, size=args.size, mode=args.mode,
                    backend=args.backend if args.mode.startswith("array") else None, precision=args.precision,
                    B=args.B, indices=list(range(args.B)), device=args.device, seed=0, compile_backend="inductor")
        seconds = compare(args.roots, spec, args.rounds, args.steps, args.threads)
        rows.append({"workload": workload, "ms_per_step": [s * 1e3 for s in seconds],
                     "speedup": [seconds[0] / s for s in seconds]})
        cells = ", ".join(f"{rev}: {s * 1e3:.2f} ms ({seconds[0] / s:.2f}x)" for rev, s in zip(revisions, seconds))
        print(f"{workload} {args.size} B={args.B} {args.mode}: {cells}", flush=True)
    if args.out:
        import torch

        from bench.report import recorded_argv
        from bench.train_throughput import environment
        env = environment(torch.device(args.device), args.threads)
        # The checkouts by revision: their folders are the machine's own.
        command = recorded_argv(sys.argv[1:] if argv is None else argv)
        start = command.index("--roots") + 1
        command[start:start + len(args.roots)] = [f"<{rev}>" for rev in revisions]
        # Settings of the C allocator change CPU step times (page faults of fresh memory).
        malloc = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")}
        record = {"benchmark": "compare_checkouts", "command": command, "revisions": revisions,
                  "environment": env, "malloc_env": malloc, "rows": rows}
        Path(args.out + ".json").write_text(json.dumps(record, indent=1) + "\n")
        head = "| workload | " + " | ".join(f"`{rev}`" for rev in revisions) + " |"
        lines = [f"# One training step in {len(revisions)} checkouts: {env['device']}, {env['date']}", "",
                 f"torch {env['torch']}, Python {env['python']}; workload size `{args.size}`, B = {args.B}, "
                 f"mode `{args.mode}`, {args.precision}; median of {args.rounds} interleaved rounds of "
                 f"{args.steps} steps, ms per step (speedup over `{revisions[0]}`); command: "
                 f"`{''.join(f'{k}={v} ' for k, v in malloc.items())}"
                 f"python bench/compare_checkouts.py {' '.join(command)}` (each `<rev>` a checkout of that "
                 "revision with its extension built)", "",
                 head, "| --- |" + " --- |" * len(revisions)]
        for row in rows:
            lines.append(f"| {row['workload']} | " + " | ".join(
                f"{ms:.2f} ({x:.2f}x)" for ms, x in zip(row["ms_per_step"], row["speedup"])) + " |")
        Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
