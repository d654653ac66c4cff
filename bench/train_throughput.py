"""End-to-end training throughput of the published workloads (bench/models): B
models trained as one hfkern array against what a user would do instead.

Modes (``--modes``):

* ``serial``: the B torch models one after another in one process, each with
  its own ``torch.optim`` optimizer;
* ``concurrent``: B processes sharing the device, one model each (on a CPU,
  each process gets ``threads // B`` threads, at least one);
* ``vmap``: one model's code over the stacked parameters
  (``torch.func.stack_module_state`` + ``functional_call`` under ``torch.vmap``),
  stepped by the hfkern array optimizer (torch.optim cannot give stacked
  parameters a learning rate per model);
* ``hfta``: the original HFTA's horizontal fusion in plain torch, no hfkern
  (``bench/models/hfta.py``): grouped convolutions and one batch norm over
  ``B*C`` channels on the ``[N, B*C, H, W]`` layout, ``baddbmm`` linear layers,
  torch's foreach optimizer math over the fused parameters with each model's
  learning rate as a ``[B, 1]`` column; the baseline the array modes must beat;
* ``array``: ``hfkern.fuse`` of the B models with the hfkern array optimizer,
  once per backend (``--backends``; by default those available on the device:
  ``torch`` serves hfkern's ops by the original paper's kernels, cuDNN
  grouped conv and batched GEMM; ``triton`` and ``cuda`` are hfkern's kernels;
  a selection with per-op choices, ``torch,sgd_step_=cuda,adam_step_=cuda``,
  is the torch path with those ops on another backend: one op's evidence for
  ``auto``, :mod:`hfkern._evidence`);
* ``array+ops``: ``array`` with every hfkern op dispatched as under
  ``torch.compile`` (``hfkern._backend.dispatched_ops()``): the torch backend
  without its eager paths (its convolutions and batch norms under torch's own
  autograd), to measure the host time those save (only when asked for);
* ``array+compile``: the same with the fused model under ``torch.compile``
  (forward and backward; compile time is reported, not timed);
* ``array+compile-ro``: the same under ``torch.compile(mode="reduce-overhead")``,
  torch's own answer to host-bound steps (inductor's CUDA graphs of the forward
  and backward; the optimizer step eager), against which ``array+capture`` is
  weighed;
* ``array+capture``: the same whole step (forward, losses, backward, optimizer)
  under :func:`hfkern.capture_step`: one CUDA graph replay per step after the
  warm-up calls (on a CPU it runs eagerly, as ``array``).
* ``array+cl``, ``array+capture+cl``: ``array`` and ``array+capture`` with the
  fused models' images in channels-last array memory
  (``fused.to(memory_format=torch.channels_last)``, ``[N, H, W, B, C]``: the
  layout cuDNN's grouped convolutions use without conversions).

Every mode trains the same networks from the same initial weights (model b of
every mode is built under the same seed) on the same synthetic batch, with the
learning rates of ``Workload.learning_rates(B)``. Precisions (``--precisions``):
``fp32`` and ``bf16`` (the forward under ``torch.autocast``, losses in fp32).

Each mode runs in processes of its own (a forkserver with torch preloaded), so
that peak memory is the mode's own: on CUDA ``torch.cuda.max_memory_allocated``
(summed over the processes of ``concurrent``; the per-process CUDA contexts
come on top), on a CPU the peak resident memory above the process's resident
memory after its imports. The modes of one cell (workload, precision, B) run
interleaved: each round times ``--steps`` steps of every mode in turn after an
untimed step, and the median over ``--rounds`` rounds is reported, so that a
drift of the machine's speed reaches all modes alike.

B sweeps 1, 2, 4, ... up to ``--max-B``; a mode that runs out of memory (or
whose step exceeds ``--max-step-seconds``) is dropped for larger B. With
``--bisect``, the largest B that fits the array modes is then found by
bisection between the last B that fitted and the first that did not.

At ``--profile-B`` each mode's step (``--profile-modes all``), or only the
slowest hfkern array mode of the cell (``slowest-array``), is profiled with
``torch.profiler``: wall time, host (CPU) time, device time and kernel launches
per step, and the top ops by self time (device time on CUDA); the summary
names, for each mode slower than the best, the op whose time grows most
against the best mode.

Outputs in ``--out`` (default bench/results), named ``train_<device>_<date>``:
``.json`` (rows: workload, mode, backend, B, precision, samples/s, step time,
peak MB, speedups, device, versions, date; profiles; gaps), ``.md`` (the
summary) and ``_<workload>.png`` (throughput against B; needs matplotlib). The
``.json`` and ``.md`` are written after every cell; a SIGINT or SIGTERM (a time
limit's) ends the cell that is running with each mode's complete rounds, stops
its workers at once and writes the results.

    python bench/train_throughput.py --smoke                     # tiny, every mode, seconds
    python bench/train_throughput.py                             # CPU: size "cpu", B up to 16
    python bench/train_throughput.py --workloads resnet18 --B 1 2 4 8 16 --precisions fp32
    python bench/train_throughput.py --report bench/results/train_<device>_<date>.json  # summary, plots
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

MODES = ("serial", "concurrent", "vmap", "hfta", "array", "array+ops", "array+compile", "array+compile-ro",
         "array+capture", "array+cl", "array+capture+cl")
PRECISIONS = ("fp32", "bf16")
ARRAY_MODES = ("array", "array+ops", "array+compile", "array+compile-ro", "array+capture", "array+cl",
               "array+capture+cl")
COMPILE_MODES = ("array+compile", "array+compile-ro")
DIAGNOSTIC_MODES = ("array+ops",)  # run when asked for


# ==== the worker side: one mode's models, optimizers and data in one process ====================
def _optimizer_class(package, name: str):
    return getattr(package, {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}[name])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Memory:
    """Peak memory of this process from now on: CUDA's allocator peak, or on a CPU
    the peak resident set (reset through /proc/self/clear_refs) above the
    resident set at construction."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = 0
            return
        self.base = self._status("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                      # resets VmHWM to the current resident set
        except OSError:
            self.base = None

    @staticmethod
    def _status(key: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def peak_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        hwm = self._status("VmHWM")
        return None if self.base is None or hwm is None else max(hwm - self.base, 0)


class Runner:
    """One mode's training state for models ``indices`` of an array of B, and its step.

    ``spec``: workload, size, mode, backend, precision, B, indices, device, seed.
    """

    def __init__(self, spec: dict):
        import hfkern
        from bench.models import WORKLOADS

        self.hfkern = hfkern
        self.spec = spec
        self.w = WORKLOADS[spec["workload"]]
        self.device = torch.device(spec["device"])
        self.mode = spec["mode"]
        self.B = spec["B"]
        self.indices = list(spec["indices"])
        self.autocast = spec["precision"] == "bf16"
        lrs = self.w.learning_rates(self.B)
        opt_name, opt_kwargs = self.w.optimizer
        self.batch = tuple(t.to(self.device) for t in self.w.batch(spec["size"], seed=spec["seed"]))
        self.backend = spec.get("backend")

        # model b of net n: the same initial weights in every mode and process
        def build(net: str, b: int):
            torch.manual_seed(spec["seed"] * 7919 + 1000 * self.w.nets.index(net) + b)
            return self.w.build(net, spec["size"]).to(self.device)

        if self.mode in ("serial", "concurrent"):
            self.models = {n: [build(n, b) for b in self.indices] for n in self.w.nets}
            self.opts = {n: [_optimizer_class(torch.optim, opt_name)(m.parameters(), lr=lrs[b], **opt_kwargs)
                             for m, b in zip(self.models[n], self.indices)] for n in self.w.nets}
            return
        models = {n: [build(n, b) for b in range(self.B)] for n in self.w.nets}
        if self.mode == "hfta":
            from bench.models import hfta

            # HFTA's own layout: the contiguous grouped [N, B*C, H, W] (what array[torch] keeps
            # unless a +cl mode asks for channels-last).
            self.hfta = {n: hfta.fuse(self.w.name, n, ms) for n, ms in models.items()}
            self.opts = {n: hfta.optimizer(opt_name, f.parameters(), self.B, lr=lrs, **opt_kwargs)
                         for n, f in self.hfta.items()}
            return
        array_opt = _optimizer_class(hfkern.optim, opt_name)
        if self.mode == "vmap":
            self._vmapped: dict = {}
            self.stacked = {}
            for n, ms in models.items():
                params, buffers = torch.func.stack_module_state(ms)
                # Model 0 lends its code; a meta copy would not do: functional_call
                # re-ties tied weights (BERT's decoder) through the module's own tensors.
                self.stacked[n] = (ms[0], params, buffers)
            self.opts = {n: array_opt(list(self.stacked[n][1].values()), lr=lrs, **opt_kwargs) for n in self.w.nets}
            return
        self.arrays = {n: hfkern.fuse(ms) for n, ms in models.items()}
        if self.mode.endswith("+cl"):  # before the optimizer: its state follows the weights' strides
            self.arrays = {n: a.to(memory_format=torch.channels_last) for n, a in self.arrays.items()}
        self.opts = {n: array_opt(a.parameters(), lr=lrs, **opt_kwargs) for n, a in self.arrays.items()}
        self.forward = dict(self.arrays)
        if self.mode in COMPILE_MODES:
            kw = {"mode": "reduce-overhead"} if self.mode == "array+compile-ro" else {}
            self.forward = {n: torch.compile(a, backend=spec["compile_backend"], **kw) for n, a in self.arrays.items()}
        if self.mode.startswith("array+capture"):
            self.captured = hfkern.capture_step(
                lambda *batch: self.w.step(self._array_apply, self._array_update, batch), *self.batch)

    # -- one step ----------------------------------------------------------------------------
    def _autocast(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _one_model(self, k: int):
        def apply(net, *inputs, per_model=False):
            if per_model:
                inputs = tuple(x.squeeze(0) for x in inputs)
            with self._autocast():
                out = self.models[net][k](*inputs)
            return out.float().unsqueeze(0)

        def update(net, losses):
            opt = self.opts[net][k]
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
        return apply, update

    def _array_apply(self, net, *inputs, per_model=False):
        if not per_model:
            inputs = tuple(self.hfkern.broadcast(x, self.B) for x in inputs)
        with self._autocast():
            out = self.forward[net](*inputs)
        return out.float()

    def _hfta_apply(self, net, *inputs, per_model=False):
        with self._autocast():
            out = self.hfta[net](*inputs, per_model=per_model)
        return out.float()

    def _vmap_apply(self, net, *inputs, per_model=False):
        base, params, buffers = self.stacked[net]
        key = (net, len(inputs), per_model)
        if key not in self._vmapped:
            def one(p, b, *xs):
                return torch.func.functional_call(base, (p, b), xs)
            dims = (0, 0) + ((0 if per_model else None),) * len(inputs)
            self._vmapped[key] = torch.vmap(one, in_dims=dims, randomness="different")
        with self._autocast():
            out = self._vmapped[key](params, buffers, *inputs)
        return out.float()

    def _array_update(self, net, losses):
        opt = self.opts[net]
        opt.zero_grad()
        losses.sum().backward()
        opt.step()

    def step(self) -> torch.Tensor:
        if self.mode in ("serial", "concurrent"):
            return torch.cat([self.w.step(*self._one_model(k), self.batch) for k in range(len(self.indices))])
        apply = {"vmap": self._vmap_apply, "hfta": self._hfta_apply}.get(self.mode, self._array_apply)
        with (self.hfkern.use_backend(self.backend) if self.backend else contextlib.nullcontext()), \
                (self.hfkern._backend.dispatched_ops() if self.mode == "array+ops" else contextlib.nullcontext()):
            if self.mode.startswith("array+capture"):
                return self.captured(*self.batch)
            return self.w.step(apply, self._array_update, self.batch)

    def run(self, steps: int) -> tuple[float, float]:
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        _sync(self.device)
        return t0, time.perf_counter()

    def profile(self, steps: int, top: int) -> dict:
        """Per step (microseconds): wall, host and device time, kernel launches, and the top ops
        by self time over ``steps`` steps."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.run(1)
        with profile(activities=acts) as prof:
            t0, t1 = self.run(steps)
        rows = []
        for e in prof.key_averages():
            dev = getattr(e, "self_device_time_total", None)
            if dev is None:
                dev = getattr(e, "self_cuda_time_total", 0)
            rows.append({"op": e.key, "calls": e.count / steps, "self_cpu_us": e.self_cpu_time_total / steps,
                         "self_device_us": dev / steps})
        by = "self_device_us" if self.device.type == "cuda" else "self_cpu_us"
        rows.sort(key=lambda r: -r[by])
        # A launch is a runtime call that starts device work: kernels, and the graph replays
        # that stand for a whole step's kernels.
        launches = sum(r["calls"] for r in rows if r["op"] in _LAUNCH_CALLS)
        return {"steps": steps, "models_in_process": len(self.indices) if self.mode in ("serial", "concurrent")
                else self.B, "time": by, "total_us": sum(r[by] for r in rows), "ops": rows[:top],
                "wall_us": 1e6 * (t1 - t0) / steps, "host_us": sum(r["self_cpu_us"] for r in rows),
                "device_us": sum(r["self_device_us"] for r in rows), "launches": launches}


_LAUNCH_CALLS = {"cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                 "cudaGraphLaunch", "cudaLaunchCooperativeKernel"}


def _describe(e: BaseException) -> dict:
    text = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
    return {"error": text, "oom": oom, "traceback": traceback.format_exc(limit=6)}


def _worker(conn, spec: dict, barrier) -> None:
    """A mode's process: build, warm up, then answer the coordinator's commands."""
    # A time limit's SIGINT goes to the whole process group: the coordinator keeps the rounds
    # already timed and stops its workers itself, so a worker must not die mid-round first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.set_num_threads(spec["threads"])
        if spec["device"] == "cpu":
            torch.set_flush_denormal(True)      # denormal arithmetic would slow late steps on a CPU
        device = torch.device(spec["device"])
        if device.type == "cuda":
            if device.index is None:        # set_device wants an index, not "cuda"
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
        memory = _Memory(device)
        t0 = time.perf_counter()
        runner = Runner(spec)
        t1 = time.perf_counter()
        for _ in range(spec["warmup"]):
            runner.step()
        _sync(device)
        conn.send(("ready", {"build_s": t1 - t0, "warmup_s": time.perf_counter() - t1}))
        while True:
            cmd, arg = conn.recv()
            if cmd == "run":
                runner.run(1)                       # untimed: caches and allocator warm again
                if barrier is not None:
                    barrier.wait()
                conn.send(("ok", runner.run(arg)))
                if device.type == "cuda":
                    torch.cuda.empty_cache()        # idle modes hold parameters and state only
            elif cmd == "memory":
                conn.send(("ok", memory.peak_bytes()))
            elif cmd == "profile":
                conn.send(("ok", runner.profile(*arg)))
            else:
                break
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the coordinator
        with contextlib.suppress(Exception):
            if barrier is not None:
                barrier.abort()
            conn.send(("error", _describe(e)))


# ==== the coordinator: cells, interleaved rounds, rows ==========================================
@dataclass
class Group:
    """The processes of one mode (one, or B for ``concurrent``)."""

    key: str                                   # "serial", "array[torch]", ...
    mode: str
    backend: str | None
    procs: list = field(default_factory=list)
    conns: list = field(default_factory=list)
    info: dict = field(default_factory=dict)
    times: list = field(default_factory=list)
    error: dict | None = None
    barrier: Any = None                        # kept alive until the processes have unpickled it
    # Whether every process has answered its last command. A busy worker (building, warming
    # up, timing, profiling) reads "stop" only after its task, which can take minutes.
    idle: bool = False

    def send(self, cmd, arg=None) -> None:
        self.idle = False
        for c in self.conns:
            c.send((cmd, arg))

    def gather(self, timeout: float) -> list:
        out = []
        for c in self.conns:
            if not c.poll(timeout):
                raise TimeoutError(f"{self.key}: no answer within {timeout:.0f} s")
            kind, payload = c.recv()
            if kind == "error":
                raise _WorkerError(payload)
            out.append(payload)
        self.idle = True
        return out

    def close(self, wait: float = 30.0) -> None:
        """Stop the processes: idle ones are asked to, busy ones are terminated at once; any
        still alive after ``wait`` seconds is killed."""
        for c in self.conns:
            with contextlib.suppress(Exception):
                c.send(("stop", None))
        for p in self.procs:
            if not self.idle and p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=wait)
            if p.is_alive():
                p.kill()
                p.join()


class _WorkerError(Exception):
    def __init__(self, payload: dict):
        super().__init__(payload["error"])
        self.payload = payload


def _context():
    ctx = mp.get_context("forkserver")
    # The server imports these once; each worker forks from it with them loaded.
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "torch.optim", "hfkern", "bench.models",
                                "bench.models.hfta"])
    return ctx


def available_backends(device: torch.device) -> list[str]:
    import hfkern

    info = hfkern.backend_info()["backends"]
    names = [n for n, b in info.items() if b["available"]]
    if device.type != "cuda":
        names = [n for n in names if n == "torch"]    # Triton's interpreter is a test tool, not a backend to time
    return names


def _group_keys(modes, backends) -> list[tuple[str, str, str | None]]:
    keys = []
    for mode in modes:
        if mode in ARRAY_MODES:
            keys += [(f"{mode}[{b}]", mode, b) for b in backends]
        else:
            keys.append((mode, mode, None))
    return keys


@dataclass
class Settings:
    size: str
    device: str
    threads: int
    steps: int
    rounds: int
    warmup: int
    timeout: float
    max_procs: int
    compile_backend: str = "inductor"
    profile_modes: str = "all"
    seed: int = 0


def start_group(ctx, key, mode, backend, workload, precision, B, s: Settings) -> Group:
    g = Group(key, mode, backend)
    if mode == "concurrent":
        parts = [[b] for b in range(B)]
        threads = max(1, s.threads // B)
    else:
        parts = [list(range(B))]
        threads = s.threads
    barrier = g.barrier = ctx.Barrier(len(parts)) if len(parts) > 1 else None
    for idx in parts:
        spec = {"workload": workload, "size": s.size, "mode": mode, "backend": backend, "precision": precision,
                "B": B, "indices": idx, "device": s.device, "seed": s.seed, "threads": threads,
                "warmup": s.warmup, "compile_backend": s.compile_backend}
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child, spec, barrier), daemon=True)
        p.start()
        child.close()
        g.procs.append(p)
        g.conns.append(parent)
    return g


def run_cell(ctx, workload: str, precision: str, B: int, keys, s: Settings, profile: tuple[int, int] | None,
             progress=None) -> tuple[list[dict], dict, bool]:
    """Time every mode of one (workload, precision, B) in interleaved rounds: (rows, profiles,
    interrupted). A SIGINT (the time limit's) ends the cell with the rounds already timed."""
    groups: list[Group] = []
    interrupted = True                  # also when an exception leaves _run_cell
    try:
        rows, profiles, interrupted = _run_cell(ctx, workload, precision, B, keys, s, profile, progress, groups)
        return rows, profiles, interrupted
    finally:
        # After the time limit's SIGINT its kill follows within seconds, and what has not been
        # written by then is lost: no waiting for workers that are still building or timing.
        for g in groups:
            g.close(wait=5.0 if interrupted else 30.0)


def _run_cell(ctx, workload, precision, B, keys, s: Settings, profile, progress, groups: list[Group]):
    from bench.models import hfta

    live = []
    interrupted = False
    cell = f"{workload} {precision} B={B}"
    try:
        for key, mode, backend in keys:
            skip = None
            if mode == "concurrent" and B > s.max_procs:
                skip = f"skipped: B = {B} processes exceeds --max-procs {s.max_procs}"
            elif mode == "hfta" and not hfta.supports(workload):
                skip = f"skipped: hfta is not implemented for workload {workload!r}"
            if skip:
                g = Group(key, mode, backend)
                g.error = {"error": skip, "oom": False}
                groups.append(g)
                continue
            groups.append(start_group(ctx, key, mode, backend, workload, precision, B, s))
        started = time.perf_counter()
        for g in groups:                # every group builds and warms up at once; gather in turn
            if g.error:
                continue
            try:
                infos = g.gather(s.timeout * 4)
                g.info = {"build_s": max(i["build_s"] for i in infos),
                          "warmup_s": max(i["warmup_s"] for i in infos)}
                live.append(g)
                _log(progress, f"{cell} {g.key}: ready after {time.perf_counter() - started:.0f} s "
                               f"(build {g.info['build_s']:.1f} s, warm-up {g.info['warmup_s']:.1f} s)")
            except (_WorkerError, TimeoutError, EOFError, OSError) as e:
                g.error = _error_of(e)
                _log(progress, f"{cell} {g.key}: failed ({g.error['error'][:120]})")
                g.close()
        for _ in range(s.rounds):
            for g in list(live):
                try:
                    g.send("run", s.steps)
                    spans = g.gather(s.timeout)
                    g.times.append((max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)) / s.steps)
                except (_WorkerError, TimeoutError, EOFError, OSError) as e:
                    g.error = _error_of(e)
                    live.remove(g)
                    g.close()
            if progress is not None:
                progress()
    except KeyboardInterrupt:
        # The time limit: keep each mode's complete rounds (a mode that has none reports so).
        interrupted = True
        _log(progress, f"{cell}: interrupted; keeping the rounds already timed")
    profiled = {g.key for g in live}
    if s.profile_modes == "slowest-array":
        timed = [g for g in live if g.mode in ARRAY_MODES and g.times]
        profiled = {max(timed, key=lambda g: statistics.median(g.times)).key} if timed else set()
    if profile is None:
        profiled = set()
    profiles: dict = {}
    if not interrupted:
        if live:
            _log(progress, f"{cell}: rounds done; reading peak memory" + (" and profiling" if profiled else ""))
        try:
            _measure_after_rounds(live, s, profile, profiled, profiles, progress, cell)
        except KeyboardInterrupt:
            # Every round is complete by now: the rows keep them, without what was not read yet.
            interrupted = True
            _log(progress, f"{cell}: interrupted after its rounds; keeping the rounds already timed "
                           "(peak memory and profiles not read by then are not measured)")
    rows = []
    for g in groups:
        row = {"workload": workload, "mode": g.mode, "backend": g.backend, "key": g.key, "B": B,
               "precision": precision}
        if g.error or not g.times:
            none = "interrupted before its first round" if interrupted else "no time"
            row.update(error=(g.error or {}).get("error", none), oom=(g.error or {}).get("oom", False))
        else:
            med = statistics.median(g.times)
            row.update(step_ms=1e3 * med, min_step_ms=1e3 * min(g.times), rounds=len(g.times),
                       peak_mb=None if g.info.get("peak_bytes") is None else g.info["peak_bytes"] / 2**20,
                       build_s=g.info["build_s"], warmup_s=g.info["warmup_s"])
            unmeasured = (["peak memory"] if "peak_bytes" not in g.info else []) + \
                (["profile"] if g.key in profiled and g.key not in profiles else [])
            if unmeasured:
                row["unmeasured"] = unmeasured
        rows.append(row)
    return rows, profiles, interrupted


def _measure_after_rounds(live: list[Group], s: Settings, profile, profiled: set, profiles: dict, progress,
                          cell: str) -> None:
    """Each timed mode's peak memory (into its ``info``) and the profiles of ``profiled``, kept as
    they come in: an interrupt leaves what was read."""
    # A profile runs its own number of steps under the profiler: its timeout grows with them (up
    # to a day; a pipe's poll takes no more than about 24 days).
    profile_timeout = min(s.timeout * max(1.0, (profile[0] + 1) / (s.steps + 1)), 86400.0) if profile \
        else s.timeout
    for g in live:
        with contextlib.suppress(_WorkerError, TimeoutError, EOFError, OSError):
            g.send("memory")
            peaks = g.gather(s.timeout)
            g.info["peak_bytes"] = None if any(p is None for p in peaks) else sum(peaks)
        if g.key in profiled:
            try:
                g.idle = False
                g.conns[0].send(("profile", profile))
                if not g.conns[0].poll(profile_timeout):
                    raise TimeoutError(f"no answer within {profile_timeout:.0f} s")
                kind, payload = g.conns[0].recv()
                if kind == "ok":
                    profiles[g.key] = payload
                    g.idle = True
            except (TimeoutError, EOFError, OSError) as e:
                _log(progress, f"{cell} {g.key}: profile not measured ({type(e).__name__}: {e})")


def _error_of(e: BaseException) -> dict:
    """A row's error of a worker's failure, or of the coordinator's (timeout, lost pipe)."""
    return e.payload if isinstance(e, _WorkerError) else {"error": f"{type(e).__name__}: {e}", "oom": False}


def _log(progress, text: str) -> None:
    if progress is not None:
        progress.log(text)
    else:
        print(text, file=sys.stderr, flush=True)


# ==== results: rows, gaps, summary, plots ========================================================
def environment(device: torch.device, threads: int) -> dict:
    import hfkern

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({platform.processor() or platform.machine()}, {threads} threads)"
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return {"device": name, "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton, "hfkern": hfkern.__version__, "date": datetime.date.today().isoformat()}


def finish_rows(rows: list[dict], workloads, size: str, env: dict) -> None:
    """Samples/s and speedups over serial, vmap, concurrent and hfta at equal B; device and versions."""
    from bench.models import WORKLOADS

    for r in rows:
        r.update(env)
        r["size"] = size
        if "step_ms" in r:
            r["samples_per_s"] = r["B"] * WORKLOADS[r["workload"]].samples(size) / (r["step_ms"] / 1e3)
    speedups(rows)


def speedups(rows: list[dict]) -> None:
    """Each row's speedups over serial, vmap, concurrent and hfta of its (workload, precision, B)."""
    by_cell: dict = {}
    for r in rows:
        if "samples_per_s" in r:
            by_cell.setdefault((r["workload"], r["precision"], r["B"]), {})[r["key"]] = r["samples_per_s"]
    for r in rows:
        if "samples_per_s" not in r:
            continue
        cell = by_cell[(r["workload"], r["precision"], r["B"])]
        for ref in ("serial", "vmap", "concurrent", "hfta"):
            r[f"vs_{ref}"] = r["samples_per_s"] / cell[ref] if ref in cell else None


def gaps(rows: list[dict], profiles: dict) -> list[dict]:
    """For each profiled cell, the op that grows most from the best mode to each slower one."""
    out = []
    for cell_key, per_mode in profiles.items():
        workload, precision, B = cell_key.split("|")
        B = int(B)
        cell = [r for r in rows if r["workload"] == workload and r["precision"] == precision and r["B"] == B
                and "samples_per_s" in r and r["key"] in per_mode]
        if len(cell) < 2:
            continue
        best = max(cell, key=lambda r: r["samples_per_s"])

        def per_step(key):
            p = per_mode[key]
            scale = B / p["models_in_process"]        # a concurrent profile covers one model of B
            return {o["op"]: o[p["time"]] * scale for o in p["ops"]}

        ref = per_step(best["key"])
        for r in cell:
            if r is best:
                continue
            mine = per_step(r["key"])
            deltas = {op: t - ref.get(op, 0.0) for op, t in mine.items()}
            op, delta = max(deltas.items(), key=lambda kv: kv[1])
            out.append({"workload": workload, "precision": precision, "B": B, "mode": r["key"],
                        "best": best["key"], "gap_ms": r["step_ms"] - best["step_ms"], "op": op,
                        "op_delta_ms": delta / 1e3, "op_ms": mine[op] / 1e3, "op_best_ms": ref.get(op, 0.0) / 1e3})
    return out


def _fmt(x, spec=".2f", suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"


def summary(record: dict) -> str:
    rows = [r for r in record["rows"] if "samples_per_s" in r]
    env = record["environment"]
    lines = [f"# End-to-end training throughput: {env['device']}, {env['date']}", "",
             f"torch {env['torch']}, triton {env['triton']}, Python {env['python']}, hfkern {env['hfkern']}; "
             f"workload size `{record['settings']['size']}`; median of {record['settings']['rounds']} interleaved "
             f"rounds of {record['settings']['steps']} steps; command: `{record['command']}`", "",
             "Samples/s are of all B models together; `xS`, `xV`, `xC`, `xH`: speedup over serial, vmap, "
             "concurrent and hfta (the HFTA-style baseline) at the same B; peak MB: the mode's own peak memory "
             "(bench/train_throughput.py).", ""]
    errors = [r for r in record["rows"] if "error" in r]
    for workload in dict.fromkeys(r["workload"] for r in record["rows"]):
        for precision in dict.fromkeys(r["precision"] for r in record["rows"] if r["workload"] == workload):
            mine = [r for r in rows if r["workload"] == workload and r["precision"] == precision]
            if not mine:
                continue
            lines += [f"## {workload}, {precision}", ""]
            keys = list(dict.fromkeys(r["key"] for r in mine))
            Bs = sorted({r["B"] for r in mine})
            lines.append("| B | " + " | ".join(keys) + " |")
            lines.append("| --- |" + " --- |" * len(keys))
            for B in Bs:
                cells = []
                for k in keys:
                    r = next((r for r in mine if r["B"] == B and r["key"] == k), None)
                    if r is None:
                        e = next((e for e in errors if e["workload"] == workload and e["precision"] == precision
                                  and e["B"] == B and e["key"] == k), None)
                        cells.append("OOM" if e and e.get("oom") else ("failed" if e else ""))
                        continue
                    extra = [f"x{r['vs_serial']:.2f}S" if r.get("vs_serial") and r["mode"] != "serial" else ""]
                    if r["mode"] in ARRAY_MODES:
                        extra += [f"x{r[f'vs_{ref}']:.2f}{mark}" for ref, mark in
                                  (("vmap", "V"), ("concurrent", "C"), ("hfta", "H")) if r.get(f"vs_{ref}")]
                    cells.append(f"{r['samples_per_s']:,.0f} {' '.join(x for x in extra if x)}"
                                 f" ({_fmt(r.get('peak_mb'), '.0f')} MB)")
                lines.append(f"| {B} | " + " | ".join(cells) + " |")
            best = max(mine, key=lambda r: r["samples_per_s"])
            serial_best = max((r["samples_per_s"] for r in mine if r["mode"] == "serial"), default=None)
            lines += ["", f"Best: {best['key']} at B = {best['B']}, {best['samples_per_s']:,.0f} samples/s"
                      + (f", {best['samples_per_s'] / serial_best:.2f}x the best serial rate" if serial_best else "")
                      + ".", ""]
            gs = [g for g in record.get("gaps", []) if g["workload"] == workload and g["precision"] == precision]
            for B in dict.fromkeys(g["B"] for g in gs):
                at_B = [g for g in gs if g["B"] == B]
                # A gap is taken against the fastest mode with a profile, which need not be the
                # cell's fastest when only some modes were profiled.
                fastest = max((r for r in mine if r["B"] == B), key=lambda r: r["samples_per_s"])["key"]
                against = at_B[0]["best"]
                where = (f"best there: {against}" if against == fastest else
                         f"against the fastest profiled mode, {against}; the fastest there, {fastest}, "
                         "was not profiled")
                lines.append(f"Profile at B = {B} ({where}); the op that grows most in each slower mode, "
                             "per step of all B models:")
                lines.append("")
                for g in at_B:
                    lines.append(f"- {g['mode']}: {g['gap_ms']:.2f} ms/step slower; `{g['op']}` "
                                 f"{g['op_ms']:.2f} ms against {g['op_best_ms']:.2f} ms (+{g['op_delta_ms']:.2f} ms)")
                lines.append("")
            cells = [(key, mode, p) for key, per_mode in record.get("profiles", {}).items()
                     if key.startswith(f"{workload}|{precision}|") for mode, p in per_mode.items() if "host_us" in p]
            if cells:
                lines += ["Profiled steps (per step of all B models): wall, host (CPU) and device time, kernel "
                          "launches, and the top ops by device (CPU) time:", ""]
                for key, mode, p in cells:
                    top = ", ".join(f"`{o['op'][:60]}` {o[p['time']] / 1e3:.2f} ms" for o in p["ops"][:5])
                    B = int(key.split("|")[2])
                    # concurrent's profile is one of its B processes: its own models, not all B
                    n = p.get("models_in_process", B)
                    if n < B:
                        mode = f"{mode} (one process, {n} of the {B} models)"
                    lines.append(f"- B = {B}, {mode}: wall {p['wall_us'] / 1e3:.2f} ms, host "
                                 f"{p['host_us'] / 1e3:.2f} ms, device {p['device_us'] / 1e3:.2f} ms, "
                                 f"{p['launches']:.0f} launches; {top}")
                lines.append("")
    partial = [f"- {r['workload']} {r['precision']} B={r['B']} {r['key']}: {r['rounds']} of "
               f"{record['settings']['rounds']} rounds; not measured: {', '.join(r['unmeasured'])}"
               for r in rows if r.get("unmeasured")]
    if record.get("skipped") or partial:
        lines += ["## Not run (time budget or interrupted)", "", *[f"- {x}" for x in record.get("skipped", [])],
                  *partial, ""]
    if errors:
        lines += ["## Failures", ""]
        for e in errors:
            lines.append(f"- {e['workload']} {e['precision']} B={e['B']} {e['key']}: {e['error']}")
        lines.append("")
    return "\n".join(lines)


def plot(record: dict, stem: str) -> list[str]:
    """One PNG per workload: samples/s against B, one line per mode and precision."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (render them later with --report FILE.json)")
        return []
    rows = [r for r in record["rows"] if "samples_per_s" in r]
    files = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        mine = [r for r in rows if r["workload"] == workload]
        for (key, precision) in dict.fromkeys((r["key"], r["precision"]) for r in mine):
            pts = sorted((r["B"], r["samples_per_s"]) for r in mine if r["key"] == key and r["precision"] == precision)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    linestyle="-" if precision == "fp32" else "--", label=f"{key} {precision}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("B (models trained together)")
        ax.set_ylabel("samples/s, all models")
        env = record["environment"]
        ax.set_title(f"{workload} ({record['settings']['size']}), {env['device']}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = f"{stem}_{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def merge(records: list[dict]) -> dict:
    """One result of several runs (say one per precision) of the same size and device."""
    first = records[0]
    for r in records[1:]:
        if r["settings"]["size"] != first["settings"]["size"] or r["environment"]["device"] != first["environment"]["device"]:
            raise ValueError("merge: expected results of one size and device, got "
                             f"{first['settings']['size']}/{first['environment']['device']} and "
                             f"{r['settings']['size']}/{r['environment']['device']}")
    out = {**first, "command": " ; ".join(r["command"] for r in records),
           "seconds": sum(r["seconds"] for r in records), "rows": [], "profiles": {}, "gaps": [], "skipped": []}
    for r in records:
        out["rows"] += r["rows"]
        for cell, per_mode in r["profiles"].items():
            out["profiles"].setdefault(cell, {}).update(per_mode)
        out["skipped"] += r["skipped"]
    speedups(out["rows"])        # against the baselines of another run of the same cell too
    out["gaps"] = gaps(out["rows"], out["profiles"])
    return out


def write_outputs(record: dict, stem: str, plots: bool = True) -> list[str]:
    # Each file replaced whole: a run killed while writing keeps the previous cell's.
    for path, text in ((stem + ".json", json.dumps(record, indent=1)), (stem + ".md", summary(record))):
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    files = [stem + ".json", stem + ".md"]
    if plots:
        files += plot(record, stem)
    return files


# ==== the sweep ==================================================================================
def _powers(max_B: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(max_B)) + 1)]


class _Progress:
    def __init__(self, total: int):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="round", dynamic_ncols=True)
        except ImportError:
            self.bar = None
        self.done, self.total = 0, total

    def __call__(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def log(self, text: str) -> None:
        """A line of its own above the bar (a mode ready, failed, interrupted)."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)
        else:
            print(f"[{self.done}/{self.total}] {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def profiled_B(requested: int, Bs: list[int]) -> int:
    """The B that is profiled: ``requested`` where it is swept, else the largest swept B below it
    (the smallest swept B where there is none)."""
    return requested if requested in Bs else max((b for b in Bs if b <= requested), default=min(Bs))


def sweep(args, s: Settings, keys, env: dict, save=None) -> dict:
    """Every cell of the plan (``args.B`` and ``args.profile_B`` as used). ``save(result)`` is called
    with the result so far after every cell: a run killed after its time limit's SIGINT keeps
    the cells that finished."""
    ctx = _context()
    rows: list[dict] = []
    profiles: dict = {}
    skipped: list[str] = []
    plan = [(w, p) for w in args.workloads for p in args.precisions]
    progress = _Progress(len(plan) * len(args.B) * s.rounds)

    def result() -> dict:
        finish_rows(rows, args.workloads, s.size, env)
        return {"rows": rows, "profiles": profiles, "gaps": gaps(rows, profiles), "skipped": skipped}

    def cell_done() -> None:
        if save is not None:
            save(result())

    try:
        _sweep_plan(ctx, args, s, keys, plan, progress, rows, profiles, skipped, cell_done)
    except KeyboardInterrupt:
        skipped.append("interrupted: the cells after the last one reported")
    progress.close()
    return result()


def _cell_keys(keys, args, workload: str, B: int, dropped) -> list:
    """The modes a cell runs: those not dropped, the compiled ones only at --compile-B and on
    --compile-workloads."""
    compiled = ((not args.compile_B or B in args.compile_B)
                and (not args.compile_workloads or workload in args.compile_workloads))
    return [k for k in keys if k[0] not in dropped and (compiled or k[1] not in COMPILE_MODES)]


def _sweep_plan(ctx, args, s, keys, plan, progress, rows, profiles, skipped, cell_done) -> None:
    start = time.perf_counter()

    def over_budget() -> bool:
        return bool(args.time_budget) and time.perf_counter() - start > args.time_budget

    for workload, precision in plan:
        dropped: dict[str, str] = {}               # group key -> why it stopped
        oom_at: dict[str, int] = {}                # group key -> the B it ran out of memory at
        last_fit = first_fail = None
        for B in args.B:
            if over_budget():
                skipped.append(f"{workload} {precision} B={B}")
                progress(s.rounds)
                continue
            cell_keys = _cell_keys(keys, args, workload, B, dropped)
            if not cell_keys:
                progress(s.rounds)
                continue
            progress.note(f"{workload} {precision} B={B}")
            prof = (args.profile_steps, args.profile_top) \
                if B == args.profile_B and precision in args.profile_precisions else None
            cell_rows, cell_prof, interrupted = run_cell(ctx, workload, precision, B, cell_keys, s, prof, progress)
            rows += cell_rows
            if cell_prof:
                profiles[f"{workload}|{precision}|{B}"] = cell_prof
            if interrupted:
                raise KeyboardInterrupt
            cell_done()
            for r in cell_rows:
                if "error" in r and r["mode"] != "concurrent":
                    dropped[r["key"]] = r["error"]
                    if r.get("oom"):
                        oom_at[r["key"]] = B
                elif r.get("step_ms", 0) / 1e3 > args.max_step_seconds:
                    dropped[r["key"]] = f"step over {args.max_step_seconds} s at B = {B}"
            arr = [r for r in cell_rows if r["mode"] == "array"]
            if arr and all("error" not in r for r in arr):
                last_fit = B
            elif arr and any(r.get("oom") for r in arr) and first_fail is None:
                first_fail = B
        if args.bisect and last_fit and first_fail:
            # Between last_fit and first_fail, the modes still running and those that ran out of
            # memory at first_fail or above (what the bisection is for); not those dropped for
            # their step time, a failure, or memory at a B below first_fail.
            still_out = {k: why for k, why in dropped.items() if oom_at.get(k, 0) < first_fail}
            lo, hi = last_fit, first_fail
            while hi - lo > max(1, lo // 8):
                mid = (lo + hi) // 2
                if over_budget():
                    skipped.append(f"{workload} {precision} bisect B={mid}")
                    break
                bkeys = [k for k in _cell_keys(keys, args, workload, mid, still_out)
                         if k[1] in ARRAY_MODES or k[1] in ("serial", "hfta")]
                progress.note(f"{workload} {precision} bisect B={mid}")
                cell_rows, _, interrupted = run_cell(ctx, workload, precision, mid, bkeys, s, None)
                rows += cell_rows
                if interrupted:
                    raise KeyboardInterrupt
                cell_done()
                arr = [r for r in cell_rows if r["mode"] == "array"]
                lo, hi = (mid, hi) if all("error" not in r for r in arr) else (lo, mid)


def main(argv=None) -> int:
    from bench.models import WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--modes", nargs="+", default=[m for m in MODES if m not in DIAGNOSTIC_MODES], choices=MODES,
                   help=f"default: all but {', '.join(DIAGNOSTIC_MODES)}")
    p.add_argument("--backends", nargs="+",
                   help="array backends (default: those available on the device); a backend with per-op "
                        "choices, torch,sgd_step_=cuda, times one op's kernels within the torch path's step")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--size", choices=("full", "cpu", "smoke"), help="workload sizes (default: full on CUDA, cpu otherwise)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--B", type=int, nargs="+", help="array sizes (default: 1, 2, 4, ... up to --max-B)")
    p.add_argument("--max-B", type=int, default=16)
    p.add_argument("--bisect", action="store_true", help="bisect for the largest B the array fits after an OOM")
    p.add_argument("--steps", type=int, help="timed steps per round (default 3; --smoke: 1)")
    p.add_argument("--rounds", type=int, help="interleaved rounds per cell (default 5; --smoke: 1)")
    p.add_argument("--warmup", type=int,
                   help="untimed steps after building (compiles, autotunes; default 2; --smoke: 1)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads per mode")
    p.add_argument("--max-procs", type=int, default=32, help="largest B the concurrent mode runs")
    p.add_argument("--max-step-seconds", type=float, default=30.0, help="drop a mode for larger B past this")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a mode may take for one round")
    p.add_argument("--profile-B", type=int,
                   help="the B profiled (default 16; --smoke: the largest B), else the largest swept B below it")
    p.add_argument("--profile-steps", type=int, help="steps per profile (default 2; --smoke: 1)")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--profile-precisions", nargs="+", default=["fp32"], choices=PRECISIONS)
    p.add_argument("--profile-modes", choices=("all", "slowest-array"), default="all",
                   help="profile every mode of the profiled cells, or the slowest hfkern array mode only")
    p.add_argument("--time-budget", type=float, default=0, help="start no cell after this many seconds")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", help="file stem (default train_<device>_<date>)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--compile-B", type=int, nargs="+",
                   help="the B values array+compile and array+compile-ro run at (default: all)")
    p.add_argument("--compile-workloads", nargs="+", choices=list(WORKLOADS),
                   help="the workloads array+compile and array+compile-ro run on (default: all)")
    p.add_argument("--compile-backend",
                   help="torch.compile backend of array+compile and array+compile-ro (default inductor; "
                        "--smoke: aot_eager)")
    p.add_argument("--smoke", action="store_true",
                   help="the harness's own check: other defaults (size smoke, B = 2, one round of one step "
                        "after one warm-up step, profiles of one step at the largest B, compile with "
                        "aot_eager); options given explicitly win")
    p.add_argument("--report", metavar="JSON", nargs="+",
                   help="only write the summary and plots of saved results (several, or with --name: merged "
                        "into --out/--name, speedups taken across the runs)")
    args = p.parse_args(argv)
    # A time limit's SIGINT or SIGTERM stops the sweep and writes what it has; a
    # process started in the background by a shell inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    if args.report:
        records = []
        for path in args.report:
            with open(path) as f:
                records.append(json.load(f))
        if len(records) == 1 and not args.name:
            record = records[0]
            stem = args.report[0][:-5] if args.report[0].endswith(".json") else args.report[0]
            files = [stem + ".md"]
        else:
            if not args.name:
                p.error("--report with several files: --name STEM names the merged result")
            os.makedirs(args.out, exist_ok=True)
            record = merge(records)
            stem = os.path.join(args.out, args.name)
            files = write_outputs(record, stem, plots=False)
        with open(stem + ".md", "w") as f:
            f.write(summary(record))
        print("\n".join(files + ([] if args.no_plots else plot(record, stem))))
        return 0
    # --smoke changes the defaults only: an option given explicitly wins.
    defaults = {"steps": 3, "rounds": 5, "warmup": 2, "profile_steps": 2, "compile_backend": "inductor"}
    if args.smoke:
        args.size = args.size or "smoke"
        args.B = args.B or [2]
        # the compile path without inductor's C++ builds
        defaults = {"steps": 1, "rounds": 1, "warmup": 1, "profile_steps": 1, "compile_backend": "aot_eager"}
        args.profile_B = max(args.B) if args.profile_B is None else args.profile_B
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    device = torch.device(args.device)
    size = args.size or ("full" if device.type == "cuda" else "cpu")
    for B in args.B or []:
        if B < 1:
            p.error(f"--B: expected array sizes >= 1, got {B}")
    if args.max_B < 1:
        p.error(f"--max-B: expected >= 1, got {args.max_B}")
    # Step times are divided by the steps, medians taken over the rounds; the warm-up may be
    # skipped (every round starts with an untimed step).
    for name, least in (("steps", 1), ("rounds", 1), ("profile_steps", 1), ("threads", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')}: expected >= {least}, got {getattr(args, name)}")
    args.B = args.B or _powers(args.max_B)
    args.profile_B = profiled_B(16 if args.profile_B is None else args.profile_B, args.B)
    backends = args.backends or available_backends(device)
    import hfkern

    for b in backends:
        if b.split(",")[0] not in hfkern.backend_info()["backends"]:
            p.error(f"--backends: unknown backend {b!r}; expected some of {tuple(hfkern.backend_info()['backends'])}")
        if "," in b:  # per-op choices: checked as hfkern checks them, availability included
            try:
                hfkern._backend._check_requestable(b, "--backends")
            except (ValueError, TypeError, RuntimeError) as e:
                p.error(str(e))
    keys = _group_keys(args.modes, backends)
    s = Settings(size=size, device=str(device), threads=args.threads, steps=args.steps, rounds=args.rounds,
                 warmup=args.warmup, timeout=args.timeout, max_procs=args.max_procs,
                 compile_backend=args.compile_backend, profile_modes=args.profile_modes)
    from bench.report import recorded_argv

    env = environment(device, args.threads)
    os.makedirs(args.out, exist_ok=True)
    dev = "cpu" if device.type != "cuda" else env["device"].replace("NVIDIA ", "").split()[0].lower()
    stem = os.path.join(args.out, args.name or f"train_{dev}_{env['date']}")
    t0 = time.perf_counter()

    def record_of(result: dict) -> dict:
        return {"benchmark": "bench/train_throughput.py", "environment": env,
                "command": "python bench/train_throughput.py " + " ".join(
                    recorded_argv(argv if argv is not None else sys.argv[1:])),
                "settings": {"size": size, "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
                             "threads": args.threads, "modes": list(args.modes), "backends": backends,
                             "precisions": list(args.precisions), "profile_B": args.profile_B,
                             "compile_backend": args.compile_backend,
                             "compile_workloads": args.compile_workloads or list(args.workloads)},
                "seconds": time.perf_counter() - t0, **result}

    # The JSON and summary after every cell (plots only at the end: matplotlib takes seconds).
    record = record_of(sweep(args, s, keys, env, save=lambda result: write_outputs(record_of(result), stem,
                                                                                     plots=False)))
    files = write_outputs(record, stem, plots=not args.no_plots)
    print(summary(record))
    print("written: " + ", ".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
