"""The kernel benchmark (bench/bench_kernels.py) end to end in its CPU --smoke mode,
and the arithmetic behind its columns and summary."""

import csv
import importlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["COLUMNS"] = "200"
    proc = subprocess.run(
        [sys.executable, os.path.join("bench", "bench_kernels.py"), "--smoke", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"smoke run failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return out, proc.stdout


def test_smoke_writes_csv_and_json(smoke_run, bench):
    out, stdout = smoke_run
    report, bk = bench["report"], bench["bench_kernels"]
    csvs = [f for f in os.listdir(out) if f.endswith(".csv")]
    jsons = [f for f in os.listdir(out) if f.endswith(".json")]
    assert len(csvs) == 1 and len(jsons) == 1 and csvs[0][:-4] == jsons[0][:-5], os.listdir(out)

    with open(out / csvs[0], newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == report.COLUMNS
        csv_rows = list(reader)
    with open(out / jsons[0]) as f:
        data = json.load(f)
    meta, rows = data["meta"], data["rows"]
    assert len(rows) == len(csv_rows) > 0
    assert all(list(r) == report.COLUMNS for r in rows)
    assert meta["complete"] and meta["finished"] and meta["skipped_cases"] == 0
    assert meta["ceilings"]["copy_gbps"] > 0
    assert meta["versions"]["torch"] == torch.__version__

    # every family with a default suite, each of its directions and every smoke dtype is there, and ran
    default = bk.suite_families("default", smoke=True)
    assert {"conv", "layer_norm", "embedding"} <= set(default)
    for op, family in default.items():
        for direction in family.directions:
            for dtype in bk.SMOKE_DTYPES:
                got = [r for r in rows if (r["op"], r["direction"], r["dtype"]) == (op, direction, dtype)]
                assert got and all(r["status"] == "ok" for r in got), (op, direction, dtype)
    impls = {(r["op"], r["impl"]) for r in rows}
    # --smoke runs the torch backend only, never triton; each family's implementations that
    # apply to its default suite (a layout conversion or an unfused pair applies to none)
    expected = {(op, i.name) for op, f in default.items() for s in f.suite(smoke=True)
                for i in f.make_impls(s, f.impl_names()) if i.backend != "triton"}
    expected |= {(op, n) for op, f in default.items() for n, b in f.baselines.items()
                 if isinstance(b, bench["families"].Fastest)}
    assert impls == expected
    assert {i for op, i in impls if op == "conv"} == {
        "torch", "grouped_nchw", "grouped_nhwc", "grouped_best", "vmap", "loop"}

    for r in rows:
        assert r["device"] and r["date"] and r["timer"] == "perf_counter" and r["torch"] == torch.__version__
        assert r["ms"] > 0 and r["bytes"] > 0 and r["rotate"] >= 1
        assert math.isclose(r["gbps"], r["bytes"] / (r["ms"] * 1e-3) / 1e9, rel_tol=1e-9)
        assert math.isclose(r["frac_copy_bw"], r["gbps"] / meta["ceilings"]["copy_gbps"], rel_tol=1e-9)
        if r["op"] == "conv":
            assert r["flops"] > 0 and math.isclose(r["tflops"], r["flops"] / (r["ms"] * 1e-3) / 1e12, rel_tol=1e-9)
        else:
            assert r["flops"] is None and r["tflops"] is None
        # Every baseline computes what the torch backend computes: checked on the same inputs.
        if r["impl"] != "torch":
            tol = 1e-5 if r["dtype"] == "fp32" else 3e-2
            assert r["rel_err"] is not None and r["rel_err"] < tol, r

    # grouped_best is the faster layout of the two, per case
    def key(r):
        return (r["op"], r["layer"], r["B"], r["dtype"], r["direction"])

    by_case = {}
    for r in rows:
        by_case.setdefault(key(r), {})[r["impl"]] = r
    for case in (c for c in by_case.values() if "grouped_best" in c):
        best = case["grouped_best"]
        assert best["ms"] == min(case["grouped_nchw"]["ms"], case["grouped_nhwc"]["ms"])
        assert best["note"].split(";")[0] in ("grouped_nchw", "grouped_nhwc")

    assert "=== summary ===" in stdout
    assert "conv fwd+bwd: triton speedup over cuDNN grouped conv" in stdout
    assert "layer norm fwd: bandwidth as % of copy bandwidth" in stdout
    assert "embedding fwd: bandwidth as % of copy bandwidth" in stdout


def test_report_merge_and_partial_load(smoke_run, bench, tmp_path):
    report = bench["report"]
    out, _ = smoke_run
    (path,) = [out / f for f in os.listdir(out) if f.endswith(".json")]
    meta, rows = report.load(str(path))
    # A run that was killed: JSON still says incomplete, rows only in the CSV.
    part = tmp_path / "part_cut"
    report.write_json(str(part) + ".json", {**meta, "complete": False}, [])
    report.write_csv(str(part) + ".csv", rows[:7])
    pmeta, prows = report.load(str(part) + ".csv")
    assert len(prows) == 7 and pmeta["complete"] is False
    assert [r["ms"] for r in prows] == [r["ms"] for r in rows[:7]]
    assert all(isinstance(r["B"], int) and isinstance(r["ms"], float) for r in prows)
    mmeta, mrows = report.merge([str(path), str(part) + ".csv"])
    assert len(mrows) == len(rows) + 7 and mmeta["complete"] is False
    assert report.main(["merge", str(path), "--out", str(tmp_path / "merged")]) == 0
    merged = sorted(os.listdir(tmp_path / "merged"))
    assert len(merged) == 2 and merged[0][:-4] == merged[1][:-5] and merged[0].startswith("kernels_cpu")
    _, again = report.load(str(tmp_path / "merged" / merged[1]))
    assert again == rows


def _row(report, op, impl, ms, dtype="bf16", layer="l", B=8, direction="fwd+bwd", status="ok", frac=None):
    r = dict.fromkeys(report.COLUMNS)
    r.update(op=op, model="m", layer=layer, B=B, dtype=dtype, direction=direction, impl=impl, status=status,
             ms=ms if status == "ok" else None, frac_copy_bw=frac)
    return r


def test_summary_arithmetic(bench):
    report = bench["report"]
    rows = [
        _row(report, "conv", "triton", 1.0, layer="a"),
        _row(report, "conv", "grouped_best", 2.0, layer="a"),
        _row(report, "conv", "triton", 2.0, layer="b"),
        _row(report, "conv", "grouped_best", 8.0, layer="b"),
        # no partner: left out of the geometric mean
        _row(report, "conv", "triton", 5.0, layer="c"),
        # an error row is never paired
        _row(report, "conv", "triton", None, layer="d", status="error"),
        _row(report, "conv", "grouped_best", 1.0, layer="d"),
        _row(report, "conv", "triton", 1.0, layer="a", dtype="fp16"),
        _row(report, "conv", "grouped_best", 0.5, layer="a", dtype="fp16"),
        _row(report, "layer_norm", "triton", 1.0, direction="fwd", frac=0.8, layer="x"),
        _row(report, "layer_norm", "triton", 1.0, direction="fwd", frac=0.6, layer="y"),
        _row(report, "layer_norm", "triton", 1.0, direction="fwd", frac=0.7, layer="z"),
        _row(report, "embedding", "torch", 1.0, direction="fwd", frac=0.25, dtype="fp32"),
    ]
    s = report.summarize(rows)
    conv = s["conv_fwdbwd_triton_vs_cudnn_grouped"]
    assert conv["bf16"]["n"] == 2 and conv["bf16"]["geomean"] == pytest.approx(math.sqrt(2 * 4))
    assert conv["bf16"]["min"] == pytest.approx(2) and conv["bf16"]["max"] == pytest.approx(4)
    assert conv["fp16"]["geomean"] == pytest.approx(0.5) and "fp32" not in conv
    ln = s["layer_norm_fwd_frac_copy_bw"]["triton"]["bf16"]
    assert ln == {"median": pytest.approx(0.7), "min": 0.6, "max": 0.8, "n": 3}
    assert s["embedding_fwd_frac_copy_bw"]["torch"]["fp32"]["median"] == 0.25
    assert s["errors"] == 1 and s["error_impls"] == ["conv:triton"]
    text = "\n".join(report.summary_lines(s))
    assert "bf16: 2.83x geomean over 2 cases (min 2.00x, max 4.00x)" in text
    assert "triton bf16: 70% median over 3 cases (min 60%, max 80%)" in text


def test_cost_counts(bench):
    bk, families = bench["bench_kernels"], bench["families"]
    conv, layer_norm, embedding = families.conv, families.layer_norm, families.embedding
    s = conv.ConvShape("m", "l", N=2, C_in=4, C_out=6, H=8, W=8, kernel=3, stride=2, padding=1, bias=True)
    assert s.out_hw() == (4, 4)
    macs = 2 * 6 * 4 * 4 * 4 * 9
    assert s.macs() == macs
    B = 3
    x, y, w, b = B * 2 * 4 * 64, B * 2 * 6 * 16, B * 6 * 4 * 9, B * 6
    assert bk.cost(bk.Case("conv", s, B, "fp16", "fwd"), 2) == (2 * (x + w + b + y), 2 * B * macs)
    assert bk.cost(bk.Case("conv", s, B, "fp16", "bwd"), 2) == (2 * (y + 2 * x + 2 * w + b), 4 * B * macs)
    assert bk.cost(bk.Case("conv", s, B, "fp16", "fwd+bwd"), 2)[1] == 6 * B * macs
    t = conv.ConvShape("m", "t", N=2, C_in=4, C_out=6, H=5, W=5, kernel=4, stride=2, padding=1, transposed=True)
    assert t.out_hw() == (10, 10) and t.macs() == 2 * 4 * 25 * 6 * 16
    ln = layer_norm.LayerNormShape("m", "l", batch=2, seq=3, D=10)
    rows, n, p = B * 6, B * 60, B * 10
    assert bk.cost(bk.Case("layer_norm", ln, B, "fp32", "fwd"), 4) == (4 * (2 * n + 2 * p) + 8 * rows, None)
    assert bk.cost(bk.Case("layer_norm", ln, B, "fp32", "bwd"), 4) == (4 * (3 * n + 3 * p) + 8 * rows, None)
    e = embedding.EmbeddingShape("m", "e", V=100, D=16, batch=2, seq=5)
    assert bk.cost(bk.Case("embedding", e, B, "bf16", "fwd"), 2) == (8 * 30 + 2 * 2 * 30 * 16, None)
    assert bk.cost(bk.Case("embedding", e, B, "bf16", "bwd"), 2) == (8 * 30 + 2 * 30 * 16 + 2 * B * 100 * 16, None)


def test_failing_backend_gives_error_row_and_run_goes_on(bench, tmp_path):
    """A backend that raises gets an error row; the other implementations still run."""
    bk = bench["bench_kernels"]
    if torch.cuda.is_available():
        pytest.skip("the triton backend may work here; the failure is staged on a CPU-only machine")
    args = bk.parse_args(["--smoke", "--impls", "torch,triton,loop"])
    device = torch.device("cpu")
    env = bk.environment(device) | {"timer": "perf_counter"}
    runner = bk.Runner(args, device, bk.bandwidth.CpuTimer(reps=1, warmup=0), {"copy_gbps": 1.0}, env)
    case = bk.Case("layer_norm", bk.FAMILIES["layer_norm"].smoke_shapes[0], 2, "fp32", "fwd+bwd")
    rows = runner.run_case(case, args.impls)
    assert [r["impl"] for r in rows] == ["torch", "triton", "loop"]
    torch_row, triton_row, loop_row = rows
    assert triton_row["status"] == "error" and triton_row["ms"] is None
    assert "triton" in triton_row["error"] and "not available" in triton_row["error"]
    assert torch_row["status"] == loop_row["status"] == "ok"
    assert loop_row["rel_err"] < 1e-5


def test_plan_orders_quick_subset_first_and_time_budget_stops(bench, tmp_path):
    bk = bench["bench_kernels"]
    cases = bk.plan(bk.parse_args([]))
    n_quick = len(bk.plan(bk.parse_args(["--quick"])))
    assert 0 < n_quick < len(cases)
    assert all(c.shape.quick and c.B == 8 for c in cases[:n_quick])
    default = bk.suite_families("default")
    assert {c.op for c in cases[:len(default)]} == set(default)  # ops interleaved
    assert len(cases) == len(set(cases))
    full = sum(len(f.suite()) * len(f.directions) for f in default.values()) * 3 * 3  # B, dtypes
    assert len(cases) == full
    # budget 0: nothing starts, the files still say what was planned
    rc = bk.main(["--smoke", "--ops", "embedding", "--time-budget", "0", "--out", str(tmp_path),
                  "--name", "cut", "--no-table"])
    assert rc == 0
    with open(tmp_path / "cut.json") as f:
        data = json.load(f)
    assert data["rows"] == [] and data["meta"]["skipped_cases"] == data["meta"]["planned_cases"] > 0


def test_profile_case_smoke_lists_each_implementations_work():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, os.path.join("bench", "profile_case.py"), "--smoke", "--ops", "conv",
         "--dtypes", "fp32", "--directions", "fwd+bwd", "--impls", "torch,grouped_nchw",
         "--calls", "2", "--top", "3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "conv smoke." in out and "  torch: wall" in out and "  grouped_nchw: wall" in out
    assert "failed" not in out
    # each implementation lists the ops it ran: the torch path and the bare grouped conv both convolve
    assert out.count("convolution") >= 2, out


def test_cuda_timer_names(bench):
    bandwidth = importlib.import_module("bandwidth")
    assert set(bandwidth.TIMERS) == {"do_bench", "cuda_graph"}
    assert isinstance(bandwidth.make_cuda_timer("cuda_graph"), bandwidth.GraphTimer)
    assert isinstance(bandwidth.make_cuda_timer("do_bench"), bandwidth.CudaTimer)
    with pytest.raises(ValueError, match="timer must be one of .*got 'events'"):
        bandwidth.make_cuda_timer("events")
