"""hfkern.data.CachedDataset: exact tier statistics, bounds, bit-exact round trips, DataLoader
workers, concurrent processes and killed writers.

Every sample the cache returns is compared with the wrapped dataset's own sample (type, dtype,
shape and bytes). The counts of the scripted access patterns are worked out by hand in the
comments, not computed by a model of the cache.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import signal
import struct
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hfkern.data import CachedDataset

FORK = mp.get_context("fork")


# -- helpers -------------------------------------------------------------------------------


def assert_same(got, want, where="sample"):
    """Same type, dtype, shape and bits (NaN payloads and -0.0 included), recursively."""
    assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got.dtype, want.dtype, got.shape)
        assert got.is_contiguous()
        g = got.reshape(-1).view(torch.uint8) if got.numel() else got
        want = want.resolve_conj().resolve_neg().contiguous()
        w = want.reshape(-1).view(torch.uint8) if want.numel() else want
        assert torch.equal(g, w), f"{where}: bytes differ"
    elif isinstance(want, (np.ndarray, np.generic)):
        assert got.dtype == want.dtype and np.shape(got) == np.shape(want), (where, got.dtype, want.dtype)
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), f"{where}: bytes differ"
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), where
        for k, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{k}]")
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{where}: {got!r} != {want!r}"
    elif isinstance(want, complex):
        assert_same(got.real, want.real, where)
        assert_same(got.imag, want.imag, where)
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


class Fixed:
    """Sample i: a float32 vector filled with i (every entry of i < 10 has the same size)."""

    def __init__(self, n=10, numel=16):
        self.n, self.numel, self.calls = n, numel, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.calls.append(i)
        return torch.full((self.numel,), float(i))


class Mixed:
    """Deterministic nested samples of varying size: tensor, numpy array, scalars, a string."""

    def __init__(self, n=40, seed=0, scale=1):
        self.n, self.seed, self.scale = n, seed, scale

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        k = int(torch.randint(1, 64 * self.scale, (), generator=g))
        x = torch.randn(k, 3, generator=g)
        return {"x": x.to(torch.bfloat16), "y": (i, x.sum().item(), x.numpy()[::2].astype(np.float16)),
                "name": f"s{i}"}


def _entry_size(tmp_path, dataset, i, tier):
    """The size of sample i's entry in a tier, read from the cache's own usage report."""
    if tier == "memory":
        probe = CachedDataset(dataset, memory_bytes=1 << 30)
        probe[i]
        return probe.memory_usage()["bytes"]
    probe = CachedDataset(dataset, disk_dir=tmp_path / "probe", disk_bytes=1 << 30, key="probe")
    probe[i]
    return probe.disk_usage()["bytes"]


def _stat_line(ds):
    s = ds.stats()
    return s["memory"], s["disk"], s["loads"]


# -- round trips ---------------------------------------------------------------------------

TORCH_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint16]


def _samples():
    g = torch.Generator().manual_seed(1)
    out = []
    for dt in TORCH_DTYPES:
        x = torch.randn(5, 7, generator=g) * 100
        if dt.is_complex:
            x = torch.complex(x, -x)
        out.append(x.to(dt))
    odd = torch.randn(6, 9, generator=g)
    odd[0, 0], odd[0, 1], odd[0, 2] = float("nan"), -0.0, float("inf")
    out += [
        odd,
        odd.t(),                                    # non-contiguous
        odd[::2, 1::3].to(torch.bfloat16),          # strided view of a larger storage
        torch.tensor(3.5),                          # 0-d
        torch.empty(0, 3, dtype=torch.int32),       # empty
        torch.randn(4, generator=g).to(torch.complex64).conj(),  # lazy conjugate
        np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],     # non-contiguous numpy
        np.random.default_rng(2).standard_normal((3, 5)).astype(np.float16),
        np.array(["ab", "c", ""]),
        np.array([1, 2, 3], dtype="datetime64[ms]"),
        np.array([True, False]),
        np.zeros((0, 2), dtype=np.uint32),
        np.float32(2.5), np.int64(-7), np.bool_(True),
        (torch.arange(5), {"a": np.arange(3.0), "b": [1, 2.5, "x"]}, None),
        {"img": torch.randn(2, 3, 3, generator=g), "label": 7, 3: b"\x00\xffraw", None: 1 + 2j, 2.5: True},
        [float("nan"), -0.0, 2 ** 70, -(2 ** 63), "ünïcode", b"", False],
        [],
        {},
        (),
    ]
    return out


class ListDataset:
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_round_trip_is_bit_exact(tmp_path, tier):
    items = _samples()
    kw = dict(memory_bytes=1 << 24) if tier == "memory" else dict(disk_dir=tmp_path, disk_bytes=1 << 24, key="rt")
    ds = CachedDataset(ListDataset(items), **kw)
    for i, want in enumerate(items):
        assert ds[i] is want                    # a miss returns the dataset's own object
    if tier == "disk":                           # read back through a fresh wrapper: no memory at all
        ds = CachedDataset(ListDataset(items), **kw)
    for i, want in enumerate(items):
        assert_same(ds[i], want, f"items[{i}]")
    assert ds.stats()["loads"] == (len(items) if tier == "memory" else 0)
    assert ds.stats()[tier]["hits"] == len(items)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_modifying_a_returned_sample_does_not_change_the_cache(tmp_path, tier):
    kw = dict(memory_bytes=1 << 20) if tier == "memory" else dict(disk_dir=tmp_path, disk_bytes=1 << 20, key="m")
    base = [(torch.randn(8, 3), np.arange(6.0))]
    ds = CachedDataset(ListDataset(base), **kw)
    want = (base[0][0].clone(), base[0][1].copy())
    ds[0]
    for _ in range(2):
        x, a = ds[0]                              # a hit
        x.mul_(0).add_(1)
        a[:] = -1
    assert_same(ds[0], want)
    if tier == "disk":                            # the file itself is unchanged
        assert_same(CachedDataset(ListDataset(base), **kw)[0], want)


@pytest.mark.parametrize("path", ["mapped", "read"])
def test_samples_read_from_disk_hold_no_file_descriptor(tmp_path, monkeypatch, path):
    """A process keeps more disk hits than it may open files (its soft RLIMIT_NOFILE, lowered here
    for the test): a sample holds no file descriptor (Python's mmap of the entry did). Both ways
    of reading an entry: the private map, and the read where the system has no /proc/self/fd.
    Writing into a sample changes neither the cache nor the file."""
    resource = pytest.importorskip("resource")
    from hfkern.data import cache

    if path == "read":
        monkeypatch.setattr(cache, "_FD_DIR", str(tmp_path / "no-such-dir"))
    elif not os.path.isdir(cache._FD_DIR):
        pytest.skip("no /proc/self/fd: entries are read")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    limit = len(os.listdir(fd_dir)) + 32      # what is open now, and a few for the cache's own files
    n = 3 * limit
    data = Fixed(n=n)
    ds = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 24, key="fd")
    for i in range(n):
        ds[i]                                     # written
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, soft), hard))
    try:
        kept = [ds[i] for i in range(n)]          # read back, every one kept
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert ds.stats()["disk"]["hits"] == n and data.calls == list(range(n))
    for i, sample in enumerate(kept):
        assert_same(sample, torch.full((16,), float(i)))
    kept[3].fill_(-1.0)
    assert_same(ds[3], torch.full((16,), 3.0))
    assert ds.stats()["disk"]["hits"] == n + 1


@pytest.mark.parametrize(
    "sample, what",
    [
        (np.array([1, "a"], dtype=object), "numpy.ndarray"),
        (np.zeros(3, dtype=[("a", "<i4"), ("b", "<f4")]), "numpy.ndarray"),
        (np.ma.masked_array([1, 2], mask=[0, 1]), "MaskedArray"),
        (torch.randn(3, requires_grad=True), "requires grad"),
        (torch.randn(3, 3).to_sparse(), "layout torch.sparse_coo"),
        (torch.nn.Parameter(torch.randn(2)), "Parameter"),
        ({1, 2}, "builtins.set"),
        ((1, [2, {"k": object()}]), "sample[1][1]['k']"),
        ({(1, 2): 3}, "a dict key"),
        (bytearray(b"x"), "builtins.bytearray"),
    ],
)
def test_unsupported_samples_raise_type_error(tmp_path, sample, what):
    ds = CachedDataset(ListDataset([sample]), memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20, key="u")
    with pytest.raises(TypeError, match="cannot cache sample") as e:
        ds[0]
    assert what in str(e.value) and "supported:" in str(e.value)
    assert ds.memory_usage()["entries"] == 0 and ds.disk_usage()["entries"] == 0


# -- exact statistics for scripted access patterns ------------------------------------------

# Capacity 3: 0 1 2 miss; 0 hit; 3 miss (evicts 1, the least recent); 1 miss (evicts 2);
# 0 hit; 2 miss (evicts 3). Hits 2, misses 6, evictions 3; left: 1, 0, 2.
SCRIPT = [0, 1, 2, 0, 3, 1, 0, 2]


def test_memory_tier_lru_counts(tmp_path):
    size = _entry_size(tmp_path, Fixed(), 0, "memory")
    data = Fixed()
    ds = CachedDataset(data, memory_bytes=3 * size + size // 2)
    for i in SCRIPT:
        assert_same(ds[i], torch.full((16,), float(i)))
        assert ds.memory_usage()["bytes"] <= ds.memory_bytes
    assert ds.stats() == {"memory": {"hits": 2, "misses": 6, "evictions": 3, "too_large": 0},
                          "disk": {"hits": 0, "misses": 0, "writes": 0, "evictions": 0, "too_large": 0,
                                   "corrupt": 0},
                          "loads": 6}
    assert data.calls == [0, 1, 2, 3, 1, 2]
    assert ds.memory_usage() == {"entries": 3, "bytes": 3 * size}
    data.calls.clear()
    for i in (1, 0, 2):                            # the three that stayed
        ds[i]
    assert data.calls == [] and ds.stats()["memory"]["hits"] == 5

    tiny = CachedDataset(Fixed(), memory_bytes=size - 1)
    tiny[0], tiny[0]
    assert tiny.stats()["memory"] == {"hits": 0, "misses": 2, "evictions": 0, "too_large": 2}
    assert tiny.memory_usage() == {"entries": 0, "bytes": 0}


def test_disk_tier_lru_counts(tmp_path):
    size = _entry_size(tmp_path, Fixed(), 0, "disk")
    ds = CachedDataset(Fixed(), disk_dir=tmp_path / "c", disk_bytes=3 * size + size // 2, key="fixed")
    for i in SCRIPT:
        assert_same(ds[i], torch.full((16,), float(i)))
    assert ds.stats()["disk"] == {"hits": 2, "misses": 6, "writes": 6, "evictions": 3, "too_large": 0,
                                  "corrupt": 0}
    assert ds.stats()["loads"] == 6
    usage = ds.disk_usage()
    assert usage == {"entries": 3, "bytes": 3 * size, "key_entries": 3, "key_bytes": 3 * size}
    # Another process's view (a fresh wrapper): 1, 0 and 2 are there, 3 is not.
    data = Fixed()
    other = CachedDataset(data, disk_dir=tmp_path / "c", disk_bytes=3 * size + size // 2, key="fixed")
    for i in (1, 0, 2, 3):
        assert_same(other[i], torch.full((16,), float(i)))
    assert data.calls == [3]
    assert other.stats()["disk"] == {"hits": 3, "misses": 1, "writes": 1, "evictions": 1, "too_large": 0,
                                     "corrupt": 0}

    small = CachedDataset(Fixed(), disk_dir=tmp_path / "s", disk_bytes=size - 1, key="fixed")
    small[0], small[0]
    assert small.stats()["disk"]["too_large"] == 2 and small.disk_usage()["entries"] == 0


def test_both_tiers_counts(tmp_path):
    msize = _entry_size(tmp_path, Fixed(), 0, "memory")
    dsize = _entry_size(tmp_path, Fixed(), 0, "disk")
    data = Fixed()
    ds = CachedDataset(data, memory_bytes=msize, disk_dir=tmp_path / "c", disk_bytes=3 * dsize, key="fixed")
    # memory holds 1 entry, disk 3:
    # 0: miss, miss, load          mem [0]   disk [0]
    # 1: miss, miss, load          mem [1]   disk [0 1]       (memory evicts 0)
    # 0: miss, disk hit            mem [0]   disk [1 0]       (memory evicts 1)
    # 2: miss, miss, load          mem [2]   disk [1 0 2]     (memory evicts 0)
    # 3: miss, miss, load          mem [3]   disk [0 2 3]     (memory evicts 2, disk evicts 1)
    # 0: miss, disk hit            mem [0]                    (memory evicts 3)
    # 0: memory hit
    for i in (0, 1, 0, 2, 3, 0, 0):
        assert_same(ds[i], torch.full((16,), float(i)))
    assert ds.stats() == {"memory": {"hits": 1, "misses": 6, "evictions": 5, "too_large": 0},
                          "disk": {"hits": 2, "misses": 4, "writes": 4, "evictions": 1, "too_large": 0,
                                   "corrupt": 0},
                          "loads": 4}
    assert data.calls == [0, 1, 2, 3]
    ds.reset_stats()
    assert ds.stats()["loads"] == 0 and ds.stats()["memory"]["hits"] == 0


def test_bounds_hold_under_random_access(tmp_path):
    rng = random.Random(5)
    data = Mixed(n=60)
    ds = CachedDataset(data, memory_bytes=6000, disk_dir=tmp_path, disk_bytes=20000, key="mixed")
    for _ in range(300):
        i = rng.randrange(-len(data), len(data))
        assert_same(ds[i], data[i % len(data)], f"ds[{i}]")
        assert ds.memory_usage()["bytes"] <= 6000
    usage = ds.disk_usage()
    assert 0 < usage["bytes"] <= 20000
    s = ds.stats()
    assert s["memory"]["hits"] > 0 and s["disk"]["hits"] > 0 and s["disk"]["evictions"] > 0
    assert s["memory"]["hits"] + s["memory"]["misses"] == 300
    assert s["disk"]["hits"] + s["disk"]["misses"] == s["memory"]["misses"]
    assert s["loads"] == s["disk"]["misses"] == s["disk"]["writes"]
    # the byte count kept under the lock agrees with a listing
    with open(tmp_path / ".hfc-usage") as f:
        assert int(f.read()) == usage["bytes"]


# -- identity, invalidation, damage ---------------------------------------------------------


def test_key_and_version_separate_entries(tmp_path):
    kw = dict(disk_dir=tmp_path, disk_bytes=1 << 20)
    a = CachedDataset(Fixed(), key="fixed", version=1, **kw)
    for i in range(4):
        a[i]
    b_data = Fixed()
    b = CachedDataset(b_data, key="fixed", version=2, **kw)       # a changed transform
    c_data = Fixed()
    c = CachedDataset(c_data, key="fixed-other", version=1, **kw)  # another dataset
    for i in range(4):
        b[i], c[i]
    assert b_data.calls == c_data.calls == [0, 1, 2, 3]
    assert CachedDataset(Fixed(), key="fixed", version="1", **kw)[0] is not None  # "1" is not 1
    same = CachedDataset(Fixed(), key="fixed", version=1, **kw)
    for i in range(4):
        same[i]
    assert same.stats()["disk"]["hits"] == 4
    assert same.disk_usage()["key_entries"] == 9  # versions 1, 2 and "1" under key "fixed"

    same.invalidate(2)
    same.invalidate(-8)                              # negative: counted from len (10) -> 2 again
    assert same.disk_usage()["key_entries"] == 8
    same[2]
    assert same.stats()["disk"]["misses"] == 1
    same.clear()                                     # every version of "fixed", not "fixed-other"
    u = same.disk_usage()
    assert u["key_entries"] == 0 and u["entries"] == 4
    with open(tmp_path / ".hfc-usage") as f:
        assert int(f.read()) == u["bytes"]


def test_memory_tier_invalidate_and_clear():
    data = Fixed()
    ds = CachedDataset(data, memory_bytes=1 << 20)
    for i in (0, 1, 0):
        ds[i]
    ds.invalidate(0)
    ds[0], ds[1]
    assert data.calls == [0, 1, 0]
    ds.clear()
    ds[1]
    assert data.calls == [0, 1, 0, 1] and ds.memory_usage()["entries"] == 1


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "other_entry"])
def test_damaged_entry_is_counted_and_reloaded(tmp_path, damage):
    data = Mixed()
    ds = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="mixed")
    ds[3], ds[4]
    path = ds._disk.path(3)
    blob = open(path, "rb").read()
    if damage == "truncate":
        blob = blob[: len(blob) - 7]
    elif damage == "garbage":
        blob = bytes(len(blob))
    elif damage == "empty":
        blob = b""
    else:                                            # a complete entry, but of another index
        blob = open(ds._disk.path(4), "rb").read()
    with open(path, "wb") as f:
        f.write(blob)
    fresh = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="mixed")
    assert_same(fresh[3], data[3])
    assert fresh.stats()["disk"] == {"hits": 0, "misses": 1, "writes": 1, "evictions": 0, "too_large": 0,
                                     "corrupt": 1}
    assert_same(CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="mixed")[3], data[3])


# -- processes ------------------------------------------------------------------------------


def _tensor_dataset(n=23):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 3, 5, generator=g).to(torch.bfloat16), torch.randint(0, 9, (n,), generator=g))


def _collect(loader):
    return [tuple(t.clone() for t in batch) for batch in loader]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_share_the_disk_tier(tmp_path, context):
    base = _tensor_dataset()
    n = len(base)
    want = _collect(DataLoader(base, batch_size=4))
    ds = CachedDataset(base, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20, key="tensors")
    kw = dict(batch_size=4, num_workers=2, multiprocessing_context=context)
    loader = DataLoader(ds, persistent_workers=True, **kw)
    for epoch in range(2):
        got = _collect(loader)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    del loader
    # epoch 1: every sample loaded once and written; epoch 2: the same workers hit their memory
    s = ds.stats()
    assert s["loads"] == n and s["disk"]["writes"] == n and s["disk"]["misses"] == n
    assert s["memory"] == {"hits": n, "misses": n, "evictions": 0, "too_large": 0}
    rows = ds.stats(per_process=True)
    assert rows[0]["loads"] == 0 and rows[1]["loads"] > 0 and rows[2]["loads"] > 0
    assert rows[1]["loads"] + rows[2]["loads"] == n and all(r["loads"] == 0 for r in rows[3:])
    if context == "spawn":
        return  # starting workers by spawn costs seconds each; fork shows the rest
    # fresh workers: empty memory tiers (the parent's is empty too), everything from disk
    ds.reset_stats()
    got = _collect(DataLoader(ds, **kw))
    for g, w in zip(got, want):
        assert_same(g, w)
    s = ds.stats()
    assert s["loads"] == 0 and s["disk"]["hits"] == n and s["memory"]["misses"] == n


def _reader(disk_dir, seed, rounds, failures):
    torch.set_num_threads(1)
    try:
        data = Mixed(n=30, scale=4)
        ds = CachedDataset(data, disk_dir=disk_dir, disk_bytes=40_000, key="shared")
        rng = random.Random(seed)
        order = list(range(len(data)))
        for _ in range(rounds):
            rng.shuffle(order)
            for i in order:
                assert_same(ds[i], data[i], f"ds[{i}]")
        s = ds.stats()
        failures.put(("ok", s["disk"]["hits"], s["disk"]["corrupt"]))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        failures.put(("error", repr(e), 0))


def test_concurrent_processes_read_and_write_the_same_keys(tmp_path):
    q = FORK.Queue()
    procs = [FORK.Process(target=_reader, args=(str(tmp_path), seed, 3, q), daemon=True) for seed in range(3)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(r[0] == "ok" for r in results), results
    assert sum(r[1] for r in results) > 0 and all(r[2] == 0 for r in results), results
    ds = CachedDataset(Mixed(n=30, scale=4), disk_dir=tmp_path, disk_bytes=40_000, key="shared")
    usage = ds.disk_usage()
    assert 0 < usage["bytes"] <= 40_000
    with open(tmp_path / ".hfc-usage") as f:
        assert int(f.read()) == usage["bytes"]
    assert not [n for n in os.listdir(ds._disk.dir) if n.startswith(".hfc-tmp.")]


def _blocked_writer(disk_dir, ready):
    # Stop inside the write, after the temp file holds the whole entry and before the rename.
    def block(fd):
        ready.set()
        time.sleep(600)

    os.fsync = block
    CachedDataset(Mixed(), disk_dir=disk_dir, disk_bytes=1 << 20, key="mixed")[3]


def _temps(ds):
    return [n for n in os.listdir(ds._disk.dir) if n.startswith(".hfc-tmp.")]


def test_killed_writer_leaves_no_entry_and_its_temp_is_removed(tmp_path):
    data = Mixed()
    ready = FORK.Event()
    p = FORK.Process(target=_blocked_writer, args=(str(tmp_path), ready), daemon=True)
    p.start()
    try:
        assert ready.wait(60)
        ds = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="mixed")
        assert len(_temps(ds)) == 1                # a live writer's temp file stays
        assert not os.path.exists(ds._disk.path(3))
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    assert p.exitcode == -signal.SIGKILL
    ds = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="mixed")
    assert _temps(ds) == []                        # the dead writer's is removed
    assert_same(ds[3], data[3])
    assert ds.stats()["disk"]["misses"] == 1 and ds.stats()["loads"] == 1
    assert_same(CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="mixed")[3], data[3])


def _busy_writer(disk_dir):
    torch.set_num_threads(1)
    data = Mixed(n=10_000, scale=50)
    ds = CachedDataset(data, disk_dir=disk_dir, disk_bytes=1 << 20, key="busy")
    for i in range(len(data)):
        ds[i]


@pytest.mark.parametrize("delay", [0.15, 0.3, 0.5])
def test_writer_killed_at_a_random_moment(tmp_path, delay):
    p = FORK.Process(target=_busy_writer, args=(str(tmp_path),), daemon=True)
    p.start()
    time.sleep(delay)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    data = Mixed(n=10_000, scale=50)
    ds = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="busy")
    assert _temps(ds) == []
    names = [n for n in os.listdir(ds._disk.dir) if n.endswith(".hfc")]
    assert names, "the writer wrote nothing before it was killed; lengthen the delay"
    for name in names:
        i = int(name.split("-")[1].split(".")[0])
        assert_same(ds[i], data[i], f"ds[{i}]")
    assert ds.stats()["disk"]["hits"] == len(names) and ds.stats()["disk"]["corrupt"] == 0


def test_pickled_copy_has_an_empty_memory_tier_and_the_same_disk_tier(tmp_path):
    data = Fixed()
    ds = CachedDataset(data, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20, key="fixed")
    ds[0]
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.memory_usage()["entries"] == 0
    assert_same(copy[0], torch.full((16,), 0.0))
    assert copy.stats()["disk"]["hits"] == 1 and copy.dataset.calls == [0]


# -- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(), ValueError, "nothing to cache.*memory_bytes=0 and disk_dir=None"),
        (dict(memory_bytes=-1), ValueError, "memory_bytes must be >= 0, got -1"),
        (dict(memory_bytes=1.5), TypeError, "memory_bytes must be an int, got float"),
        (dict(memory_bytes=True), TypeError, "memory_bytes must be an int, got bool"),
        (dict(memory_bytes=10, disk_bytes=10), ValueError, "disk_bytes=10 needs a disk_dir"),
        (dict(disk_dir="DIR", key="k"), ValueError, "disk_dir needs disk_bytes.*got None"),
        (dict(disk_dir="DIR", disk_bytes=0, key="k"), ValueError, "disk_bytes must be >= 1, got 0"),
        (dict(disk_dir="DIR", disk_bytes=10), ValueError, "disk_dir needs key.*does not guess"),
        (dict(disk_dir="DIR", disk_bytes=10, key=""), ValueError, "key must be a non-empty str.*got ''"),
        (dict(disk_dir="DIR", disk_bytes=10, key=3), TypeError, "key must be a non-empty str, got int"),
        (dict(disk_dir=3, disk_bytes=10, key="k"), TypeError, "disk_dir must be a path.*got int"),
        # An empty path would be the working directory.
        (dict(disk_dir="", disk_bytes=10, key="k"), ValueError, "disk_dir must name a directory, got an empty"),
        (dict(disk_dir=b"cache", disk_bytes=10, key="k"), TypeError, "disk_dir must be a path.*got bytes"),
        (dict(memory_bytes=10, version=1.0), TypeError, "version must be an int or a str, got float"),
        (dict(memory_bytes=10, version=None), TypeError, "version must be an int or a str, got NoneType"),
        (dict(memory_bytes=10, max_workers=-1), ValueError, "max_workers must be >= 0, got -1"),
    ],
)
def test_bad_arguments(tmp_path, monkeypatch, kwargs, error, match):
    monkeypatch.chdir(tmp_path)  # so that nothing written to the working directory goes unseen
    if kwargs.get("disk_dir") == "DIR":
        kwargs["disk_dir"] = tmp_path
    with pytest.raises(error, match=match):
        CachedDataset(Fixed(), **kwargs)
    assert not any(tmp_path.iterdir())


def test_bad_dataset_and_indices():
    with pytest.raises(TypeError, match="map-style dataset.*got int"):
        CachedDataset(3, memory_bytes=10)
    ds = CachedDataset(Fixed(n=5), memory_bytes=1 << 16)
    assert_same(ds[np.int64(2)], torch.full((16,), 2.0))
    assert_same(ds[torch.tensor(-1)], torch.full((16,), 4.0))
    for bad in (1.0, "1", slice(0, 2), None):
        with pytest.raises(TypeError, match="indices must be integers, got"):
            ds[bad]
    with pytest.raises(IndexError, match="index -6 out of range for a dataset of length 5"):
        ds[-6]
    with pytest.raises(IndexError):
        ds[5]                                        # the wrapped dataset's own error
    assert len(ds) == 5 and "memory_bytes=65536" in repr(ds)
    assert ds.stats()["loads"] == 2


def test_bench_cache_configs_read_the_same_samples(tmp_path):
    from bench import bench_cache

    pngs = bench_cache.make_pngs(6, 16)
    sums = {}
    for config in bench_cache.CONFIGS:
        name = "disk" if config == "disk_reopen" else config
        res = bench_cache.run_config(config, pngs, str(tmp_path / name), epochs=2, workers=0, batch_size=4)
        sums[config] = res["checksum"]
        assert len(res["s_per_sample"]) == 2
        if config == "disk_reopen":
            assert res["stats"]["loads"] == 0 and res["stats"]["disk"]["hits"] == 12
    assert len(set(sums.values())) == 1, sums
