"""Kernel benchmark: hfkern's array ops per backend against the baselines they replace.

For every case (op family, layer shape, array size B, dtype, direction) each
implementation runs on the same random inputs:

* ``torch``, ``triton``: the family's hfkern op (``torch.ops.hfkern.array_conv``,
  ``array_layer_norm``, ...) under ``hfkern.use_backend(name)``.
* the family's baselines: what a sweep runs without hfkern (B separate calls,
  one grouped cuDNN conv, ``torch.func.vmap``, ...).

The families, their shape suites, inputs, byte counts and baselines are
described in ``bench/families/`` (one module each); a family without a shape
suite is not benchmarked here. ``--suite bytes`` runs the named suite beside
the default one: the published workloads' shapes in both array layouts (NCHW
and channels-last memory) with the cost of a layout conversion, norms with a
fused activation against the unfused pair, and ReLU / residual add / copy_,
each row's bytes against the copy bandwidth.

Directions: ``fwd`` (forward under ``torch.no_grad``), ``bwd`` (the backward
alone: ``torch.autograd.grad`` over a forward graph built once and retained),
``fwd+bwd`` (forward with autograd, then the gradients of every input and
parameter). Every implementation's output (or gradients) is compared with the
torch backend's: ``rel_err`` = max over outputs of ||out - ref|| / ||ref||.

    python bench/bench_kernels.py                    # the whole suite on CUDA
    python bench/bench_kernels.py --quick            # a subset, a few minutes
    python bench/bench_kernels.py --ops layer_norm --dtypes bf16 --B 8
    python bench/bench_kernels.py --time-budget 300  # stop starting cases after 300 s
    python bench/bench_kernels.py --smoke            # tiny shapes on the CPU, seconds
    python bench/bench_kernels.py --suite bytes --dtypes bf16 --time-budget 90
    python bench/bench_kernels.py --show results.json  # the table and summaries of a result file again

Results go to ``<out>/<name>.csv`` and ``.json`` (bench/README.md explains the
columns and how bytes and FLOPs are counted); a table and the summary are
printed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):  # HERE first: the sibling modules below; ROOT: the in-tree hfkern
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import bandwidth  # noqa: E402
import families  # noqa: E402
import report  # noqa: E402
from families import Impl  # noqa: E402

import hfkern  # noqa: E402

# The families with a shape suite (the default one or a named one), by name.
FAMILIES = {name: f for name, f in families.discover().items() if f.shapes or f.suites}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
B_VALUES = (4, 8, 16)
# Array sizes of a named suite, where not B_VALUES: the bytes suite is at the
# published batch sizes, so B = 32 is what an H100's memory holds at most.
SUITE_B_VALUES = {"bytes": (8, 32)}
QUICK_B_VALUES = (8,)
SMOKE_B_VALUES = (2,)
SMOKE_DTYPES = ("fp32", "bf16")
# B's priority when a time budget cuts the suite short: the middle size first.
B_PRIORITY = (8, 16, 4)
# Rotation needs the last-level cache size; the CPU figure only sizes --smoke's rotation.
CPU_CACHE_BYTES = 4 * 2**20
MAX_ROTATE = 8
# A case's device memory, estimated as this many times its fwd+bwd bytes: the
# canonical inputs and gradients, a baseline's converted copies, outputs and
# saved tensors. Cases over the memory budget (by default this fraction of the
# device's memory) are not planned.
MEMORY_FACTOR = 2
MEMORY_FRACTION = 0.75


def suite_families(suite: str = "default", smoke: bool = False) -> dict:
    """{name: Family} of the families with shapes in ``suite``."""
    return {n: f for n, f in FAMILIES.items() if f.suite(name=suite, smoke=smoke)}


@dataclass(frozen=True)
class Case:
    op: str  # the family's name
    shape: object  # one of the family's shapes
    B: int
    dtype: str
    direction: str

    def label(self) -> str:
        s = self.shape
        return f"{self.op} {s.model}.{s.layer} B={self.B} {self.dtype} {self.direction}"


ContextLost = report.ContextLost  # the runners raise it when the CUDA context is unusable


# ---- bytes and FLOPs ---------------------------------------------------------

def cost(case: Case, elem: int) -> tuple[int, int | None]:
    """(bytes, FLOPs) the direction must move / compute at least.

    Bytes: every input read once and every output written once, in the
    benchmark's dtype (``elem`` bytes; the family's ``cost`` says what that is
    for its ops). ``fwd+bwd`` is the sum of the two directions.
    """
    fwd, bwd = FAMILIES[case.op].cost(case.shape, case.B, elem)
    if case.direction == "fwd":
        return fwd
    if case.direction == "bwd":
        return bwd
    return fwd[0] + bwd[0], (None if fwd[1] is None else fwd[1] + bwd[1])


# ---- implementations ---------------------------------------------------------

def build_fn(impl: Impl, d: dict, direction: str) -> tuple[Callable, Callable]:
    """(the timed callable, a map of its result to canonical tensors)."""
    own = impl.timed(d, direction)
    if own is not None:
        return own
    args, diff = impl.inputs(d, grad=direction != "fwd")
    if direction == "fwd":
        def fn():
            with torch.no_grad():
                return impl.forward(args)
        return fn, lambda res: [impl.canon_out(res)]
    gouts = impl.grad_outputs(d)
    if direction == "fwd+bwd":
        def fn():
            return torch.autograd.grad(impl.forward(args), diff, gouts)
    else:
        outs = impl.forward(args)

        def fn():
            return torch.autograd.grad(outs, diff, gouts, retain_graph=True)
    return fn, impl.canon_grads


def rel_err(outs: list, refs: list) -> float:
    """max over outputs of ||out - ref|| / ||ref||, in fp32."""
    if len(outs) != len(refs):
        raise ValueError(f"{len(outs)} outputs against {len(refs)} reference outputs")
    worst = 0.0
    for a, r in zip(outs, refs):
        if a.shape != r.shape:
            raise ValueError(f"output shape {list(a.shape)} against reference {list(r.shape)}")
        a, r = a.float(), r.float()
        den = r.norm().item()
        num = (a - r).norm().item()
        worst = max(worst, num / den if den > 0 else num)
    return worst


# ---- the run -----------------------------------------------------------------

class Runner:
    """Runs the implementations of one case after another and makes their rows."""

    def __init__(self, args, device: torch.device, timer, ceilings: dict, env: dict):
        self.args = args
        self.device = device
        self.timer = timer
        self.ceilings = ceilings
        self.env = env
        self.cache_bytes = _cache_bytes(device)
        self._reported: set[tuple] = set()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _check_context(self, after: str) -> None:
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize()
            torch.ones(1, device=self.device).add_(1).item()
        except Exception as e:  # noqa: BLE001
            raise ContextLost(f"CUDA context unusable after {after}: {type(e).__name__}: {e}") from e

    def _frac_matmul(self, dtype: str, tflops):
        if tflops is None:
            return None
        key = dtype
        if dtype == "fp32":
            key = "tf32" if self.device.type == "cuda" and torch.backends.cudnn.allow_tf32 else "fp32"
        ceil = (self.ceilings.get("matmul_tflops") or {}).get(key)
        return tflops / ceil if ceil else None

    def base_row(self, case: Case, impl_name: str, kind: str) -> dict:
        s = case.shape
        return {
            "op": case.op, "model": s.model, "layer": s.layer, "shape": s.describe(), "B": case.B,
            "dtype": case.dtype, "direction": case.direction, "impl": impl_name, "kind": kind,
            "status": None, "ms": None, "gbps": None, "tflops": None, "frac_copy_bw": None,
            "frac_matmul": None, "bytes": None, "flops": None, "rel_err": None, "rotate": None,
            "note": None, "error": None, **self.env,
        }

    def run_case(self, case: Case, impl_names) -> list[dict]:
        dtype = DTYPES[case.dtype]
        nbytes, flops = cost(case, torch.empty(0, dtype=dtype).element_size())
        # do_bench already flushes L2 before each timed call; rotating among
        # several input sets as well keeps a small case's inputs from being
        # cache-resident even where that flush is not used (CPU, cuda_events).
        rotate = 1 if nbytes >= self.cache_bytes else min(MAX_ROTATE, math.ceil(2 * self.cache_bytes / nbytes))
        grad = case.direction != "fwd"
        family = FAMILIES[case.op]
        datasets = [family.make_data(case.shape, case.B, dtype, self.device, grad) for _ in range(rotate)]
        impls = family.make_impls(case.shape, impl_names)
        rows, ref = [], None
        for impl in impls:
            row = self.base_row(case, impl.name, impl.kind)
            # An implementation that runs more passes than the op (an unfused
            # norm + activation, a layout conversion) counts the bytes of its own.
            row.update(bytes=impl.moved_bytes(nbytes, datasets[0], case.direction),
                       flops=flops if impl.computes_op else None, rotate=rotate,
                       note=getattr(impl, "note", None))
            failed = False

            def check(result, impl=impl, row=row):
                nonlocal ref
                if not impl.computes_op:
                    return
                if impl.name == "torch":
                    ref = result
                elif ref is not None:
                    try:
                        row["rel_err"] = rel_err(result, ref)
                        if not math.isfinite(row["rel_err"]):
                            row["rel_err"], row["note"] = None, "non-finite output"
                    except (ValueError, RuntimeError) as e:
                        row["note"] = f"not checked: {e}"

            try:
                ms = self._measure(impl, datasets, case.direction, check)
                if not ms > 0:
                    raise RuntimeError(f"the timer returned {ms} ms")
            except ContextLost:
                raise
            except Exception as e:  # noqa: BLE001  (one failing implementation must not stop the run)
                text = str(e).strip()
                msg = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:500]
                row.update(status="error", error=msg)
                if self.args.verbose:
                    traceback.print_exc()
                elif (case.op, impl.name, msg) not in self._reported:
                    self._reported.add((case.op, impl.name, msg))
                    print(f"  {impl.name} failed on {case.label()}: {msg}", flush=True)
                failed = True
            if failed:
                # Outside the except block, so the failed call's tensors are gone
                # before the allocator's cache is emptied.
                if self.device.type == "cuda":
                    self._check_context(f"{impl.name} on {case.label()}: {row['error'][:200]}")
                    torch.cuda.empty_cache()
                rows.append(row)
                continue
            row.update(status="ok", ms=ms, gbps=row["bytes"] / (ms * 1e-3) / 1e9)
            copy = self.ceilings.get("copy_gbps")
            row["frac_copy_bw"] = row["gbps"] / copy if copy else None
            if row["flops"] is not None:
                row["tflops"] = row["flops"] / (ms * 1e-3) / 1e12
                row["frac_matmul"] = self._frac_matmul(case.dtype, row["tflops"])
            rows.append(row)
        rows.extend(family.derived_rows(rows))
        return rows

    def _measure(self, impl: Impl, datasets: list[dict], direction: str, check: Callable) -> float:
        """Median ms of ``impl`` cycling over ``datasets``; ``check`` gets the
        canonical result of the first call on ``datasets[0]`` before the timing."""
        with impl.context():
            built = [build_fn(impl, d, direction) for d in datasets]
            fns, canon = [b[0] for b in built], built[0][1]
            del built
            # The first call compiles / autotunes / picks cuDNN algorithms and
            # gives the result that is checked against the reference.
            result = [t.detach() for t in canon(fns[0]())]
            self.sync()
            check(result)
            del result
            if isinstance(self.timer, bandwidth.GraphTimer):
                # One capture holds a call on every input set, in turn.
                ms = self.timer(lambda: [f() for f in fns]) / len(fns)
            else:
                cycle = itertools.cycle(fns)
                ms = self.timer(lambda: next(cycle)())
            self.sync()
        return ms


def _cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
    return CPU_CACHE_BYTES


def plan(args) -> list[Case]:
    """The cases to run, most important first (a time budget cuts the tail).

    The ``--quick`` subset (quick shapes, B=8, the directions the targets
    need, the headline direction first) comes first, then the rest of the
    suite by B (8, 16, 4, then larger); ops are interleaved so that a cut
    leaves every op measured. ``args.suite`` names the suite (``default``:
    each family's ``shapes``); a shape with ``directions`` runs in those only.
    """
    suite = args.suite
    if args.smoke:
        tiers = [[(op, s, B, dt, d) for s in FAMILIES[op].suite(smoke=True, name=suite) for B in args.B
                  for dt in args.dtypes for d in _directions(FAMILIES[op], args.directions, shape=s)]
                 for op in args.ops]
        return _filtered(_interleave(tiers), args)
    quick, rest = [], []
    for op in args.ops:
        family = FAMILIES[op]
        dirs_q = _directions(family, args.directions, quick=True, suite=suite)
        q = [(op, s, B, dt, d) for d in dirs_q for s in family.suite(quick=True, name=suite)
             if d in _directions(family, args.directions, quick=True, suite=suite, shape=s)
             for B in args.B if B in QUICK_B_VALUES or args.B_given
             for dt in args.dtypes]
        quick.append(q)
        seen = set(q)
        r = [(op, s, B, dt, d) for B in sorted(args.B, key=_b_priority) for s in family.suite(name=suite)
             for dt in args.dtypes for d in _directions(family, args.directions, shape=s)]
        rest.append([c for c in r if c not in seen])
    return _filtered(_interleave(quick) + ([] if args.quick else _interleave(rest)), args)


def _directions(family, asked: list[str] | None, quick: bool = False, suite: str = "default",
                shape=None) -> list[str]:
    """The directions ``--directions`` asked for that the family benchmarks, else its own
    (of the suite's --quick subset with ``quick``); only the shape's own where it has them."""
    if asked:
        dirs = [d for d in asked if d in family.directions]
    else:
        dirs = list(family.quick_directions_of(suite) if quick else family.directions)
    own = getattr(shape, "directions", None)
    return [d for d in dirs if own is None or d in own]


def _filtered(cases: list[tuple], args) -> list[Case]:
    """``--filter``: only layers whose ``model.layer`` contains the text; ``--exclude``:
    none that contains any of its texts."""
    text, exclude = args.filter, args.exclude or []

    def keep(c):
        name = f"{c[1].model}.{c[1].layer}"
        return (not text or text in name) and not any(e in name for e in exclude)

    return [Case(*c) for c in cases if keep(c)]


def footprint(case: Case) -> int:
    """Estimated device memory of a case: MEMORY_FACTOR times its fwd+bwd bytes,
    whatever its direction (a shape and B fit or not in every direction)."""
    elem = torch.empty(0, dtype=DTYPES[case.dtype]).element_size()
    fwd, bwd = FAMILIES[case.op].cost(case.shape, case.B, elem)
    return MEMORY_FACTOR * (fwd[0] + bwd[0])


def memory_budget(args, device: torch.device) -> float | None:
    """Bytes a case may take: ``--memory-budget`` GB, else MEMORY_FRACTION of the
    device's memory on CUDA; None (no limit) on the CPU."""
    if args.memory_budget is not None:
        return args.memory_budget * 1e9
    if device.type == "cuda":
        return MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory
    return None


def within_memory(cases: list[Case], budget: float | None) -> tuple[list[Case], list[Case]]:
    """(the cases whose footprint fits the budget, the others)."""
    if budget is None:
        return cases, []
    fits = [c for c in cases if footprint(c) <= budget]
    return fits, [c for c in cases if footprint(c) > budget]


def _b_priority(B: int) -> int:
    return B_PRIORITY.index(B) if B in B_PRIORITY else len(B_PRIORITY) + B


def _interleave(lists: list[list]) -> list:
    out = []
    for group in itertools.zip_longest(*lists):
        out.extend(c for c in group if c is not None)
    return out


# ---- environment -------------------------------------------------------------

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    """The per-row environment columns."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cudnn = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
    else:
        name = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
        cudnn = None
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": _version("triton") or _version("pytorch-triton"),
        "cudnn": cudnn,
        "cuda": torch.version.cuda,
        "hfkern": hfkern.__version__,
        "timer": None,
        "date": datetime.date.today().isoformat(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _csv_list(kind, choices=None):
    def parse(text: str):
        items = [kind(t.strip()) for t in text.split(",") if t.strip()]
        if choices is not None:
            bad = [i for i in items if i not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"expected a comma list of {list(choices)}, got {bad}")
        return items
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    all_impls = sorted({i for f in FAMILIES.values() for i in f.impl_names()})
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="op families:\n" + "\n".join(
                                    f"  {name}: {f.summary}" for name, f in FAMILIES.items())
                                + "\nsuites:\n" + "\n".join(f"  {n}: {t}" for n, t in families.SUITES.items()))
    p.add_argument("--suite", choices=list(families.SUITES), default="default",
                   help="the shape suite (default: each family's own; bytes: layouts, fused norms, "
                        "elementwise ops at the published workloads' shapes)")
    p.add_argument("--ops", type=_csv_list(str, FAMILIES), default=None,
                   help=f"comma list of op families (default: every family with shapes in the suite; "
                        f"{', '.join(FAMILIES)})")
    p.add_argument("--dtypes", type=_csv_list(str, DTYPES), default=None,
                   help="comma list of fp32, bf16, fp16 (default: all; --smoke: fp32,bf16)")
    p.add_argument("--B", type=_csv_list(int), default=None,
                   help="comma list of array sizes (default: 4,8,16, the quick subset 8; --smoke: 2)")
    p.add_argument("--directions", type=_csv_list(str, families.DIRECTIONS), default=None,
                   help="comma list of fwd, bwd, fwd+bwd (default: all; the quick subset: what the "
                        "targets need)")
    p.add_argument("--impls", type=_csv_list(str, all_impls), default=None,
                   help=f"comma list of implementations (default: all; --smoke: all but triton): {all_impls}")
    p.add_argument("--filter", default=None, help="only layers whose 'model.layer' contains this text")
    p.add_argument("--exclude", type=_csv_list(str), default=None,
                   help="comma list: no layer whose 'model.layer' contains any of these texts")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                   help=f"plan no case whose estimated memory ({MEMORY_FACTOR}x its fwd+bwd bytes) exceeds "
                        f"this (default on CUDA: {MEMORY_FRACTION * 100:.0f}%% of the device's memory)")
    p.add_argument("--quick", action="store_true", help="only the quick subset (a few minutes)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU, perf_counter timing, torch backend only (seconds)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no new case after this many seconds (the cases left are counted as skipped)")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="results directory (default bench/results)")
    p.add_argument("--name", default=None, help="file stem of the results (default kernels_<device>_<date>)")
    p.add_argument("--ceilings", default=None, metavar="JSON",
                   help="ceilings written by bench/bandwidth.py --out (default: measure them now)")
    p.add_argument("--timer", choices=bandwidth.TIMERS, default="do_bench",
                   help="CUDA timer: do_bench (eager calls, launch overhead included) or "
                        "cuda_graph (replays of one captured call: the kernels' own time)")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="warm-up per timing (ms)")
    p.add_argument("--rep-ms", type=float, default=40.0, help="repetition time per timing (ms)")
    p.add_argument("--no-table", action="store_true", help="print only the summary")
    p.add_argument("--list", action="store_true", help="print the planned cases and exit")
    p.add_argument("--verbose", action="store_true", help="print the traceback of every error row")
    p.add_argument("--show", nargs="+", default=None, metavar="FILE",
                   help="print the table (unless --no-table) and summaries of result files, run nothing")
    args = p.parse_args(argv)
    args.B_given = args.B is not None
    if args.ops is None:
        args.ops = list(suite_families(args.suite, smoke=args.smoke))
    if args.smoke:
        args.dtypes = args.dtypes or list(SMOKE_DTYPES)
        args.B = args.B or list(SMOKE_B_VALUES)
        # the CPU has no Triton: neither the backend nor a baseline run under it
        args.impls = args.impls or [i for i in all_impls if i != "triton" and not i.endswith("_triton")]
    else:
        args.dtypes = args.dtypes or list(DTYPES)
        args.B = args.B or list(SUITE_B_VALUES.get(args.suite, B_VALUES))
        args.impls = args.impls or all_impls
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.show:
        return show(args.show, table=not args.no_table)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    budget = memory_budget(args, device)
    cases, over_memory = within_memory(plan(args), budget)
    if args.list:
        for i, c in enumerate(cases):
            print(f"{i:5d} {c.label()}  [{c.shape.describe()}]")
        for c in over_memory:
            print(f"  over the memory budget: {c.label()}  [{c.shape.describe()}]")
        return 0
    t_start = time.monotonic()
    if device.type == "cuda":
        # cuDNN picks the fastest algorithm per shape, for the torch backend
        # and the baselines alike.
        torch.backends.cudnn.benchmark = True
        timer = bandwidth.make_cuda_timer(args.timer, args.warmup_ms, args.rep_ms)
    else:
        # The first call of every implementation (the checked one) is the warm-up.
        timer = bandwidth.CpuTimer(reps=3, max_seconds=0.5, warmup=0) if args.smoke else bandwidth.CpuTimer()
        if not args.smoke:
            print("warning: no CUDA device; timing on the CPU with perf_counter"
                  + (f" (--timer {args.timer} is for CUDA)" if args.timer != "do_bench" else ""))
    torch.manual_seed(0)
    env = environment(device)
    env["timer"] = timer.name

    ceilings = None
    if args.ceilings:
        try:
            with open(args.ceilings) as f:
                ceilings = json.load(f)
            if ceilings.get("device") not in (None, env["device"]):
                print(f"warning: ceilings were measured on {ceilings.get('device')}, not {env['device']}")
        except (OSError, ValueError) as e:
            print(f"could not read ceilings from {args.ceilings} ({e}); measuring them")
            ceilings = None
    if ceilings is None:
        ceilings = bandwidth.measure_ceilings(device, timer, smoke=args.smoke)
        ceilings["device"] = env["device"]

    tag = "" if args.suite == "default" else f"-{args.suite}"
    stem = args.name or f"kernels{tag}_{report.slug(env['device'].split(' (')[0])}_{env['date']}"
    if args.smoke and not args.name:
        stem = f"kernels{tag}_smoke_{env['date']}"
    meta = {
        "benchmark": "bench/bench_kernels.py",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "date": env["date"],
        "device": env["device"],
        "versions": {k: env[k] for k in ("torch", "triton", "cudnn", "cuda", "hfkern")}
        | {"python": platform.python_version(), "git": _git_commit()},
        "ceilings": ceilings,
        "settings": {
            "timer": timer.name, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark) if device.type == "cuda" else None,
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32) if device.type == "cuda" else None,
            "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32) if device.type == "cuda" else None,
            "cache_bytes": _cache_bytes(device), "quick": args.quick, "smoke": args.smoke,
            "time_budget_s": args.time_budget, "suite": args.suite,
            "memory_budget_bytes": budget, "memory_factor": MEMORY_FACTOR,
        },
        "backends": _backend_summary(),
        "planned_cases": len(cases),
        "skipped_cases": 0,
        # Cases left out of the plan because their estimated memory exceeds the budget.
        "over_memory_budget": [c.label() for c in over_memory],
        # True once the plan ran to its end or to the time budget; False after
        # an abort (CUDA context lost) or an interrupt.
        "finished": False,
    }
    writer = report.RowWriter(args.out, stem, meta)
    writer.write_json(complete=False)
    bw = ceilings.get("copy_gbps")
    print(f"device: {env['device']}; torch {env['torch']}, triton {env['triton']}, cuDNN {env['cudnn']}, "
          f"CUDA {env['cuda']}; timer {timer.name}")
    print(f"copy bandwidth ceiling: {bw:.0f} GB/s; matmul TFLOP/s: "
          + ", ".join(f"{k} {v:.1f}" for k, v in (ceilings.get('matmul_tflops') or {}).items())
          if bw else "copy bandwidth ceiling: not measured")
    print(f"{len(cases)} cases; writing {writer.csv_path}", flush=True)
    if over_memory:
        print(f"{len(over_memory)} cases over the memory budget of {budget / 1e9:.0f} GB not planned: "
              + ", ".join(c.label() for c in over_memory[:6]) + (", ..." if len(over_memory) > 6 else ""))

    runner = Runner(args, device, timer, ceilings, env)
    report.run_cases(cases, lambda case: runner.run_case(case, args.impls), writer, meta, args.time_budget, t_start, device)
    if not args.no_table:
        report.print_table(writer.rows)
    meta["summary"] = report.print_summary(writer.rows, meta)
    if any(_split_layer(r["layer"])[2] or r["op"] == "elementwise" for r in writer.rows):
        meta["bytes_summary"] = bytes_summary(writer.rows)
        print("\n".join(["", "=== where the bytes go ==="] + bytes_summary_lines(meta["bytes_summary"])))
    writer.write_json(complete=True)
    print(f"wrote {writer.csv_path} and {writer.json_path} ({len(writer.rows)} rows)")
    return 0 if meta["finished"] else 3


def show(paths: list[str], table: bool = True) -> int:
    """The table and summaries of result files (several are merged)."""
    meta, rows = report.merge(paths)
    if table:
        report.print_table(rows)
    report.print_summary(rows, meta)
    if any(_split_layer(r["layer"])[2] or r["op"] == "elementwise" for r in rows):
        print("\n".join(["", "=== where the bytes go ==="] + bytes_summary_lines(bytes_summary(rows))))
    return 0


# ---- the bytes suite's summary -------------------------------------------------

def _split_layer(layer: str) -> tuple[str, str | None, str | None]:
    """(layer, fused activation, layout) of a layer name such as ``layer1.bn+relu@nhwc``."""
    base, _, layout = (layer or "").partition("@")
    base, _, act = base.partition("+")
    return base, act or None, layout or None


def _reads_case_memory(impl: str) -> bool:
    """Whether an implementation computes on the case's own layout (the baselines
    that convert or copy their inputs before the timing do not)."""
    return impl in families.BACKENDS or impl == "grouped" or impl.startswith("unfused_")


def _stats(values: list[float], mean: str = "geomean") -> dict:
    centre = report.geomean(values) if mean == "geomean" else statistics.median(values)
    return {mean: centre, "min": min(values), "max": max(values), "n": len(values)}


def bytes_summary(rows: list[dict]) -> dict:
    """What the bytes suite shows, from its rows:

    * ``layout``: time in nhwc memory over time in nchw memory, per op,
      direction, implementation and dtype, geometric mean over the shapes and
      B where both ran (< 1: channels-last is faster);
    * ``conversion``: the ``convert`` row's time over the op's (its faster
      hfkern backend) in the same case, median per op, direction, layout, dtype;
    * ``fusion``: ``unfused_<backend>`` time over the fused op's under that
      backend (> 1: fusing wins), geometric mean per op, activation, direction,
      backend and dtype, with the fused op's median fraction of the copy bandwidth;
    * ``elementwise``: the fraction of the copy bandwidth of torch's
      elementwise ops, median per op, direction, layout and dtype.
    """
    ok = [r for r in rows if r.get("status") == "ok" and r.get("ms")]
    layout_pairs: dict[tuple, dict[str, float]] = {}
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in ok:
        base, act, layout = _split_layer(r["layer"])
        by_case.setdefault((r["op"], r["model"], r["layer"], r["B"], r["dtype"], r["direction"]), {})[r["impl"]] = r
        if layout and _reads_case_memory(r["impl"]):
            key = (r["op"], r["model"], base, act, r["B"], r["dtype"], r["direction"], r["impl"])
            layout_pairs.setdefault(key, {})[layout] = r["ms"]
    layout_ratios: dict[str, list[float]] = {}
    for (op, _m, _l, act, _B, dtype, direction, impl), t in layout_pairs.items():
        if "nchw" in t and "nhwc" in t:
            name = f"{op}{'+' + act if act else ''} {direction} {impl} {dtype}"
            layout_ratios.setdefault(name, []).append(t["nhwc"] / t["nchw"])
    conversion: dict[str, list[float]] = {}
    fusion: dict[str, list[float]] = {}
    fused_frac: dict[str, list[float]] = {}
    elementwise: dict[str, list[float]] = {}
    for (op, _m, layer, _B, dtype, direction), impls in by_case.items():
        base, act, layout = _split_layer(layer)
        conv = impls.get("convert")
        ops = [impls[b] for b in families.BACKENDS if b in impls]
        if conv and ops:
            fastest = min(ops, key=lambda r: r["ms"])
            conversion.setdefault(f"{op} {direction} {layout} {dtype}", []).append(conv["ms"] / fastest["ms"])
        if act:
            for b in families.BACKENDS:
                fused, unfused = impls.get(b), impls.get(f"unfused_{b}")
                if fused and unfused:
                    name = f"{op}+{act} {direction} {b} {dtype}"
                    fusion.setdefault(name, []).append(unfused["ms"] / fused["ms"])
                    if fused.get("frac_copy_bw") is not None:
                        fused_frac.setdefault(name, []).append(fused["frac_copy_bw"])
        if op == "elementwise" and "torch" in impls and impls["torch"].get("frac_copy_bw") is not None:
            ew = base.rsplit(".", 1)[-1]
            elementwise.setdefault(f"{ew} {direction} {layout} {dtype}", []).append(impls["torch"]["frac_copy_bw"])
    return {
        "layout_nhwc_over_nchw": {k: _stats(v) for k, v in layout_ratios.items()},
        "conversion_over_op": {k: _stats(v, "median") for k, v in conversion.items()},
        "unfused_over_fused": {k: {**_stats(v), "fused_frac_copy_bw": statistics.median(fused_frac[k])
                                   if fused_frac.get(k) else None} for k, v in fusion.items()},
        "elementwise_frac_copy_bw": {k: _stats(v, "median") for k, v in elementwise.items()},
    }


def bytes_summary_lines(summary: dict) -> list[str]:
    lines = []

    def block(title, stats, fmt):
        lines.append(title)
        if not stats:
            lines.append("  n/a (no case where both ran)")
        for key, st in sorted(stats.items()):
            lines.append(f"  {key}: {fmt(st)}")

    def ratio(centre):
        return lambda st: (f"{st[centre]:.2f}x {centre} over {st['n']} cases "
                           f"(min {st['min']:.2f}x, max {st['max']:.2f}x)")

    block("layout: time in nhwc memory over time in nchw memory (< 1: channels-last faster)",
          summary["layout_nhwc_over_nchw"], ratio("geomean"))
    block("layout conversion to the other layout and back: its time over the op's (fastest hfkern backend)",
          summary["conversion_over_op"], ratio("median"))

    def fused(st):
        frac = st.get("fused_frac_copy_bw")
        return ratio("geomean")(st) + ("" if frac is None else f"; fused at {100 * frac:.0f}% of copy bandwidth")

    block("fused norm + activation: unfused pair's time over the fused op's (> 1: fusion faster)",
          summary["unfused_over_fused"], fused)
    block("elementwise ops (torch): % of copy bandwidth",
          summary["elementwise_frac_copy_bw"],
          lambda st: f"{100 * st['median']:.0f}% median over {st['n']} cases "
                     f"(min {100 * st['min']:.0f}%, max {100 * st['max']:.0f}%)")
    return lines


def _backend_summary() -> dict:
    try:
        info = hfkern.backend_info()
        return {"backends": info["backends"], "ops": info["ops"]}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
    raise SystemExit(main())
