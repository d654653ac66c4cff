"""hfkern.data.CachedDataset: counters that torch cannot move, copies that keep counting, rows
of workers that never collide, disk hits that do not use up the process's mappings, exact
floats and big ints, and clear errors.

Tests that crashed the interpreter before the fix (a segfault, a corrupted heap) run their
scenario in a subprocess, which imports the same hfkern as this module. Counts are worked out
by hand in the comments.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import os
import pickle
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import hfkern
from hfkern.data import CachedDataset, cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hfkern.__file__)))
N = 8


class Small(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.full((4,), float(i))


from test_data_cache_defects import ListDataset as Items  # noqa: E402 (a list's items, the indices asked recorded)


class Ints:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _same_collate(batch):
    return batch


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _run_script(tmp_path, body: str, timeout: int = 240) -> str:
    """Run ``body`` as a script in a fresh interpreter (so that a crash fails this test alone);
    its stdout, asserting that it exited 0 and printed OK."""
    script = tmp_path / "scenario.py"
    script.write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\n" + textwrap.dedent(body))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True,
                       timeout=timeout, cwd=str(tmp_path), env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"exit code {p.returncode}:\n{out[-4000:]}"
    assert "OK" in p.stdout, out[-4000:]
    return p.stdout


_PRELUDE = """
import copy, gc, pickle
import torch
torch.set_num_threads(1)
import torch.multiprocessing
from torch.utils.data import DataLoader
import hfkern
from hfkern.data import CachedDataset
assert hfkern.__file__.startswith(sys.path[0]), hfkern.__file__


class Small(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.full((4,), float(i))


def churn():
    # allocate and free: what a write through freed memory would corrupt
    return sum(len(bytearray(200)) for _ in range(2000))
"""


# -- 1. torch's sharing strategy cannot move the counters ---------------------------------


@pytest.mark.parametrize("order, contexts", [("after", ["spawn", "forkserver", "fork"]), ("before", ["spawn"])])
def test_sharing_strategy_file_system_then_workers_keep_exact_counters(tmp_path, order, contexts):
    """set_sharing_strategy("file_system") before or after the wrapper is built, then
    DataLoaders: stats() reads the live counters (it read freed memory and crashed)."""
    _run_script(tmp_path, _PRELUDE + f"""
if __name__ == "__main__":
    if {order!r} == "before":
        torch.multiprocessing.set_sharing_strategy("file_system")
    ds = CachedDataset(Small(), memory_bytes=1 << 20)
    if {order!r} == "after":
        torch.multiprocessing.set_sharing_strategy("file_system")
    ds[0]                                   # this process: a miss, a load
    for ctx in {contexts!r}:
        ds.reset_stats()
        list(DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context=ctx))
        s = ds.stats()
        # spawn / forkserver: the worker's memory tier is empty (8 loads); fork: it is a copy
        # of this process's, which holds sample 0 (7 loads, 1 hit)
        want = 7 if ctx == "fork" else 8
        assert s["loads"] == want and s["memory"]["hits"] == 8 - want, (ctx, s)
        rows = ds.stats(per_process=True)
        assert rows[0]["loads"] == 0 and rows[1]["loads"] == want, (ctx, rows[:3])
        for _ in range(100):
            ds.reset_stats()
            churn()
        assert ds.stats()["loads"] == 0 and ds.stats()["memory"]["misses"] == 0
        ds[0]
        assert ds.stats()["memory"]["hits"] == 1 and ds.stats()["loads"] == 0
    print("OK")
""")


# -- 2. copies made in the process share its counters ----------------------------------------


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_then_spawn_workers_count_into_the_live_table(tmp_path, how):
    """A deepcopy or a pickle loaded in the same process, then a spawn DataLoader: the copy's
    stats() and reset_stats() use the live table (they read and wrote freed heap memory)."""
    _run_script(tmp_path, _PRELUDE + f"""
if __name__ == "__main__":
    base = CachedDataset(Small(), memory_bytes=1 << 20)
    ds = copy.deepcopy(base) if {how!r} == "deepcopy" else pickle.loads(pickle.dumps(base))
    ds[0]                                   # the copy's memory tier starts empty: a load
    assert ds.stats()["loads"] == 1
    list(DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="spawn"))
    s = ds.stats()
    assert s["loads"] == 1 + 8 and s["memory"]["misses"] == 1 + 8, s
    assert base.stats() == s                # copies made in one process share its counters
    for _ in range(200):
        ds.reset_stats()
        churn()
    gc.collect()
    assert ds.stats()["loads"] == 0 and base.stats()["loads"] == 0
    print("OK")
""")


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_forked_workers_of_a_copy_count_into_its_stats(how):
    base = CachedDataset(Small(), memory_bytes=1 << 20)
    ds = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda b: pickle.loads(pickle.dumps(b))}[how](base)
    ds.reset_stats()
    batches = list(DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork"))
    assert torch.equal(torch.cat(batches), torch.arange(N, dtype=torch.float32)[:, None].expand(N, 4))
    # the copy's memory tier is empty (base's was never filled): every sample loaded once
    s = ds.stats()
    assert s["loads"] == N and s["memory"]["misses"] == N, s
    loads = [r["loads"] for r in ds.stats(per_process=True)]
    assert loads[0] == 0 and loads[1] + loads[2] == N and loads[1] > 0 and loads[2] > 0, loads
    assert base.stats() == s


# -- 3. disk hits do not use up the process's memory mappings -------------------------------


def _map_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_small_disk_hits_are_read_not_mapped(tmp_path, monkeypatch):
    """Each mapped disk hit is one of the process's vm.max_map_count (65530) mappings: a process
    keeping ~65k small samples failed with ENOMEM. Small entries are read into memory; large
    ones are still mapped."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc/self/maps")
    n = 1500
    data = Items([torch.tensor([i], dtype=torch.int32) for i in range(n)] + [torch.zeros(1 << 16)])
    ds = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 26, key="small")
    for i in range(n + 1):
        ds[i]                                        # written
    mapped = []
    real = cache._map_private
    monkeypatch.setattr(cache, "_map_private", lambda fd, size: mapped.append(size) or real(fd, size))
    before = _map_count()
    kept = [ds[i] for i in range(n)]                 # disk hits, every one kept
    grown = _map_count() - before
    assert mapped == [] and grown < 100, (len(mapped), grown)
    for i, x in enumerate(kept):
        assert torch.equal(x, torch.tensor([i], dtype=torch.int32))
    big = ds[n]                                      # 256 KiB of data: mapped, as before
    assert len(mapped) == 1 and mapped[0] > cache._MAP_MIN_BYTES
    assert torch.equal(big, torch.zeros(1 << 16))
    assert ds.stats()["disk"]["hits"] == n + 1 and data.calls == list(range(n + 1))


@pytest.mark.parametrize("error", [
    RuntimeError("unable to mmap 262272 bytes from file </proc/self/fd/9>: Cannot allocate memory (12)"),
    OSError(errno.ENOMEM, "Cannot allocate memory"),
])
def test_a_disk_hit_that_cannot_be_mapped_is_read(tmp_path, monkeypatch, error):
    want = torch.arange(1 << 16, dtype=torch.float32)
    data = Items([want])
    ds = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 22, key="nomap")
    ds[0]                                            # written

    def fail(fd, size):
        raise error

    monkeypatch.setattr(cache, "_map_private", fail)
    got = ds[0]
    assert torch.equal(got, want) and ds.stats()["disk"]["hits"] == 1 and data.calls == [0]
    got.fill_(-1)                                    # a buffer of its own
    assert torch.equal(ds[0], want)


# -- 4. two DataLoaders at once: rows of their own, no lost counts ------------------------------


def _two_loaders_at_once(ds, n):
    a = DataLoader(ds, batch_size=64, num_workers=1, collate_fn=_same_collate, multiprocessing_context="fork")
    b = DataLoader(ds, batch_size=64, num_workers=1, collate_fn=_same_collate, multiprocessing_context="fork")
    seen = 0
    for xa, xb in zip(a, b):
        seen += len(xa) + len(xb)
    assert seen == 2 * n


def test_two_dataloaders_at_once_count_into_rows_of_their_own():
    """Both loaders' worker 0 counted into row 1, by a read-modify-write of each count: counts
    were lost. Each worker now holds a row of its own."""
    n = 3000
    ds = CachedDataset(Ints(n), memory_bytes=1 << 10)   # tiny tier: nearly every lookup a miss
    _two_loaders_at_once(ds, n)
    s, rows = ds.stats(), ds.stats(per_process=True)
    m = s["memory"]
    assert m["hits"] + m["misses"] == 2 * n and s["loads"] + m["hits"] == 2 * n, s
    lookups = [r["memory"]["hits"] + r["memory"]["misses"] for r in rows]
    assert lookups[0] == 0 and lookups[1] == n and lookups[2] == n and sum(lookups) == 2 * n, lookups[:4]
    assert len(rows) == 2 + 64


@pytest.mark.parametrize("max_workers", [0, 1])
def test_workers_beyond_max_workers_share_the_overflow_row(max_workers):
    """More live workers than rows: the others count together into the last row (under a lock),
    none lost (with max_workers=0 every worker kept its counts to itself)."""
    n = 1500
    ds = CachedDataset(Ints(n), memory_bytes=1 << 10, max_workers=max_workers)
    _two_loaders_at_once(ds, n)
    s, rows = ds.stats(), ds.stats(per_process=True)
    assert len(rows) == 2 + max_workers
    m = s["memory"]
    assert m["hits"] + m["misses"] == 2 * n and s["loads"] + m["hits"] == 2 * n, s
    lookups = [r["memory"]["hits"] + r["memory"]["misses"] for r in rows]
    assert lookups[0] == 0 and lookups[-1] == (2 - max_workers) * n and sum(lookups) == 2 * n, lookups
    ds.reset_stats()
    assert ds.stats()["loads"] == 0 and all(r["loads"] == 0 for r in ds.stats(per_process=True))


def _reset_in_overflow_worker(worker_id):
    ds = torch.utils.data.get_worker_info().dataset
    ds[0]
    assert ds.stats()["memory"]["misses"] == 1
    ds.reset_stats()                                 # its own counts out of the shared row
    assert ds.stats(per_process=True)[0]["memory"]["misses"] == 0


def test_reset_in_an_overflow_worker_takes_out_its_own_counts_only():
    ds = CachedDataset(Small(), memory_bytes=1 << 20, max_workers=0)
    ds.reset_stats()
    list(DataLoader(ds, batch_size=N, num_workers=1, multiprocessing_context="fork",
                    worker_init_fn=_reset_in_overflow_worker))
    rows = ds.stats(per_process=True)
    # the worker: its init's miss reset, then the batch: 1 hit (sample 0), 7 misses and loads
    assert rows[-1]["memory"] == {"hits": 1, "misses": N - 1, "evictions": 0, "too_large": 0}
    assert rows[-1]["loads"] == N - 1 and rows[0]["loads"] == 0


def test_rows_are_reused_by_the_workers_of_later_epochs():
    ds = CachedDataset(Small(), memory_bytes=1 << 20, max_workers=2)
    loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork")
    for epoch in range(3):
        list(loader)                                 # new workers each epoch, empty memory tiers
    s, rows = ds.stats(), ds.stats(per_process=True)
    assert s["loads"] == 3 * N and s["memory"]["misses"] == 3 * N, s
    assert rows[1]["loads"] + rows[2]["loads"] == 3 * N and rows[-1]["loads"] == 0


# -- 5. exact floats, complex parts and big ints ------------------------------------------------


NEG_NAN = -float("nan")
PAYLOAD_NAN = struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0]
BIG = 7 ** 6000                                      # 5071 decimal digits (> 4300, Python's limit)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_floats_keep_their_bits_and_big_ints_round_trip(tmp_path, tier):
    kw = {"memory_bytes": 1 << 20} if tier == "memory" else {"disk_dir": tmp_path, "disk_bytes": 1 << 22, "key": "f"}
    sample = [NEG_NAN, PAYLOAD_NAN, -0.0, float("-inf"), 5e-324, complex(NEG_NAN, PAYLOAD_NAN),
              {NEG_NAN: "key"}, BIG, -BIG, 2 ** 63, -(2 ** 63), 2 ** 63 - 1, {BIG: 1}, (True, 0)]
    ds = CachedDataset(Items([sample]), **kw)
    ds[0]
    got = ds[0]                                      # a hit
    assert ds.stats()[tier]["hits"] == 1
    for i in range(5):
        assert type(got[i]) is float and _bits(got[i]) == _bits(sample[i]), (i, got[i])
    assert type(got[5]) is complex
    assert _bits(got[5].real) == _bits(NEG_NAN) and _bits(got[5].imag) == _bits(PAYLOAD_NAN)
    (key,) = got[6]
    assert _bits(key) == _bits(NEG_NAN) and list(got[6].values()) == ["key"]
    assert got[7:12] == sample[7:12] and all(type(x) is int for x in got[7:12])
    assert got[12] == {BIG: 1} and got[13] == (True, 0) and type(got[13][0]) is bool


# -- 6. what is a map-style dataset --------------------------------------------------------------


class _Iterable(IterableDataset):
    def __iter__(self):
        yield torch.zeros(1)


def test_iterable_datasets_and_classes_are_refused_dicts_and_strs_taken():
    with pytest.raises(TypeError, match="IterableDataset.*no index"):
        CachedDataset(_Iterable(), memory_bytes=100)
    for cls in (list, Small):
        with pytest.raises(TypeError, match="got the class .*pass an instance"):
            CachedDataset(cls, memory_bytes=100)
    # As torch's DataLoader: anything with __getitem__ (and __len__) is indexable.
    d = CachedDataset({0: "a", 1: "b"}, memory_bytes=1 << 10)
    assert [d[1], d[-2], d[1]] == ["b", "a", "b"] and d.stats()["memory"]["hits"] == 1
    s = CachedDataset("xyz", memory_bytes=1 << 10)
    assert [s[i] for i in range(len(s))] == ["x", "y", "z"]


# -- 7. clear errors -----------------------------------------------------------------------------


def test_max_workers_is_bounded_before_anything_is_made(tmp_path):
    disk = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"max_workers must be <= 4096, got 1099511627776"):
        CachedDataset(Small(), disk_dir=disk, disk_bytes=1 << 20, key="k", max_workers=2 ** 40)
    assert not disk.exists()
    assert len(CachedDataset(Small(), memory_bytes=100, max_workers=4096).stats(per_process=True)) == 4098


def test_too_deep_and_self_containing_samples_raise_type_error():
    deep = 0
    for _ in range(80):
        deep = [deep]
    loop = [1]
    loop.append(loop)
    looped_dict = {}
    looped_dict["me"] = (looped_dict,)
    ds = CachedDataset(Items([deep, loop, looped_dict]), memory_bytes=1 << 20)
    with pytest.raises(TypeError, match="nested deeper than 64 levels"):
        ds[0]
    with pytest.raises(TypeError, match=r"cannot cache sample\[1\]: a list that contains itself"):
        ds[1]
    with pytest.raises(TypeError, match=r"cannot cache sample\['me'\]\[0\]: a dict that contains itself"):
        ds[2]
    ok = [[1, 2]] * 3                                # one list three times: no loop
    assert CachedDataset(Items([ok]), memory_bytes=1 << 20)[0] == ok


@pytest.mark.parametrize("bad", ["no", 1, 0, None, np.int64(1)])
def test_stats_per_process_must_be_a_bool(bad):
    ds = CachedDataset(Small(), memory_bytes=100)
    with pytest.raises(TypeError, match="per_process must be a bool"):
        ds.stats(per_process=bad)
    assert isinstance(ds.stats(per_process=np.bool_(True)), list) and isinstance(ds.stats(per_process=False), dict)


def test_a_key_with_a_lone_surrogate_names_its_own_entries(tmp_path):
    a = CachedDataset(Items(["A"]), disk_dir=tmp_path, disk_bytes=1 << 20, key="data-\ud800")
    b = CachedDataset(Items(["B"]), disk_dir=tmp_path, disk_bytes=1 << 20, key="data-\udfff")
    assert a[0] == "A" and b[0] == "B"
    again = Items(["?"])
    assert CachedDataset(again, disk_dir=tmp_path, disk_bytes=1 << 20, key="data-\ud800")[0] == "A"
    assert again.calls == [] and a.disk_usage()["entries"] == 2


# -- 8. a dead writer's temp file goes with the next cache to open the directory ----------------


def test_opening_any_key_removes_dead_writers_temp_files_of_every_key(tmp_path):
    a = CachedDataset(Items(["a"]), disk_dir=tmp_path, disk_bytes=1 << 20, key="A")
    a[0]                                             # the directory has a byte count
    dead = os.path.join(a._disk.dir, ".hfc-tmp.999999.0123456789ab")
    live = os.path.join(a._disk.dir, ".hfc-tmp.999998.ba9876543210")
    for path in (dead, live):
        with open(path, "wb") as f:
            f.write(b"x" * 100)
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)               # a live writer holds its temp file's lock
        CachedDataset(Items(["b"]), disk_dir=tmp_path, disk_bytes=1 << 20, key="B")
        assert not os.path.exists(dead) and os.path.exists(live)
    finally:
        os.close(fd)
    assert a[0] == "a" and a.stats()["disk"]["hits"] == 1
