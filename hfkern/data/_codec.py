"""The byte format of one cached sample, shared by the memory and the disk tier.

An entry is one contiguous buffer::

    offset 0   prefix  "<8sIIQQ": magic, format version, CRC-32, header length H, total length T
    offset 32  header  H bytes of UTF-8 JSON: the cache identity and the sample's tree
    align(32 + H, 64)  data: every array leaf's bytes, each at a 64-byte aligned offset

The CRC-32 (``zlib.crc32``) covers everything after itself: H, T, the header,
the padding and the data. It is written when the entry is meant for the disk
tier and checked on every read from disk (:func:`decode` with ``verify=True``),
so a flipped bit in the header or in a leaf is a corrupt entry, not a wrong
sample. Memory-tier entries never leave the process and are not checked.

The tree mirrors the sample: ``tuple``/``list``/``dict`` nodes hold their
children; array leaves (``torch.Tensor``, ``numpy.ndarray``, numpy scalars,
``bytes``) name a dtype, a shape and a byte range of the data area; plain
Python scalars (``int``, ``float``, ``complex``, ``bool``, ``str``, ``None``)
live in the JSON itself: ``bool``, ``str``, ``None`` and ints of magnitude below
2**63 as JSON values, larger ints as hexadecimal text (exact for any size, and
not bound by ``sys.set_int_max_str_digits``, which limits decimal text), floats
and complex parts as the 16 hexadecimal digits of their IEEE-754 bits, so every
float comes back with its bits: ``-0.0``, ``inf`` and NaNs of either sign and
any payload included.

numpy ``str_`` / ``bytes_`` scalars are kept whole, trailing NULs included
(numpy drops those when it reads an element of an array, so they are not
stored as 0-d arrays): a ``str_``'s text lives in the JSON, a ``bytes_``'s
bytes in the data area, each with its dtype, and they are rebuilt with
``numpy.str_`` / ``numpy.bytes_``. Arrays of strings keep their bytes and dtype;
reading an element of one drops trailing NULs, as numpy does for the original.

Decoding builds the leaves with ``torch.frombuffer`` / ``numpy.frombuffer``
over the buffer: over a private (copy-on-write) memory map of a disk entry they
share the mapped pages until written; over a memory-tier entry they are copied,
so a caller that modifies a sample in place cannot change the cache. Leaves
come back contiguous; strides are not kept.

The 64-byte alignment keeps every leaf aligned for any dtype (and a cache line
apart), so a leaf read from the mapping is as good as a freshly allocated one.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np
import torch

MAGIC = b"HFKCACHE"
# 2: the prefix holds a CRC-32 of the rest of the entry; numpy str_/bytes_ scalars kept whole.
# 3: floats and complex parts stored as their IEEE-754 bits (NaN sign and payload kept), ints
#    of magnitude 2**63 and over as hexadecimal text. Entries of format 2 are never read (the
#    format is part of an entry's name, see cache.py): they are misses and age out.
FORMAT = 3
_PREFIX = struct.Struct("<8sIIQQ")
_CRC_AT = 12  # offset of the CRC-32 in the prefix; it covers the entry from _CRC_FROM on
_CRC = struct.Struct("<I")
_CRC_FROM = _CRC_AT + _CRC.size
ALIGN = 64
# A sample nested deeper than this is refused (TypeError) rather than recursed into; a tuple,
# list or dict that contains itself is refused as such.
MAX_DEPTH = 64
_BIG_INT = 1 << 63  # ints of this magnitude and over are stored as hexadecimal text
_F64 = struct.Struct("<d")

SUPPORTED = (
    "torch.Tensor (CPU, dense, any dtype, not requiring grad), numpy.ndarray and numpy "
    "scalars (any dtype without Python objects or fields), bytes, int, float, complex, "
    "bool, str, None, and tuple / list / dict (keys: str, int, float, bool or None) of these"
)

_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class CorruptEntry(ValueError):
    """A buffer that is not a complete entry of this format (or not the one asked for)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _unsupported(obj: Any, where: str, why: str = "") -> TypeError:
    what = f"{type(obj).__module__}.{type(obj).__qualname__}"
    return TypeError(f"cannot cache sample{where}: {what}{why}; supported: {SUPPORTED}")


def _float_bits(x: float) -> str:
    """The IEEE-754 bits of ``x`` as 16 hexadecimal digits (a NaN keeps its sign and payload)."""
    return _F64.pack(x).hex()


def _bits_float(bits: Any) -> float:
    if type(bits) is not str or len(bits) != 16:
        raise CorruptEntry(f"float bits {bits!r} are not 16 hexadecimal digits")
    return _F64.unpack(bytes.fromhex(bits))[0]


def _show(key: Any) -> str:
    """A dict key as the path of an error message shows it (an int too long for its decimal
    text, see ``sys.set_int_max_str_digits``, in hexadecimal)."""
    if type(key) is int and not -_BIG_INT < key < _BIG_INT:
        return hex(key)
    return repr(key)


class _Encoder:
    def __init__(self) -> None:
        self.leaves: list[tuple[int, Any]] = []  # (offset in the data area, contiguous array)
        self.size = 0
        self.open: set[int] = set()  # ids of the tuples, lists and dicts on the path being encoded

    def _leaf(self, data: Any, nbytes: int) -> int:
        off = self.size
        self.leaves.append((off, data))
        self.size = _align(off + nbytes)
        return off

    def node(self, obj: Any, where: str, depth: int) -> dict:
        if depth > MAX_DEPTH:
            raise TypeError(f"cannot cache sample{where}: nested deeper than {MAX_DEPTH} levels "
                            f"(of tuples, lists and dicts); supported: {SUPPORTED}")
        t = type(obj)
        if t is torch.Tensor:
            if obj.layout != torch.strided or obj.is_nested or obj.is_quantized:
                raise _unsupported(obj, where, f" with layout {obj.layout}"
                                   f"{' (nested)' if obj.is_nested else ''}{' (quantized)' if obj.is_quantized else ''}")
            if obj.device.type != "cpu":
                raise _unsupported(obj, where, f" on device {obj.device} (expected a CPU tensor)")
            if obj.requires_grad:
                raise _unsupported(obj, where, " that requires grad (its autograd graph cannot be cached; "
                                   "return a detached tensor)")
            data = obj.resolve_conj().resolve_neg().contiguous()
            n = data.numel() * data.element_size()
            return {"t": "tensor", "dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
                    "off": self._leaf(data, n), "n": n}
        if isinstance(obj, np.str_):
            # Its own text, trailing NULs included (a 0-d array would drop them when read back).
            return {"t": "npstr", "dtype": obj.dtype.str, "v": str.__str__(obj)}
        if isinstance(obj, np.bytes_):
            data = bytes(obj)  # every byte, trailing NULs included
            return {"t": "npbytes", "dtype": obj.dtype.str, "off": self._leaf(data, len(data)), "n": len(data)}
        if t is np.ndarray or isinstance(obj, np.generic):  # ndarray subclasses (matrix, masked) are refused
            dt = obj.dtype
            if dt.hasobject or dt.fields is not None:
                raise _unsupported(obj, where, f" of dtype {dt} (Python objects or fields)")
            data = np.asarray(obj, order="C")  # not ascontiguousarray: it makes a scalar 1-d
            if data.dtype != dt:  # the bytes written must be those of the dtype recorded
                raise _unsupported(obj, where, f" of dtype {dt} (numpy makes it an array of dtype {data.dtype})")
            kind = "ndarray" if t is np.ndarray else "npscalar"
            return {"t": kind, "dtype": dt.str, "shape": list(data.shape), "off": self._leaf(data, data.nbytes),
                    "n": data.nbytes}
        if t is bytes:
            return {"t": "bytes", "off": self._leaf(obj, len(obj)), "n": len(obj)}
        if t is int and not -_BIG_INT < obj < _BIG_INT:
            return {"t": "int", "x": hex(obj)}
        if t is bool or t is int or t is str or obj is None:
            return {"t": "v", "v": obj}
        if t is float:
            return {"t": "float", "b": _float_bits(obj)}
        if t is complex:
            return {"t": "complex", "b": [_float_bits(obj.real), _float_bits(obj.imag)]}
        if t is tuple or t is list or t is dict:
            if id(obj) in self.open:
                raise TypeError(f"cannot cache sample{where}: a {t.__name__} that contains itself; "
                                f"supported: {SUPPORTED}")
            self.open.add(id(obj))
            try:
                return self._container(obj, t, where, depth)
            finally:
                self.open.discard(id(obj))
        raise _unsupported(obj, where)

    def _container(self, obj: Any, t: type, where: str, depth: int) -> dict:
        if t is dict:
            keys = []
            for k in obj:
                if type(k) not in (str, int, float, bool) and k is not None:
                    raise _unsupported(k, f"{where} (a dict key)")
                keys.append(self.node(k, where, depth + 1))
            return {"t": "dict", "keys": keys,
                    "items": [self.node(v, f"{where}[{_show(k)}]", depth + 1) for k, v in obj.items()]}
        return {"t": t.__name__, "items": [self.node(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(obj)]}


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous tensor as a flat uint8 numpy view (any dtype, bfloat16 included).

    Entries are copied by numpy, not by ``Tensor.copy_``: numpy's copy is one
    memcpy, while torch may split even a small copy across its intra-op threads,
    and on a loaded machine a copy then waits milliseconds for a descheduled thread.
    """
    return t.reshape(-1).view(torch.uint8).numpy()


def encode(sample: Any, ident: dict, *, checksum: bool = True) -> bytearray:
    """The entry for ``sample``; ``ident`` (JSON values) is stored with it and checked by :func:`decode`.

    ``checksum=False`` leaves the CRC-32 at 0 (an entry that will never be read
    with ``verify=True``: the memory tier's alone). Raises a TypeError naming the
    offending part of ``sample`` before anything is written.
    """
    enc = _Encoder()
    tree = enc.node(sample, "", 0)
    header = json.dumps({"ident": ident, "tree": tree}, separators=(",", ":")).encode()
    start = _align(_PREFIX.size + len(header))
    total = start + enc.size
    buf = bytearray(total)
    _PREFIX.pack_into(buf, 0, MAGIC, FORMAT, 0, len(header), total)
    buf[_PREFIX.size:_PREFIX.size + len(header)] = header
    for off, data in enc.leaves:
        off += start
        if isinstance(data, torch.Tensor):
            n = data.numel() * data.element_size()
            if n:
                np.frombuffer(buf, np.uint8, n, off)[:] = _bytes_of(data)
        elif isinstance(data, np.ndarray):
            if data.nbytes:
                np.frombuffer(buf, np.uint8, data.nbytes, off)[:] = data.reshape(-1).view(np.uint8)
        else:  # bytes
            buf[off:off + len(data)] = data
    if checksum:
        with memoryview(buf) as view:
            _CRC.pack_into(buf, _CRC_AT, zlib.crc32(view[_CRC_FROM:]))
    return buf


def entry_size(buf) -> int:
    """The total length recorded in an entry's prefix (raises CorruptEntry when it is not one)."""
    if len(buf) < _PREFIX.size:
        raise CorruptEntry(f"entry of {len(buf)} bytes is shorter than its {_PREFIX.size}-byte prefix")
    magic, fmt, _, _, total = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC or fmt != FORMAT:
        raise CorruptEntry(f"expected magic {MAGIC!r} format {FORMAT}, got {magic!r} format {fmt}")
    return total


def decode(buf, ident: dict, *, copy: bool, verify: bool = True) -> Any:
    """The sample stored in ``buf`` (a bytearray, or a writable uint8 numpy array over a private map).

    ``copy=True`` gives leaves that own their memory; ``copy=False`` leaves that
    view ``buf`` (keeping it alive). ``verify=True`` checks the entry's CRC-32
    first (an entry encoded with ``checksum=True``). Raises CorruptEntry when
    ``buf`` is not a complete entry, its checksum does not match, or its
    identity is not ``ident``.
    """
    total = entry_size(buf)
    _, _, crc, hlen, _ = _PREFIX.unpack_from(buf, 0)
    if total != len(buf) or _PREFIX.size + hlen > total:
        raise CorruptEntry(f"entry records {total} bytes (header {hlen}), buffer holds {len(buf)}")
    if verify:
        with memoryview(buf) as view:
            got = zlib.crc32(view[_CRC_FROM:])
        if got != crc:
            raise CorruptEntry(f"entry checksum mismatch: recorded CRC-32 {crc:#010x}, computed {got:#010x}")
    try:
        header = json.loads(bytes(buf[_PREFIX.size:_PREFIX.size + hlen]))
        if header["ident"] != ident:
            raise CorruptEntry(f"entry belongs to {header['ident']}, expected {ident}")
        start = _align(_PREFIX.size + hlen)
        return _Decoder(buf, start, copy).node(header["tree"], 0)
    except CorruptEntry:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError, struct.error) as e:
        # Malformed JSON or a tree of the wrong shape: the entry is damaged, not the caller.
        raise CorruptEntry(f"malformed entry header: {type(e).__name__}: {e}") from None


class _Decoder:
    def __init__(self, buf, start: int, copy: bool) -> None:
        self.buf, self.start, self.copy = buf, start, copy

    def _range(self, node: dict, nbytes: int) -> int:
        off, n = node["off"], node["n"]
        if type(off) is not int or off < 0 or n != nbytes or self.start + off + n > len(self.buf):
            raise CorruptEntry(f"leaf of {n} bytes at {off} does not fit the entry (expected {nbytes} bytes)")
        return self.start + off

    def node(self, node: dict, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CorruptEntry(f"tree deeper than {MAX_DEPTH}")
        t = node["t"]
        if t == "tensor":
            dtype = _TORCH_DTYPES[node["dtype"]]
            shape = [int(s) for s in node["shape"]]
            numel = int(np.prod(shape, dtype=np.int64))
            off = self._range(node, numel * dtype.itemsize)
            if numel == 0:
                return torch.empty(shape, dtype=dtype)
            if self.copy:
                out = torch.empty(shape, dtype=dtype)
                _bytes_of(out)[:] = np.frombuffer(self.buf, np.uint8, numel * dtype.itemsize, off)
                return out
            return torch.frombuffer(self.buf, dtype=dtype, count=numel, offset=off).view(shape)
        if t in ("ndarray", "npscalar"):
            dtype = np.dtype(node["dtype"])
            shape = tuple(int(s) for s in node["shape"])
            numel = int(np.prod(shape, dtype=np.int64))
            off = self._range(node, numel * dtype.itemsize)
            if numel == 0 or dtype.itemsize == 0:  # no bytes (frombuffer refuses an itemsize of 0, as V0's)
                out = np.empty(shape, dtype=dtype)
                return out[()] if t == "npscalar" else out
            out = np.frombuffer(self.buf, dtype=dtype, count=numel, offset=off).reshape(shape)
            if self.copy:
                out = out.copy()
            return out[()] if t == "npscalar" else out
        if t == "bytes":
            off = self._range(node, node["n"])
            return bytes(self.buf[off:off + node["n"]])
        if t == "npstr":
            v = node["v"]
            if type(v) is not str:
                raise CorruptEntry(f"numpy str_ scalar holds a {type(v).__name__}")
            return self._checked(np.str_(v), node["dtype"])
        if t == "npbytes":
            off = self._range(node, node["n"])
            return self._checked(np.bytes_(bytes(self.buf[off:off + node["n"]])), node["dtype"])
        if t == "v":
            return node["v"]
        if t == "int":
            x = node["x"]
            if type(x) is not str:
                raise CorruptEntry(f"int node holds a {type(x).__name__}")
            return int(x, 16)
        if t == "float":
            return _bits_float(node["b"])
        if t == "complex":
            re_bits, im_bits = node["b"]
            return complex(_bits_float(re_bits), _bits_float(im_bits))
        if t == "tuple":
            return tuple(self.node(x, depth + 1) for x in node["items"])
        if t == "list":
            return [self.node(x, depth + 1) for x in node["items"]]
        if t == "dict":
            keys, items = node["keys"], node["items"]
            if len(keys) != len(items):
                raise CorruptEntry(f"dict with {len(keys)} keys and {len(items)} values")
            return {self.node(k, depth + 1): self.node(v, depth + 1) for k, v in zip(keys, items)}
        raise CorruptEntry(f"unknown node type {t!r}")

    @staticmethod
    def _checked(scalar: np.generic, dtype: str) -> np.generic:
        """``scalar`` if its dtype is the one recorded (a str_/bytes_ scalar's dtype is its length)."""
        if scalar.dtype.str != dtype:
            raise CorruptEntry(f"numpy {type(scalar).__name__} scalar of dtype {scalar.dtype.str}, recorded {dtype}")
        return scalar
