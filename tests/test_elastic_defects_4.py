"""Regressions of hfkern.elastic (worker, JobSpec, executor) and hfkern.distributed.topk (TopKState).

* A parameter the global batch does not reach keeps no gradient on 2 ranks as in one process
  (it was zero-filled: weight decay and optimizer state for it); one reached by some ranks only
  gets the whole batch's gradient. Results against a single process and plain torch.
* ``Executor.apply_all`` checks every decision before it carries out any, and names an unknown
  job with a ValueError (it rescaled running jobs first, and raised a bare KeyError).
* ``TopKState`` settings (and ``load_state_dict``'s step) that differ between ranks raise a
  ValueError on every rank, naming the setting and the ranks' values (Gloo aborted the process).
* A job refuses another job's checkpoint, and an executor a shared checkpoint_dir.
* ``loss="mse"`` on class labels: one-hot over the data set's classes, present or not.
* The worker documents that dropout masks depend on the world size.
* ``JobSpec`` stores numpy ints as ints; ``register`` leaves no temporary file behind.
* Misspelled ``optimizer_kwargs`` / ``dataset_kwargs`` / ``model_kwargs`` and a missing model
  factory are refused at ``JobSpec`` / ``register`` instead of failing the launched job.

The 2-rank runs start two processes (Gloo) once per module: the worker's ``train`` under the
environment torchrun would give it, and the TopKState checks on a file store.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import tempfile
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from hfkern.elastic._autoscaler import Decision
from hfkern.elastic._executor import Executor, JobSpec, JobStatus, TorchrunExecutor
from hfkern.elastic._optimizer import Allocation

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with Gloo")

WORLD = 2
_DEADLINE_S = 240
_THIS = __name__   # the factories below, as the worker imports them ("module:function")


# ---- models (imported by the workers) ------------------------------------------------------
class _Heads(nn.Module):
    """A body; a head that forward never uses; and with ``threshold``, a head used only for the
    samples whose first feature exceeds it (so a local batch may not reach it)."""

    def __init__(self, in_features=6, out_features=3, hidden=5, threshold=None):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))
        self.unused = nn.Linear(hidden, 2)
        self.rare = nn.Linear(in_features, out_features)
        self.threshold = threshold

    def forward(self, x):
        out = self.body(x)
        if self.threshold is not None:
            sel = (x[:, 0] > self.threshold).nonzero().squeeze(1)
            if sel.numel():
                out = out.index_add(0, sel, self.rare(x[sel]))
        return out


def heads(**kw):
    return _Heads(**kw)


# ---- helpers ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_job(job_dir, spec: JobSpec, batch: int, lr: float, generation: int = 0) -> str:
    job_dir = str(job_dir)
    os.makedirs(job_dir, exist_ok=True)
    with open(os.path.join(job_dir, "spec.json"), "w") as f:
        json.dump(spec.to_dict(), f)
    with open(os.path.join(job_dir, "launch.json"), "w") as f:
        json.dump({"generation": generation, "batch_size": batch, "lr": lr, "device": "cpu"}, f)
    return job_dir


def _log(job_dir) -> list[dict]:
    with open(os.path.join(job_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def _ckpt(job_dir) -> dict:
    return torch.load(os.path.join(job_dir, "checkpoint", "latest.pt"), weights_only=True)


def _join(ctx, deadline_s: float) -> str | None:
    """Wait for ``mp.spawn(..., join=False)``'s processes: None, or why they failed."""
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                return f"the processes did not finish within {deadline_s} s"
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        return f"a process failed: {e}"
    return None


# ---- 2-rank worker runs (one spawn for every job) -----------------------------------------------
def _train_ranks(rank, world, jobs, ports, out_dir):
    """One rank of each job in turn, in the environment torchrun gives its workers."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from hfkern.elastic.worker import train

    record = {}
    for job_dir, port in zip(jobs, ports):
        os.environ["MASTER_PORT"] = str(port)
        try:
            record[job_dir] = train(job_dir)
        except Exception:  # noqa: BLE001 - recorded for the test; the group is gone with the exception
            record[job_dir] = "FAIL " + traceback.format_exc()
            if dist.is_initialized():
                dist.destroy_process_group()
        with open(os.path.join(out_dir, f"train{rank}.json"), "w") as f:
            json.dump(record, f)


def _heads_spec(name: str, threshold) -> JobSpec:
    return JobSpec(name, model=f"{_THIS}:heads", model_kwargs={} if threshold is None else {"threshold": threshold},
                   dataset="classification", dataset_kwargs={"n_samples": 40, "n_features": 6, "n_classes": 3},
                   optimizer="adamw", optimizer_kwargs={"weight_decay": 0.5}, lr=0.1, batch_size=8,
                   total_steps=6, seed=0)


_THRESHOLD = 1.0
_JOBS = {"unused": None, "rare": _THRESHOLD}   # job -> the heads' threshold


@pytest.fixture(scope="module")
def two_rank_jobs(tmp_path_factory):
    """Each job run twice: one process (this one) and 2 ranks; job name -> (single dir, 2-rank dir)."""
    root = tmp_path_factory.mktemp("elastic4")
    dirs = {}
    for name, threshold in _JOBS.items():
        spec = _heads_spec(name, threshold)
        single = _make_job(root / f"{name}_single", spec, 8, 0.1)
        ranks = _make_job(root / f"{name}_w2", spec, 8, 0.1)
        dirs[name] = (single, ranks)
    ctx = mp.spawn(_train_ranks, args=(WORLD, [d[1] for d in dirs.values()], [_free_port() for _ in dirs],
                                       str(root)), nprocs=WORLD, join=False)
    failure = _join(ctx, _DEADLINE_S)
    from hfkern.elastic.worker import train

    for single, _ in dirs.values():
        assert train(single) == "finished"
    records = {}
    for r in range(WORLD):
        path = root / f"train{r}.json"
        records[r] = json.loads(path.read_text()) if path.exists() else {}
    return dirs, records, failure


def _torch_reference(spec: JobSpec, steps: int, batch: int, lr: float) -> nn.Module:
    """Plain torch: the factory's model, torch.optim, the whole batch's mean loss, zero_grad()."""
    from hfkern.elastic.worker import load_dataset, stream_indices

    x, y = load_dataset(spec.dataset, spec.seed, **spec.dataset_kwargs)
    torch.manual_seed(spec.seed)
    model = heads(**spec.model_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, **spec.optimizer_kwargs)
    for step in range(steps):
        idx = torch.from_numpy(stream_indices(x.size(0), spec.seed, step * batch, batch))
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return model


def _check_job(two_rank_jobs, name):
    dirs, records, failure = two_rank_jobs
    single, ranks = dirs[name]
    for r in range(WORLD):
        got = records[r].get(ranks, f"not run ({failure})")
        assert got == "finished", f"rank {r}: {got}"
    spec = _heads_spec(name, _JOBS[name])
    want = _torch_reference(spec, 6, 8, 0.1).state_dict()
    init = (torch.manual_seed(0), heads(**spec.model_kwargs))[1].state_dict()
    ck1, ck2 = _ckpt(single), _ckpt(ranks)
    for key, ref in want.items():
        for what, ck in (("one process", ck1), ("2 ranks", ck2)):
            torch.testing.assert_close(ck["model"][key], ref, rtol=0, atol=2e-5,
                                       msg=lambda m, key=key, what=what: f"{what}: {key}: {m}")
    # never reached: untouched (no weight decay), and no optimizer state, on 2 ranks as in one process
    for key in ("unused.weight", "unused.bias"):
        assert torch.equal(ck2["model"][key], init[key]), f"2 ranks changed {key}"
    names = list(want)
    for what, ck in (("one process", ck1), ("2 ranks", ck2)):
        held = {names[i] for i in ck["optimizer"]["state"]}
        assert not held & {"unused.weight", "unused.bias"}, f"{what}: optimizer state for {sorted(held)}"
    assert sorted(ck1["optimizer"]["state"]) == sorted(ck2["optimizer"]["state"])
    l1 = [r["loss"] for r in _log(single)]
    l2 = [r["loss"] for r in _log(ranks)]
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-5, atol=1e-6)


def test_unused_parameter_gets_no_update_on_two_ranks(two_rank_jobs):
    """A head forward never uses: AdamW (weight_decay 0.5) leaves it untouched, holds no state for it."""
    _check_job(two_rank_jobs, "unused")


def test_parameter_reached_by_some_ranks_gets_the_whole_batch_gradient(two_rank_jobs):
    """A head used only for some samples: steps where no rank reached it skip it (no decay), steps
    where one rank did give the whole batch's gradient (zeros from the other rank)."""
    from hfkern.elastic.worker import load_dataset, rank_slice, stream_indices

    x, _ = load_dataset("classification", 0, n_samples=40, n_features=6, n_classes=3)
    kinds = set()
    for step in range(6):
        idx = stream_indices(40, 0, step * 8, 8)
        hit = [bool((x[idx[f:f + c], 0] > _THRESHOLD).any()) for f, c in (rank_slice(8, WORLD, r)
                                                                          for r in range(WORLD))]
        kinds.add(sum(hit))
    assert {0, 1} <= kinds, f"the data do not give the cases this test is about: {kinds}"
    _check_job(two_rank_jobs, "rare")


# ---- Executor.apply_all ---------------------------------------------------------------------------
class _Fake(Executor):
    """A process-free back end recording what it is asked to do."""

    def __init__(self):
        self.specs, self.st, self.calls = {}, {}, []

    def register(self, spec):
        self.specs[spec.name] = spec
        self.st[spec.name] = JobStatus(spec.name, "pending", B=spec.B)
        return self.st[spec.name]

    def launch(self, spec, allocation, *, lr=None):
        self.calls.append(("launch", spec.name))
        self.st[spec.name] = JobStatus(spec.name, "running", gpus=allocation.gpus,
                                       batch_size=allocation.batch_size, lr=lr, B=spec.B)
        return self.st[spec.name]

    def rescale(self, name, gpus, batch_size, *, lr_scale=None, block=True, timeout=None):
        self.calls.append(("rescale", name))
        self.st[name] = dataclasses.replace(self.st[name], gpus=gpus, batch_size=batch_size)
        return self.st[name]

    def stop(self, name, *, block=True, timeout=None):
        self.calls.append(("stop", name))
        self.st[name] = JobStatus(name, "stopped")
        return self.st[name]

    def poll(self):
        return dict(self.st)

    def shutdown(self, *, checkpoint=False, timeout=30.0):
        pass

    def log(self, name, last=None):
        return []

    def spec(self, name):
        if name not in self.specs:
            raise ValueError(f"unknown job {name!r}")
        return self.specs[name]


def _alloc(gpus, batch, B):
    return Allocation(gpus=gpus, batch_size=batch, B=B, goodput=0.0)


def _fake_with_running():
    ex = _Fake()
    ex.register(JobSpec("a", total_steps=10, B=1))
    ex.register(JobSpec("b", total_steps=10, B=4))
    ex.register(JobSpec("c", total_steps=10, B=1))
    ex.launch(ex.specs["a"], _alloc(2, 32, 1), lr=0.1)
    ex.launch(ex.specs["c"], _alloc(1, 32, 1), lr=0.1)
    ex.calls.clear()
    return ex


@pytest.mark.parametrize("bad, texts", [
    (Decision("b", None, _alloc(1, 32, 2), 1.0, "arrival"), ["job 'b' trains an array of B=4", "got 2"]),
    (Decision("zzz", None, _alloc(1, 32, 1), 1.0, "arrival"),
     ["apply_all: expected a known job name, got 'zzz' (known: ['a', 'b', 'c'])"]),
    (Decision("a", _alloc(2, 32, 1), _alloc(0, 32, 1), 1.0, "interval"), ["at most one decision per job", "'a'"]),
])
def test_apply_all_checks_every_decision_before_any_is_carried_out(bad, texts):
    ex = _fake_with_running()
    before = ex.poll()
    round_ = [Decision("a", _alloc(2, 32, 1), _alloc(1, 32, 1), 1.0, "arrival"),
              Decision("c", _alloc(1, 32, 1), _alloc(0, 32, 1), 1.0, "arrival"), bad]
    with pytest.raises(ValueError) as info:
        ex.apply_all(round_)
    for t in texts:
        assert t in str(info.value), str(info.value)
    assert ex.calls == [], f"carried out before the error: {ex.calls}"
    assert ex.poll() == before


def test_apply_all_unknown_job_on_the_torchrun_executor(tmp_path):
    ex = TorchrunExecutor(tmp_path / "jobs")
    try:
        ex.register(JobSpec("np", total_steps=5))
        with pytest.raises(ValueError, match=r"apply_all: expected a known job name, got 'nope' \(known: \['np'\]\)"):
            ex.apply_all([Decision("nope", None, _alloc(1, 8, 1), 1.0, "arrival")])
        assert ex.status("np").state == "pending"
    finally:
        ex.shutdown()


# ---- TopKState: settings agreed across ranks ------------------------------------------------------
class _Params(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])


def _expect_refusal(make, texts):
    try:
        make()
    except ValueError as e:
        for t in texts:
            assert t in str(e), f"{t!r} not in {str(e)!r}"
        return
    raise AssertionError(f"did not raise ValueError (expected {texts})")


def _hook_once(st, model, rank):
    from _dist_topk_cases import FakeBucket

    from hfkern.distributed import topk_hook

    params = list(model.parameters())
    g = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(rank))
    return topk_hook(st, FakeBucket(g, 0, True, params)).wait()


def check_mismatched_settings(rank):
    """Each setting that sets the message sizes, different on the two ranks: a ValueError on both
    ranks naming it and both values; the group still works afterwards."""
    from hfkern.distributed import TopKState, node_groups

    two_nodes = node_groups(1)   # collective: both ranks create it

    def one(a, b):   # rank 0's value, rank 1's value
        return a if rank == 0 else b

    m = _Params([(2, 30)])
    cases = [
        (lambda: TopKState(m, density=one(0.1, 0.3), fallback=False), ["density", "rank 0: 0.1", "rank 1: 0.3"]),
        (lambda: TopKState(m, density=0.1, per_model=one(2, None)), ["per_model", "rank 0: 2", "rank 1: None"]),
        (lambda: TopKState(m, density=0.1, exact=one(True, False)), ["exact", "rank 0: True", "rank 1: False"]),
        (lambda: TopKState(m, density=0.1, fallback=one(True, False)), ["fallback"]),
        (lambda: TopKState(m, density=0.1, warmup_steps=one(0, 3)), ["warmup_steps", "rank 0: 0", "rank 1: 3"]),
        (lambda: TopKState(m, **one({"density": 0.5}, {"density_schedule": [(0, 0.5), (4, 0.1)]})),
         ["density"]),
        (lambda: TopKState(m, density=0.1, nodes=one(two_nodes, None)), ["nodes", "rank 1: None"]),
        (lambda: TopKState(_Params([(2, 30)] if rank == 0 else [(3, 20)]), density=0.1),
         ["parameter 0", "rank 0: shape (2, 30)", "rank 1: shape (3, 20)"]),
        (lambda: TopKState(_Params([(4,)] * (1 + rank)), density=0.1),
         ["number of parameters", "rank 0: 1", "rank 1: 2"]),
    ]
    for make, texts in cases:
        _expect_refusal(make, ["TopKState: the ranks disagree on"] + texts)
    # the same settings (a different seed is allowed): builds, and the hook's exchange works
    st = TopKState(m, density=0.1, fallback=False, seed=rank)
    out = _hook_once(st, m, rank)
    assert st.step == 1 and out.numel() == 60


def check_mismatched_step_on_load(rank):
    """States of different steps: load_state_dict raises on both ranks, and changes nothing."""
    from hfkern.distributed import TopKState

    m = _Params([(40,)])
    st = TopKState(m, density=0.1, fallback=False, warmup_steps=2)
    for _ in range(3):
        _hook_once(st, m, rank)
    saved = st.state_dict()
    bad = {**saved, "step": saved["step"] + 5 * rank}
    _expect_refusal(lambda: st.load_state_dict(bad),
                    ["TopKState.load_state_dict: the ranks disagree on step", "rank 0: 3", "rank 1: 8"])
    assert st.step == 3
    st.load_state_dict(saved)   # the same step on every rank loads
    _hook_once(st, m, rank)
    assert st.step == 4


_TOPK_CHECKS = [check_mismatched_settings, check_mismatched_step_on_load]


def _topk_ranks(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    record = {}
    for check in _TOPK_CHECKS:
        try:
            check(rank)
            record[check.__name__] = "ok"
        except Exception:  # noqa: BLE001 - recorded for the test to report
            record[check.__name__] = traceback.format_exc()
        with open(os.path.join(out_dir, f"topk{rank}.json"), "w") as f:
            json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def topk_records(tmp_path_factory):
    out = tmp_path_factory.mktemp("topk4")
    fd, init_file = tempfile.mkstemp(dir=out)
    os.close(fd)
    os.unlink(init_file)
    ctx = mp.spawn(_topk_ranks, args=(WORLD, init_file, str(out)), nprocs=WORLD, join=False)
    failure = _join(ctx, _DEADLINE_S)
    recs = {}
    for r in range(WORLD):
        path = out / f"topk{r}.json"
        recs[r] = json.loads(path.read_text()) if path.exists() else {}
        recs[r]["_failure"] = failure
    return recs


@pytest.mark.parametrize("check", [c.__name__ for c in _TOPK_CHECKS])
def test_topk_state_mismatch_between_ranks(topk_records, check):
    failures = {r: rec.get(check, f"not run: {rec['_failure']}") for r, rec in topk_records.items()
                if rec.get(check) != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{msg}" for r, msg in failures.items())


# ---- checkpoints of other jobs --------------------------------------------------------------------
def _small(name, **kw):
    base = dict(dataset="classification", dataset_kwargs={"n_samples": 40, "n_features": 20},
                model_kwargs={"in_features": 20, "out_features": 4, "hidden": 8}, lr=0.1, batch_size=8,
                total_steps=3, seed=1)
    base.update(kw)
    return JobSpec(name, **base)


def test_a_job_refuses_another_jobs_checkpoint(tmp_path):
    from hfkern.elastic.worker import train

    ck = str(tmp_path / "shared_ckpt")
    a = _small("a", checkpoint_dir=ck)
    assert train(_make_job(tmp_path / "a", a, 8, 0.1)) == "finished"
    for other in (_small("b", checkpoint_dir=ck, seed=2, total_steps=6),
                  _small("a", checkpoint_dir=ck, seed=2, total_steps=6),            # same name, another seed
                  _small("a", checkpoint_dir=ck, total_steps=6, optimizer="adam")):
        d = _make_job(tmp_path / f"other{len(os.listdir(tmp_path))}", other, 8, 0.1)
        with pytest.raises(ValueError, match="belongs to another job") as info:
            train(d)
        assert "checkpoint_dir of its own" in str(info.value)
        assert not os.path.exists(os.path.join(d, "log.jsonl")) or _log(d) == []
    # the job itself resumes (a longer run of it: the length is not part of its identity)
    d = _make_job(tmp_path / "a_again", dataclasses.replace(a, total_steps=5), 8, 0.1)
    assert train(d) == "finished"
    assert [r["step"] for r in _log(d)] == [3, 4]


def test_register_refuses_a_checkpoint_dir_in_use(tmp_path):
    ex = TorchrunExecutor(tmp_path / "jobs")
    try:
        ck = str(tmp_path / "ck")
        ex.register(_small("a", checkpoint_dir=ck))
        with pytest.raises(ValueError, match="which job 'a' already uses"):
            ex.register(_small("b", checkpoint_dir=ck))
        with pytest.raises(ValueError, match="which job 'a' already uses"):
            ex.register(_small("c", checkpoint_dir=os.path.join(ck, ".")))
        with pytest.raises(ValueError, match="which job 'a' already uses"):
            ex.register(_small("d", checkpoint_dir=ck + "/../ck"))
        # another job's default checkpoint directory
        ex.register(_small("e"))
        with pytest.raises(ValueError, match="which job 'e' already uses"):
            ex.register(_small("f", checkpoint_dir=os.path.join(ex.workdir, "e", "checkpoint")))
        assert sorted(os.listdir(ex.workdir)) == ["a", "e"]
        ex.register(_small("g", checkpoint_dir=str(tmp_path / "ck2")))
    finally:
        ex.shutdown()


# ---- mse on class labels ------------------------------------------------------------------------
def test_mse_on_labels_one_hot_over_the_data_sets_classes(tmp_path):
    from hfkern.elastic.worker import load_dataset, mlp, stream_indices, train

    kw = {"n_samples": 12, "n_features": 6, "n_classes": 6}
    x, y = load_dataset("classification", 1, **kw)
    assert int(y.max()) < 5, "the data set should lack its highest class"
    spec = JobSpec("m", model_kwargs={"in_features": 6, "out_features": 6, "hidden": 5}, dataset="classification",
                   dataset_kwargs=kw, loss="mse", lr=0.1, batch_size=4, total_steps=2, seed=1)
    d = _make_job(tmp_path / "m", spec, 4, 0.1)
    assert train(d) == "finished"
    torch.manual_seed(1)
    ref = mlp(6, 6, 5)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for step in range(2):
        idx = torch.from_numpy(stream_indices(12, 1, 4 * step, 4))
        opt.zero_grad()
        loss = (ref(x[idx]) - F.one_hot(y[idx], 6).float()).pow(2).mean()
        loss.backward()
        opt.step()
        want.append(loss.item())
    got = [r["loss"] for r in _log(d)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)
    # a model of another output width is told so
    bad = dataclasses.replace(spec, model_kwargs={"in_features": 6, "out_features": 5, "hidden": 5})
    with pytest.raises(ValueError, match="expected a model with 6 outputs"):
        train(_make_job(tmp_path / "bad", bad, 4, 0.1))


# ---- dropout and the world size -----------------------------------------------------------------
def test_worker_documents_that_dropout_depends_on_the_world_size():
    from hfkern.elastic import worker

    doc = " ".join(worker.__doc__.split())
    assert "dropout masks on the world size" in doc
    assert "matches an uninterrupted run only at an unchanged world size" in doc


# ---- JobSpec: numpy ints; register leaves nothing behind ------------------------------------------
def test_job_spec_stores_numpy_ints_as_ints(tmp_path):
    spec = JobSpec("np", batch_size=np.int64(16), total_steps=np.int32(5), seed=np.uint8(3), B=np.int64(1),
                   checkpoint_every=np.int16(2))
    for field in ("batch_size", "total_steps", "seed", "B", "checkpoint_every"):
        assert type(getattr(spec, field)) is int, field
    spec2 = JobSpec("np2", total_samples=np.int64(100))
    assert type(spec2.total_samples) is int
    json.dumps(spec.to_dict())
    ex = TorchrunExecutor(tmp_path / "jobs")
    try:
        ex.register(spec)
        assert os.listdir(os.path.join(ex.workdir, "np")) == ["spec.json"]
        assert JobSpec.from_dict(json.loads((tmp_path / "jobs" / "np" / "spec.json").read_text())) == spec
    finally:
        ex.shutdown()


def test_register_leaves_no_temporary_file_on_failure(tmp_path, monkeypatch):
    ex = TorchrunExecutor(tmp_path / "jobs")
    try:
        real = os.replace

        def failing(src, dst):
            if str(dst).endswith("spec.json"):
                raise OSError("injected: disk full")
            return real(src, dst)

        monkeypatch.setattr(os, "replace", failing)
        with pytest.raises(OSError, match="injected"):
            ex.register(JobSpec("x", total_steps=2))
        monkeypatch.setattr(os, "replace", real)
        assert os.listdir(ex.workdir) == []
        ex.register(JobSpec("x", total_steps=2))   # and it registers once the disk is back
        assert os.listdir(os.path.join(ex.workdir, "x")) == ["spec.json"]
    finally:
        ex.shutdown()


# ---- options the worker would refuse, refused up front --------------------------------------------
@pytest.mark.parametrize("kw, exc, texts", [
    (dict(optimizer_kwargs={"momentun": 0.9}), ValueError,
     ["optimizer_kwargs among the options of torch.optim.SGD", "'momentum'", "got unknown ['momentun']"]),
    (dict(optimizer="adamw", optimizer_kwargs={"betas": [0.9, 0.99], "weight_decai": 0.1}), ValueError,
     ["torch.optim.AdamW", "'weight_decay'", "got unknown ['weight_decai']"]),
    (dict(dataset="classification", dataset_kwargs={"n_sample": 10}), ValueError,
     ["dataset_kwargs", "'classification' takes options ['n_classes', 'n_features', 'n_samples', 'noise']",
      "got ['n_sample']"]),
    (dict(dataset_kwargs={"n_samples": 10}), ValueError, ["'digits' takes no options", "got ['n_samples']"]),
    (dict(dataset="regression", dataset_kwargs={"n_targets": 0}), ValueError,
     ["expected n_targets to be a positive int, got 0"]),
])
def test_job_spec_refuses_options_the_worker_would(kw, exc, texts):
    with pytest.raises(exc) as info:
        JobSpec("late", total_steps=2, **kw)
    for t in texts:
        assert t in str(info.value), str(info.value)


@pytest.mark.parametrize("kw, exc, texts", [
    (dict(model_kwargs={"hiden": 8}), ValueError,
     ["model_kwargs among the arguments of hfkern.elastic.worker:mlp", "'hidden'", "got unknown ['hiden']"]),
    (dict(model="hfkern.elastic.worker:no_such_factory"), ValueError,
     ["importable factory", "'hfkern.elastic.worker:no_such_factory'", "no attribute 'no_such_factory'"]),
    (dict(model="no_such_module_4:f"), ValueError, ["importing 'no_such_module_4' failed"]),
    (dict(model="hfkern.elastic.worker:DATASETS"), TypeError, ["to be callable", "got tuple"]),
    (dict(model="torch.nn:Linear", model_kwargs={"in_features": 3}), TypeError,
     ["missing a required argument: 'out_features'"]),
])
def test_register_refuses_a_model_the_worker_could_not_build(tmp_path, kw, exc, texts):
    ex = TorchrunExecutor(tmp_path / "jobs")
    try:
        with pytest.raises(exc) as info:
            ex.register(JobSpec("late", total_steps=2, **kw))
        for t in texts:
            assert t in str(info.value), str(info.value)
        assert os.listdir(ex.workdir) == []
        assert ex.poll() == {}
    finally:
        ex.shutdown()


def test_register_accepts_good_options(tmp_path):
    ex = TorchrunExecutor(tmp_path / "jobs")
    try:
        ex.register(JobSpec("ok", total_steps=2, model_kwargs={"hidden": 8, "depth": 2},
                            optimizer="sgd", optimizer_kwargs={"momentum": 0.9, "nesterov": True}))
        ex.register(JobSpec("ok2", total_steps=2, model=f"{_THIS}:heads", model_kwargs={"threshold": 0.5},
                            dataset="classification", dataset_kwargs={"n_features": 6, "n_classes": 3}))
        assert sorted(ex.poll()) == ["ok", "ok2"]
    finally:
        ex.shutdown()


def test_failing_job_is_still_reported(executor):
    """A job that register accepts but whose worker fails (the factory refuses a value): "failed",
    with the worker's error in the message (a missing factory no longer gets this far)."""
    spec = JobSpec("broken", model_kwargs={"hidden": 0}, total_steps=5)
    executor.launch(spec, Allocation(gpus=1, batch_size=32, B=1, goodput=0.0))
    st = executor.wait("broken", timeout=90.0)
    assert st.state == "failed" and st.returncode != 0 and st.pid is None
    assert "expected hidden to be a positive int, got 0" in st.message, st.message
