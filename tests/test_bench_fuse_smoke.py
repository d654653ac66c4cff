"""bench/bench_fuse.py end to end with tiny settings: every implementation runs and is reported."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_fuse_runs_every_implementation(tmp_path):
    out = tmp_path / "fuse.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, os.path.join("bench", "bench_fuse.py"), "--B", "2", "--batch-size", "8",
         "--rounds", "2", "--steps", "1", "--warmup", "1", "--device", "cpu", "--save", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    rows = record["results"][0]["rows"]
    assert [r["impl"] for r in rows] == ["fused", "hand_written", "serial", "vmap"]
    for r in rows:
        assert "error" not in r, r
        assert r["median_step_ms"] > 0 and r["samples_per_s"] > 0
    assert next(r for r in rows if r["impl"] == "hand_written")["vs_hand_written"] == 1.0
    assert record["device"].startswith("cpu") and record["torch"] == __import__("torch").__version__
