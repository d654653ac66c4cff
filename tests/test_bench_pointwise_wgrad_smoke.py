"""bench/bench_pointwise_wgrad.py end to end on its smallest layers: both weight gradients
agree (the bench checks) and are timed and reported."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_pointwise_wgrad_runs(tmp_path):
    out = tmp_path / "wgrad"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, os.path.join("bench", "bench_pointwise_wgrad.py"), "--B", "2", "--rounds", "1",
         "--layers", "pointnet-cpu", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.with_suffix(".json").read_text())
    assert [r["layer"] for r in record["rows"]] == [f"pointnet-cpu/conv{i}" for i in range(1, 5)]
    for r in record["rows"]:
        assert r["grouped_conv_ms"] > 0 and r["matmul_sum_ms"] > 0
    assert "| pointnet-cpu/conv4 | 32 -> 256 | 256 |" in out.with_suffix(".md").read_text()
