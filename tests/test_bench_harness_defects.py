"""The benchmark harness under the conditions of a short GPU session: a stage stopped by
``timeout -s INT`` (bench/gpu_run.sh) keeps what it finished, and the options, summaries and
tables say what was measured. CPU only, smoke sizes."""

from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import os
import select
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))


def _script(name: str, *args: str) -> list[str]:
    return [sys.executable, os.path.join("bench", name), *args]


def _run(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(_script(name, *args), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def _read_until(stream, marker: str, limit_s: float) -> str:
    """What ``stream`` (a pipe, read raw: tqdm ends its updates with \\r) says until ``marker``,
    or until ``limit_s`` seconds have passed."""
    seen, end = "", time.monotonic() + limit_s
    while marker not in seen and (left := end - time.monotonic()) > 0:
        if not select.select([stream], [], [], left)[0]:
            break
        chunk = os.read(stream.fileno(), 4096)
        if not chunk:
            break
        seen += chunk.decode(errors="replace")
    return seen


@pytest.fixture(scope="module")
def bench_scripts():
    """bench/'s script modules (report, bench_optim) imported as the scripts import them."""
    added = [p for p in (BENCH, ROOT) if p not in sys.path]
    sys.path[:0] = added
    try:
        yield types.SimpleNamespace(report=importlib.import_module("report"),
                                    bench_optim=importlib.import_module("bench_optim"))
    finally:
        for p in added:
            sys.path.remove(p)
        for name in ("bench_optim", "bench_kernels", "report", "shapes", "bandwidth"):
            sys.modules.pop(name, None)


# ---- train_throughput.py: a time limit's interrupt ------------------------------------------

def _busy_worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # as the benchmark's workers do
    time.sleep(120)


def test_closing_a_group_stops_a_busy_worker_at_once():
    from bench.train_throughput import Group

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_busy_worker, daemon=True)
    proc.start()
    g = Group("array[torch]", "array", "torch", procs=[proc], conns=[parent])   # no answer yet: busy
    t0 = time.monotonic()
    g.close()
    assert not proc.is_alive() and time.monotonic() - t0 < 10


@pytest.mark.long
def test_an_interrupt_while_workers_build_keeps_the_finished_cells(tmp_path):
    """The B = 1 cell is written as soon as it is done; the interrupt comes while the B = 2 cell's
    workers build and compile, and the benchmark ends at once instead of waiting for them."""
    stem = tmp_path / "t"
    proc = subprocess.Popen(
        _script("train_throughput.py", "--size", "smoke", "--B", "1", "2", "--compile-B", "2", "--precisions", "fp32",
                "--workloads", "pointnet", "--modes", "serial", "array", "array+compile", "array+compile-ro",
                "--compile-backend", "inductor", "--rounds", "1", "--steps", "1", "--warmup", "1",
                "--out", str(tmp_path), "--name", "t", "--no-plots"),
        cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 150
        while not (tmp_path / "t.json").exists() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before the interrupt"
        written = json.loads((tmp_path / "t.json").read_text())   # after the first cell, before the end
        assert {(r["B"], r["key"]) for r in written["rows"]} == {(1, "serial"), (1, "array[torch]")}
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        proc.wait(timeout=60)
        stopped_s = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert stopped_s < 20                  # not 30 s per busy worker
    record = json.loads(stem.with_suffix(".json").read_text())
    rows = {(r["B"], r["key"]): r for r in record["rows"]}
    for key in ("serial", "array[torch]"):
        assert "error" not in rows[(1, key)] and rows[(1, key)]["step_ms"] > 0
    assert all(r["B"] == 1 or "error" in r for r in record["rows"])
    assert record["skipped"] == ["interrupted: the cells after the last one reported"]
    assert "## pointnet, fp32" in stem.with_suffix(".md").read_text()


@pytest.mark.long
def test_an_interrupt_while_profiling_keeps_the_complete_rounds(tmp_path):
    """Every round done, then the profile (far too many steps) is interrupted: the rows keep the
    rounds, and say what was not measured. --smoke's defaults give way to the options given."""
    proc = subprocess.Popen(
        _script("train_throughput.py", "--smoke", "--precisions", "fp32", "--workloads", "pointnet",
                "--modes", "serial", "array", "--rounds", "2", "--profile-B", "3", "--profile-steps", "100000",
                "--out", str(tmp_path), "--name", "t", "--no-plots"),
        cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        seen = _read_until(proc.stderr, "rounds done; reading peak memory and profiling", 150)
        assert "rounds done" in seen, seen[-2000:]
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    record = json.loads((tmp_path / "t.json").read_text())
    assert record["settings"]["rounds"] == 2 and record["settings"]["profile_B"] == 2   # the B profiled
    rows = {r["key"]: r for r in record["rows"]}
    assert set(rows) == {"serial", "array[torch]"}
    for r in rows.values():
        assert "error" not in r and r["rounds"] == 2 and r["step_ms"] > 0, r
        assert "profile" in r["unmeasured"], r
    assert record["profiles"] == {}
    assert "not measured: " in (tmp_path / "t.md").read_text()


class _Progress:
    def __call__(self, n: int = 1) -> None:
        pass

    def note(self, text: str) -> None:
        pass


def _bisect_args(**kw):
    args = dict(B=[1, 2, 4, 8], time_budget=0, compile_B=[1, 6], compile_workloads=None, profile_B=0,
                profile_precisions=[], profile_steps=1, profile_top=1, max_step_seconds=1.0, bisect=True)
    return types.SimpleNamespace(**{**args, **kw})


def _fake_cells(calls: list, slow_B: int | None = None):
    """run_cell's stand-in: arrays run out of memory from B = 6 on, serial's step passes a second
    at B = 4, array+capture fails at B = 2 (not for memory)."""

    def run_cell(ctx, workload, precision, B, keys, s, profile, progress=None):
        calls.append((B, [k[0] for k in keys]))
        if B == slow_B:
            time.sleep(0.3)
        rows = []
        for key, mode, backend in keys:
            row = {"workload": workload, "precision": precision, "B": B, "key": key, "mode": mode}
            if mode.startswith("array") and B >= 6:
                row.update(error="OutOfMemoryError", oom=True)
            elif mode == "array+capture" and B == 2:
                row.update(error="RuntimeError: broken", oom=False)
            else:
                row["step_ms"] = 300.0 * B if mode == "serial" else 1.0
            rows.append(row)
        return rows, {}, False

    return run_cell


def _bisect(monkeypatch, args, slow_B=None):
    from bench import train_throughput as tt

    calls: list = []
    monkeypatch.setattr(tt, "run_cell", _fake_cells(calls, slow_B))
    keys = tt._group_keys(["serial", "hfta", "array", "array+compile", "array+capture"], ["torch"])
    s = tt.Settings(size="smoke", device="cpu", threads=1, steps=1, rounds=1, warmup=0, timeout=1, max_procs=1)
    rows, skipped = [], []
    tt._sweep_plan(None, args, s, keys, [("resnet18", "fp32")], _Progress(), rows, {}, skipped, lambda: None)
    return calls, skipped


def test_bisect_keeps_the_dropped_modes_out_and_compiles_only_at_compile_B(monkeypatch):
    calls, skipped = _bisect(monkeypatch, _bisect_args())
    assert [B for B, _ in calls] == [1, 2, 4, 8, 6, 5]
    by_B = dict(calls)
    # serial: dropped for its step time at B = 4; array+capture: failed at B = 2
    assert by_B[6] == ["hfta", "array[torch]", "array+compile[torch]"]
    assert by_B[5] == ["hfta", "array[torch]"]
    assert skipped == []


def test_bisect_starts_nothing_after_the_time_budget(monkeypatch):
    calls, skipped = _bisect(monkeypatch, _bisect_args(time_budget=0.2), slow_B=8)
    assert [B for B, _ in calls] == [1, 2, 4, 8]
    assert skipped == ["resnet18 fp32 bisect B=6"]


# ---- train_throughput.py: options and summary -------------------------------------------------

@pytest.mark.parametrize("option, value", [("--steps", "0"), ("--rounds", "0"), ("--warmup", "-1")])
def test_train_throughput_refuses_counts_it_cannot_use(option, value, tmp_path):
    # (--out: were the check to fail, the run must not write into the repository's results)
    proc = _run("train_throughput.py", "--smoke", option, value, "--out", str(tmp_path), "--no-plots", timeout=120)
    least = 0 if option == "--warmup" else 1
    assert proc.returncode == 2 and f"{option}: expected >= {least}, got {value}" in proc.stderr, proc.stderr


def test_summary_marks_speedups_and_says_what_a_profile_covers():
    from bench import train_throughput as tt

    def row(key, mode, sps, step_ms):
        return {"workload": "pointnet", "precision": "fp32", "B": 4, "key": key, "mode": mode,
                "samples_per_s": sps, "step_ms": step_ms}

    def prof(models, op_us):
        return {"models_in_process": models, "time": "self_cpu_us", "ops": [{"op": "aten::mm", "self_cpu_us": op_us}],
                "wall_us": 1e3, "host_us": 1e3, "device_us": 0.0, "launches": 0}

    rows = [row("serial", "serial", 100.0, 40.0), row("concurrent", "concurrent", 200.0, 20.0),
            row("hfta", "hfta", 400.0, 10.0), row("array[torch]", "array", 300.0, 13.0),
            row("array+capture[torch]", "array+capture", 250.0, 16.0)]
    tt.speedups(rows)
    # the cell's fastest (hfta) has no profile: the gaps are taken against array[torch]
    profiles = {"pointnet|fp32|4": {"concurrent": prof(1, 100.0), "array[torch]": prof(4, 200.0),
                                    "array+capture[torch]": prof(4, 300.0)}}
    record = {"environment": {"device": "cpu", "date": "d", "torch": "t", "triton": None, "python": "p",
                              "hfkern": "h"},
              "settings": {"size": "smoke", "rounds": 1, "steps": 1}, "command": "c", "rows": rows,
              "profiles": profiles, "gaps": tt.gaps(rows, profiles), "skipped": []}
    text = tt.summary(record)
    assert "300 x3.00S x1.50C x0.75H" in text
    assert ("Profile at B = 4 (against the fastest profiled mode, array[torch]; the fastest there, hfta, "
            "was not profiled)") in text
    assert "- B = 4, concurrent (one process, 1 of the 4 models): wall" in text
    assert "- B = 4, array[torch]: wall" in text


# ---- the other benchmarks --------------------------------------------------------------------

def test_bench_topk_keeps_the_sizes_done_when_interrupted(tmp_path):
    proc = subprocess.Popen(
        _script("bench_topk.py", "--sizes", "3001,3e7", "--densities", "0.01", "--reps", "2", "--device", "cpu",
                "--out", str(tmp_path), "--name", "tk"),
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = _read_until(proc.stdout, "[1/2] n=3001", 120)
        assert "[1/2] n=3001" in seen, seen
        assert json.loads((tmp_path / "tk.json").read_text())["rows"]     # written before the end
        proc.send_signal(signal.SIGINT)    # timeout -s INT's, while the second size runs
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    data = json.loads((tmp_path / "tk.json").read_text())
    assert data["meta"]["aborted"] == "interrupted" and data["meta"]["complete"]
    rows = data["rows"]
    assert {r["impl"] for r in rows if r["n"] == 3001} == {"torch.topk", "torch/approx", "torch/exact"}
    assert all(r["ms"] > 0 for r in rows)


def test_bench_kernels_help_prints():
    proc = _run("bench_kernels.py", "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "75% of the" in proc.stdout


def test_tables_print_long_layer_names_whole(bench_scripts, capsys):
    report = bench_scripts.report
    impls = ("torch", "triton", "cuda", "loop", "grouped_nchw", "grouped_nhwc", "unfused_torch", "unfused_triton",
             "convert", "vmap", "grouped")
    rows = [dict(dict.fromkeys(report.COLUMNS), op="batch_norm", model="mobilenet_v2",
                 layer="features.3.expand.bn+relu@nhwc", B=8, dtype="bf16", direction="fwd", impl=i, status="ok",
                 ms=0.1234, gbps=100.0, frac_copy_bw=0.5) for i in impls]
    report.print_table(rows)
    out = capsys.readouterr().out
    assert "mobilenet_v2.features.3.expand.bn+relu@nhwc" in out and "…" not in out


def test_optim_show_of_several_files_takes_each_files_ceiling(bench_scripts, tmp_path, capsys):
    report, bo = bench_scripts.report, bench_scripts.bench_optim
    paths = []
    for name, B, ms, copy in (("a", 4, 20.0, 100.0), ("b", 8, 2.0, 1000.0)):
        gbps = 1e9 / (ms * 1e-3) / 1e9
        row = dict(dict.fromkeys(report.COLUMNS), op="adam", B=B, impl="torch", status="ok", ms=ms, bytes=10**9,
                   gbps=gbps, frac_copy_bw=gbps / copy, dtype="fp32", direction="step")
        paths.append(str(tmp_path / f"{name}.json"))
        report.write_json(paths[-1], {"device": "gpu", "ceilings": {"copy_gbps": copy}, "complete": True}, [row])
    assert bo.main(["--show", *paths, "--no-table"]) == 0
    out = capsys.readouterr().out
    assert "adam B=4: hfkern torch 20.000 ms, 50 GB/s, floor 10.000 ms" in out
    assert "adam B=8: hfkern torch 2.000 ms, 500 GB/s, floor 1.000 ms" in out
    assert "copy bandwidth ceiling: per file, a.json: 100 GB/s, b.json: 1000 GB/s" in out


def test_compare_checkouts_refuses_an_unknown_mode():
    proc = _run("compare_checkouts.py", "--roots", ROOT, ROOT, "--mode", "array+captur", timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'array+captur'" in proc.stderr, proc.stderr


def test_bench_plan_records_the_backend_of_each_op():
    import hfkern
    from bench import bench_plan

    backends = bench_plan.resolved_backends(torch.device("cpu"))
    assert backends["requested"] == hfkern.backend_info()["requested"]
    assert backends["ops"]["adam_step_"].startswith("torch (")


def test_readme_states_the_optimizer_benchmarks_gradients():
    with open(os.path.join(BENCH, "README.md")) as f:
        text = f.read()
    assert "gradients stay fixed" not in text
    assert "by default (`fresh`)" in text
