"""The optimizer-step benchmark (bench/bench_optim.py) end to end in its CPU --smoke mode,
the parameter shapes and byte counts behind its columns, its baselines' math and its summary."""

import contextlib
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
_MODULES = ("bench_optim", "bench_kernels", "report", "shapes", "bandwidth")


@pytest.fixture(scope="module")
def bo():
    """bench_optim as a module (bench/ is a script folder, not a package)."""
    added = [p for p in (BENCH, ROOT) if p not in sys.path]
    sys.path[:0] = added
    try:
        yield importlib.import_module("bench_optim")
    finally:
        for p in added:
            sys.path.remove(p)
        for name in _MODULES:
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("optim_smoke")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["COLUMNS"] = "200"
    proc = subprocess.run(
        [sys.executable, os.path.join("bench", "bench_optim.py"), "--smoke", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"smoke run failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return out, proc.stdout


def test_smoke_writes_rows_csv_and_json(smoke_run, bo):
    out, stdout = smoke_run
    report = bo.report
    files = sorted(os.listdir(out))
    assert len(files) == 2 and files[0].endswith(".csv") and files[1] == files[0][:-4] + ".json", files
    assert files[0].startswith("optim_smoke_")
    with open(out / files[0], newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == report.COLUMNS
        csv_rows = list(reader)
    with open(out / files[1]) as f:
        data = json.load(f)
    meta, rows = data["meta"], data["rows"]
    assert len(rows) == len(csv_rows) == len(bo.OPS) * len(bo.SMOKE_B_VALUES) * (len(bo.IMPLS) - len(bo.GPU_BACKENDS))
    assert [r["impl"] for r in rows] == [r["impl"] for r in csv_rows]
    assert meta["complete"] and meta["finished"] and meta["skipped_cases"] == 0
    copy = meta["ceilings"]["copy_gbps"]
    assert copy > 0
    n_params = bo.param_count(bo.resnet18_cifar_shapes(bo.SMOKE_WIDTH))
    assert meta["settings"]["params_per_model"] == n_params
    assert meta["settings"]["bytes_per_param"] == {"adam": 28, "adamw": 28, "sgd_momentum": 20}

    # every optimizer and every implementation but the GPU backends (--smoke is torch-backend only) ran
    got = {(r["op"], r["B"], r["impl"]) for r in rows}
    assert got == {(op, B, i) for op in bo.OPS for B in bo.SMOKE_B_VALUES for i in bo.IMPLS if i not in bo.GPU_BACKENDS}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["dtype"] == "fp32" and r["direction"] == "step" and r["model"] == "resnet18_cifar"
        assert r["device"] and r["date"] and r["timer"] == "perf_counter" and r["torch"] == torch.__version__
        assert r["kind"] == ("backend" if r["impl"] == "torch" else "baseline")
        assert r["bytes"] == bo.BYTES_PER_PARAM[r["op"]] * n_params * r["B"]
        assert r["ms"] > 0
        assert math.isclose(r["gbps"], r["bytes"] / (r["ms"] * 1e-3) / 1e9, rel_tol=1e-9)
        assert math.isclose(r["frac_copy_bw"], r["gbps"] / copy, rel_tol=1e-9)
        # Every implementation's first step moves the parameters as the torch backend's does.
        if r["impl"] == "torch":
            assert r["rel_err"] is None
        else:
            # fused_one_list is compared against a rescaled reference (a few ulp more)
            tol = 1e-4 if r["impl"] == "fused_one_list" else 1e-5
            assert r["rel_err"] is not None and r["rel_err"] < tol, r

    summary = meta["summary"]
    assert set(summary["cases"]) == {f"{op} B={B}" for op in bo.OPS for B in bo.SMOKE_B_VALUES}
    for c in summary["cases"].values():
        assert c["best"] == "torch" and c["frac_copy_bw"] > 0 and c["speedup"]["fused_per_model"] > 0
    assert "=== optimizer step summary ===" in stdout
    for B in bo.SMOKE_B_VALUES:
        assert f"adam B={B}: hfkern torch" in stdout
    assert "of copy bandwidth" in stdout and "x vs B fused torch Adam" in stdout
    assert ">= 85% of copy bandwidth, >= 1.5x" in stdout


def test_show_reads_result_files(smoke_run, bo, capsys):
    out, _ = smoke_run
    (path,) = [out / f for f in os.listdir(out) if f.endswith(".json")]
    assert bo.main(["--show", str(path), "--no-table"]) == 0
    text = capsys.readouterr().out
    assert "=== optimizer step summary ===" in text and "x vs B fused torch SGD (momentum)" in text


def test_resnet18_cifar_shapes(bo):
    shapes = bo.resnet18_cifar_shapes()
    named = dict(shapes)
    assert len(shapes) == len(named) == 62
    assert bo.param_count(shapes) == 11_173_962  # the published parameter count of ResNet-18 for CIFAR-10
    assert named["conv1.weight"] == (64, 3, 3, 3) and named["bn1.bias"] == (64,)
    assert named["layer1.1.conv2.weight"] == (64, 64, 3, 3)
    assert named["layer2.0.conv1.weight"] == (128, 64, 3, 3)
    assert named["layer2.0.shortcut.0.weight"] == (128, 64, 1, 1)
    assert named["layer4.1.bn2.weight"] == (512,)
    assert "layer1.0.shortcut.0.weight" not in named and "layer3.1.shortcut.0.weight" not in named
    assert named["linear.weight"] == (10, 512) and shapes[-1] == ("linear.bias", (10,))
    small = bo.resnet18_cifar_shapes(width=4, num_classes=7)
    assert [n for n, _ in small] == [n for n, _ in shapes]
    assert dict(small)["layer4.0.shortcut.0.weight"] == (32, 16, 1, 1) and dict(small)["linear.weight"] == (7, 32)


def test_step_bytes(bo):
    assert bo.step_bytes("adam", 1000, 3) == 28 * 1000 * 3
    assert bo.step_bytes("adamw", 10, 2) == 28 * 10 * 2
    assert bo.step_bytes("sgd_momentum", 10, 2) == 20 * 10 * 2


@pytest.mark.parametrize("op", ["adam", "adamw", "sgd_momentum"])
def test_every_implementation_follows_torch_per_model_over_steps(bo, op):
    """Three steps of each implementation against torch.optim's single-tensor path run
    per model with that model's learning rate (the bias corrections change every step)."""
    B, steps = 3, 3
    shapes = bo.resnet18_cifar_shapes(width=2)[:7] + [("linear.weight", (5, 16))]
    prob = bo.make_problem(op, B, shapes, torch.device("cpu"), seed=1)
    assert len(set(prob.lr.tolist())) == B
    expected = []
    for b in range(B):
        ps = [p[b].clone().requires_grad_() for p in prob.p0]
        for p, g in zip(ps, prob.grads):
            p.grad = g[b].clone()
        opt = bo._torch_optimizer(op, ps, float(prob.lr[b]), foreach=False)
        for _ in range(steps):
            opt.step()
        expected.append([p.detach() for p in ps])
    expected = [torch.stack([m[i] for m in expected]) for i in range(len(shapes))]
    for impl in bo.make_impls([i for i in bo.IMPLS if i not in (*bo.GPU_BACKENDS, "fused_one_list")]):
        with impl.context():
            step, params = impl.build(prob)
            for _ in range(steps):
                step()
        got = params()
        for g, e, p0 in zip(got, expected, prob.p0):
            assert not torch.equal(g, p0)
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"{impl.name}: {m}")


def test_fresh_gradients_are_new_tensors_at_every_step(bo):
    """The default condition: each step's gradients are new tensors at new (16-byte aligned)
    addresses, the first step's the problem's own; every implementation steps with set k at
    its k-th step."""
    shapes = bo.resnet18_cifar_shapes(width=2)[:5]
    cpu = torch.device("cpu")
    prob = bo.make_problem("adam", 3, shapes, cpu, seed=1, placements=bo.GRAD_PLACEMENTS)
    kept = bo.make_problem("adam", 3, shapes, cpu, seed=1)
    assert len(kept.grad_sets) == 1 and len(prob.grad_sets) == bo.GRAD_PLACEMENTS
    assert all(torch.equal(a, b) for a, b in zip(prob.grads, kept.grads))
    assert all(torch.equal(a, b) for a, b in zip(prob.p0, kept.p0))
    assert len({tuple(g.data_ptr() for g in gs) for gs in prob.grad_sets}) == bo.GRAD_PLACEMENTS
    assert all(g.data_ptr() % 16 == 0 for gs in prob.grad_sets for g in gs)
    assert not torch.equal(prob.grad_sets[1][0], prob.grads[0])
    runs = {}
    for name, p in (("fresh", prob), ("kept", kept)):
        for impl in bo.make_impls(["torch", "foreach_per_model", "loop"]):
            step, params = impl.build(p)
            for _ in range(3):
                step()
            runs[name, impl.name] = [t.clone() for t in params()]
    for name in ("foreach_per_model", "loop"):
        for a, b in zip(runs["fresh", name], runs["fresh", "torch"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not all(torch.allclose(a, b) for a, b in zip(runs["fresh", "torch"], runs["kept", "torch"]))


def test_one_list_expected_is_the_reference_at_model_0_lr(bo):
    prob = bo.make_problem("adam", 3, bo.resnet18_cifar_shapes(width=2)[:4], torch.device("cpu"))
    ref, got = [], []
    for impl in (bo.HfkernImpl("torch"), bo.OneListTorch()):
        step, params = impl.build(prob)
        step()
        (ref if impl.name == "torch" else got).append([p - p0 for p, p0 in zip(params(), prob.p0)])
    expected = bo.OneListTorch().expected(ref[0], prob)
    assert bo.rel_err(got[0], expected) < 1e-4
    assert bo.rel_err(got[0], ref[0]) > 0.5  # the other models' learning rates do differ


def test_rel_err_is_per_model(bo):
    ref = [torch.tensor([[1.0, 2.0], [1e-3, 2e-3]]), torch.tensor([[3.0], [1e-3]])]
    out = [r.clone() for r in ref]
    assert bo.rel_err(out, ref) == 0
    out[1][1] *= 1.1  # model 1's change is small: a whole-array norm would hide this
    assert bo.rel_err(out, ref) == pytest.approx(0.1 * 1e-3 / math.sqrt(1e-6 + 4e-6 + 1e-6), rel=1e-6)
    out[0][0, 0] = float("nan")
    assert math.isnan(bo.rel_err(out, ref))


class _Failing:
    name = "triton"
    kind = "backend"
    note = None

    def context(self):
        return contextlib.nullcontext()

    def build(self, prob):
        raise RuntimeError("hfkern backend 'triton' has no implementation of hfkern::adam_step_")


def test_failing_implementation_gives_error_row_and_run_goes_on(bo):
    device = torch.device("cpu")
    env = bo.bench_kernels.environment(device) | {"timer": "perf_counter"}
    runner = bo.Runner(device, bo.bandwidth.CpuTimer(reps=1, warmup=0), {"copy_gbps": 2.0}, env, width=2)
    impls = [bo.HfkernImpl("torch"), _Failing(), bo.LoopImpl()]
    rows = runner.run_case(bo.Case("adam", 2), impls)
    assert [r["impl"] for r in rows] == ["torch", "triton", "loop"]
    torch_row, bad, loop_row = rows
    assert bad["status"] == "error" and bad["ms"] is None and "no implementation" in bad["error"]
    assert torch_row["status"] == loop_row["status"] == "ok"
    assert loop_row["rel_err"] < 1e-5 and loop_row["frac_copy_bw"] == pytest.approx(loop_row["gbps"] / 2.0)
    s = bo.summarize(rows, {"copy_gbps": 2.0})
    assert s["errors"] == 1 and s["error_impls"] == ["adam:triton"]
    assert s["cases"]["adam B=2"]["best"] == "torch"


def _row(report, op, impl, ms, B=16, status="ok", nbytes=1e9, copy=2000.0):
    r = dict.fromkeys(report.COLUMNS)
    gbps = nbytes / (ms * 1e-3) / 1e9 if status == "ok" else None
    r.update(op=op, B=B, impl=impl, status=status, ms=ms if status == "ok" else None, bytes=int(nbytes),
             gbps=gbps, frac_copy_bw=None if gbps is None else gbps / copy, dtype="fp32", direction="step")
    return r


def test_summary_arithmetic(bo):
    report = bo.report
    rows = [
        _row(report, "adam", "torch", 1.0),
        _row(report, "adam", "triton", 0.55),  # 1 GB in 0.55 ms: 1818 GB/s, 91% of 2000
        _row(report, "adam", "fused_per_model", 1.1),
        _row(report, "adam", "fused_one_list", 0.66),
        _row(report, "adam", "loop", 2.2),
        _row(report, "adam", "torch", 2.0, B=4),
        _row(report, "adam", "triton", None, B=4, status="error"),
        _row(report, "adam", "fused_per_model", 2.5, B=4),
        _row(report, "sgd_momentum", "fused_per_model", 1.0, B=4),
    ]
    s = bo.summarize(rows, {"copy_gbps": 2000.0})
    c = s["cases"]["adam B=16"]
    assert c["best"] == "triton" and c["ms"] == 0.55
    assert c["frac_copy_bw"] == pytest.approx(1 / 0.55 / 2) and c["frac_target_met"] is True
    assert c["speedup"] == pytest.approx({"fused_per_model": 2.0, "fused_one_list": 1.2, "loop": 4.0})
    assert c["speedup_target_met"] is True and c["floor_ms"] == pytest.approx(0.5)
    c4 = s["cases"]["adam B=4"]
    assert c4["best"] == "torch" and c4["speedup"]["fused_per_model"] == pytest.approx(1.25)
    assert c4["speedup_target_met"] is False and c4["frac_target_met"] is False
    assert s["cases"]["sgd_momentum B=4"]["best"] is None
    assert list(s["cases"]) == ["adam B=4", "adam B=16", "sgd_momentum B=4"]
    text = "\n".join(bo.summary_lines(s))
    assert "adam B=16: hfkern triton 0.550 ms, 1818 GB/s, floor 0.500 ms: 91% of copy bandwidth (met); " \
           "2.00x vs B fused torch Adam (met)" in text
    assert "adam B=4: hfkern torch 2.000 ms" in text and "1.25x vs B fused torch Adam (MISSED)" in text
    assert "sgd_momentum B=4: no hfkern backend ran" in text
    header, lines = bo.table(rows)
    assert header[:2] == ["op", "B"] and "err" in lines[1]
    assert lines[0][-3:] == ["1818 triton", "91%", "2.00x"]


def test_time_budget_zero_runs_nothing_but_writes_files(bo, tmp_path):
    rc = bo.main(["--smoke", "--ops", "adam", "--time-budget", "0", "--out", str(tmp_path),
                  "--name", "cut", "--no-table"])
    assert rc == 0
    with open(tmp_path / "cut.json") as f:
        data = json.load(f)
    assert data["rows"] == [] and data["meta"]["skipped_cases"] == data["meta"]["planned_cases"] == 1
    assert data["meta"]["complete"] and data["meta"]["finished"]
