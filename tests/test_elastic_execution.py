"""Real elastic execution: torchrun groups of CPU worker processes (Gloo), rescaled mid-run.

Every wait below has its own deadline (the whole file takes well under two
minutes on two cores), and the executor fixture kills every job's process
group on teardown, so a failing test leaves no process behind.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
import torch.distributed as dist

from hfkern.elastic._autoscaler import Decision, scale_lr
from hfkern.elastic._executor import Executor, JobSpec, JobStatus, TorchrunExecutor
from hfkern.elastic._optimizer import Allocation
from hfkern.elastic.worker import load_dataset, stream_indices

from _elastic import processes_of

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the Gloo backend is not available in this torch build",
)

LR = 0.02
STARTUP = 90.0   # seconds allowed for a launch, its run and its exit on a loaded 2-core machine


def _allocation(gpus: int, batch_size: int, B: int = 1) -> Allocation:
    return Allocation(gpus=gpus, batch_size=batch_size, B=B, goodput=0.0)


def _decision(job: str, old, new, lr_scale: float) -> Decision:
    return Decision(job=job, old=old, new=new, lr_scale=lr_scale, reason="interval")


def _spec(name: str, **kw) -> JobSpec:
    base = dict(model="hfkern.elastic.worker:mlp", model_kwargs={"hidden": 64}, dataset="digits",
                optimizer="adam", lr=LR, lr_rule="sqrt",
                batch_size=32, total_steps=40, seed=3, min_step_seconds=0.05)
    base.update(kw)
    return JobSpec(name, **base)


def _wait_for_step(ex: TorchrunExecutor, name: str, step: int, timeout: float = STARTUP):
    import time

    deadline = time.monotonic() + timeout
    while True:
        st = ex.status(name)
        if st.step >= step:
            return st
        assert st.state == "running", f"job {name} is {st.state} before step {step}: {st.message}"
        assert time.monotonic() < deadline, f"job {name} did not reach step {step} in {timeout} s"
        time.sleep(0.02)


def _check_stream(log: list[dict], spec: JobSpec, n_data: int, total: int | None = None) -> None:
    """Steps 0..N-1 in order, each step's samples the next ones of the stream, and the ranks
    together used exactly those samples (their index sum)."""
    assert [r["step"] for r in log] == list(range(len(log)))
    assert log[0]["offset"] == 0
    for prev, rec in zip(log, log[1:]):
        assert rec["offset"] == prev["samples"], (prev, rec)
    for rec in log:
        assert rec["samples"] == rec["offset"] + rec["batch"]
        idx = stream_indices(n_data, spec.seed, rec["offset"], rec["batch"])
        assert rec["index_sum"] == int(idx.sum()), rec
    if total is not None:
        assert log[-1]["samples"] == total


def _reference_log(tmp_path, spec: JobSpec, batch_size: int) -> list[dict]:
    """One uninterrupted single-process run of ``spec`` (the worker without torchrun)."""
    from hfkern.elastic.worker import train

    job_dir = tmp_path / "reference"
    job_dir.mkdir()
    (job_dir / "spec.json").write_text(json.dumps(dataclasses.replace(spec, min_step_seconds=0.0).to_dict()))
    (job_dir / "launch.json").write_text(json.dumps({"generation": 0, "batch_size": batch_size, "lr": spec.lr,
                                                     "device": "cpu"}))
    assert train(str(job_dir)) == "finished"
    return [json.loads(line) for line in (job_dir / "log.jsonl").read_text().splitlines()]


@pytest.mark.long
def test_rescale_same_batch_matches_uninterrupted_run(executor, tmp_path):
    """(a) 2 workers, rescaled to 3 at the same global batch: the loss curve is an uninterrupted run's."""
    spec = _spec("a", total_steps=40)
    reference = _reference_log(tmp_path, spec, 32)

    old = _allocation(2, 32)
    executor.launch(spec, old)
    _wait_for_step(executor, "a", 8)
    st = executor.apply(_decision("a", old, _allocation(3, 32), 1.0), timeout=STARTUP)
    assert st.state == "running" and st.world_size == 3 and st.generation == 1
    st = executor.wait("a", timeout=STARTUP)
    assert st.state == "finished", st.message

    log = executor.log("a")
    assert len(log) == 40 and st.step == 40 and st.samples == 40 * 32
    _check_stream(log, spec, 1797, 40 * 32)
    sizes = [r["world_size"] for r in log]
    k = sizes.index(3)
    assert 8 <= k < 40 and set(sizes[:k]) == {2} and set(sizes[k:]) == {3}
    assert {r["generation"] for r in log[:k]} == {0} and {r["generation"] for r in log[k:]} == {1}
    assert all(r["lr"] == pytest.approx(LR) for r in log)
    got = torch.tensor([r["loss"] for r in log], dtype=torch.float64)
    want = torch.tensor([r["loss"] for r in reference], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0)
    assert want[-1] < 0.7 * want[0]   # it trained: the comparison is not between two flat curves


@pytest.mark.long
def test_rescale_to_new_batch_size_continues(executor):
    """(b) 2 workers at batch 32, rescaled to 1 worker at batch 64: the stream, the lr rule, the loss go on."""
    total = 36 * 32
    spec = _spec("b", total_steps=None, total_samples=total, lr_rule="sqrt")
    executor.launch(spec, _allocation(2, 32))
    _wait_for_step(executor, "b", 12)
    st = executor.rescale("b", 1, 64, timeout=STARTUP)
    assert st.state == "running" and st.batch_size == 64 and st.world_size == 1
    assert st.lr == pytest.approx(LR * math.sqrt(2))
    st = executor.wait("b", timeout=STARTUP)
    assert st.state == "finished", st.message

    log = executor.log("b")
    _check_stream(log, spec, 1797, total)
    k = next(i for i, r in enumerate(log) if r["batch"] == 64)
    assert k >= 12
    assert all(r["batch"] == 32 and r["world_size"] == 2 and r["lr"] == pytest.approx(LR) for r in log[:k])
    assert all(r["batch"] == 64 and r["world_size"] == 1 for r in log[k:-1])
    assert log[-1]["batch"] == min(64, total - log[-1]["offset"])   # the last step takes what is left
    assert all(r["lr"] == pytest.approx(scale_lr(LR, 32, 64, "sqrt")) for r in log[k:])
    # (means over 3 steps: a single step's loss is noisy at these batch sizes)
    first = log[0]["loss"]
    before = sum(r["loss"] for r in log[k - 3:k]) / 3
    after = sum(r["loss"] for r in log[k:k + 3]) / 3
    assert before < 0.8 * first
    # the resumed model goes on from where the stopped one was, not from its initial loss
    assert abs(after - before) < 0.5 * (first - before), (first, before, after)
    assert sum(r["loss"] for r in log[-3:]) / 3 < before


@pytest.mark.long
def test_three_jobs_one_rescaled_all_finish(executor):
    """(c) three jobs as separate elastic groups at once (an array of B=2 among them); one rescaled."""
    specs = [
        _spec("arr", dataset="classification", model_kwargs={"in_features": 20, "out_features": 4, "hidden": 16},
              B=2, total_steps=30, optimizer="adam", lr=0.01, optimizer_kwargs={}),
        _spec("reg", dataset="regression", model_kwargs={"in_features": 20, "out_features": 1, "hidden": 16},
              total_steps=30, optimizer="sgd", lr=0.05),
        _spec("dig", total_steps=50),
    ]
    allocations = {"arr": _allocation(1, 32, B=2), "reg": _allocation(1, 32), "dig": _allocation(1, 32)}
    for spec in specs:
        executor.launch(spec, allocations[spec.name])
    assert {st.state for st in executor.poll().values()} <= {"running", "finished"}
    _wait_for_step(executor, "dig", 5)
    new = _allocation(2, 48)
    lr_scale = scale_lr(1.0, 32, 48, "linear")
    statuses = executor.apply_all([_decision("dig", allocations["dig"], new, lr_scale)], timeout=STARTUP)
    assert statuses["dig"].generation == 1 and statuses["dig"].batch_size == 48
    for spec in specs:
        st = executor.wait(spec.name, timeout=STARTUP)
        assert st.state == "finished", (spec.name, st.message)

    n_data = {"arr": 1024, "reg": 1024, "dig": 1797}
    for spec in specs:
        log = executor.log(spec.name)
        assert len(log) == spec.total_steps
        _check_stream(log, spec, n_data[spec.name])
    dig = executor.log("dig")
    assert executor.log("dig", last=5) == dig[-5:]          # the records the executor keeps, as read
    with pytest.raises(ValueError, match="last"):
        executor.log("dig", last=0)
    k = next(i for i, r in enumerate(dig) if r["world_size"] == 2)
    assert all(r["batch"] == 48 and r["lr"] == pytest.approx(LR * 1.5) for r in dig[k:])
    arr = executor.log("arr")
    assert all(len(r["losses"]) == 2 for r in arr)
    assert arr[0]["losses"][0] != arr[0]["losses"][1]        # two different initialisations
    assert all(a < b for a, b in zip(arr[-1]["losses"], arr[0]["losses"]))
    assert executor.log("reg")[-1]["loss"] < executor.log("reg")[0]["loss"]


@pytest.mark.long
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process groups from /proc (Linux)")
def test_shutdown_kills_every_process_and_stop_resumes(tmp_path):
    """Stop checkpoints a job and a later launch resumes it; shutdown leaves no worker behind."""
    ex = TorchrunExecutor(tmp_path / "jobs")
    try:
        spec = _spec("s", total_steps=100_000, min_step_seconds=0.02)
        ex.launch(spec, _allocation(1, 32))
        _wait_for_step(ex, "s", 3)
        st = ex.stop("s", timeout=STARTUP)
        assert st.state == "stopped" and st.pid is None
        assert os.path.exists(os.path.join(ex.job_dir("s"), "checkpoint", "latest.pt"))
        stopped_at = st.step
        # a restart: lr_scale (here the linear rule's, not the spec's sqrt) is relative to the last launch
        st = ex.apply(_decision("s", None, _allocation(1, 64), scale_lr(1.0, 32, 64, "linear")))
        assert st.state == "running" and st.batch_size == 64 and st.lr == pytest.approx(2 * LR)
        _wait_for_step(ex, "s", stopped_at + 2)
        assert len(processes_of(ex.job_dir("s"))) == 2   # torchrun and its worker
    finally:
        ex.shutdown()
    assert processes_of(ex.job_dir("s")) == []
    st = ex.status("s")
    assert st.state == "failed" and "shutdown" in st.message
    log = ex.log("s")
    assert [r["step"] for r in log] == list(range(len(log)))
    assert log[stopped_at]["offset"] == stopped_at * 32 and log[stopped_at]["batch"] == 64


def test_bad_input_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="exactly one of total_steps and total_samples"):
        JobSpec("x", total_steps=10, total_samples=100)
    with pytest.raises(ValueError, match="'module:function'"):
        JobSpec("x", model="no_colon", total_steps=1)
    with pytest.raises(ValueError, match="lr_rule"):
        JobSpec("x", total_steps=1, lr_rule="cubic")
    with pytest.raises(TypeError, match="batch_size to be an int"):
        JobSpec("x", total_steps=1, batch_size=3.5)
    with pytest.raises(ValueError, match="directory name"):
        JobSpec("../x", total_steps=1)
    with pytest.raises(TypeError, match="JSON values"):
        JobSpec("x", total_steps=1, model_kwargs={"f": object()})
    assert JobSpec.from_dict(_spec("x").to_dict()) == _spec("x")
    with pytest.raises(ValueError, match="unknown"):
        JobSpec.from_dict({**_spec("x").to_dict(), "epochs": 3})

    ex = TorchrunExecutor(tmp_path / "jobs")
    spec = _spec("x", B=2)
    with pytest.raises(ValueError, match="allocation.B == 2, got 1"):
        ex.launch(spec, _allocation(1, 32, B=1))
    with pytest.raises(ValueError, match="at least 1 GPU"):
        ex.launch(spec, _allocation(0, 32, B=2))
    with pytest.raises(TypeError, match="Allocation"):
        ex.launch(spec, object())
    ex.register(spec)
    assert ex.status("x").state == "pending"
    with pytest.raises(ValueError, match=r"new.B == 2, got 3"):
        ex.apply(_decision("x", None, _allocation(1, 32, B=3), 1.0))
    with pytest.raises(ValueError, match="known job name"):
        ex.apply(_decision("nope", None, _allocation(1, 32), 1.0))
    with pytest.raises(TypeError, match="Decision"):
        ex.apply(_allocation(1, 32))
    with pytest.raises(ValueError, match="expected a running job"):
        ex.rescale("x", 2, 32)
    with pytest.raises(ValueError, match="another job's spec"):
        TorchrunExecutor(tmp_path / "jobs").register(_spec("x", B=3))
    ex.shutdown()


def test_data_stream_and_rank_slices():
    from hfkern.elastic.worker import rank_slice

    n = 10
    full = stream_indices(n, 5, 0, 35)
    for e in range(3):   # every epoch a permutation
        assert sorted(full[e * n:(e + 1) * n].tolist()) == list(range(n))
    assert full[:n].tolist() != full[n:2 * n].tolist()
    # any split of the stream into consecutive reads gives the same stream
    parts = [stream_indices(n, 5, a, b - a) for a, b in ((0, 7), (7, 19), (19, 35))]
    assert sum((p.tolist() for p in parts), []) == full.tolist()
    for batch, world in ((32, 3), (7, 4), (2, 3)):
        slices = [rank_slice(batch, world, r) for r in range(world)]
        assert slices[0][0] == 0 and sum(c for _, c in slices) == batch
        assert all(a + c == b for (a, c), (b, _) in zip(slices, slices[1:]))
        assert max(c for _, c in slices) - min(c for _, c in slices) <= 1
    x, y = load_dataset("regression", seed=1, n_samples=50)
    assert x.shape == (50, 20) and y.shape == (50, 1)
    with pytest.raises(ValueError, match="one of"):
        load_dataset("mnist")


def test_failing_job_is_reported(executor):
    """A worker that cannot start its job: the job is "failed" with the launcher's output, others unaffected."""
    spec = _spec("broken", model_kwargs={"hidden": 0}, total_steps=5)  # accepted by register, refused by mlp in the worker
    executor.launch(spec, _allocation(1, 32))
    st = executor.wait("broken", timeout=STARTUP)
    assert st.state == "failed" and st.returncode != 0 and st.pid is None
    assert "expected hidden to be a positive int, got 0" in st.message
    with pytest.raises(ValueError, match="cannot be launched again"):
        executor.launch(spec, _allocation(1, 32))


class _RecordingExecutor(Executor):
    """A process-free back end whose jobs stop one poll after they are asked to (checks the base class)."""

    def __init__(self):
        self.calls, self.jobs, self.specs = [], {}, {}

    def register(self, spec):
        self.specs[spec.name] = spec
        self.jobs[spec.name] = JobStatus(spec.name, "pending")
        return self.jobs[spec.name]

    def spec(self, name):
        return self.specs[name]

    def launch(self, spec, allocation, *, lr=None):
        self.calls.append(("launch", spec.name, allocation.gpus))
        self.jobs[spec.name] = JobStatus(spec.name, "running", gpus=allocation.gpus)
        return self.jobs[spec.name]

    def rescale(self, name, gpus, batch_size, *, lr_scale=None, block=True, timeout=None):
        self.calls.append(("rescale", name, gpus, lr_scale))
        self.jobs[name] = dataclasses.replace(self.jobs[name], state="rescaling", gpus=gpus)
        return self.jobs[name]

    def stop(self, name, *, block=True, timeout=None):
        self.calls.append(("stop", name))
        self.jobs[name] = dataclasses.replace(self.jobs[name], state="stopping")
        return self.jobs[name]

    def poll(self):
        statuses = dict(self.jobs)
        for name, st in self.jobs.items():
            if st.state in ("stopping", "rescaling"):
                self.calls.append(("done", name))
                self.jobs[name] = dataclasses.replace(st, state="stopped" if st.state == "stopping" else "running")
        return statuses

    def log(self, name, last=None):
        return []

    def shutdown(self, *, checkpoint=False, timeout=30.0):
        pass


def test_apply_all_stops_before_it_starts():
    ex = _RecordingExecutor()
    for name in ("run1", "run2", "new"):
        ex.register(_spec(name))
    ex.launch(_spec("run1"), _allocation(2, 32))
    ex.launch(_spec("run2"), _allocation(2, 32))
    ex.calls.clear()
    ex.apply_all([
        _decision("new", None, _allocation(2, 32), 1.0),               # needs run1's devices
        _decision("run1", _allocation(2, 32), _allocation(0, 32), 1.0),
        _decision("run2", _allocation(2, 32), _allocation(1, 32), 0.5),
    ])
    # the running jobs' requests first, the start last, after both stops completed
    assert ex.calls[-1] == ("launch", "new", 2)
    assert [c for c in ex.calls if c[0] in ("stop", "rescale")] == [("stop", "run1"), ("rescale", "run2", 1, 0.5)]
    assert sorted(c for c in ex.calls[:-1] if c[0] == "done") == [("done", "run1"), ("done", "run2")]
    statuses = ex.poll()
    assert (statuses["run1"].state, statuses["run2"].gpus, statuses["new"].state) == ("stopped", 1, "running")
