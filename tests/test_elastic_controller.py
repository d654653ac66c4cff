"""The autoscaler's decisions carried out on real torchrun groups (Gloo, CPU workers).

Two jobs share three worker slots. The long one starts alone on all three and
is shrunk to two when the short one arrives; when the short one finishes, the
autoscaler gives its slot back and the controller rescales the long job mid-run:
its log continues from its checkpoint at each new world size, every step once
and every sample of the stream once.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hfkern.elastic._autoscaler import Autoscaler
from hfkern.elastic._controller import Controller, profile
from hfkern.elastic._executor import Executor, JobSpec
from hfkern.elastic._model import Efficiency, Job, ThroughputModel

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the Gloo backend is not available in this torch build",
)


def _spec(name: str, steps: int, **kw) -> JobSpec:
    base = dict(model="hfkern.elastic.worker:mlp", model_kwargs={"hidden": 32}, dataset="digits",
                optimizer="adam", lr=0.01, lr_rule="sqrt", batch_size=32, total_steps=steps, seed=5,
                min_step_seconds=0.1)
    base.update(kw)
    return JobSpec(name, **base)


def _job(name: str, max_gpus: int) -> Job:
    # A model in which a second and a third worker help (compute split over workers,
    # a small all-reduce): what a job whose step is mostly compute measures on a GPU.
    model = ThroughputModel(alpha_grad=0.01, beta_grad=0.004, alpha_sync=0.005, beta_sync=0.001)
    return Job(name, model, Efficiency(base_batch_size=32, noise_scale=1000.0), batch_sizes=(32,),
               max_gpus=max_gpus)


@pytest.mark.long
def test_autoscaler_rescales_the_long_job_when_the_short_one_ends(executor):
    scaler = Autoscaler(3, interval=1e6, restart_cost=0.5, policy="hfkern")
    ctl = Controller(scaler, executor)
    ctl.submit(_job("long", max_gpus=3), _spec("long", steps=90))
    assert {n: a.gpus for n, a in scaler.allocations.items()} == {"long": 3}
    ctl.submit(_job("short", max_gpus=1), _spec("short", steps=12))
    assert {n: a.gpus for n, a in scaler.allocations.items()} == {"long": 2, "short": 1}

    statuses = ctl.run(poll=0.2, timeout=150)
    assert {n: s.state for n, s in statuses.items()} == {"long": "finished", "short": "finished"}
    rescales = [d for _, d in ctl.history if d.job == "long" and d.old is not None]
    # Shrunk for the arrival, grown again when the short job ends.
    assert [(d.old.gpus, d.new.gpus, d.reason) for d in rescales] == [(3, 2, "arrival"), (2, 3, "completion")]

    log = executor.log("long")
    assert [r["step"] for r in log] == list(range(90))
    sizes = [r["world_size"] for r in log]
    runs = [w for i, w in enumerate(sizes) if i == 0 or sizes[i - 1] != w]
    assert runs in ([3, 2, 3], [2, 3])  # the first launch may be stopped before its first step
    k = max(i for i in range(1, 90) if sizes[i - 1] == 2 and sizes[i] == 3)
    # The stream continues: each step starts where the last ended, the batch unchanged.
    assert all(b["offset"] == a["offset"] + a["batch"] for a, b in zip(log, log[1:]))
    assert all(r["batch"] == 32 for r in log)
    # The loss curve continues from the checkpoint instead of starting over.
    assert log[k]["loss"] < 0.8 * log[0]["loss"]


@pytest.mark.long
def test_profile_measures_step_times_for_the_fit(executor):
    samples = profile(executor, _spec("p", steps=1), [(1, 32), (2, 64)], steps=4, timeout=120)
    assert [(g, b, B, nodes) for g, b, B, nodes, _ in samples] == [(1, 32, 1, 1), (2, 64, 1, 1)]
    # A step time, not a timeout's or a launch's (a loose bound: CI machines are loaded).
    assert all(0 < t < 30 for *_, t in samples)
    # Two sizes do not pin down the four parameters of a model: fit refuses them.
    with pytest.raises(ValueError):
        ThroughputModel.fit(samples)
    # A second call runs again, in directories of its own (it reused the first's names: "has
    # finished; it cannot be launched again", or in a new process read the old run's log back).
    again = profile(executor, _spec("p", steps=1), [(1, 32)], steps=2, timeout=120)
    assert [s[:4] for s in again] == [(1, 32, 1, 1)] and 0 < again[0][4] < 30


class _Unused(Executor):
    """An executor that must not be called: the submissions below are refused first."""

    def _called(self, *args, **kwargs):
        raise AssertionError("the executor was called for a submission that must be refused")

    launch = rescale = stop = poll = shutdown = register = log = spec = _called


def test_submit_refuses_a_spec_whose_learning_rate_the_autoscaler_would_scale_wrongly():
    # The first launch's lr is spec.lr scaled from the Job's default batch by the autoscaler's
    # rule: a spec at another batch, or with another rule, got a silently wrong learning rate.
    ctl = Controller(Autoscaler(2, policy="hfkern", lr_rule="sqrt"), _Unused())
    job = Job("a", ThroughputModel(0.0, 0.01), Efficiency(64, 1e12), (64,), max_gpus=2)
    with pytest.raises(ValueError, match="spec.batch_size=32.*default_batch_size=64"):
        ctl.submit(job, _spec("a", steps=10, batch_size=32))
    with pytest.raises(ValueError, match="lr_rule='linear'.*'sqrt'"):
        ctl.submit(job, _spec("a", steps=10, batch_size=64, lr_rule="linear"))
    assert ctl.autoscaler.jobs == {}
