"""The spool's record format: data only, so opening a run directory from someone else runs no code.

Why not pickle: unpickling a file calls whatever callables the file names — a run directory
received from someone else (a bug report, a shared capture) could run code on the machine that
merely recovers it (``statescope capture-recover``). This format can only describe data: decoding
builds None, booleans, integers, floats, strings, bytes, lists, tuples, dicts, numpy arrays, torch
CPU tensors, torch dtypes, and ``SpooledRecord`` attribute bags for the step's small objects
(copy launches, copy events). No name read from the file is ever imported, looked up or called.

What it does: ``encode(obj) -> bytes`` and ``decode(data) -> obj``; one tag byte per value,
little-endian lengths. Arrays and tensors travel as their raw bytes (dtype name, shape, bytes;
bfloat16 as its bits); a device tensor is written as "not here" and decodes to None (the emitter
takes device data from the step's packed host copy, and spooling must never read device memory).
An object encoded twice (a launch listed in the step and in its packed copy) is written once and
referenced after, so identity survives the round trip as it does in memory.

Bounds (a record may come from a hostile sender): nothing is allocated from a number in the file
before it is checked. Every length is checked against the bytes left in the record before the
bytes are taken; every count (list items, dict entries, table rows, record fields) against the
bytes left too (each item costs at least one byte) and against one budget per record of
``SLOTS_PER_BYTE * len(record) + BUDGET_SLACK`` container slots, charged as containers are made
(an item 1, a table row or record ``ROW_SLOTS``): items that cost the writer no bytes (a list of
``None``, the rows of a table without columns) are bounded by it, so decoding a record of N bytes
holds at most about 100·N bytes of Python objects; shapes have at most ``MAX_NDIM`` dimensions, each at most ``MAX_DIM``, and
their product is computed with Python integers and compared with the bytes present before any
reshape; big integers are ASCII decimal digits, at most ``MAX_BIG_DIGITS``. A record longer than
``MAX_RECORD_BYTES`` is refused by the reader (``statescope.capture.spool.read_spool``) before it
is read.

What it deliberately does not do: version records across statescope releases (the spool lives
only until its steps are emitted), compress, or accept a type it does not list — ``encode``
raises ``TypeError`` for one, ``decode`` raises ``SpoolFormatError`` for a tag it does not know,
a length or count past the record's end or its budget, or nesting deeper than ``MAX_DEPTH``.
"""
from __future__ import annotations

import dataclasses
import math
import re
import struct
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

MAX_DEPTH = 64
MAX_RECORD_BYTES = 1 << 32  # one step's record (its packed host copy included): 4 GiB
MAX_NDIM, MAX_DIM = 32, 1 << 40  # numpy allows 64 dimensions; no real step tensor has 2**40 rows
MAX_BIG_DIGITS = 4300  # Python's own int-from-string limit
SLOTS_PER_BYTE, BUDGET_SLACK = 8, 4096  # container slots per record byte, and for tiny records
ROW_SLOTS = 8  # a table row or record is an object with a dict: it costs several slots
_DIGITS = re.compile(r"-?[0-9]+")
_I64, _F64, _U32, _U64 = struct.Struct("<q"), struct.Struct("<d"), struct.Struct("<I"), struct.Struct("<Q")
# torch dtypes by name: the file names one, this table decides what it is (never getattr(torch, name)).
TORCH_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
# numpy dtypes that carry no Python objects (np.dtype() of anything else is refused).
NUMPY_KINDS = set("biufc")


class SpoolFormatError(ValueError):
    """A record that this format cannot have written."""


class SpooledRecord(SimpleNamespace):
    """A step object read back from the spool: its fields as attributes, nothing else."""


def _str(out: bytearray, s: str) -> None:
    raw = s.encode("utf-8")
    out += _U32.pack(len(raw)) + raw


def _shape(out: bytearray, shape: tuple) -> None:
    out.append(len(shape))
    for n in shape:
        out += _U64.pack(int(n))


class _Encoder:
    def __init__(self) -> None:
        self.out = bytearray()
        self.records: dict[int, int] = {}  # id(obj) -> index of its first encoding
        self.keep: list = []  # keep encoded objects alive, so their ids stay unique

    def value(self, obj: Any) -> None:
        out, t = self.out, type(obj)
        # exact built-in types first (most values), numpy and torch scalars and objects after
        if t is str:
            out += b"s"
            _str(out, obj)
        elif t is int:
            self.integer(obj)
        elif t is dict:
            out += b"d"
            out += _U32.pack(len(obj))
            for k, v in obj.items():
                self.value(k)
                self.value(v)
        elif t is list or t is tuple:
            self.sequence(obj, t is list)
        elif t is np.ndarray:
            self.array(obj)
        elif obj is None:
            out += b"N"
        elif t is bool or t is np.bool_:
            out += b"T" if obj else b"F"
        elif t is float:
            out += b"f" + _F64.pack(obj)
        elif isinstance(obj, torch.dtype):
            out += b"D"
            _str(out, str(obj).replace("torch.", ""))
        elif isinstance(obj, torch.Tensor):
            self.tensor(obj)
        elif isinstance(obj, np.integer):
            self.integer(int(obj))
        elif isinstance(obj, np.floating):
            out += b"f" + _F64.pack(float(obj))
        elif t is bytes:
            out += b"b" + _U32.pack(len(obj)) + obj
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type) or isinstance(obj, SimpleNamespace):
            self.record(obj)
        else:
            raise TypeError(f"spool: a {t.__module__}.{t.__qualname__} cannot be spooled "
                            "(data only: see statescope.capture.spool_format)")

    def integer(self, v: int) -> None:
        if -2**63 <= v < 2**63:
            self.out += b"i"
            self.out += _I64.pack(v)
        else:
            self.out += b"I"
            _str(self.out, str(v))

    def sequence(self, obj: list | tuple, is_list: bool) -> None:
        """A list or tuple; homogeneous ones in one piece (the step's lists are: request ids,
        token counts, per-request dicts with the same keys, copy events of one class)."""
        out, kinds = self.out, set(map(type, obj))
        if len(obj) > 1 and len(kinds) == 1:
            (kind,) = kinds
            if kind is int and -2**63 <= min(obj) and max(obj) < 2**63:
                out += b"J" if is_list else b"j"
                out += _U32.pack(len(obj))
                out += np.asarray(obj, dtype="<i8").tobytes()
                return
            if kind is bool:
                out += b"B" if is_list else b"V"
                out += _U32.pack(len(obj))
                out += bytes(obj)
                return
            if obj[0] is None:
                out += b"n" if is_list else b"m"
                out += _U32.pack(len(obj))
                return
            if kind is str:
                joined = "\0".join(obj)
                if joined.count("\0") == len(obj) - 1:  # no string holds the separator itself
                    out += b"S" if is_list else b"Z"
                    out += _U32.pack(len(obj))
                    _str(out, joined)
                    return
            if kind is dict:
                keys = list(obj[0])
                if all(list(d) == keys for d in obj):
                    self.columns(b"K" if is_list else b"k", keys, [[d[k] for d in obj] for k in keys], len(obj))
                    return
            if dataclasses.is_dataclass(kind) and not any(id(v) in self.records for v in obj):
                fields = [list(vars(v)) for v in obj]
                if all(f == fields[0] for f in fields):
                    for v in obj:  # numbered in order, as the decoder numbers them
                        self.records[id(v)] = len(self.records)
                        self.keep.append(v)
                    self.columns(b"Q" if is_list else b"q", fields[0],
                                 [[getattr(v, k) for v in obj] for k in fields[0]], len(obj))
                    return
        out += b"l" if is_list else b"t"
        out += _U32.pack(len(obj))
        for v in obj:
            self.value(v)

    def columns(self, tag: bytes, names: list[str], columns: list[list], n: int) -> None:
        self.out += tag
        self.out += _U32.pack(n)
        self.out += _U32.pack(len(names))
        for name, col in zip(names, columns):
            self.value(name)
            self.sequence(col, True)

    def array(self, a: np.ndarray) -> None:
        if a.dtype.kind not in NUMPY_KINDS:
            raise TypeError(f"spool: numpy dtype {a.dtype} holds objects; data only")
        a = np.ascontiguousarray(a)
        self.out += b"a"
        _str(self.out, a.dtype.str)
        _shape(self.out, a.shape)
        self.out += _U64.pack(a.nbytes)
        self.out += a.tobytes()

    def tensor(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            self.out += b"P"  # a launch's device input: emit takes it from the packed host copy
            return
        t = t.detach().contiguous()
        name = str(t.dtype).replace("torch.", "")
        if name not in TORCH_DTYPES:
            raise TypeError(f"spool: torch dtype {t.dtype} is not spooled")
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        self.out += b"g"
        _str(self.out, name)
        _shape(self.out, tuple(t.shape))
        self.out += _U64.pack(len(raw))
        self.out += raw

    def record(self, obj: Any) -> None:
        key = id(obj)
        if key in self.records:
            self.out += b"r"
            self.out += _U32.pack(self.records[key])
            return
        self.records[key] = len(self.records)
        self.keep.append(obj)
        self.out += b"o"
        fields = vars(obj)
        self.out += _U32.pack(len(fields))
        for k, v in fields.items():
            _str(self.out, k)
            self.value(v)


def encode(obj: Any) -> bytes:
    """The record bytes of ``obj`` (see the module docstring for what may be in it)."""
    enc = _Encoder()
    enc.value(obj)
    return bytes(enc.out)


class _Decoder:
    def __init__(self, data: bytes | memoryview) -> None:
        self.data, self.pos = memoryview(data), 0
        self.records: list[SpooledRecord] = []
        self.budget = SLOTS_PER_BYTE * len(self.data) + BUDGET_SLACK  # slots it may still build

    def count(self, per_item: int = 1, what: str = "items") -> int:
        """A u32 count of things that each take at least ``per_item`` bytes of what is left
        (0: items that cost no bytes, bounded by the budget alone), charged to the budget."""
        at = self.pos
        n = self.u32()
        left = len(self.data) - self.pos
        if per_item and n * per_item > left:
            raise SpoolFormatError(f"a count of {n} {what} at byte {at} needs at least "
                                   f"{n * per_item} bytes, {left} are left in the record")
        self.charge(n, at, what)
        return n

    def charge(self, n: int, at: int, what: str) -> None:
        if n > self.budget:
            raise SpoolFormatError(f"{n} {what} at byte {at} exceed what a record of "
                                   f"{len(self.data)} bytes can hold")
        self.budget -= n

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise SpoolFormatError(f"a length of {n} bytes at byte {self.pos} runs past the record "
                                   f"({len(self.data)} bytes)")
        chunk, self.pos = self.data[self.pos:end], end
        return chunk

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self.take(8))[0]

    def text(self) -> str:
        try:
            return str(self.take(self.u32()), "utf-8")
        except UnicodeDecodeError as exc:
            raise SpoolFormatError(f"a string at byte {self.pos} is not UTF-8 ({exc.reason})") from None

    def shape(self) -> tuple:
        at = self.pos
        ndim = self.take(1)[0]
        if ndim > MAX_NDIM:
            raise SpoolFormatError(f"a shape of {ndim} dimensions at byte {at} (at most {MAX_NDIM})")
        dims = tuple(self.u64() for _ in range(ndim))
        if any(d > MAX_DIM for d in dims):
            raise SpoolFormatError(f"a shape {dims} at byte {at} has a dimension above {MAX_DIM}")
        return dims

    def raw_for(self, shape: tuple, itemsize: int, what: str) -> memoryview:
        """The buffer of an array of ``shape``: its byte count must be the shape's product (Python
        integers: no overflow) times ``itemsize``, checked before anything is allocated."""
        at = self.pos
        n = self.u64()
        want = math.prod(shape) * itemsize
        if n != want:
            raise SpoolFormatError(f"{what} of shape {shape} at byte {at} needs {want} bytes, "
                                   f"the record says {n}")
        return self.take(n)

    def value(self, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise SpoolFormatError(f"values nested deeper than {MAX_DEPTH} at byte {self.pos}")
        tag = bytes(self.take(1))
        if tag == b"N" or tag == b"P":
            return None
        if tag in (b"T", b"F"):
            return tag == b"T"
        if tag == b"i":
            return _I64.unpack(self.take(8))[0]
        if tag == b"I":
            at = self.pos
            digits = self.text()
            if len(digits) > MAX_BIG_DIGITS or not _DIGITS.fullmatch(digits):
                raise SpoolFormatError(f"a big integer at byte {at} is not at most {MAX_BIG_DIGITS} "
                                       "ASCII decimal digits")
            return int(digits)
        if tag == b"f":
            return _F64.unpack(self.take(8))[0]
        if tag == b"s":
            return self.text()
        if tag == b"b":
            return bytes(self.take(self.u32()))
        if tag in (b"l", b"t"):
            items = [self.value(depth + 1) for _ in range(self.count(1, "list items"))]
            return items if tag == b"l" else tuple(items)
        if tag in (b"J", b"j"):
            n = self.count(8, "integers")
            items = np.frombuffer(self.take(8 * n), dtype="<i8").tolist()
            return items if tag == b"J" else tuple(items)
        if tag in (b"B", b"V"):
            n = self.count(1, "booleans")
            items = [b != 0 for b in bytes(self.take(n))]
            return items if tag == b"B" else tuple(items)
        if tag in (b"n", b"m"):
            n = self.count(0, "None values")  # each None costs the writer nothing: the budget bounds it
            return [None] * n if tag == b"n" else (None,) * n
        if tag in (b"S", b"Z"):
            at = self.pos
            n = self.count(0, "strings")
            items = self.text().split("\0")
            if len(items) != n:
                raise SpoolFormatError(f"a list of {n} strings at byte {at} holds {len(items)}")
            return items if tag == b"S" else tuple(items)
        if tag in (b"K", b"k", b"Q", b"q"):
            return self.table(tag, depth)
        if tag == b"d":
            out = {}
            for _ in range(self.count(2, "dict entries")):
                k = self.value(depth + 1)
                try:
                    out[k] = self.value(depth + 1)
                except TypeError:
                    raise SpoolFormatError(f"an unhashable dict key at byte {self.pos}") from None
            return out
        if tag == b"a":
            return self.array()
        if tag == b"g":
            return self.tensor()
        if tag == b"D":
            return self.dtype(self.text())
        if tag == b"o":
            return self.record(depth)
        if tag == b"r":
            i = self.u32()
            if i >= len(self.records):
                raise SpoolFormatError(f"a reference to record {i} at byte {self.pos} precedes it")
            return self.records[i]
        raise SpoolFormatError(f"unknown tag {tag!r} at byte {self.pos - 1}")

    def table(self, tag: bytes, depth: int) -> list | tuple:
        """A list of dicts with the same keys (K) or of records with the same fields (Q), stored
        column by column."""
        at = self.pos
        n, width = self.u32(), self.u32()
        left = len(self.data) - self.pos
        if width * 2 > left:  # each column is at least a name tag and a list tag
            raise SpoolFormatError(f"a table of {width} columns at byte {at} needs more than the "
                                   f"{left} bytes left in the record")
        # rows cost no bytes of their own (a column of None is 5 bytes for any n): the budget
        # bounds them before any row is made (each column charges its own cells)
        self.charge(n * ROW_SLOTS, at, f"slots for a table of {n} rows")
        records = [SpooledRecord() for _ in range(n)] if tag in (b"Q", b"q") else None
        if records is not None:
            self.records += records  # numbered before their fields, as the encoder numbered them
        names, columns = [], []
        for _ in range(width):
            name = self.value(depth + 1)
            column = self.value(depth + 1)
            if not isinstance(column, list) or len(column) != n:
                raise SpoolFormatError(f"a column of a {n}-row table at byte {self.pos} is not "
                                       f"a list of {n} values")
            if records is not None and (not isinstance(name, str) or not name.isidentifier()
                                        or name.startswith("__")):
                raise SpoolFormatError(f"field name {name!r} at byte {self.pos} is not a plain identifier")
            names.append(name)
            columns.append(column)
        if records is None:
            try:
                rows: list = [dict(zip(names, row)) for row in zip(*columns)] if names else [{} for _ in range(n)]
            except TypeError:
                raise SpoolFormatError(f"an unhashable dict key at byte {self.pos}") from None
        else:
            for name, column in zip(names, columns):
                for rec, v in zip(records, column):
                    setattr(rec, name, v)
            rows = records
        return rows if tag in (b"K", b"Q") else tuple(rows)

    def array(self) -> np.ndarray:
        spec = self.text()
        try:
            dtype = np.dtype(spec) if spec[1:2] in NUMPY_KINDS and len(spec) <= 4 else None
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind not in NUMPY_KINDS:
            raise SpoolFormatError(f"numpy dtype {spec!r} at byte {self.pos} is not a plain number type")
        shape = self.shape()
        raw = self.raw_for(shape, dtype.itemsize, f"an array of {dtype}")
        try:
            return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        except ValueError as exc:  # e.g. an empty array whose strides would overflow
            raise SpoolFormatError(f"an array of shape {shape} at byte {self.pos}: {exc}") from None

    def dtype(self, name: str) -> torch.dtype:
        if name not in TORCH_DTYPES:
            raise SpoolFormatError(f"torch dtype {name!r} at byte {self.pos} is not one this "
                                   f"format writes ({sorted(TORCH_DTYPES)})")
        return TORCH_DTYPES[name]

    def tensor(self) -> torch.Tensor:
        dtype = self.dtype(self.text())
        shape = self.shape()
        carrier = torch.int16 if dtype == torch.bfloat16 else dtype
        size = torch.empty((), dtype=carrier).element_size()
        raw = self.raw_for(shape, size, f"a tensor of {dtype}")
        try:
            t = torch.frombuffer(bytearray(raw), dtype=carrier) if len(raw) else torch.empty(0, dtype=carrier)
            t = t.reshape(shape)
        except (ValueError, RuntimeError) as exc:  # e.g. an empty tensor of impossible strides
            raise SpoolFormatError(f"a tensor of shape {shape} at byte {self.pos}: {exc}") from None
        return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t

    def record(self, depth: int) -> SpooledRecord:
        rec = SpooledRecord()
        self.charge(ROW_SLOTS, self.pos, "slots for a record")
        self.records.append(rec)  # before its fields: a field may refer back to it
        for _ in range(self.count(5, "record fields")):
            name = self.text()
            if not name.isidentifier() or name.startswith("__"):
                raise SpoolFormatError(f"field name {name!r} at byte {self.pos} is not a plain "
                                       "identifier")
            setattr(rec, name, self.value(depth + 1))
        return rec


def decode(data: bytes | memoryview) -> Any:
    """The value ``encode`` wrote; ``SpoolFormatError`` for anything it could not have written."""
    dec = _Decoder(data)
    value = dec.value()
    if dec.pos != len(dec.data):
        raise SpoolFormatError(f"{len(dec.data) - dec.pos} bytes after the value's end")
    return value
