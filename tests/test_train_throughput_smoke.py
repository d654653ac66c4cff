"""The end-to-end benchmark harness (bench/train_throughput.py) and the convergence
check (bench/convergence.py) run end to end at tiny sizes, so that they never rot.

The numbers mean nothing at these sizes; the tests check that every workload
trains in every mode (the HFTA-style baseline ``hfta`` included), and that the
results, profiles, summary and plots come out complete.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.models import WORKLOADS  # noqa: E402


def _run(script, *args, timeout=900):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, os.path.join("bench", script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.long
def test_smoke_every_workload_in_every_mode(tmp_path):
    # torch.compile's modes on ResNet-18 only, as bench/gpu_run.sh runs them: compiling the
    # other five workloads would take most of this test's time and check the harness no further
    proc = _run("train_throughput.py", "--smoke", "--precisions", "fp32", "--compile-workloads", "resnet18",
                "--out", str(tmp_path), "--name", "t")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    record = json.loads((tmp_path / "t.json").read_text())
    compiled = ["array+compile[torch]", "array+compile-ro[torch]"]
    keys = ["serial", "concurrent", "vmap", "hfta", "array[torch]", *compiled,
            "array+capture[torch]", "array+cl[torch]", "array+capture+cl[torch]"]

    def keys_of(w):
        return keys if w == "resnet18" else [k for k in keys if k not in compiled]

    rows = record["rows"]
    assert record["settings"]["compile_workloads"] == ["resnet18"]
    assert {(r["workload"], r["key"]) for r in rows} == {(w, k) for w in WORKLOADS for k in keys_of(w)}
    for r in rows:
        assert "error" not in r, r
        assert r["B"] == 2 and r["precision"] == "fp32" and r["size"] == "smoke"
        assert r["samples_per_s"] > 0 and r["step_ms"] > 0 and r["torch"] and r["device"].startswith("cpu")
        assert r["peak_mb"] is None or r["peak_mb"] >= 0
        if r["mode"] != "serial":
            assert r["vs_serial"] > 0
        if r["mode"].startswith("array"):
            assert r["vs_hfta"] > 0                  # the HFTA-style baseline at the same B
    # a profile of every mode of every workload at the profiled B, and the gap of each slower mode
    assert set(record["profiles"]) == {f"{w}|fp32|2" for w in WORKLOADS}
    for name, per_mode in record["profiles"].items():
        assert set(per_mode) == set(keys_of(name.split("|")[0]))
        for p in per_mode.values():
            assert p["ops"] and all(o["calls"] > 0 for o in p["ops"])
            assert p["wall_us"] > 0 and p["host_us"] > 0 and p["launches"] == 0  # no kernels on a CPU
    assert len(record["gaps"]) == sum(len(keys_of(w)) - 1 for w in WORKLOADS)
    summary = (tmp_path / "t.md").read_text()
    for w in WORKLOADS:
        assert f"## {w}, fp32" in summary
        assert (tmp_path / f"t_{w}.png").stat().st_size > 0
    assert ("| B | serial | concurrent | vmap | hfta | array[torch] | array+compile[torch] | array+compile-ro[torch] "
            "| array+capture[torch] | array+cl[torch] | array+capture+cl[torch] |" in summary)
    assert "Profiled steps (per step of all B models)" in summary
    # the summary and plots are rendered again from the saved JSON alone
    (tmp_path / "t.md").unlink()
    proc = _run("train_throughput.py", "--report", str(tmp_path / "t.json"), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t.md").read_text() == summary


def test_smoke_bf16_autocast(tmp_path):
    proc = _run("train_throughput.py", "--smoke", "--precisions", "bf16", "--workloads", "resnet18",
                "transformer_lm", "--modes", "serial", "hfta", "array", "--out", str(tmp_path), "--name", "t",
                "--no-plots")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert len(rows) == 6 and all("error" not in r and r["precision"] == "bf16" for r in rows), rows


def test_profile_of_the_slowest_array_mode_only(tmp_path):
    proc = _run("train_throughput.py", "--smoke", "--precisions", "fp32", "--workloads", "pointnet", "--modes",
                "serial", "hfta", "array", "array+capture", "--profile-modes", "slowest-array", "--out",
                str(tmp_path), "--name", "t", "--no-plots")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    record = json.loads((tmp_path / "t.json").read_text())
    times = {r["key"]: r["step_ms"] for r in record["rows"] if r["mode"] in ("array", "array+capture")}
    assert list(record["profiles"]["pointnet|fp32|2"]) == [max(times, key=times.get)]


def test_bad_arguments_are_reported():
    proc = _run("train_throughput.py", "--B", "0", "--smoke")
    assert proc.returncode != 0 and "expected array sizes >= 1, got 0" in proc.stderr
    proc = _run("train_throughput.py", "--smoke", "--backends", "nope")
    assert proc.returncode != 0 and "unknown backend 'nope'" in proc.stderr


@pytest.mark.parametrize("steps", [3])
def test_convergence_check_smoke(tmp_path, steps):
    proc = _run("convergence.py", "--size", "smoke", "--steps", str(steps), "--out", str(tmp_path),
                "--name", "c", "--device", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "c.json").read_text())
    assert record["passed"] and len(record["serial"]) == len(record["array"]) == steps
    assert all(len(r) == 3 for r in record["array"])
    assert (tmp_path / "c.png").stat().st_size > 0


def test_a_time_limit_keeps_the_rounds_already_timed(tmp_path):
    """SIGINT (a time limit's) in the middle of a cell: the modes keep the rounds they finished,
    each mode said when it was ready, and the result is written."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, os.path.join("bench", "train_throughput.py"), "--size", "smoke", "--B", "2", "--precisions", "fp32",
         "--workloads", "pointnet", "--modes", "serial", "array", "--rounds", "100000", "--steps", "1", "--warmup", "1",
         "--out", str(tmp_path), "--name", "t", "--no-plots"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = []
    try:
        for line in proc.stderr:              # tqdm's bar ends its updates with \r, the log lines with \n
            if ": ready after " in line:
                ready.append(line.split(": ready after ")[0].rsplit(" ", 1)[-1])
                if len(ready) == 2:
                    break
        time.sleep(3)                         # rounds of a smoke step take milliseconds
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert sorted(ready) == ["array[torch]", "serial"]
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    assert "interrupted; keeping the rounds already timed" in err
    record = json.loads((tmp_path / "t.json").read_text())
    rows = {r["key"]: r for r in record["rows"]}
    assert set(rows) == {"serial", "array[torch]"}
    for r in rows.values():
        assert "error" not in r and 1 <= r["rounds"] < 100000 and r["step_ms"] > 0, r
    assert rows["array[torch]"]["vs_serial"] > 0
    assert record["skipped"] == ["interrupted: the cells after the last one reported"]


@pytest.mark.long
def test_merged_runs_compare_with_the_baselines_of_another_run(tmp_path):
    """gpu_run.sh times the other backends in a run of their own: the merged report gives their
    speedups over the first run's serial and hfta rows of the same cell."""
    for name, modes in (("a", ["serial", "hfta", "array"]), ("b", ["array+capture"])):
        proc = _run("train_throughput.py", "--smoke", "--precisions", "fp32", "--workloads", "pointnet",
                    "--modes", *modes, "--out", str(tmp_path), "--name", name, "--no-plots")
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["rows"][0]["vs_serial"] is None              # run b alone has no baseline
    proc = _run("train_throughput.py", "--report", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                "--name", "m", "--out", str(tmp_path), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    rows = {r["key"]: r for r in json.loads((tmp_path / "m.json").read_text())["rows"]}
    capture, serial = rows["array+capture[torch]"], rows["serial"]
    assert capture["vs_serial"] == capture["samples_per_s"] / serial["samples_per_s"]
    assert capture["vs_hfta"] == capture["samples_per_s"] / rows["hfta"]["samples_per_s"]


def test_the_dispatched_ops_mode_runs_beside_the_array(tmp_path):
    """array+ops (every hfkern op dispatched: the torch path without its eager paths) trains
    the same models as array, so gpu_run.sh can time what the eager paths save."""
    proc = _run("train_throughput.py", "--smoke", "--precisions", "fp32", "--workloads", "resnet18", "--B", "2",
                "--modes", "array", "array+ops", "--out", str(tmp_path), "--name", "t", "--no-plots")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    record = json.loads((tmp_path / "t.json").read_text())
    rows = {r["key"]: r for r in record["rows"]}
    assert set(rows) == {"array[torch]", "array+ops[torch]"}
    for r in rows.values():
        assert "error" not in r and r["step_ms"] > 0, r
    assert "--out <out>" in record["command"]  # a scratch folder is not recorded


def test_a_backend_with_per_op_choices_is_a_mode_of_its_own(tmp_path):
    """gpu_run.sh times the torch path with only the optimizer steps on hfkern's kernels
    (``--backends torch,sgd_step_=cuda``): one op's evidence for auto. On a CPU the
    per-op auto serves the torch path; what is checked is that the selection reaches the
    workers and keys its rows, and that a bad one is refused up front."""
    proc = _run("train_throughput.py", "--smoke", "--precisions", "fp32", "--workloads", "resnet18", "--B", "2",
                "--backends", "torch", "torch,sgd_step_=auto", "--modes", "array",
                "--out", str(tmp_path), "--name", "t", "--no-plots")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["key"]: r for r in json.loads((tmp_path / "t.json").read_text())["rows"]}
    assert set(rows) == {"array[torch]", "array[torch,sgd_step_=auto]"}
    for r in rows.values():
        assert "error" not in r and r["step_ms"] > 0, r
    proc = _run("train_throughput.py", "--smoke", "--backends", "torch,array_conv_input_grad=cuda")
    assert proc.returncode != 0 and "runs on the backend its forward op ran" in proc.stderr
