"""bench/profile_step.py end to end with tiny settings: a profile, the comparison, the saved record
and its summary."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.long
def test_profile_step_prints_and_saves_profile_and_comparison(tmp_path):
    out = tmp_path / "profile.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, os.path.join("bench", "profile_step.py"), "--B", "2", "--batch", "8", "--optim", "adam",
         "--steps", "1", "--warmup", "1", "--compare", "--rounds", "2", "--steps-per-round", "1",
         "--label", "smoke", "--save", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hand_written / adam: B=2, batch 8" in proc.stdout and "aten::threshold_backward" in proc.stdout
    run = json.loads(out.read_text())["runs"][0]
    assert run["label"] == "smoke" and run["device"].startswith("cpu")
    ops = {o["name"]: o for o in run["profile"]["ops"]}
    assert ops["aten::clamp_min"]["calls_per_step"] == 2 and ops["aten::threshold_backward"]["calls_per_step"] == 2
    assert ops["aten::sum"]["calls_per_step"] >= 1 and run["profile"]["all_ops_self_cpu_us_per_step"] > 0
    rows = run["compare"]
    assert [r["variant"] for r in rows] == ["hand_written", "fused", "baseline"]
    for r in rows:
        assert r["median_step_ms"] > 0 and r["median_optimizer_step_ms"] > 0 and len(r["step_ms"]) == 2
    assert rows[-1]["step_vs_baseline"] == 1.0
    proc = subprocess.run([sys.executable, os.path.join("bench", "profile_step.py"), "--summarize", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())["summary"]
    assert [(r["label"], r["variant"], r["samples"]) for r in summary["steps"]] == \
        [("smoke", v, 2) for v in ("hand_written", "fused", "baseline")]
    assert summary["steps"][-1]["median_vs_baseline"] == 1.0
    assert summary["profiles"][0]["calls_per_step"]["aten::clamp_min"] == 2
    # --steps 0: the comparison alone, appended to the record; the summary pools both runs
    proc = subprocess.run(
        [sys.executable, os.path.join("bench", "profile_step.py"), "--B", "2", "--batch", "8", "--optim", "adam",
         "--steps", "0", "--warmup", "1", "--compare", "--rounds", "1", "--steps-per-round", "1",
         "--label", "smoke", "--save", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2 and "profile" not in runs[1] and len(runs[1]["compare"]) == 3
    proc = subprocess.run([sys.executable, os.path.join("bench", "profile_step.py"), "--summarize", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())["summary"]
    assert [r["samples"] for r in summary["steps"]] == [3, 3, 3] and len(summary["profiles"]) == 1
