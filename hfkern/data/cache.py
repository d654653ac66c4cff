"""A two-tier cache of decoded samples: a per-process memory LRU in front of a shared disk directory.

:class:`CachedDataset` wraps a map-style dataset. ``ds[i]`` looks in

1. the **memory tier**: this process's LRU of encoded entries, bounded by
   ``memory_bytes`` (the bytes of the entries, exactly), then in
2. the **disk tier**: one file per sample in ``disk_dir``, read into memory
   (entries under 64 KiB) or through a private memory map that holds no file
   descriptor (larger ones), shared by every process on the machine that opens
   the same directory (the DataLoader workers of one run, the trials of a sweep),
   bounded by ``disk_bytes`` with least-recently-used eviction,

and only then calls the wrapped dataset, storing what it returns in both tiers.

Disk protocol (POSIX; one machine):

* An entry is written to ``.hfc-tmp.<pid>.<random>`` in its final directory,
  flushed with ``fsync``, then renamed over the entry with ``os.replace``, so a
  reader opens either nothing or a complete entry. Readers take no lock.
* The writer holds an ``flock`` on its temp file while it writes; the kernel
  drops it when the writer dies, so a stray temp file whose lock can be taken
  belongs to a dead writer and is removed, in the subdirectory of any key (when a
  dataset is constructed, when the tier evicts, on :meth:`CachedDataset.clear`).
* Renames, removals and the byte count (``.hfc-usage``) change only under an
  exclusive ``flock`` on ``.hfc-lock``. When a write takes the count above
  ``disk_bytes``, the writer lists the directory and removes the entries with
  the oldest access time until the total fits. An entry's access time is its
  modification time, which the cache sets itself (to ``time.time_ns()``) when
  it writes or reads the entry, so it does not depend on the mount's atime policy.
  A process killed between a rename and the count update leaves the count short
  by one entry until the next listing recomputes it.
* Every entry records its dataset key, version and index and a CRC-32 of its
  header and data, checked on read. An entry that fails the checks (or is not a
  complete entry) is counted as ``corrupt``, removed, and loaded again. Entry
  names include the entry format's version, so the entries of another format
  are never read: they age out like those of another ``version``.

Identity: the disk tier needs ``key``, a string that names the dataset
(its source and its transform) and is the same in every process that should
share entries; ``version`` (int or str) separates entries made by different
code. The cache never derives either from the dataset object.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import mmap
import multiprocessing.context
import multiprocessing.reduction
import operator
import os
import re
import secrets
import tempfile
import threading
import time
import warnings
import weakref
from typing import Any

import numpy as np
import torch
import torch.utils.data

from . import _codec

try:
    import fcntl
except ImportError:  # not POSIX: the disk tier refuses to start (CachedDataset checks os.name)
    fcntl = None

__all__ = ["CachedDataset"]

_ENTRY_SUFFIX = ".hfc"
_TMP_PREFIX = ".hfc-tmp."
_LOCK_NAME = ".hfc-lock"
_USAGE_NAME = ".hfc-usage"
# Only names the cache makes are ever removed from the directory.
_SUBDIR_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,39}-[0-9a-f]{16}")
_ENTRY_RE = re.compile(r"[0-9a-f]{12}-[0-9]+\.hfc")

# Counter columns. Every process that uses a wrapper (other than as a DataLoader worker) has a
# table of its own in shared memory: row 0 its own counters, one row each for its live DataLoader
# workers, and an overflow row (see _CounterTable and CachedDataset._ensure_process).
_FIELDS = (
    "memory_hits", "memory_misses", "memory_evictions", "memory_too_large",
    "disk_hits", "disk_misses", "disk_writes", "disk_evictions", "disk_too_large", "disk_corrupt",
    "loads",
)
_COL = {name: i for i, name in enumerate(_FIELDS)}


def _int_arg(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _slug(key: str) -> str:
    """A directory name for ``key``: a readable prefix and a hash that makes it unique. A key
    may hold lone surrogates (as file names decoded with ``surrogateescape`` do): it is hashed
    with ``surrogatepass``, which encodes every str, and differently for different strs."""
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", key).lstrip(".-")[:40] or "_"
    return f"{readable}-{hashlib.sha256(key.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


class _MemoryTier:
    """An LRU of encoded entries bounded by their total length."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: collections.OrderedDict[int, bytearray] = collections.OrderedDict()
        self.bytes = 0

    def get(self, index: int) -> bytearray | None:
        blob = self.entries.get(index)
        if blob is not None:
            self.entries.move_to_end(index)
        return blob

    def put(self, index: int, blob: bytearray) -> tuple[bool, int]:
        """Store ``blob``; (whether it was stored, how many entries were evicted for it)."""
        self.pop(index)
        if len(blob) > self.capacity:
            return False, 0
        evicted = 0
        while self.bytes + len(blob) > self.capacity:
            _, old = self.entries.popitem(last=False)
            self.bytes -= len(old)
            evicted += 1
        self.entries[index] = blob
        self.bytes += len(blob)
        return True, evicted

    def pop(self, index: int) -> None:
        old = self.entries.pop(index, None)
        if old is not None:
            self.bytes -= len(old)

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


_FD_DIR = "/proc/self/fd"  # a path to an open descriptor's file (Linux)
# Entries smaller than this are read into memory, not mapped: each map is one of the process's
# vm.max_map_count (65530 on Linux) mappings and pins at least a page, so a process that keeps
# tens of thousands of small samples would run out of mappings (mmap fails with ENOMEM).
_MAP_MIN_BYTES = 64 << 10


def _map_private(fd: int, size: int) -> Any:
    """A private (copy-on-write) map of the open file ``fd``, as a writable uint8 numpy array that
    holds no descriptor (torch's file mapping closes the one it opens once mapped, and it opens the
    file through ``fd``: the same inode, even if a new entry has been renamed over the path); None
    where that path to ``fd`` does not exist, or for an empty file (which cannot be mapped)."""
    if size == 0 or not os.path.isdir(_FD_DIR):
        return None
    return torch.from_file(f"{_FD_DIR}/{fd}", shared=False, size=size, dtype=torch.uint8).numpy()


def _read_all(fd: int, size: int) -> bytearray:
    """The open file ``fd`` read into a new buffer. An entry is never written in place (a new one is
    renamed over it), so its size stays; a read that ends early leaves a short buffer, which
    decodes as corrupt."""
    buf = bytearray(size)
    with memoryview(buf) as view:
        got = 0
        while got < size and (n := os.readv(fd, [view[got:]])) > 0:
            got += n
    del buf[got:]
    return buf


class _DiskTier:
    """The shared directory: entries, the byte count, eviction and cleanup (see the module docstring)."""

    def __init__(self, root: str, capacity: int, key: str, version: int | str) -> None:
        self.root = root
        self.capacity = capacity
        self.dir = os.path.join(root, _slug(key))
        # The entry format is part of the name: another format's entries are stale, never misread.
        self.prefix = hashlib.sha256(repr((key, version, _codec.FORMAT)).encode()).hexdigest()[:12]
        self._last_ns = 0

    # -- paths and time ---------------------------------------------------------------

    def path(self, index: int) -> str:
        return os.path.join(self.dir, f"{self.prefix}-{index}{_ENTRY_SUFFIX}")

    def _now_ns(self) -> int:
        # Strictly increasing within a process, so two accesses in one clock tick keep their order.
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        return self._last_ns

    @contextlib.contextmanager
    def _locked(self):
        fd = os.open(os.path.join(self.root, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    # -- the byte count (under the lock) ----------------------------------------------

    def _read_usage(self) -> int | None:
        try:
            with open(os.path.join(self.root, _USAGE_NAME), "rb") as f:
                value = int(f.read().decode("ascii").strip())
        except (FileNotFoundError, ValueError, UnicodeDecodeError):
            return None  # missing or torn by a killed writer: the caller lists the directory
        return value if value >= 0 else None

    def _write_usage(self, total: int) -> None:
        with open(os.path.join(self.root, _USAGE_NAME), "wb") as f:
            f.write(b"%d\n" % total)

    def _subdirs(self) -> list[str]:
        """The subdirectory of every key in the directory (only names the cache makes)."""
        with os.scandir(self.root) as top:
            return [d.path for d in top if _SUBDIR_RE.fullmatch(d.name) and d.is_dir(follow_symlinks=False)]

    def _scan(self) -> tuple[list[tuple[int, str, str, int]], int]:
        """Every entry of the directory as (access ns, subdir, path, size), and the total;
        removes the temp files of dead writers on the way."""
        entries, total = [], 0
        for sub in self._subdirs():
            try:
                it = os.scandir(sub)
            except FileNotFoundError:
                continue
            with it:
                for e in it:
                    if e.name.startswith(_TMP_PREFIX):
                        _remove_if_dead(e.path)
                    elif _ENTRY_RE.fullmatch(e.name):
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        entries.append((st.st_mtime_ns, sub, e.path, st.st_size))
                        total += st.st_size
        return entries, total

    def _evict_to_fit(self) -> tuple[int, int]:
        """(entries removed, total after) so that the directory holds at most ``capacity`` bytes."""
        entries, total = self._scan()
        removed = 0
        if total > self.capacity:
            entries.sort()
            for _, _, path, size in entries:
                if total <= self.capacity:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed += 1
                total -= size
        return removed, total

    # -- operations -------------------------------------------------------------------

    def cleanup(self) -> None:
        """Remove the temp files of dead writers in the subdirectory of every key (a writer
        killed mid-write leaves one in its own key's), names alone listed; recount the bytes
        when the byte count is missing or damaged."""
        os.makedirs(self.dir, exist_ok=True)
        # Not under the directory lock: a temp file's own flock tells a live writer's from a
        # dead one's, and writers create theirs without the directory lock anyway.
        for sub in self._subdirs():
            try:
                it = os.scandir(sub)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with it:
                temps = [e.path for e in it if e.name.startswith(_TMP_PREFIX) and e.is_file(follow_symlinks=False)]
            for path in temps:
                _remove_if_dead(path)
        with self._locked():
            if self._read_usage() is None:
                self._write_usage(self._scan()[1])

    def get(self, index: int) -> tuple[Any, int] | None:
        """Entry ``index`` as a buffer of its own (the file read into memory when it is smaller
        than ``_MAP_MIN_BYTES``, or where it cannot be mapped; else a private, copy-on-write
        map of the file), and the file's inode; None when there is no entry.

        No buffer holds a file descriptor: the samples decoded from it view it, and keeping a few
        thousand samples must not exhaust the process's descriptors (Python's ``mmap`` holds a
        duplicate of the descriptor it maps for as long as the map lives)."""
        try:
            fd = os.open(self.path(index), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            buf = None
            if st.st_size >= _MAP_MIN_BYTES:
                try:
                    buf = _map_private(fd, st.st_size)
                except (RuntimeError, OSError):
                    # The map failed (ENOMEM once the process holds vm.max_map_count mappings):
                    # reading gives the same bytes.
                    buf = None
            if buf is None:
                buf = _read_all(fd, st.st_size)
            t = self._now_ns()
            os.utime(fd, ns=(t, t))  # through the descriptor: valid even if evicted meanwhile
            return buf, st.st_ino
        finally:
            os.close(fd)

    def put(self, index: int, blob: bytearray) -> tuple[bool, int]:
        """Write entry ``index``; (whether it landed, entries evicted for it)."""
        os.makedirs(self.dir, exist_ok=True)
        final = self.path(index)
        tmp = os.path.join(self.dir, f"{_TMP_PREFIX}{os.getpid()}.{secrets.token_hex(6)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        renamed = False
        try:
            # Held until we close the file: a cleaner that can take it knows we are dead.
            fcntl.flock(fd, fcntl.LOCK_EX)
            view = memoryview(blob)
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
            os.fsync(fd)
            t = self._now_ns()
            os.utime(fd, ns=(t, t))
            with self._locked():
                try:
                    old = os.stat(final).st_size
                except FileNotFoundError:
                    old = 0
                try:
                    os.replace(tmp, final)
                except FileNotFoundError:
                    # A cleaner took our lock in the instant between open and flock and removed
                    # the temp as a dead writer's: this write is lost, nothing else is affected.
                    return False, 0
                renamed = True
                total = self._read_usage()
                evicted = 0
                if total is None or total + len(blob) - old > self.capacity:
                    evicted, total = self._evict_to_fit()
                else:
                    total += len(blob) - old
                self._write_usage(total)
                return True, evicted
        finally:
            os.close(fd)
            if not renamed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def remove(self, index: int, only_inode: int | None = None) -> None:
        """Remove entry ``index`` (only if it is still the file ``only_inode``, when given)."""
        path = self.path(index)
        with self._locked():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return
            if only_inode is not None and st.st_ino != only_inode:
                return  # replaced by a new write since we read it
            os.unlink(path)
            total = self._read_usage()
            self._write_usage(max(total - st.st_size, 0) if total is not None else self._scan()[1])

    def remove_all(self) -> None:
        """Remove every entry of this key (all versions)."""
        with self._locked():
            with contextlib.suppress(FileNotFoundError), os.scandir(self.dir) as it:
                for e in it:
                    if _ENTRY_RE.fullmatch(e.name):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(e.path)
            self._write_usage(self._scan()[1])

    def usage(self) -> dict:
        with self._locked():
            entries, total = self._scan()
        mine = [size for _, sub, _, size in entries if sub == self.dir]
        return {"entries": len(entries), "bytes": total, "key_entries": len(mine), "key_bytes": sum(mine)}


def _remove_if_dead(path: str) -> None:
    """Remove a temp file unless a live writer still holds its lock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return  # a live writer
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    finally:
        os.close(fd)


# Every live wrapper of this process, and the lock under which a process chooses its counters.
_instances: weakref.WeakSet = weakref.WeakSet()
_setup_lock = threading.RLock()


# -- counters in shared memory --------------------------------------------------------------

_MAX_WORKERS = 4096  # the largest max_workers: rows of worker counters in one table
_META_WORDS = 8  # int64 words before the counters: [0] counts the resets of the overflow row
_OVERFLOW_LOCK_AT = 0  # the byte of a table's file locked while its overflow row is written

# The tables this process has mapped, by uid: a table unpickled in a process that has it already
# (a copy pickled and loaded in the same process, or in a forked child) is that table.
_tables: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _shared_fd(nbytes: int) -> int:
    """A descriptor of a new file of ``nbytes`` zeros that has no name: a memfd where the system
    has them (Linux), else a temp file unlinked at once."""
    fd = None
    if hasattr(os, "memfd_create"):
        with contextlib.suppress(OSError):
            fd = os.memfd_create("hfkern-cache-counters", os.MFD_CLOEXEC)
    if fd is None:
        fd, path = tempfile.mkstemp(prefix=".hfkern-counters-",
                                    dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.unlink(path)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _close_fds(fds: list, keep: list) -> None:
    """A table's finalizer: close its descriptors, unless this process holds a row of the table
    (a POSIX lock is dropped when its process closes *any* descriptor of the file)."""
    if keep[0] == os.getpid():
        return
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


class _CounterTable:
    """The counters of one process (the table's *home*) and of its DataLoader workers.

    The table lives in a file without a name (a memfd), mapped shared (``MAP_SHARED``) by every
    process that uses it: a worker started by ``fork`` inherits the mapping; one started by
    ``spawn`` or ``forkserver`` receives the descriptor with the pickled wrapper (only while a
    process is being started: :func:`multiprocessing.reduction.DupFd`) and maps the same pages.
    Nothing can move that memory (it is no torch storage: torch's sharing strategies and
    ForkingPickler never touch it), so a view of it is never stale.

    Rows: 0 is the home process's; 1 .. ``workers`` are one each for DataLoader workers alive at
    once: a worker takes a row by a POSIX lock on that byte of the file (the one of its id if it
    is free, else the lowest free one) and holds it until it dies, when the kernel drops the lock
    and the row can be taken by a later worker, which adds to it. So no two live processes ever
    write one row, and a row's counts are read-modify-written by one process alone. The last row
    (``overflow``) is shared by the workers that found no free row, each count under a lock of
    byte 0. ``counts`` are written only by the process holding the row (the overflow row: under
    its lock); ``base`` only by the home process, whose :meth:`reset` snapshots ``counts`` into
    it: the home process reports ``counts - base``.
    """

    def __init__(self, workers: int, fd: int | None = None, uid: str | None = None,
                 home_pid: int | None = None) -> None:
        self.workers = workers
        self.uid = uid or secrets.token_hex(16)
        self.home_pid = os.getpid() if home_pid is None else home_pid
        self.attached_pid = os.getpid()  # the process that built or received this object
        self._fds: list[int] = [] if fd is None else [fd]
        self._keep: list = [None]  # the pid of a process that holds a row here (never closes the file)
        weakref.finalize(self, _close_fds, self._fds, self._keep)
        nbytes = 8 * (_META_WORDS + 2 * (workers + 2) * len(_FIELDS))
        if fcntl is None:
            # Not POSIX (no fork, no locks): a table of this process alone; spawned workers keep
            # their counters to themselves.
            self._map = mmap.mmap(-1, nbytes)
        else:
            if fd is None:
                self._fds.append(_shared_fd(nbytes))
            self._map = mmap.mmap(self._fds[0], nbytes)  # shared, read-write
        words = np.frombuffer(self._map, dtype=np.int64)
        self.meta = words[:_META_WORDS]
        body = words[_META_WORDS:].reshape(2, workers + 2, len(_FIELDS))
        self.counts, self.base = body[0], body[1]
        self._tlock, self._tlock_pid = threading.Lock(), os.getpid()
        self._writer, self._writer_pid = None, None

    # -- pickling: one table per process ------------------------------------------------

    def __reduce__(self):
        dup = None
        if self._fds and multiprocessing.context.get_spawning_popen() is not None:
            # Pickled to start a process (a DataLoader worker by spawn or forkserver): the
            # descriptor goes with it. Any other pickle carries no table: a process that
            # unpickles it and is no worker of this one counts into a table of its own.
            dup = multiprocessing.reduction.DupFd(self._fds[0])
        return _attach_table, (self.uid, self.home_pid, self.workers, dup)

    def __copy__(self) -> _CounterTable:
        return self  # copies of a wrapper made in one process share its table

    def __deepcopy__(self, memo: dict) -> _CounterTable:
        return self

    # -- this process -------------------------------------------------------------------

    def thread_lock(self) -> threading.Lock:
        """A lock of this process's threads (a forked copy of one may be held by a thread that is not here)."""
        pid = os.getpid()
        if self._tlock_pid != pid:
            with _setup_lock:
                if self._tlock_pid != pid:
                    self._tlock, self._tlock_pid = threading.Lock(), pid
        return self._tlock

    @contextlib.contextmanager
    def overflow_locked(self):
        with self.thread_lock():
            if fcntl is None or not self._fds:
                yield
                return
            fd = self._fds[0]
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, _OVERFLOW_LOCK_AT)
            try:
                yield
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, _OVERFLOW_LOCK_AT)

    def writer(self, worker_id: int | None):
        """This process's writer, chosen once per process (under ``_setup_lock``): row 0 in the
        home process, else (a DataLoader worker of the home) a row of its own or the overflow row."""
        pid = os.getpid()
        if self._writer_pid != pid:
            if pid == self.home_pid:
                w = _RowWriter(self, 0)
            else:
                row = self._claim(worker_id)
                w = _RowWriter(self, row) if row is not None else _OverflowWriter(self)
            self._writer, self._writer_pid = w, pid
        return self._writer

    def _claim(self, worker_id: int | None) -> int | None:
        if fcntl is None or not self._fds:
            return None
        self._keep[0] = os.getpid()  # from now on this process keeps every descriptor of the file
        fd = self._fds[0]
        rows = list(range(1, self.workers + 1))
        if worker_id is not None and 0 <= worker_id < self.workers:
            rows.insert(0, 1 + worker_id)
        for row in rows:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, row)
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    continue  # a live worker holds it
                raise
            return row
        return None

    # -- the home process ---------------------------------------------------------------

    def view(self) -> np.ndarray:
        """Every row's counters since the last :meth:`reset` (never below 0: a worker's own
        reset may cross the home's)."""
        return np.maximum(self.counts - self.base, 0)

    def reset(self) -> None:
        self.base[:-1] = self.counts[:-1]
        with self.overflow_locked():
            self.base[-1] = self.counts[-1]
            self.meta[0] += 1  # tells the overflow row's writers their part of it is gone


def _attach_table(uid: str, home_pid: int, workers: int, dup: Any) -> _CounterTable | None:
    """Unpickle a table: the one this process has already, else the received descriptor mapped
    (None when the pickle carried none)."""
    fd = dup.detach() if dup is not None else None
    with _setup_lock:
        table = _tables.get(uid)
        if table is not None:
            if fd is not None:
                table._fds.append(fd)  # closed with the table (not before: see _close_fds)
            return table
        if fd is None:
            return None
        try:
            table = _CounterTable(workers, fd=fd, uid=uid, home_pid=home_pid)
        except (OSError, ValueError):
            return None  # its finalizer closes fd; this process keeps its counters to itself
        _tables[uid] = table
        return table


def _new_table(workers: int) -> _CounterTable:
    table = _CounterTable(workers)
    with _setup_lock:
        _tables[table.uid] = table
    return table


class _RowWriter:
    """A row that this process alone writes: row 0 of the home process, or a worker's own row,
    which may hold what earlier workers counted in it (``start``)."""

    def __init__(self, table: _CounterTable, row: int) -> None:
        self.home = row == 0
        self.row, self.base = table.counts[row], table.base[row]
        self.start = self.row.copy()
        self.lock = threading.Lock()

    def add(self, col: int, n: int) -> None:
        with self.lock:
            self.row[col] += n

    def own(self) -> np.ndarray:
        """This worker's counts since it started, or since its last or its parent's reset."""
        with self.lock:
            return np.maximum(self.row - np.maximum(self.base, self.start), 0)

    def reset(self) -> None:
        """Take this worker's counts out of its row (earlier holders' stay)."""
        with self.lock:
            self.row[:] = np.minimum(self.row, np.maximum(self.base, self.start))
            self.start = self.row.copy()


class _OverflowWriter:
    """The overflow row, which the workers that found no free row share, each count under its lock."""

    home = False

    def __init__(self, table: _CounterTable) -> None:
        self.table, self.row = table, table.counts[-1]
        self.mine = np.zeros(len(_FIELDS), dtype=np.int64)  # this worker's part, since the last reset
        self.resets = None
        self.lock = threading.Lock()

    def _sync(self) -> None:
        resets = int(self.table.meta[0])
        if resets != self.resets:  # the home process reset the row: our part of it is gone
            self.mine[:] = 0
            self.resets = resets

    def add(self, col: int, n: int) -> None:
        with self.lock, self.table.overflow_locked():
            self._sync()
            self.row[col] += n
            self.mine[col] += n

    def own(self) -> np.ndarray:
        with self.lock, self.table.overflow_locked():
            self._sync()
            return self.mine.copy()

    def reset(self) -> None:
        with self.lock, self.table.overflow_locked():
            self._sync()
            self.row -= self.mine
            self.mine[:] = 0


class _PrivateWriter(_RowWriter):
    """Counters of this process alone: a DataLoader worker that cannot reach its parent's table."""

    home = False

    def __init__(self) -> None:  # (no table: add() as a row writer's, on a row of its own)
        self.row = np.zeros(len(_FIELDS), dtype=np.int64)
        self.lock = threading.Lock()

    def own(self) -> np.ndarray:
        with self.lock:
            return self.row.copy()

    def reset(self) -> None:
        with self.lock:
            self.row[:] = 0


def _before_fork() -> None:
    """Before this process forks: every wrapper settles its counters here first, so that a
    process that received a wrapper (a sweep trial) has its own table before its DataLoader
    workers fork from it, and those workers count into it (not into the creator's)."""
    with _setup_lock:
        live = list(_instances)
    for ds in live:
        with contextlib.suppress(Exception):  # a fork hook must not raise; the child checks again
            ds._ensure_process()


def _after_fork_in_child() -> None:
    global _setup_lock
    _setup_lock = threading.RLock()  # the parent's may have been held by a thread that is not here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


class CachedDataset(torch.utils.data.Dataset):
    """``dataset`` with its samples cached in memory and on a local disk shared by processes.

    Args:
        dataset: a map-style dataset (``dataset[i]`` for ints ``i``; ``len`` if
            negative indices or ``len(cached)`` are used). As torch's DataLoader,
            the wrapper takes any object with ``__getitem__`` (a ``dict`` with keys
            ``0 .. n-1``, a ``str``, a list); it refuses a class (pass an instance)
            and an ``IterableDataset`` (its samples have no index to cache them by)
            with a TypeError.
        memory_bytes: bound of this process's memory tier, in bytes of encoded
            entries; 0 disables it. Every DataLoader worker has its own tier of
            this size (a worker started by ``fork`` begins with a copy of the
            parent's, one started by ``spawn`` empty).
        disk_dir: directory of the disk tier (created if missing), or None. Use
            a local file system: the tier relies on ``flock`` and ``os.replace``
            behaving as they do on one machine.
        disk_bytes: bound of everything the cache stores in ``disk_dir`` (all
            datasets sharing it), in bytes; required with ``disk_dir``. Each
            writer enforces its own value, so give every user of a directory the same.
        key: the dataset's identity in ``disk_dir``; required with ``disk_dir``.
            Processes that pass the same key (and version) share entries, so
            the key must change whenever the samples would (another source,
            another transform, other parameters).
        version: int or str stored with each entry; bump it when the code that
            makes samples changes. Entries of other versions are never read and
            age out of the disk tier (or go with :meth:`clear`).
        max_workers: rows of counters for DataLoader workers alive at once, per
            process (at most 4096). A worker holds a row of its own while it lives
            (several DataLoaders iterated together have their own rows); workers that
            find every row held share one more row, the overflow row, taking a lock
            for each count. No count is lost either way.

    Samples may be: ``torch.Tensor`` (CPU, dense, any dtype, not requiring
    grad), ``numpy.ndarray`` and numpy scalars (dtypes without Python objects
    or fields), ``bytes``, ``int``, ``float``, ``complex``, ``bool``, ``str``,
    ``None``, and tuples, lists and dicts of these (dict keys: plain scalars).
    Anything else raises a TypeError naming the offending part, as does a
    sample nested deeper than 64 levels or one that contains itself. Cached
    samples come back equal in type, dtype, shape and bits, contiguous (Python
    floats and complex parts too: a NaN keeps its sign and payload; ints of
    any size); each call returns arrays of its own (a memory hit copies, a
    disk hit reads the entry, or maps it copy-on-write when it is 64 KiB or
    more; no sample holds a file descriptor), so modifying a sample never
    changes the cache. A miss returns the wrapped dataset's own object.

    The wrapper pickles (DataLoader workers by ``fork``, ``spawn`` or
    ``forkserver``, sweep trials in other processes): the memory tier stays
    behind, the disk tier travels. Counters are per process, in shared memory:
    a DataLoader worker counts into a row of its parent's table (the process
    that iterates the DataLoader), and any other process that uses the wrapper
    (one it was pickled or forked to) counts into a table of its own, which its
    own workers join; so :meth:`stats` and :meth:`reset_stats` of each process
    cover that process and its workers, never another process's counters.
    Copies made in one process (``copy.copy``, ``copy.deepcopy``, a pickle
    loaded in the same process) share its table. The table is a nameless
    shared file that nothing moves: ``torch.multiprocessing.set_sharing_strategy``
    (before or after the wrapper is built) does not affect it.

    A random transform inside the wrapped dataset is frozen by the cache: the
    first sample drawn for an index is returned for it until it is evicted or
    invalidated (put random augmentation outside the wrapper).
    """

    def __init__(self, dataset, *, memory_bytes: int = 0, disk_dir: str | os.PathLike | None = None,
                 disk_bytes: int | None = None, key: str | None = None, version: int | str = 0,
                 max_workers: int = 64) -> None:
        if isinstance(dataset, type):
            raise TypeError(f"dataset must be a map-style dataset, got the class {dataset.__qualname__} "
                            f"(pass an instance)")
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError(f"dataset must be a map-style dataset, got an IterableDataset "
                            f"({type(dataset).__name__}): its samples have no index to cache them by")
        if not hasattr(dataset, "__getitem__"):
            raise TypeError(f"dataset must be a map-style dataset (with __getitem__), got {type(dataset).__name__}")
        memory_bytes = _int_arg("memory_bytes", memory_bytes, 0)
        max_workers = _int_arg("max_workers", max_workers, 0)
        if max_workers > _MAX_WORKERS:
            raise ValueError(f"max_workers must be <= {_MAX_WORKERS}, got {max_workers}")
        if isinstance(version, bool) or not isinstance(version, (int, str)):
            raise TypeError(f"version must be an int or a str, got {type(version).__name__} {version!r}")
        if disk_dir is None:
            if disk_bytes is not None:
                raise ValueError(f"disk_bytes={disk_bytes!r} needs a disk_dir (got disk_dir=None)")
            if memory_bytes == 0:
                raise ValueError("nothing to cache: expected memory_bytes > 0 or a disk_dir, got memory_bytes=0 "
                                 "and disk_dir=None")
        else:
            if not isinstance(disk_dir, (str, os.PathLike)) or not isinstance(os.fspath(disk_dir), str):
                raise TypeError(f"disk_dir must be a path (a str or an os.PathLike of a str), got "
                                f"{type(disk_dir).__name__} {disk_dir!r}")
            if not os.fspath(disk_dir):
                # os.path.abspath("") is the working directory: never a cache the user asked for.
                raise ValueError("disk_dir must name a directory, got an empty path ''; pass None for no disk tier")
            if disk_bytes is None:
                raise ValueError("disk_dir needs disk_bytes, the bound of the directory in bytes (got None)")
            disk_bytes = _int_arg("disk_bytes", disk_bytes, 1)
            if key is None:
                raise ValueError("disk_dir needs key, a string naming the dataset and its transform (got None); "
                                 "the cache does not guess a dataset's identity")
            if os.name != "posix":
                raise OSError(f"the disk tier needs a POSIX system (flock), got os.name={os.name!r}")
        if key is not None and not isinstance(key, str):
            raise TypeError(f"key must be a non-empty str, got {type(key).__name__} {key!r}")
        if key == "":
            raise ValueError("key must be a non-empty str naming the dataset and its transform, got ''")

        self.dataset = dataset
        self.memory_bytes = memory_bytes
        self.disk_dir = None if disk_dir is None else os.path.abspath(os.fspath(disk_dir))
        self.disk_bytes = disk_bytes
        self.key = key
        self.version = version
        self.max_workers = max_workers
        self._ident_base = {"key": key, "version": version}
        self._memory = _MemoryTier(memory_bytes) if memory_bytes else None
        # This process's table of counters (its own row, its DataLoader workers' rows), in shared
        # memory so that the workers' rows are readable here (see _CounterTable).
        self._table = _new_table(max_workers)
        self._w = None  # this process's writer (a row of a table), chosen by _ensure_process
        self._pid = None
        self._lock = threading.Lock()
        self._disk = None
        if self.disk_dir is not None:
            os.makedirs(self.disk_dir, exist_ok=True)
            self._disk = _DiskTier(self.disk_dir, disk_bytes, key, version)
            self._disk.cleanup()
        with _setup_lock:
            _instances.add(self)
        self._ensure_process()

    # -- per-process state ----------------------------------------------------------------

    def _ensure_process(self) -> None:
        """Choose this process's counters, once per process: at its first use, since a
        DataLoader worker learns its id only after it unpickled the dataset.

        * A DataLoader worker (``get_worker_info()`` set) counts into its parent's table: the
          table this copy came with when it was unpickled here (``spawn``, ``forkserver``: the
          parent settled its own table before pickling, in :meth:`__getstate__`), or, for a
          forked copy, the table of the process it was forked from (the parent settles it
          before forking, in a fork hook). It takes a row that no live process holds (that of
          its id when free), or the shared overflow row when every row is held. A worker whose
          parent's table cannot be found keeps its counters to itself, with a RuntimeWarning.
        * Any other process counts into row 0 of its own table: the process that built the
          wrapper (and copies made in it) into the table made in ``__init__``; a process the
          wrapper was pickled or forked to into a new table, which its own workers then join.
        """
        pid = os.getpid()
        if self._pid == pid:
            return
        with _setup_lock:
            if self._pid == pid:
                return
            table = self._table
            info = torch.utils.data.get_worker_info()
            if table is not None and table.home_pid == pid:
                writer = table.writer(None)  # a wrapper built in this process (a worker's too)
            elif info is not None:
                if table is not None and (table.attached_pid == pid or table.home_pid == os.getppid()):
                    writer = table.writer(info.id)
                else:
                    writer = _PrivateWriter()
                    if fcntl is not None:
                        warnings.warn("CachedDataset: this DataLoader worker cannot reach its parent's "
                                      "counters (the wrapper did not come with its parent's table); its "
                                      "counts are kept in the worker alone", RuntimeWarning, stacklevel=3)
            else:
                # Not the creator's table: this process gets one of its own.
                table = self._table = _new_table(self.max_workers)
                writer = table.writer(None)
            self._lock = threading.Lock()  # a forked copy of a lock may be held by a thread that is not here
            self._w = writer
            self._pid = pid

    def __getstate__(self) -> dict:
        # Settle this process's own table first: the copy carries it, and the DataLoader workers
        # this process starts by spawn or forkserver count into it.
        self._ensure_process()
        state = self.__dict__.copy()
        for name in ("_lock", "_w"):
            state.pop(name, None)
        state["_pid"] = None
        if self._memory is not None:
            state["_memory"] = _MemoryTier(self.memory_bytes)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_table", None)
        self.__dict__.setdefault("max_workers", 64)
        self._lock = threading.Lock()
        self._w = None
        self._pid = None
        with _setup_lock:
            _instances.add(self)

    # -- the dataset ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.dataset)

    def _index(self, index: Any) -> int:
        # A bool has an __index__ (and a bool tensor one too), but True is no sample number.
        if isinstance(index, (bool, np.bool_)) or (isinstance(index, torch.Tensor) and index.dtype == torch.bool):
            raise TypeError(f"CachedDataset indices must be integers, got {type(index).__name__} {index!r}")
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"CachedDataset indices must be integers, got {type(index).__name__} {index!r}") from None
        if i < 0:
            n = len(self.dataset)
            if i + n < 0:
                raise IndexError(f"index {i} out of range for a dataset of length {n}")
            i += n
        return i

    def _count(self, name: str, n: int = 1) -> None:
        self._w.add(_COL[name], n)

    def __getitem__(self, index: Any) -> Any:
        i = self._index(index)
        self._ensure_process()
        ident = dict(self._ident_base, index=i)
        memory, disk = self._memory, self._disk
        if memory is not None:
            with self._lock:
                blob = memory.get(i)
                self._count("memory_hits" if blob is not None else "memory_misses")
            if blob is not None:
                try:
                    return _codec.decode(blob, ident, copy=True, verify=False)
                except _codec.CorruptEntry as e:
                    # Never expected (the process encoded it itself): counted as a miss, not a hit,
                    # dropped, and looked up further like any miss.
                    with self._lock:
                        if memory.entries.get(i) is blob:
                            memory.pop(i)
                        self._count("memory_hits", -1)
                        self._count("memory_misses")
                    warnings.warn(f"CachedDataset: memory-tier entry {i} could not be decoded and was "
                                  f"dropped ({e})", RuntimeWarning, stacklevel=2)
        if disk is not None:
            found = disk.get(i)
            if found is not None:
                buf, inode = found
                try:
                    sample = _codec.decode(buf, ident, copy=False, verify=True)
                except _codec.CorruptEntry:
                    # Counted as corrupt and as a miss: removed, then loaded and written again.
                    self._count("disk_corrupt")
                    disk.remove(i, only_inode=inode)
                else:
                    self._count("disk_hits")
                    if memory is not None:
                        self._remember(i, bytearray(buf))
                    return sample
            self._count("disk_misses")
        sample = self.dataset[i]
        self._count("loads")
        blob = _codec.encode(sample, ident, checksum=disk is not None)  # checked on disk reads alone
        if memory is not None:
            self._remember(i, blob)
        if disk is not None:
            if len(blob) > disk.capacity:
                self._count("disk_too_large")
            else:
                landed, evicted = disk.put(i, blob)
                self._count("disk_writes", int(landed))
                self._count("disk_evictions", evicted)
        return sample

    def _remember(self, i: int, blob: bytearray) -> None:
        with self._lock:
            stored, evicted = self._memory.put(i, blob)
            self._count("memory_evictions", evicted)
            if not stored:
                self._count("memory_too_large")

    # -- management -----------------------------------------------------------------------

    def invalidate(self, index: Any) -> None:
        """Forget sample ``index`` in this process's memory tier and in the disk tier
        (other processes' memory tiers keep their copies)."""
        i = self._index(index)
        if self._memory is not None:
            with self._lock:
                self._memory.pop(i)
        if self._disk is not None:
            self._disk.remove(i)

    def clear(self) -> None:
        """Forget every sample of this key: this process's memory tier, and the disk tier's
        entries of this key in every version (other keys in ``disk_dir`` stay); removes the
        temp files of dead writers."""
        if self._memory is not None:
            with self._lock:
                self._memory.clear()
        if self._disk is not None:
            self._disk.remove_all()

    def stats(self, *, per_process: bool = False) -> dict | list[dict]:
        """Counters, summed over this process and its DataLoader workers (every one of them,
        since the last :meth:`reset_stats`), as ``{"memory": {...}, "disk": {...}, "loads": n}``.
        Each process has counters of its own: the process that built the wrapper and a process it
        was pickled to (a sweep trial) count apart, each with its own workers; in a DataLoader
        worker, the worker's own counters alone.

        * memory: ``hits``, ``misses`` (an entry that cannot be decoded, which would be a bug of
          the cache, is dropped with a RuntimeWarning and counted as a miss), ``evictions``,
          ``too_large`` (entries larger than the tier);
        * disk: ``hits``, ``misses``, ``writes``, ``evictions`` (done by these processes, of any
          key), ``too_large``, ``corrupt`` (entries found damaged, by their checks or checksum,
          and removed);
        * ``loads``: calls of the wrapped dataset.

        A tier that is off counts nothing. ``per_process=True`` (a bool) returns one such dict per
        row instead, ``2 + max_workers`` of them: ``[this process, row 1, ..., row max_workers,
        overflow]``. A DataLoader worker counts into row ``1 + id`` when no live worker holds it
        (one DataLoader at a time: worker ``w`` in row ``1 + w``), else into the lowest free row;
        a row adds up the workers that held it one after another (those of successive epochs);
        the overflow row, the workers that found every row held. In a DataLoader worker: a list
        of one, the worker's own.
        """
        if not isinstance(per_process, (bool, np.bool_)):
            raise TypeError(f"per_process must be a bool, got {type(per_process).__name__} {per_process!r}")
        self._ensure_process()
        w = self._w
        table = self._table.view() if w.home else w.own()[None]
        rows = [self._format(r) for r in table] if per_process else [self._format(table.sum(0))]
        return rows if per_process else rows[0]

    @staticmethod
    def _format(row: np.ndarray) -> dict:
        out: dict = {"memory": {}, "disk": {}}
        for name, value in zip(_FIELDS, row.tolist()):
            tier, _, what = name.partition("_")
            if tier in out:
                out[tier][what] = value
            else:
                out[name] = value
        return out

    def reset_stats(self) -> None:
        """Zero the counters of this process and its DataLoader workers: those :meth:`stats`
        reports here (the workers' rows are not written: this process keeps what they held as
        its new zero). Another process's counters (the creator's, a sweep trial's) stay; in a
        DataLoader worker, only the worker's own counts are zeroed (taken out of its row)."""
        self._ensure_process()
        if self._w.home:
            self._table.reset()  # row 0 (this process) and its workers' rows
        else:
            self._w.reset()

    def memory_usage(self) -> dict:
        """This process's memory tier: ``{"entries": n, "bytes": b}`` (b <= memory_bytes)."""
        if self._memory is None:
            return {"entries": 0, "bytes": 0}
        with self._lock:
            return {"entries": len(self._memory.entries), "bytes": self._memory.bytes}

    def disk_usage(self) -> dict:
        """The disk tier, listed now: ``{"entries", "bytes"}`` of the whole directory (what
        ``disk_bytes`` bounds) and ``{"key_entries", "key_bytes"}`` of this key (all versions)."""
        if self._disk is None:
            return {"entries": 0, "bytes": 0, "key_entries": 0, "key_bytes": 0}
        return self._disk.usage()

    def __repr__(self) -> str:
        tiers = []
        if self._memory is not None:
            tiers.append(f"memory_bytes={self.memory_bytes}")
        if self._disk is not None:
            tiers.append(f"disk_dir={self.disk_dir!r}, disk_bytes={self.disk_bytes}, key={self.key!r}, "
                         f"version={self.version!r}")
        return f"CachedDataset({type(self.dataset).__name__}, {', '.join(tiers)})"

