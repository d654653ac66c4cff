"""hfkern.distributed: the top-k sparse DDP communication hook, on Gloo in 4 processes.

One spawn runs every check of tests/_dist_topk_cases.py (process start-up
costs seconds on a small machine); each test below reports one check on every
rank. The groups stand for two nodes of two ranks.
"""

import json
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _dist_topk_cases as cases

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with Gloo")

_DEADLINE_S = 240


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_topk")
    fd, init_file = tempfile.mkstemp(dir=out)
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    ctx = mp.spawn(cases.worker, args=(cases.WORLD, str(out), init_file), nprocs=cases.WORLD,
                   join=False)
    deadline = time.monotonic() + _DEADLINE_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the {cases.WORLD} processes did not finish within {_DEADLINE_S} s")
    recs = {}
    for r in range(cases.WORLD):
        with open(out / f"rank{r}.json") as f:
            recs[r] = json.load(f)
    return recs


@pytest.mark.parametrize("check", [c.__name__ for c in cases.CHECKS])
def test_distributed(records, check):
    failures = {r: rec.get(check, "not run") for r, rec in records.items() if rec.get(check) != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{msg}" for r, msg in failures.items())


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
