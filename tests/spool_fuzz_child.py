"""Child process of ``test_bounded_inputs``: mutate spool records and decode them under a memory limit.

What it does: imports the decoder, then caps its own address space (``RLIMIT_AS``: what it has
mapped so far plus ``argv[2]`` MiB), decodes ``argv[1]`` mutations of a few real records (bytes
flipped, lengths and counts set to huge values, bytes inserted, cut, repeated) and the hostile
records of issue 33, and reads a spool file for some of them through ``read_spool`` (the
``InputError`` path). Prints one JSON line: counts by outcome, the first few unexpected
exceptions with their tracebacks, the peak RSS and the wall time. What it deliberately does not
do: judge; the test asserts.
"""
from __future__ import annotations

import json
import random
import resource
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from statescope.capture import spool, spool_format as sf
from statescope.errors import InputError


def _vm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def seeds() -> list[bytes]:
    from types import SimpleNamespace

    ev = [SimpleNamespace(src=i, dest=i + 1, bias=1, hit=None) for i in range(3)]
    item = {"engine_step": 7, "launches": ev, "again": ev[0], "ids": ["a", "b"], "rows": [1, 2, 3],
            "flags": [True, False], "sched": [{"n": 1, "hit": None}, {"n": 2, "hit": None}],
            "bf": torch.ones(2, 3, dtype=torch.bfloat16), "arr": np.arange(12, dtype=np.int32).reshape(3, 4),
            "big": 2**70, "neg": -2**80, "f": 1.5, "b": b"xyz", "none": [None, None, None],
            "t": (1, "x", None), "dt": torch.float16, "empty": np.zeros((0, 5), dtype=np.float32),
            "nested": {"a": [{"k": [1, 2]}, {"k": [3]}]}, "dicts": [{}, {}]}
    return [sf.encode(item), sf.encode({"engine_step": 1, "x": list(range(50))}),
            sf.encode([{"a": i, "b": str(i)} for i in range(20)])]


def hostile() -> list[bytes]:
    u32, u64 = struct.Struct("<I").pack, struct.Struct("<Q").pack
    return [
        b"K" + u32(2**32 - 1) + u32(0),  # 2**32-1 rows, no columns
        b"Q" + u32(2**32 - 1) + u32(0),
        b"n" + u32(2**32 - 1),
        b"l" + u32(2**32 - 1) + b"N",
        b"a" + sf.encode("<f4")[1:] + bytes([2]) + u64(2**50) + u64(12 * 2**50) + u64(0),  # product overflows
        b"a" + sf.encode("<f4")[1:] + bytes([2]) + u64(0) + u64(2**62) + u64(0),
        b"g" + sf.encode("float32")[1:] + bytes([2]) + u64(2**40) + u64(2**40) + u64(0),
        b"I" + sf.encode("--5")[1:], b"I" + sf.encode("\u00b2")[1:], b"I" + sf.encode("9" * 5000)[1:],
        b"d" + u32(2**31),
        b"o" + u32(2**32 - 1),
        b"a" + sf.encode("<f4")[1:] + bytes([200]),
    ]


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(7)
    i = rng.randrange(len(b)) if b else 0
    if kind == 0:
        b[i] ^= 1 << rng.randrange(8)
    elif kind == 1:
        b[i:i + 4] = struct.pack("<I", rng.choice([2**32 - 1, 2**31, 2**16, rng.randrange(2**32)]))
    elif kind == 2:
        b[i:i + 8] = struct.pack("<Q", rng.choice([2**62, 2**63 - 1, 2**64 - 1, 2**40, rng.randrange(2**64)]))
    elif kind == 3:
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
    elif kind == 4:
        del b[i:i + rng.randrange(1, 16)]
    elif kind == 5:
        b[i] = rng.choice(b"NTFiIfsblJjBVnmSZKkQqtdagDorP")
    else:
        j = rng.randrange(len(b)) if b else 0
        b[i:i] = b[j:j + rng.randrange(1, 32)]
    return bytes(b)


def main() -> None:
    n, limit_mib = int(sys.argv[1]), int(sys.argv[2])
    # what the imports already hold (it depends on what the parent's sys.path brings along): the
    # decoder's own peak is measured above it
    baseline_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cap = _vm_bytes() + limit_mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    rng = random.Random(33)
    corpus = seeds()
    outcomes = {"decoded": 0, "refused": 0, "input_error": 0, "unexpected": 0}
    unexpected: list[str] = []
    tmp = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    cases = hostile() + [mutate(rng, mutate(rng, corpus[k % len(corpus)]) if k % 3 == 0 else
                                corpus[k % len(corpus)]) for k in range(n)]
    for k, data in enumerate(cases):
        try:
            if k % 50 == 0:  # through the file reader too: its errors name the file and byte
                (tmp / spool.SPOOL).write_bytes(struct.pack("<Q", len(data)) + data)
                for _ in spool.read_spool(tmp):
                    pass
            else:
                sf.decode(data)
            outcomes["decoded"] += 1
        except sf.SpoolFormatError:
            outcomes["refused"] += 1
        except InputError as exc:
            assert str(tmp) in str(exc) and "byte" in str(exc), exc
            outcomes["input_error"] += 1
        except BaseException as exc:  # noqa: BLE001 - the point: nothing else may escape
            outcomes["unexpected"] += 1
            if len(unexpected) < 5:
                unexpected.append(f"case {k} {data[:64]!r}: " + "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__))[-1500:])
    # the reader's own bound: a header claiming 2**62 bytes is refused before any read
    (tmp / spool.SPOOL).write_bytes(struct.pack("<Q", 2**62) + b"x" * 37)
    try:
        list(spool.read_spool(tmp))
        huge_header = "accepted"
    except InputError as exc:
        huge_header = str(exc)
    print(json.dumps({"cases": len(cases), **outcomes, "examples": unexpected,
                      "huge_header": huge_header, "seconds": round(time.perf_counter() - t0, 2),
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "baseline_rss_mib": baseline_mib,
                      "as_limit_mib": cap / 2**20}))


if __name__ == "__main__":
    main()
