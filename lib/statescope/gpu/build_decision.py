"""The GPU build decision: vLLM 0.26.0 vs 0.26.0 + the overlap-safe copy, with a flaky race oracle.

What it does: ``CopyRaceOracle`` is a probe for ``statescope.bisect``: a "request" is one
left-overlapping state copy of a racing shift class (source = destination + shift, as an in-place
conv shift), and a probe of ``n`` requests launches a batch of ``launch_copies`` such copies through
the item's copy function and reports how many of ``n`` randomly chosen ones differ from a memmove of
a pre-launch snapshot — a flaky oracle (a few percent per request), like the reported corruption.
The items are ordered builds: ``0.26.0`` (vLLM's ``batch_memcpy``), ``0.26.0 + overlap-safe``
(``statescope.patches.overlap_safe.overlap_safe_batch_memcpy`` around the same kernel), and a reference
copy (torch clone-then-copy, correct by construction) as the known-good end. ``decide_builds`` runs
``bayesian_bisect`` in find-fix mode over them: the answer is the first build whose failure rate
dropped, with the probes and the posterior; answer = the patched build means "the patch fixes it".
``build_verdicts`` adds per-build counts with Clopper-Pearson intervals. ``decide_on_device`` wires
the three copy functions for the installed vLLM (or a build's ``mamba_utils.py`` under Triton's
interpreter) and returns the decision, the counts and the oracle's log, JSON-able.

What it deliberately does not do: install builds (both builds are the one installed vLLM, with and
without the runtime patch) or probe the fused kernels (the patch does not cover them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from statescope.errors import InputError

BUILDS = ("0.26.0", "0.26.0 + overlap-safe", "reference memmove")


@dataclass
class CopyRaceOracle:
    """``probe(item, n) -> (n, k)`` over ``copy_fns[item]`` (see the module docstring)."""

    copy_fns: dict[str, Callable[[Any, Any, Any], None]]
    shift_bytes: int = 1000
    copy_bytes: int = 4096
    launch_copies: int = 20000
    device: Any = "cuda"
    seed: int = 0
    log: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.shift_bytes <= 0 or self.copy_bytes <= 0 or self.launch_copies <= 0:
            raise InputError(f"CopyRaceOracle: expected positive shift/copy/launch sizes, got "
                             f"{self.shift_bytes}/{self.copy_bytes}/{self.launch_copies}")
        self._calls = 0

    def __call__(self, item: str, n: int) -> tuple[int, int]:
        import torch

        from statescope.gpu.racecheck import slot_bytes

        if item not in self.copy_fns:
            raise InputError(f"CopyRaceOracle: unknown build {item!r}; expected one of {list(self.copy_fns)}")
        self._calls += 1
        k = max(self.launch_copies, n)
        slot = slot_bytes(self.shift_bytes, self.copy_bytes)
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + self._calls)
        buf = torch.randint(0, 256, (k * slot,), dtype=torch.uint8, device=self.device, generator=gen)
        snap = buf.clone()
        dst = buf.data_ptr() + torch.arange(k, dtype=torch.int64, device=self.device) * slot
        sizes = torch.full((k,), self.copy_bytes, dtype=torch.int64, device=self.device)
        register_buffer(buf)
        try:
            self.copy_fns[item](dst + self.shift_bytes, dst, sizes)
        finally:
            clear_buffers()
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        got, want = buf.view(k, slot), snap.view(k, slot).clone()
        want[:, :self.copy_bytes] = snap.view(k, slot)[:, self.shift_bytes:self.shift_bytes + self.copy_bytes]
        bad = (got != want).any(dim=1)
        pick = torch.randperm(k, generator=torch.Generator().manual_seed(self._calls))[:n]
        failures = int(bad.cpu()[pick].sum())
        self.log.append({"call": self._calls, "build": item, "n": n, "k": failures,
                         "launch_copies": k, "launch_corrupted": int(bad.sum())})
        return n, failures


def torch_reference_copy(src_ptrs: Any, dst_ptrs: Any, sizes: Any) -> None:
    """A correct copy for any pointer batch: gathers each source into a scratch tensor first.

    Works on raw addresses through a registered byte buffer (``register_buffer``; the oracle
    registers the one it lays its copies out in), so the scratch is a copy of the span they cover.
    """
    import torch

    lo = int(torch.minimum(src_ptrs.min(), dst_ptrs.min()))
    hi = int(torch.maximum((src_ptrs + sizes).max(), (dst_ptrs + sizes).max()))
    span = _byte_view(lo, hi - lo, src_ptrs.device)
    scratch = span.clone()  # every source byte read before any destination byte is written
    offs = torch.arange(int(sizes.max()), device=span.device)
    keep = (offs[None, :] < sizes[:, None]).flatten()
    idx_src = ((src_ptrs - lo)[:, None] + offs[None, :]).flatten()[keep]
    idx_dst = ((dst_ptrs - lo)[:, None] + offs[None, :]).flatten()[keep]
    span[idx_dst] = scratch[idx_src]


_views: dict[int, Any] = {}


def register_buffer(buf: Any) -> None:
    """Make ``buf``'s bytes addressable by ``torch_reference_copy`` (the oracle registers its own)."""
    _views[buf.data_ptr()] = buf


def clear_buffers() -> None:
    _views.clear()


def _byte_view(addr: int, nbytes: int, device: Any) -> Any:
    for start, buf in _views.items():
        if start <= addr and addr + nbytes <= start + buf.numel():
            return buf[addr - start: addr - start + nbytes]
    raise InputError(f"torch_reference_copy: address {addr:#x} (+{nbytes}) is not in a registered buffer")


def decide_builds(oracle: Callable[[str, int], tuple[int, int]], *, builds: tuple = BUILDS,
                  requests_per_probe: int = 50, budget: int = 5000, confidence: float = 0.99,
                  bad_rate_min: float = 0.002) -> Any:
    """``bayesian_bisect`` in find-fix mode over the ordered builds; returns its ``BisectResult``.

    Like every bisection it takes the first build to be before the change (bad) and the last after
    it (good); ``build_verdicts`` on the oracle's log is the evidence for each build separately."""
    from statescope.bisect import RatePrior, bayesian_bisect

    return bayesian_bisect(list(builds), oracle, mode="fix", requests_per_probe=requests_per_probe,
                           budget=budget, confidence=confidence,
                           prior=RatePrior(bad_rate_min=bad_rate_min))


def build_verdicts(log: list[dict]) -> list[dict]:
    """Per build: requests, failures, rate and 95% Clopper-Pearson interval, from the oracle's log."""
    from statescope.verdict.stats import clopper_pearson

    out = []
    for build in dict.fromkeys(r["build"] for r in log):
        n = sum(r["n"] for r in log if r["build"] == build)
        k = sum(r["k"] for r in log if r["build"] == build)
        lo, hi = clopper_pearson(k, n)
        out.append({"build": build, "probes": sum(r["build"] == build for r in log), "requests": n,
                    "failures": k, "rate": k / n if n else None, "ci_lo": lo, "ci_hi": hi})
    return out


def decide_on_device(device: str = "cuda", shift_bytes: int = 576, launch_copies: int = 20000,
                     kernel_source: str | None = None) -> dict:
    """The decision for the installed vLLM's ``batch_memcpy`` on ``device`` ("cuda"), or for the
    kernel of ``kernel_source`` (a build's ``mamba_utils.py``) under Triton's interpreter: the
    bisection, the per-build counts and the oracle's log, JSON-able."""
    import functools

    from statescope.patches.overlap_safe import overlap_safe_batch_memcpy

    if device == "cuda" and kernel_source is None:
        from vllm.v1.worker import mamba_utils

        raw = mamba_utils.batch_memcpy
    else:
        from statescope.gpu.racecheck import load_kernel_source

        if kernel_source is None:
            raise InputError(f"decide_on_device: device {device!r} needs a kernel_source (a build's mamba_utils.py)")
        m = load_kernel_source(kernel_source)

        def raw(src: Any, dst: Any, sizes: Any) -> None:
            m.batch_memcpy_kernel[(len(sizes),)](src, dst, sizes, BLOCK_SIZE=1024)
    fns = {BUILDS[0]: raw, BUILDS[1]: functools.partial(overlap_safe_batch_memcpy, kernel=raw),
           BUILDS[2]: torch_reference_copy}
    oracle = CopyRaceOracle(fns, shift_bytes=shift_bytes, launch_copies=launch_copies, device=device)
    result = decide_builds(oracle, requests_per_probe=50, budget=5000)
    return {"shift_bytes": shift_bytes, "copy_bytes": oracle.copy_bytes, "launch_copies": launch_copies,
            "bisect": result.to_dict(), "per_build": build_verdicts(oracle.log), "oracle_log": oracle.log}
