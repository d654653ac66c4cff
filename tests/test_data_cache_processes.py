"""hfkern.data.CachedDataset counters across processes: every process that uses the wrapper
counts (and resets) its own counters and its own DataLoader workers', never another's.

* ``reset_stats()`` in a process the wrapper was pickled to (a sweep trial started by
  ``spawn``) zeroes that process's counters, not the creator's and its workers';
  ``reset_stats()`` in a DataLoader worker zeroes the worker's own row alone;
* the DataLoader workers of such a process (by ``fork``, started before the process touched
  the wrapper, and by ``spawn``) count into that process's ``stats()``, not the creator's;
  the same for a trial started by ``fork``.

Each child reports through a queue; the counts are worked out by hand in the comments.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import torch
from torch.utils.data import DataLoader

from hfkern.data import CachedDataset

SPAWN = mp.get_context("spawn")
FORK = mp.get_context("fork")
N = 8
_TIMEOUT_S = 60


class Small(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.full((4,), float(i))


def _loads(stats_rows):
    return [r["loads"] for r in stats_rows]


def _run(ctx, target, *args):
    """Run ``target(queue, *args)`` in a child of ``ctx``; what it put on the queue (or its error)."""
    q = ctx.Queue()
    p = ctx.Process(target=_guarded, args=(target, q) + args, daemon=False)
    p.start()
    try:
        kind, value = q.get(timeout=_TIMEOUT_S)
    finally:
        p.join(timeout=_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()
    assert kind == "ok", value
    assert p.exitcode == 0
    return value


def _guarded(target, q, *args):
    torch.set_num_threads(1)
    try:
        q.put(("ok", target(*args)))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put(("error", traceback.format_exc()))


# -- reset_stats ------------------------------------------------------------------------------


def _trial_resets(ds):
    ds[0]  # this process's memory tier is empty (it stays behind): a miss and a load
    before = ds.stats()
    ds.reset_stats()
    return before, ds.stats()


def test_reset_stats_in_a_spawned_process_keeps_the_creators_counters():
    ds = CachedDataset(Small(), memory_bytes=1 << 20)
    for i in range(N):
        ds[i]
    ds[0]
    want = ds.stats()
    assert want["loads"] == N and want["memory"]["misses"] == N and want["memory"]["hits"] == 1
    before, after = _run(SPAWN, _trial_resets, ds)
    # the trial's own counters: one miss, one load (not the creator's 8 and 1)
    assert before["loads"] == 1 and before["memory"] == {"hits": 0, "misses": 1, "evictions": 0, "too_large": 0}
    assert after["loads"] == 0 and after["memory"]["misses"] == 0
    assert ds.stats() == want  # untouched by the trial's reset_stats()
    ds.reset_stats()
    assert ds.stats()["loads"] == 0


def _reset_in_worker(worker_id):
    info = torch.utils.data.get_worker_info()
    info.dataset[0]  # a memory hit counted in this worker's row ...
    info.dataset.reset_stats()  # ... and zeroed with it; nothing else


def test_reset_stats_in_a_worker_zeroes_its_own_row_only():
    ds = CachedDataset(Small(), memory_bytes=1 << 20)
    for i in range(N):
        ds[i]
    loader = DataLoader(ds, batch_size=N, num_workers=1, multiprocessing_context=FORK,
                        worker_init_fn=_reset_in_worker)
    (batch,) = list(loader)
    assert torch.equal(batch, torch.arange(N, dtype=torch.float32)[:, None].expand(N, 4))
    rows = ds.stats(per_process=True)
    # the creator's 8 loads stay; the worker (its memory tier a copy of the creator's, by fork):
    # its init's hit was reset, then the batch: 8 memory hits
    assert rows[0]["loads"] == N and rows[0]["memory"]["misses"] == N
    assert rows[1]["loads"] == 0 and rows[1]["memory"] == {"hits": N, "misses": 0, "evictions": 0, "too_large": 0}
    assert all(r["loads"] == 0 and r["memory"]["hits"] == 0 for r in rows[2:])


# -- workers of a process the wrapper was pickled or forked to ----------------------------------


def _trial_with_workers(ds, contexts):
    """DataLoaders with two workers each (started by each of ``contexts``), without touching the
    wrapper first; this process's stats and per-process loads after each."""
    out = []
    for ctx in contexts:
        batches = list(DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=ctx))
        got = torch.cat(batches)
        assert torch.equal(got, torch.arange(N, dtype=torch.float32)[:, None].expand(N, 4)), got
        out.append((ds.stats(), _loads(ds.stats(per_process=True))))
    return out


def _check_trial(ds, results, n_loaders):
    for k, (stats, loads) in enumerate(results, start=1):
        # each loader's fresh workers: empty memory tiers (this process's is empty), 8 loads
        assert stats["loads"] == k * N and stats["memory"]["misses"] == k * N, (k, stats)
        assert loads[0] == 0 and loads[1] + loads[2] == k * N and loads[1] > 0 and loads[2] > 0, (k, loads)
        assert all(n == 0 for n in loads[3:]), (k, loads)
    assert len(results) == n_loaders


def test_workers_of_a_spawned_process_count_into_its_stats():
    ds = CachedDataset(Small(), memory_bytes=1 << 20)
    ds[1]
    want = ds.stats(per_process=True)
    results = _run(SPAWN, _trial_with_workers, ds, ["fork", "spawn"])
    _check_trial(ds, results, 2)
    assert ds.stats(per_process=True) == want  # the creator: its own load of sample 1, no more
    # and the creator's own workers still count into the creator's table
    list(DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=FORK))
    loads = _loads(ds.stats(per_process=True))
    assert loads[0] == 1 and loads[1] + loads[2] == N - 1, loads  # sample 1 came from the copied memory tier


def test_workers_of_a_forked_process_count_into_its_stats():
    ds = CachedDataset(Small(), memory_bytes=1 << 20)
    want = ds.stats(per_process=True)
    results = _run(FORK, _trial_with_workers, ds, ["fork"])
    _check_trial(ds, results, 1)
    assert ds.stats(per_process=True) == want
