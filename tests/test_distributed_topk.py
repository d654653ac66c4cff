"""hfkern.distributed: the top-k sparse DDP communication hook, on Gloo in 4 processes.

One spawn runs the checks of tests/_dist_topk_cases.py (process start-up
costs seconds on a small machine), and a second one the checks with several
DDP buckets, whose failure mode is a hang or an abort; each test below reports
one check on every rank. The groups stand for two nodes of two ranks.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _dist_topk_cases as cases

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with Gloo")

_DEADLINE_S = 240
# The bucket checks take seconds; a collective mismatch hangs until Gloo's
# timeout (30 s there) or forever, and must fail rather than block the run.
_BUCKETS_DEADLINE_S = 90
_BUCKETS_GLOO_TIMEOUT_S = 30


def _spawn(out, suite, deadline_s, gloo_timeout_s, world=cases.WORLD):
    """Run the checks of ``cases.SUITES[suite]`` in ``world`` processes; rank -> record.

    A hang past the deadline or a dead process fails the checks that did not
    record a result (each rank writes its record after every check)."""
    fd, init_file = tempfile.mkstemp(dir=out)
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    ctx = mp.spawn(cases.worker, args=(world, str(out), init_file, suite, gloo_timeout_s),
                   nprocs=world, join=False)
    return cases.join_records(ctx, out, world, deadline_s)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("dist_topk"), "main", _DEADLINE_S, 60)


@pytest.fixture(scope="module")
def bucket_records(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("dist_topk_buckets"), "buckets", _BUCKETS_DEADLINE_S,
                  _BUCKETS_GLOO_TIMEOUT_S)


@pytest.fixture(scope="module")
def odd_records(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("dist_topk_odd"), "odd", _DEADLINE_S, 60, world=cases.ODD_WORLD)


def _assert_ok(records, check):
    failures = {r: rec.get(check, f"not run: {rec['_failure']}") for r, rec in records.items()
                if rec.get(check) != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{msg}" for r, msg in failures.items())


@pytest.mark.parametrize("check", [c.__name__ for c in cases.CHECKS])
def test_distributed(records, check):
    _assert_ok(records, check)


@pytest.mark.parametrize("check", [c.__name__ for c in cases.BUCKET_CHECKS])
def test_distributed_buckets(bucket_records, check):
    """Several DDP buckets a step (hierarchical: the issue order of collectives on
    the node groups must not depend on when a bucket's exchange completes)."""
    _assert_ok(bucket_records, check)


@pytest.mark.parametrize("check", [c.__name__ for c in cases.ODD_CHECKS])
def test_distributed_odd_world(odd_records, check):
    """Three ranks: the dense path is DDP's all-reduce bit for bit there too."""
    _assert_ok(odd_records, check)


def test_convergence_figures(records):
    """The convergence check's losses are the same on every rank (the replicas agree)."""
    figs = [rec.get("convergence") for rec in records.values()]
    if figs[0] is None:
        pytest.skip("the convergence check did not record its losses")
    assert all(f == figs[0] for f in figs), figs


def test_import_without_group():
    from hfkern.distributed import TopKState

    with pytest.raises(RuntimeError, match="not initialized"):
        TopKState(torch.nn.Linear(2, 2))
