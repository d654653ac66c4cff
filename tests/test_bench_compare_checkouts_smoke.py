"""bench/compare_checkouts.py end to end with tiny settings: two checkouts (here the same tree
twice) run the same step in their own processes, and the result files record revisions, not
the machine's folders."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compare_checkouts_runs_each_tree_and_records_revisions(tmp_path):
    out = tmp_path / "ab"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, os.path.join("bench", "compare_checkouts.py"), "--roots", ROOT, ROOT,
         "--workloads", "transformer_lm", "--size", "smoke", "--B", "2", "--rounds", "2", "--steps", "1",
         "--threads", "1", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "ab.json").read_text())
    (row,) = record["rows"]
    assert row["workload"] == "transformer_lm" and len(row["ms_per_step"]) == 2
    assert all(ms > 0 for ms in row["ms_per_step"]) and row["speedup"][0] == 1.0
    text = (tmp_path / "ab.md").read_text()
    assert ROOT not in text and str(tmp_path) not in text and ROOT not in json.dumps(record)
    assert "transformer_lm" in text and record["revisions"][0] in text


def test_compare_checkouts_refuses_a_single_tree():
    proc = subprocess.run([sys.executable, os.path.join("bench", "compare_checkouts.py"), "--roots", ROOT],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "at least two --roots" in proc.stderr
