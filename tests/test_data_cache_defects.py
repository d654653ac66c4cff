"""hfkern.data.CachedDataset: regressions for defects found by fuzzing.

* empty numpy str/bytes scalars and zero-itemsize arrays (``V0``) were cached but never read back
  (the memory tier raised CorruptEntry to the caller, the disk tier reloaded them on every read);
* numpy str/bytes scalars lost their trailing NULs (and so their dtype);
* the disk tier returned wrong data for an entry with a flipped bit (no checksum);
* ``ds[True]`` read sample 1.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hfkern.data import CachedDataset, cache
from hfkern.data import _codec

torch.set_num_threads(1)


class ListDataset:
    def __init__(self, items):
        self.items, self.calls = items, []

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        self.calls.append(i)
        return self.items[i]


def _cached(items, tier, tmp_path, key="defects"):
    data = ListDataset(items)
    if tier == "memory":
        return data, CachedDataset(data, memory_bytes=1 << 20)
    return data, CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key=key)


def assert_exact(got, want):
    """Same type, dtype, shape and bytes; for numpy str_/bytes_ scalars the whole content,
    trailing NULs included (their == ignores those)."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_exact(g, w)
        return
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_exact(got[k], want[k])
        return
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        return
    assert got.dtype == want.dtype and np.shape(got) == np.shape(want), (got.dtype, want.dtype)
    if isinstance(want, np.str_):
        assert str.__str__(got) == str.__str__(want), (str.__str__(got), str.__str__(want))
    elif isinstance(want, np.bytes_):
        assert bytes(got) == bytes(want)
    else:
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def _read_three_times(items, tier, tmp_path):
    data, ds = _cached(items, tier, tmp_path)
    for _ in range(3):
        for i, want in enumerate(items):
            assert_exact(ds[i], want)
    s = ds.stats()
    n = len(items)
    assert data.calls == list(range(n)) and s["loads"] == n
    if tier == "memory":
        assert s["memory"] == {"hits": 2 * n, "misses": n, "evictions": 0, "too_large": 0}
    else:
        assert s["disk"] == {"hits": 2 * n, "misses": n, "writes": n, "evictions": 0, "too_large": 0, "corrupt": 0}
    if tier == "disk":   # and from a fresh process's point of view: a fresh wrapper on the directory
        fresh = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="defects")
        for i, want in enumerate(items):
            assert_exact(fresh[i], want)
        assert fresh.stats()["loads"] == 0 and fresh.stats()["disk"]["corrupt"] == 0


# -- 1. empty strings and zero-itemsize arrays -------------------------------------------------


def _empty_items():
    return [
        np.str_(""),
        np.bytes_(b""),
        np.array(["", "cat"])[0],                    # how an empty label usually arrives
        np.zeros(3, dtype="V0"),
        np.zeros((2, 0), dtype="V0"),
        np.void(b""),
        np.zeros((), dtype="V0"),
        (torch.ones(2), np.str_(""), {"k": np.bytes_(b"")}),
    ]


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_empty_strings_and_zero_itemsize_arrays_round_trip(tmp_path, tier):
    _read_three_times(_empty_items(), tier, tmp_path)


def test_undecodable_memory_entry_is_dropped_and_reloaded():
    data, ds = _cached([torch.arange(4), torch.arange(5)], "memory", None)
    ds[0], ds[1]
    blob = ds._memory.entries[0]
    blob[:8] = b"XXXXXXXX"                           # not an entry any more
    with pytest.warns(RuntimeWarning, match="memory-tier entry 0 could not be decoded"):
        got = ds[0]
    assert torch.equal(got, torch.arange(4)) and data.calls == [0, 1, 0]
    # counted as a miss (not a hit), dropped and stored again: the next read is a hit
    assert ds.stats()["memory"] == {"hits": 0, "misses": 3, "evictions": 0, "too_large": 0}
    assert ds._memory.entries[0] is not blob
    assert torch.equal(ds[0], torch.arange(4)) and data.calls == [0, 1, 0]
    assert ds.stats()["memory"]["hits"] == 1 and ds.memory_usage()["entries"] == 2


def test_undecodable_memory_entry_falls_through_to_the_disk_tier(tmp_path):
    data = ListDataset([torch.arange(4)])
    ds = CachedDataset(data, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20, key="both")
    ds[0]
    ds._memory.entries[0][:8] = b"XXXXXXXX"
    with pytest.warns(RuntimeWarning):
        assert torch.equal(ds[0], torch.arange(4))
    s = ds.stats()
    assert data.calls == [0] and s["loads"] == 1 and s["disk"]["hits"] == 1
    assert s["memory"]["hits"] == 0 and s["memory"]["misses"] == 2
    assert torch.equal(ds[0], torch.arange(4)) and ds.stats()["memory"]["hits"] == 1


# -- 2. trailing NULs ------------------------------------------------------------------------


def _nul_items():
    return [
        np.str_("ab\x00"),
        np.bytes_(b"ab\x00"),
        np.str_("\x00"),
        np.bytes_(b"\x00\x00"),
        np.str_("\x00a\x00\x00"),
        np.str_("ünï\x00"),
        np.str_("\ud800\x00"),                       # a lone surrogate: numpy str_ holds any code point
        np.bytes_(b"\xff\x00"),
        [np.str_("x\x00"), np.bytes_(b"y\x00\x00")],
    ]


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_str_and_bytes_scalars_keep_trailing_nuls_and_dtype(tmp_path, tier):
    items = _nul_items()
    assert items[0].dtype == np.dtype("<U3") and items[1].dtype == np.dtype("S3")
    _read_three_times(items, tier, tmp_path)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_string_arrays_keep_their_bytes_and_dtype(tmp_path, tier):
    # numpy itself drops trailing NULs when it reads an element of an array: what round-trips is the
    # array's dtype and bytes, so its elements read back as the original's do.
    items = [np.array(["ab\x00", "\x00", ""], dtype="<U3"), np.array([b"a\x00", b""], dtype="S2")]
    _, ds = _cached(items, tier, tmp_path)
    for _ in range(2):
        for i, want in enumerate(items):
            got = ds[i]
            assert_exact(got, want)
            assert [(type(g), g.dtype, g) for g in got] == [(type(w), w.dtype, w) for w in want]


# -- 3. checksum -----------------------------------------------------------------------------


def _one_entry(tmp_path, data):
    ds = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="crc")
    ds[0], ds[1]
    return ds._disk.path(0)


class Pairs(ListDataset):
    def __init__(self):
        super().__init__([(torch.arange(16, dtype=torch.float32) + 100 * i, 5 + i) for i in range(2)])


@pytest.mark.parametrize("where", ["data", "header_label", "padding", "checksum"])
def test_flipped_bit_on_disk_is_counted_corrupt_and_reloaded(tmp_path, where):
    data = Pairs()
    path = _one_entry(tmp_path, data)
    blob = bytearray(open(path, "rb").read())
    mask = 0x01
    if where == "data":
        pos = len(blob) - 5                          # inside the tensor's bytes
    elif where == "header_label":
        pos, mask = blob.find(b'"v":5') + 4, 0x02    # the label 5 -> 7, still valid JSON
    elif where == "padding":
        hlen = int.from_bytes(blob[16:24], "little")
        pos = 32 + hlen                              # first byte after the header, before the data
        assert pos % 64                              # really padding
    else:
        pos = 12                                     # the checksum itself
    blob[pos] ^= mask
    with open(path, "wb") as f:
        f.write(blob)
    fresh = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="crc")
    got = fresh[0]
    assert torch.equal(got[0], data.items[0][0]) and got[1] == 5
    assert fresh.stats()["disk"] == {"hits": 0, "misses": 1, "writes": 1, "evictions": 0, "too_large": 0,
                                     "corrupt": 1}
    again = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="crc")
    got = again[0]
    assert torch.equal(got[0], data.items[0][0]) and got[1] == 5 and again.stats()["loads"] == 0


def test_every_single_bit_flip_of_an_entry_is_detected():
    ident = {"key": "k", "version": 0, "index": 0}
    sample = (torch.arange(6, dtype=torch.int16), np.str_("a\x00"), np.bytes_(b"b"), 3, "s")
    blob = _codec.encode(sample, ident)
    _codec.decode(bytearray(blob), ident, copy=True)             # intact: decodes
    missed = []
    for byte in range(len(blob)):
        for bit in range(8):
            bad = bytearray(blob)
            bad[byte] ^= 1 << bit
            try:
                _codec.decode(bad, ident, copy=False)
            except _codec.CorruptEntry:
                continue
            missed.append((byte, bit))
    assert not missed, f"{len(missed)} of {8 * len(blob)} flips undetected, first {missed[:5]}"


def test_entries_of_another_format_are_stale_not_read(tmp_path, monkeypatch):
    data = ListDataset([torch.arange(3)])
    monkeypatch.setattr(_codec, "FORMAT", _codec.FORMAT - 1)     # entries written by the previous format
    old = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="fmt")
    old[0]
    monkeypatch.undo()
    new = CachedDataset(data, disk_dir=tmp_path, disk_bytes=1 << 20, key="fmt")
    assert torch.equal(new[0], torch.arange(3))
    # not read at all (another name), so neither misread nor counted as corrupt
    assert new.stats()["disk"] == {"hits": 0, "misses": 1, "writes": 1, "evictions": 0, "too_large": 0,
                                   "corrupt": 0}
    assert data.calls == [0, 0] and new.disk_usage()["key_entries"] == 2
    new.clear()                                      # clear() takes every format's entries of the key
    assert new.disk_usage()["key_entries"] == 0


def test_memory_only_cache_skips_the_checksum(monkeypatch):
    seen = []
    real = _codec.encode
    monkeypatch.setattr(cache._codec, "encode", lambda *a, **k: seen.append(k.get("checksum")) or real(*a, **k))
    ds = CachedDataset(ListDataset([torch.arange(3)]), memory_bytes=1 << 20)
    ds[0]
    assert torch.equal(ds[0], torch.arange(3)) and seen == [False]


# -- 4. bool indices -------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [True, False, np.bool_(True), torch.tensor(True), torch.tensor([False])])
def test_bool_index_raises_type_error_before_anything(tmp_path, bad):
    data = ListDataset([torch.arange(2), torch.arange(3)])
    ds = CachedDataset(data, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20, key="bool")
    ds[1]
    before = (ds.stats(), ds.memory_usage(), ds.disk_usage(), sorted(os.listdir(tmp_path)))
    with pytest.raises(TypeError, match="indices must be integers, got"):
        ds[bad]
    with pytest.raises(TypeError, match="indices must be integers, got"):
        ds.invalidate(bad)
    assert (ds.stats(), ds.memory_usage(), ds.disk_usage(), sorted(os.listdir(tmp_path))) == before
    assert data.calls == [1]
    # integer indices of other types stay accepted
    assert torch.equal(ds[np.int64(1)], torch.arange(3)) and torch.equal(ds[torch.tensor(-1)], torch.arange(3))
    assert data.calls == [1]
