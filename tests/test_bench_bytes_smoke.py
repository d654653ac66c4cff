"""The kernel benchmark's ``bytes`` suite (bench/bench_kernels.py --suite bytes) in its CPU
--smoke mode: both array layouts, the layout conversion rows, fused norm + activation
against the unfused pair, the elementwise family; and the arithmetic behind them."""

import importlib
import inspect
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def _fused_activation_missing() -> dict[str, str]:
    """{op: why} for the norm ops whose fused ``activation`` argument has not landed."""
    import hfkern.ops.batch_norm
    import hfkern.ops.layer_norm  # registers torch.ops.hfkern.array_layer_norm

    missing = {}
    if "activation" not in inspect.signature(hfkern.ops.batch_norm.array_batch_norm).parameters:
        missing["batch_norm"] = "hfkern.ops.batch_norm.array_batch_norm has no activation argument yet"
    schema = torch.ops.hfkern.array_layer_norm.default._schema
    if "activation" not in [a.name for a in schema.arguments]:
        missing["layer_norm"] = "hfkern::array_layer_norm has no activation argument yet"
    return missing


# The fused cases of each norm family, by their layer names (families/*.py: "bn+relu@nhwc", "ln+gelu").
FUSED_LAYERS = {"batch_norm": ["bn+", "bn1d+"], "layer_norm": ["ln+"]}


@pytest.fixture(scope="module")
def bytes_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bytes")
    missing = _fused_activation_missing()
    exclude = [t for op in missing for t in FUSED_LAYERS[op]]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    cmd = [sys.executable, os.path.join("bench", "bench_kernels.py"), "--smoke", "--suite", "bytes",
           "--out", str(out), "--name", "bytes_smoke", "--no-table"]
    if exclude:
        cmd += ["--exclude", ",".join(exclude)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"smoke run failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return out, proc.stdout, missing


def _rows(bench, bytes_run):
    out, _, _ = bytes_run
    meta, rows = bench["report"].load(str(out / "bytes_smoke.json"))
    assert meta["complete"] and meta["finished"] and meta["settings"]["suite"] == "bytes"
    return meta, rows


def test_bytes_suite_rows_are_finite_in_both_layouts(bench, bytes_run):
    meta, rows = _rows(bench, bytes_run)
    families = bench["families"]
    assert rows and all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"][:3]
    copy = meta["ceilings"]["copy_gbps"]
    for r in rows:
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["bytes"] > 0, r
        assert math.isclose(r["gbps"], r["bytes"] / (r["ms"] * 1e-3) / 1e9, rel_tol=1e-9)
        assert math.isclose(r["frac_copy_bw"], r["gbps"] / copy, rel_tol=1e-9)
    # the layout axis: every family with one has rows in both layouts, and the layout is in the layer name
    for op in ("conv", "batch_norm", "elementwise"):
        layouts = {r["layer"].rsplit("@", 1)[1] for r in rows if r["op"] == op}
        assert layouts == set(families.LAYOUTS), (op, layouts)
    # the conversion rows: not the op, so no FLOPs and no check; their bytes are their own
    for op in ("conv", "batch_norm"):
        conv = [r for r in rows if r["op"] == op and r["impl"] == "convert"]
        assert {r["layer"].rsplit("@", 1)[1] for r in conv} == set(families.LAYOUTS)
        assert {r["direction"] for r in conv} == {"fwd", "bwd", "fwd+bwd"}
        for r in conv:
            assert r["flops"] is None and r["rel_err"] is None and "not the op" in r["note"], r
    # every other implementation computes what the torch backend computes
    for r in rows:
        if r["impl"] not in ("torch", "convert", "grouped_best"):
            tol = 1e-5 if r["dtype"] == "fp32" else 3e-2
            assert r["rel_err"] is not None and r["rel_err"] < tol, r


def test_elementwise_family_rows(bench, bytes_run):
    _, rows = _rows(bench, bytes_run)
    ew = [r for r in rows if r["op"] == "elementwise"]
    ops = {r["layer"].split("@")[0].rsplit(".", 1)[1] for r in ew}
    assert ops == set(importlib.import_module("families.elementwise").OPS)
    assert {r["impl"] for r in ew} == {"torch", "loop"}
    # only ReLU has a backward; the add and the copies are forward only
    assert {r["direction"] for r in ew if ".relu@" in r["layer"]} == {"fwd", "bwd"}
    assert {r["direction"] for r in ew if ".relu@" not in r["layer"]} == {"fwd"}
    relu = next(r for r in ew if r["layer"] == "act.relu@nhwc" and r["direction"] == "fwd" and r["dtype"] == "fp32")
    assert relu["bytes"] == 2 * 4 * (2 * 3 * 4 * 5 * 6)  # read x, write y; B=2, [3, 4, 5, 6] fp32


def test_fused_and_unfused_norm_rows(bench, bytes_run):
    _, rows = _rows(bench, bytes_run)
    _, _, missing = bytes_run
    checked = [op for op in FUSED_LAYERS if op not in missing]
    if not checked:
        pytest.skip("; ".join(missing.values()))
    for op in checked:
        fused = [r for r in rows if r["op"] == op and "+" in r["layer"]]
        acts = {r["layer"].split("+")[1].split("@")[0] for r in fused}
        assert acts == {"relu", "gelu"}, (op, acts)
        for act in acts:
            for direction in ("fwd", "fwd+bwd"):
                case = {r["impl"]: r for r in fused
                        if f"+{act}" in r["layer"] and r["direction"] == direction and r["dtype"] == "fp32"}
                assert {"torch", "unfused_torch"} <= set(case), (op, act, direction, set(case))
                # the unfused pair moves the activation's read and write on top of the norm's
                assert case["unfused_torch"]["bytes"] > case["torch"]["bytes"]
                assert case["unfused_torch"]["rel_err"] < 1e-5
    if missing:
        pytest.skip("; ".join(missing.values()))


def test_summary_of_the_bytes_suite(bench, bytes_run):
    meta, _ = _rows(bench, bytes_run)
    _, stdout, missing = bytes_run
    assert "=== where the bytes go ===" in stdout
    s = meta["bytes_summary"]
    keys = " ".join(s["layout_nhwc_over_nchw"])
    for op in ("conv fwd+bwd torch", "batch_norm fwd torch", "elementwise fwd torch"):
        assert op in keys, keys
    assert {k.split()[0] for k in s["conversion_over_op"]} == {"conv", "batch_norm"}
    assert any(k.startswith("relu bwd nhwc") for k in s["elementwise_frac_copy_bw"])
    if "batch_norm" not in missing:
        assert any(k.startswith("batch_norm+relu fwd+bwd torch") for k in s["unfused_over_fused"])


def test_byte_counts_of_conversions_and_unfused_pairs(bench):
    families = bench["families"]
    conv, bn = families.conv, families.batch_norm
    B, e = 3, 2
    s = conv.ConvShape("m", "l@nhwc", 2, 4, 6, 8, 8, 3, 2, 1, layout="nhwc")
    d = conv.make_data(s, B, torch.bfloat16, "cpu", grad=True)
    c = conv.FAMILY.baselines["convert"](s)
    x, y = B * 2 * 4 * 64, B * 2 * 6 * 16
    assert c.moved_bytes(0, d, "fwd") == 2 * e * (x + y) and c.moved_bytes(0, d, "fwd+bwd") == 4 * e * (x + y)
    fn, _ = c.timed(d, "fwd+bwd")
    got = fn()
    # x and gy to the other layout (NCHW), a y-shaped and an x-shaped tensor back to channels-last
    assert [t.is_contiguous() for t in got] == [True, False, True, False]
    assert all(t.is_contiguous(memory_format=torch.channels_last) for t in got[1::2])
    assert conv.FAMILY.baselines["convert"](conv.SHAPES[0]) is None  # the default suite has no layout axis

    b = bn.BatchNormShape("m", "bn+gelu@nchw", 4, 5, None, 7, layout="nchw", activation="gelu")
    n, p = B * 4 * 5 * 7, B * 5
    fwd, bwd = bn.cost(b, B, e)
    assert fwd[0] == 2 * e * n + 32 * p and bwd[0] == 3 * e * n + 20 * p + 4 * p  # the fused backward reads b
    d = bn.make_data(b, B, torch.bfloat16, "cpu", grad=True)
    unfused = bn.FAMILY.baselines["unfused_torch"](b)
    assert unfused.moved_bytes(fwd[0], d, "fwd") == 2 * e * n + 32 * p + 2 * e * n
    assert unfused.moved_bytes(0, d, "fwd+bwd") == 5 * e * n + 52 * p + 5 * e * n
    assert bn.FAMILY.baselines["unfused_torch"](bn.SHAPES[0]) is None  # no activation, no pair


def test_array_layouts_are_the_stated_memory(bench):
    families = bench["families"]
    N, B, C, H, W = 2, 3, 4, 5, 6
    x = families.array_randn(B, N, C, (H, W), "nhwc", dtype=torch.float32, device="cpu")
    assert x.shape == (B, N, C, H, W) and x.stride() == (C, H * W * B * C, 1, W * B * C, B * C)
    assert families.grouped_view(x).is_contiguous(memory_format=torch.channels_last)
    x = families.array_randn(B, N, C, (H, W), "nchw", dtype=torch.float32, device="cpu")
    assert families.grouped_view(x).is_contiguous()
    x1 = families.array_randn(B, N, C, (W,), "nhwc", dtype=torch.float32, device="cpu")
    assert x1.stride() == (C, W * B * C, 1, B * C)  # [N, P, B, C] memory
    g = families.grouped_view(x1)
    assert families.to_layout(g, "nhwc").data_ptr() == g.data_ptr()  # already there: no copy
    assert families.to_layout(g, "nchw").is_contiguous()


def test_plan_of_the_bytes_suite(bench):
    bk = bench["bench_kernels"]
    args = bk.parse_args(["--suite", "bytes", "--dtypes", "bf16"])
    assert args.B == [8, 32] and set(args.ops) == {"conv", "batch_norm", "layer_norm", "elementwise"}
    cases = bk.plan(args)
    n_quick = len(bk.plan(bk.parse_args(["--suite", "bytes", "--dtypes", "bf16", "--quick"])))
    assert 0 < n_quick < len(cases) and all(c.shape.quick and c.B == 8 for c in cases[:n_quick])
    assert {c.op for c in cases[:4]} == set(args.ops)  # ops interleaved
    assert all(c.direction == "fwd" for c in cases if c.op == "elementwise" and c.shape.op != "relu")
    assert {c.direction for c in cases[:n_quick] if c.op == "layer_norm"} == {"fwd", "fwd+bwd"}
    # the memory budget: PointNet's 1024-channel batch norm at B = 32 in fp32 is about 10 GB a tensor
    big = [c for c in bk.plan(bk.parse_args(["--suite", "bytes", "--ops", "batch_norm", "--dtypes", "fp32"]))
           if c.shape.model == "pointnet" and c.shape.C == 1024]
    fits, over = bk.within_memory(big, 40e9)
    assert {c.B for c in over} == {32} and {c.B for c in fits} == {8}
    assert all(bk.footprint(c) == 2 * sum(x[0] for x in bk.FAMILIES[c.op].cost(c.shape, c.B, 4)) for c in big)
    # --exclude drops the layers that contain any of its texts
    some = bk.plan(bk.parse_args(["--suite", "bytes", "--smoke", "--exclude", "bn+,bn1d+,ln+"]))
    assert some and not any("+" in c.shape.layer for c in some)


def test_bytes_summary_arithmetic(bench):
    bk, report = bench["bench_kernels"], bench["report"]

    def row(op, layer, impl, ms, direction="fwd", frac=None):
        r = dict.fromkeys(report.COLUMNS)
        r.update(op=op, model="m", layer=layer, B=8, dtype="bf16", direction=direction, impl=impl,
                 status="ok", ms=ms, frac_copy_bw=frac)
        return r

    rows = [
        row("conv", "a@nchw", "torch", 2.0), row("conv", "a@nhwc", "torch", 1.0),
        row("conv", "b@nchw", "torch", 4.0), row("conv", "b@nhwc", "torch", 1.0),
        row("conv", "a@nchw", "triton", 1.0), row("conv", "a@nchw", "convert", 0.5),
        row("conv", "a@nchw", "grouped_nhwc", 9.0), row("conv", "a@nhwc", "grouped_nhwc", 1.0),
        row("batch_norm", "bn+relu@nchw", "torch", 1.0, frac=0.5),
        row("batch_norm", "bn+relu@nchw", "unfused_torch", 1.5),
        row("elementwise", "l1.relu@nhwc", "torch", 1.0, frac=0.75),
    ]
    s = bk.bytes_summary(rows)
    lay = s["layout_nhwc_over_nchw"]
    assert lay["conv fwd torch bf16"]["geomean"] == pytest.approx(math.sqrt(0.5 * 0.25))
    assert lay["conv fwd torch bf16"]["n"] == 2
    assert not any("grouped_nhwc" in k for k in lay)  # converts its inputs untimed: no layout effect to see
    assert s["conversion_over_op"]["conv fwd nchw bf16"]["median"] == pytest.approx(0.5)  # against triton, the faster
    fused = s["unfused_over_fused"]["batch_norm+relu fwd torch bf16"]
    assert fused["geomean"] == pytest.approx(1.5) and fused["fused_frac_copy_bw"] == 0.5
    assert s["elementwise_frac_copy_bw"]["relu fwd nhwc bf16"]["median"] == 0.75
    text = "\n".join(bk.bytes_summary_lines(s))
    assert "conv fwd torch bf16: 0.35x geomean over 2 cases" in text
    assert "fused at 50% of copy bandwidth" in text
