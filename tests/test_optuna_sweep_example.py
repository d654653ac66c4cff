"""The Optuna sweep example (examples/optuna_sweep.py) runs end to end in its --quick mode, in
memory and on an SQLite study, and the README's Runner example runs as written."""

import json
import os
import re
import subprocess
import sys

import pytest
from _util import import_sweep_extra

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import_sweep_extra("optuna")
import_sweep_extra("sqlalchemy")
for module in ("matplotlib", "sklearn", "tqdm", "rich"):
    pytest.importorskip(module)

PLOTS = ("optimization_history.png", "parallel_coordinate.png", "intermediate_values.png")


def _run(*args, cwd):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["COLUMNS"] = "160"
    env["MPLBACKEND"] = "Agg"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "optuna_sweep.py"), "--quick", "--device", "cpu", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, f"example failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _check_plots(out_dir):
    for name in PLOTS:
        path = os.path.join(out_dir, name)
        assert os.path.getsize(path) > 1000, path
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", path


def test_quick_sweep_against_one_by_one(tmp_path):
    out_dir, save = tmp_path / "plots", tmp_path / "result.json"
    out = _run("--out", str(out_dir), "--save", str(save), cwd=tmp_path)
    assert "device: cpu" in out
    assert re.search(r"best \d+ of \d+ complete trials", out), out  # the runner's best-trials table
    assert re.search(r"speed-up of the fused sweep: [0-9.]+x in wall time on cpu", out), out
    _check_plots(out_dir)

    record = json.loads(save.read_text())
    for key in ("benchmark", "date", "device", "torch", "optuna", "hfkern", "settings", "fused", "plain",
                "speedup", "same_params", "same_state", "max_abs_diff_same_epoch", "per_trial", "plots"):
        assert key in record, key
    settings = record["settings"]
    assert (settings["trials"], settings["B"], settings["epochs"], settings["quick"]) == (8, 4, 2, True)
    steps = settings["steps_per_epoch"]
    for run in ("fused", "plain"):
        r = record[run]
        assert r["seconds"] > 0
        assert r["trials"] == 8 and r["complete"] + r["pruned"] + r["failed"] == 8, r
        assert r["complete"] >= 1 and 0.0 <= r["best_value"] <= 1.0
        assert set(r["best_params"]) == {"lr", "momentum", "weight_decay"}
        # a complete trial trains every epoch, a pruned one at least the pruner's warm-up
        assert r["complete"] * settings["epochs"] <= r["epochs_trained"] <= 8 * settings["epochs"]
        assert r["steps_trained"] == r["epochs_trained"] * steps
    assert record["speedup"] == pytest.approx(record["plain"]["seconds"] / record["fused"]["seconds"])
    # the random sampler with one seed: trial n has the same parameters in both runs
    assert record["same_params"] == 8
    # ... the same initial weights and batches: the same accuracies, up to a flipped image or two
    assert record["max_abs_diff_same_epoch"] <= 0.02
    assert [t["number"] for t in record["per_trial"]] == list(range(8))
    assert sorted(record["plots"]) == sorted(PLOTS)


@pytest.mark.long
def test_quick_sweep_in_a_database_resumes_the_study(tmp_path):
    # Two runs against one SQLite study: the second finds the first's 8 trials and adds 4,
    # as runners on several machines share one PostgreSQL study.
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    common = ("--storage", url, "--skip-plain", "--out", str(tmp_path / "plots"))
    _run(*common, cwd=tmp_path)
    save = tmp_path / "result.json"
    out = _run(*common, "--trials", "12", "--save", str(save), cwd=tmp_path)
    assert "speed-up" not in out
    _check_plots(tmp_path / "plots")
    record = json.loads(save.read_text())
    assert record["plain"] is None and "speedup" not in record
    assert record["fused"]["trials"] == 12
    assert record["fused"]["complete"] + record["fused"]["pruned"] == 12


def test_readme_runner_example_runs(tmp_path, monkeypatch):
    # The README's Runner block is fenced as ```py, not ```python: tests/test_readme.py runs
    # every python block on every machine, and this one needs the sweep extra.
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("## Hyper-parameter sweeps on Optuna")[1].split("\n## ")[0]
    blocks = re.findall(r"```py\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, "the README's sweep section lost its Runner example"
    monkeypatch.chdir(tmp_path)  # nothing may be written next to the README
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    summary, study = scope["summary"], scope["study"]
    assert summary.completed + summary.pruned + summary.failed == 8 and summary.B == 4
    assert {t.params["width"] for t in study.trials} == {8, 16}
    assert summary.arrays >= 2  # one array per width
    assert list(tmp_path.iterdir()) == []
