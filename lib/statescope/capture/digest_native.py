"""The CPU digest kernel: one pass over each selected state block where it lies, in C (ctypes).

What it does: ``native_kernel()`` compiles (once per host, into a private temp folder) and loads
a small C function that reads every selected block once — contiguous float32 or bfloat16, any
block stride — and writes per block the float sum, sum of squares and ``k`` bilinear projections
(``statescope.capture.digest`` defines them), the word-sum checksum and the position-keyed word
hash (``statescope.capture.word_hash``), and optionally the same two exact numbers and the float
sum per matrix row (the token rows of an SD conv window). It releases the GIL (ctypes).

What it deliberately does not do: choose blocks, count NaN/Inf (the caller does, in the rare
flagged block), or run anywhere but on host memory.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("statescope.capture.digest")
ENV_NATIVE = "STATESCOPE_DIGEST_NATIVE"  # "0": always use the torch reductions

_NATIVE_SRC = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
/* One pass over each selected block, a rows x cols matrix (contiguous, float32 or bfloat16):
   per-column float accumulators of the sum, the sum of squares and the k row-weighted sums
   u_j . X, per-column uint32 sums of the raw words (the checksum), combined in double; per row
   the sum of the hash terms fmix32(word ^ key[c]) (statescope.capture.word_hash). */
static void acc_row(const float *restrict a, int64_t cols, int64_t k, const float *restrict wu,
                    float *restrict s0, float *restrict sq, float *restrict pj) {
  if (k == 3) {  /* the default: every accumulator in one loop */
    float *restrict p0 = pj, *restrict p1 = pj + cols, *restrict p2 = pj + 2 * cols;
    for (int64_t c = 0; c < cols; ++c) { float x = a[c]; s0[c] += x; sq[c] += x * x;
      p0[c] += wu[0] * x; p1[c] += wu[1] * x; p2[c] += wu[2] * x; }
    return;
  }
  for (int64_t c = 0; c < cols; ++c) { s0[c] += a[c]; sq[c] += a[c] * a[c]; }
  for (int64_t j = 0; j < k; ++j)
    for (int64_t c = 0; c < cols; ++c) pj[j * cols + c] += wu[j] * a[c];
}

static inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16; return h;
}

/* checksum words: int16 sign-extended, as torch's int32 sum of them does; hash words: the raw
   bits zero-extended. Returns the row's word sum, and its hash-term sum in *th. */
static uint32_t words32(const uint32_t *restrict row, int64_t cols, const uint32_t *restrict key,
                        uint32_t *restrict ck, uint32_t *restrict th) {
  uint32_t total = 0, h = 0;
  for (int64_t c = 0; c < cols; ++c) { uint32_t w = row[c]; ck[c] += w; total += w;
#ifndef STATESCOPE_NO_HASH
    h += fmix32(w ^ key[c]);
#endif
  }
  *th = h;
  return total;
}

static uint32_t words16(const uint16_t *restrict row, int64_t cols, const uint32_t *restrict key,
                        uint32_t *restrict ck, uint32_t *restrict th) {
  uint32_t total = 0, h = 0;
  for (int64_t c = 0; c < cols; ++c) { uint32_t raw = row[c];
    uint32_t w = (uint32_t)(int32_t)(int16_t)row[c]; ck[c] += w; total += w;
#ifndef STATESCOPE_NO_HASH
    h += fmix32(raw ^ key[c]);
#else
    (void)raw;
#endif
  }
  *th = h;
  return total;
}

int statescope_digest(const int64_t *bases, const int64_t *strides, const int64_t *ids,
                      int64_t layers, int64_t reqs, int64_t rows, int64_t cols, int64_t elem,
                      int64_t k, const float *u, const float *v, float *stats, int64_t *check,
                      int64_t *hash, int64_t *row_check, int64_t *row_hash, float *row_sum) {
  size_t n_acc = (size_t)(cols * (k + 3) + k + cols);
  float *acc = malloc(sizeof(float) * n_acc + sizeof(uint32_t) * (size_t)cols);
  if (!acc) return 1;
  float *s0 = acc, *sq = s0 + cols, *tmp = sq + cols, *pj = tmp + cols, *wu = pj + k * cols;
  uint32_t *ck = (uint32_t *)(wu + k);
  uint32_t *key = ck + cols;
  for (int64_t c = 0; c < cols; ++c) key[c] = (uint32_t)(c + 1) * 0x9e3779b1u;
  for (int64_t b = 0; b < layers * reqs; ++b) {
    const char *x = (const char *)bases[b / reqs] + ids[b] * strides[b / reqs];
    memset(acc, 0, sizeof(float) * n_acc);
    uint32_t block_hash = 0;
    for (int64_t m = 0; m < rows; ++m) {
      const char *row = x + m * cols * elem;
      const float *a = (const float *)row;
      uint32_t rc, th;
      if (elem == 2) { const uint16_t *h = (const uint16_t *)row;  /* bf16: the high half */
        for (int64_t c = 0; c < cols; ++c) {
          uint32_t bits = (uint32_t)h[c] << 16; memcpy(tmp + c, &bits, 4); }
        a = tmp;
        rc = words16(h, cols, key, ck, &th);
      } else {
        rc = words32((const uint32_t *)row, cols, key, ck, &th);
      }
      for (int64_t j = 0; j < k; ++j) wu[j] = u[j * rows + m];
      acc_row(a, cols, k, wu, s0, sq, pj);
      block_hash += (fmix32((uint32_t)m) | 1u) * th;
      if (row_check) { double s = 0; for (int64_t c = 0; c < cols; ++c) s += a[c];
        row_check[b * rows + m] = (int32_t)rc; row_hash[b * rows + m] = (int32_t)th;
        row_sum[b * rows + m] = (float)s; }
    }
    double sum = 0, sumsq = 0; uint32_t total = 0;
    for (int64_t c = 0; c < cols; ++c) { sum += s0[c]; sumsq += sq[c]; total += ck[c]; }
    float *out = stats + b * (2 + k);
    out[0] = (float)sum; out[1] = (float)sumsq; check[b] = (int32_t)total;
    hash[b] = (int32_t)block_hash;
    for (int64_t j = 0; j < k; ++j) { double p = 0;
      for (int64_t c = 0; c < cols; ++c) p += (double)pj[j * cols + c] * v[j * cols + c];
      out[2 + j] = (float)p; }
  }
  free(acc);
  return 0;
}
"""
_NATIVE_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC") + (
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ())
_native: list = []  # [the kernel, or None when it cannot be built here]


def native_kernel() -> Any:
    """The C digest kernel (ctypes; it releases the GIL), compiled once per host into the temp
    directory; None where no C compiler works or ``STATESCOPE_DIGEST_NATIVE=0``."""
    if not _native:
        _native.append(build_kernel() if os.environ.get(ENV_NATIVE, "1") != "0" else None)
    return _native[0]


def build_kernel(defines: tuple[str, ...] = ()) -> Any:
    """Compile (once per source, flags and host) and load the kernel; None where it cannot be
    built. ``defines``: e.g. ``("STATESCOPE_NO_HASH",)`` builds it without the word hash — the
    digest as it was before the hash, for ``benchmarks/bench_digest_hash.py`` to compare."""
    flags = _NATIVE_FLAGS + tuple(f"-D{d}" for d in defines)
    fn = None
    try:
        key = hashlib.sha256((_NATIVE_SRC + str(flags) + platform.node())
                             .encode()).hexdigest()[:16]
        # a private folder per user: a library others could write is never loaded
        folder = Path(tempfile.gettempdir()) / f"statescope-native-{os.getuid()}"
        folder.mkdir(mode=0o700, exist_ok=True)
        if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o022:
            raise PermissionError(f"{folder} is not private to this user")
        lib = folder / f"digest-{key}.so"
        if not lib.exists():  # build under a private name, publish atomically
            src = folder / f"digest-{key}-{os.getpid()}.c"
            src.write_text(_NATIVE_SRC)
            tmp = src.with_suffix(".so")
            subprocess.run(["cc", *flags, "-o", str(tmp), str(src)], check=True,
                           capture_output=True, timeout=120)
            os.replace(tmp, lib)
            src.unlink()
        fn = ctypes.CDLL(str(lib)).statescope_digest
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 8
    except Exception as exc:  # no compiler, sandbox, ...: the torch reductions still work
        log.info("statescope digest: native kernel unavailable (%s); using torch", exc)
        fn = None
    return fn
