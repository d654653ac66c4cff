"""The main demo (examples/digits_sweep.py) runs end to end in its --quick mode."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("sklearn")
pytest.importorskip("tqdm")
pytest.importorskip("rich")


def test_digits_sweep_quick():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["COLUMNS"] = "120"
    proc = subprocess.run(
        [sys.executable, os.path.join("examples", "digits_sweep.py"), "--quick", "--device", "cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"demo failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    assert "device: cpu" in out
    assert "Learning-rate sweep: 16 CNNs" in out
    # one table row per model: index, learning rate, loss, two accuracies
    rows = re.findall(r"│\s*(\d+) │\s*([0-9.e+-]+) │\s*([0-9.na]+) │\s*([0-9.]+)% │\s*([0-9.]+)% │", out)
    assert [int(r[0]) for r in rows] == list(range(16)), out
    assert float(rows[0][1]) == pytest.approx(1e-3) and float(rows[-1][1]) == pytest.approx(1.0)
    assert all(0.0 <= float(r[3]) <= 100.0 for r in rows)
    assert "samples/s" in out
    assert re.search(r"speedup of the fused array: [0-9.]+x on cpu", out), out
