"""Copy-for-copy agreement: statescope's CPU align-mode kernels vs a build's own Triton kernels.

What it does: ``make_case`` builds one launch's inputs from a seed and a ``KernelGeometry``: per layer
a conv state and a recurrent state (random bytes, padded page strides, SD or DS conv layout), one
int32 block table in which every request owns its own blocks, and random decision inputs (computed,
scheduled, drafts, accepted, running column) that cover "no copy", copies between blocks and the
in-place conv shift (source and destination in one block, bias > 0). ``run_case`` launches the same
inputs through ``postprocess_mamba_fused_kernel`` (or ``precopy_mamba_align_fused_kernel``) of a
build — on the GPU for real, or under Triton's interpreter on the CPU — and through
``statescope.patches.cpu_kernels`` on CPU copies, then compares every state byte and the accepted-count
output, and lists each copy the CPU side made with whether the build's bytes match it.
``agreement_table`` runs many cases and summarises per geometry, kernel and copy kind;
``agreement_on_device`` runs it for the installed vLLM on a GPU, or for a build's ``mamba_utils.py``
under Triton's interpreter (the device job's part and its CPU shake-out).

Adapter (the seam): ``statescope.patches.cpu_kernels`` is written against vLLM 0.28.0's parameter list;
0.26.0's kernels lack ``TEMPORAL_TILES`` (and its pre-copy lacks ``HAS_IDX_MAPPING``), so the two
sides are called with the shared positional arguments and only the keywords each one declares.
Nothing in ``cpu_kernels`` is changed or monkeypatched.

What it deliberately does not do: run a model, or explain a mismatch beyond classifying it (an
in-place shift that differs from a memmove is the H-copy race; ``docs/gpu.md`` discusses the rest).
"""
from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Any

from statescope.errors import InputError

KINDS = ("postprocess", "precopy")


@dataclass(frozen=True)
class KernelGeometry:
    """One model geometry as the fused kernels see it (per TP rank)."""

    name: str
    conv_dim: int
    dtype_bytes: int = 2
    conv_kernel: int = 4
    num_spec_tokens: int = 2
    ssm_bytes: int = 2 * 16 * 16 * 4  # recurrent state per block (kept small: content is irrelevant)
    layers: int = 2
    layout: str = "SD"
    block_size: int = 16
    page_pad: int = 128  # extra bytes per block: the runner's padded page strides

    @property
    def state_len(self) -> int:
        return self.conv_kernel - 1 + self.num_spec_tokens

    @property
    def row_bytes(self) -> int:
        return self.conv_dim * self.dtype_bytes


GEOMETRIES = {
    "tiny": KernelGeometry("tiny (conv 512, 1024 B rows)", 512),
    "tiny_ds": KernelGeometry("tiny, DS layout", 512, layout="DS"),
    "race_variant": KernelGeometry("head dim 96 (conv 288, 576 B rows)", 288),
    "qwen35_27b_tp4": KernelGeometry("Qwen3.5-27B TP4 (conv 2560, 5120 B rows)", 2560, layers=1),
}


def _rng_ints(gen: Any, lo: int, hi: int, n: int) -> Any:
    import torch

    return torch.randint(lo, hi, (n,), generator=gen, dtype=torch.int32)


def make_case(geo: KernelGeometry, n_reqs: int, seed: int, kind: str = "postprocess",
              cols: int = 6) -> dict:
    """CPU tensors for one launch (raw byte buffers for the states; see the module docstring)."""
    import torch

    if kind not in KINDS:
        raise InputError(f"make_case kind={kind!r}: expected one of {KINDS}")
    if geo.layout not in ("SD", "DS"):
        raise InputError(f"KernelGeometry.layout={geo.layout!r}: expected 'SD' or 'DS'")
    gen = torch.Generator().manual_seed(seed)
    bs, k = geo.block_size, geo.num_spec_tokens
    conv_bytes = geo.state_len * geo.row_bytes
    strides = [conv_bytes + geo.page_pad, geo.ssm_bytes + geo.page_pad]
    n_blocks = 1 + n_reqs * cols  # block 0 is the null block
    states = [torch.randint(0, 256, (n_blocks * strides[i % 2],), generator=gen, dtype=torch.uint8)
              for i in range(2 * geo.layers)]
    table = torch.zeros((n_reqs, cols + 2), dtype=torch.int32)
    table[:, :cols] = 1 + torch.arange(n_reqs * cols, dtype=torch.int32).view(n_reqs, cols)
    drafts = _rng_ints(gen, 0, k + 1, n_reqs)
    accepted = (torch.rand(n_reqs, generator=gen) * (drafts + 1).float()).int() + 1
    case = {"geometry": asdict(geo), "kind": kind, "seed": seed, "n_reqs": n_reqs, "states": states,
            "strides": strides, "table": table}
    if kind == "postprocess":
        prefill = torch.rand(n_reqs, generator=gen) < 0.2
        scheduled = torch.where(prefill, _rng_ints(gen, 1, bs, n_reqs), 1 + drafts)
        drafts = torch.where(prefill, torch.zeros_like(drafts), drafts)
        accepted = torch.where(prefill, torch.ones_like(accepted), accepted)
        # Running states just before a block boundary (0..k+1 tokens short), so that most requests
        # cross it: no copy, a copy between blocks and the in-place shift all occur.
        running = bs * _rng_ints(gen, 1, 3, n_reqs) - _rng_ints(gen, 0, k + 2, n_reqs)
        computed = running - scheduled + drafts
        # The running column: the block holding the running state; sometimes one earlier.
        col = torch.clamp((running - 1) // bs - (torch.rand(n_reqs, generator=gen) < 0.2).int(), min=0)
        case.update(accepted=accepted, state_idx=col.int(), scheduled=scheduled.int(),
                    computed=computed, drafts=drafts.int())
    else:
        src = _rng_ints(gen, -1, cols - k - 1, n_reqs)
        step = _rng_ints(gen, 0, 2, n_reqs)  # 0: same column (no copy), 1: next column
        case.update(dst_col=torch.clamp(src + step, min=0).int(), src_col=src,
                    bias=(accepted - 1).int(), idx_mapping=torch.arange(n_reqs, dtype=torch.int32))
    return case


def _layout_args(case: dict, states: list, table: Any, device: Any) -> list:
    import torch

    geo = KernelGeometry(**case["geometry"])
    n = len(states)
    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    conv = [i % 2 == 0 for i in range(n)]
    inner = [geo.conv_dim if c else geo.ssm_bytes // 4 for c in conv]
    elem = [geo.dtype_bytes if c else 4 for c in conv]
    ds = geo.layout == "DS"
    return [torch.tensor([table.data_ptr()], **i64), table.stride(0),
            torch.tensor([s.data_ptr() for s in states], **i64),
            torch.tensor([case["strides"][i % 2] for i in range(n)], **i64),
            torch.tensor(elem, **i32), torch.tensor(inner, **i64),
            torch.tensor([geo.state_len if c else 0 for c in conv], **i32),
            torch.tensor([0] * n, **i32),
            torch.tensor([geo.conv_dim if (c and ds) else 0 for c in conv], **i32),
            torch.tensor([geo.state_len * geo.dtype_bytes if (c and ds) else 0 for c in conv], **i64)]


def _launch(kernel: Any, case: dict, states: list, table: Any, acc_out: Any, device: Any,
            has_idx_mapping: bool) -> None:
    """One launch through ``kernel`` (a Triton JITFunction or a ``cpu_kernels.CpuKernel``)."""
    geo = KernelGeometry(**case["geometry"])
    t = {k: v.to(device, copy=True) for k, v in case.items()
         if k in ("accepted", "state_idx", "scheduled", "computed", "drafts", "dst_col", "src_col",
                  "bias", "idx_mapping")}
    lay = _layout_args(case, states, table, device)
    target = getattr(kernel, "fn", None) or getattr(kernel, "impl", None)
    params = set(inspect.signature(target).parameters)
    grid = (case["n_reqs"], len(states))
    kw = {"COPY_BLOCK_SIZE": 1024, "CONV_STATE_DIM_FIRST": geo.layout == "DS"}
    if case["kind"] == "postprocess":
        import torch

        idx = torch.arange(case["n_reqs"], dtype=torch.int32, device=device) if has_idx_mapping else None
        if "HAS_IDX_MAPPING" in params:
            kw["HAS_IDX_MAPPING"] = has_idx_mapping
        kernel[grid](t["accepted"], t["state_idx"], t["scheduled"], t["computed"], t["drafts"], *lay,
                     acc_out, idx, case["n_reqs"], block_size=geo.block_size, **kw)
    else:
        if "HAS_IDX_MAPPING" in params:
            kw["HAS_IDX_MAPPING"] = True
        kernel[grid](t["dst_col"], t["src_col"], t["bias"], *lay, t["idx_mapping"], case["n_reqs"], **kw)
    return t


def _cpu_side(case: dict, has_idx_mapping: bool) -> tuple[list, Any, Any, list]:
    from statescope.patches import cpu_kernels

    states = [s.clone() for s in case["states"]]
    table = case["table"].clone()
    for i, s in enumerate(states):
        cpu_kernels.register_tensor(s, f"state{i}")
    cpu_kernels.register_tensor(table)
    acc_out = case["accepted"].clone() if case["kind"] == "postprocess" else None
    events: list = []
    cpu_kernels.add_copy_listener(events.append)
    try:
        kernel = (cpu_kernels.postprocess_mamba_fused_kernel if case["kind"] == "postprocess"
                  else cpu_kernels.precopy_mamba_align_fused_kernel)
        t = _launch(kernel, case, states, table, acc_out, "cpu", has_idx_mapping)
    finally:
        cpu_kernels.remove_copy_listener(events.append)
    acc = t["accepted"] if case["kind"] == "postprocess" else None
    return states, acc_out, acc, events


def run_case(case: dict, module: Any, device: Any = "cuda", has_idx_mapping: bool = False) -> dict:
    """Launch ``case`` through ``module``'s kernel on ``device`` and through the CPU stand-in; compare."""
    import torch

    name = "postprocess_mamba_fused_kernel" if case["kind"] == "postprocess" else \
        "precopy_mamba_align_fused_kernel"
    kernel = getattr(module, name, None)
    if kernel is None:
        raise InputError(f"{module!r}: expected a {name} kernel in it")
    states = [s.to(device, copy=True) for s in case["states"]]  # copy: the CPU side needs the originals
    table = case["table"].to(device, copy=True)
    acc_out = case["accepted"].clone().to(device) if case["kind"] == "postprocess" else None
    if hasattr(kernel, "impl"):  # a CPU stand-in as the "build" (tests): make its bytes addressable
        from statescope.patches import cpu_kernels

        for i, s in enumerate(states):
            cpu_kernels.register_tensor(s, f"build state{i}")
        cpu_kernels.register_tensor(table)
    t = _launch(kernel, case, states, table, acc_out, device, has_idx_mapping)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    got = [s.cpu() for s in states]
    cpu_states, cpu_acc_out, cpu_acc_in, events = _cpu_side(case, has_idx_mapping)
    copies = []
    for e in events:
        s = e.state_index
        off, n = e.dst_offset, e.nbytes
        rows = max(1, e.rows)
        same = all(bool((got[s][off + r * e.row_stride: off + r * e.row_stride + n]
                         == cpu_states[s][off + r * e.row_stride: off + r * e.row_stride + n]).all())
                   for r in range(rows)) if n else True
        copies.append({"req": e.batch_row, "state": s, "kind": e.state_kind, "in_place": e.in_place_shift,
                       "src_col": e.src_col, "dst_col": e.dst_col, "bias": e.bias, "nbytes": n * rows,
                       "match": same})
    out = {"kind": case["kind"], "seed": case["seed"], "n_reqs": case["n_reqs"],
           "has_idx_mapping": has_idx_mapping, "copies": copies,
           "states_equal": [bool((g == c).all()) for g, c in zip(got, cpu_states)]}
    if case["kind"] == "postprocess":
        out["accepted_out_equal"] = bool((acc_out.cpu() == cpu_acc_out).all())
        out["accepted_in_equal"] = bool((t["accepted"].cpu() == cpu_acc_in).all())
    return out


def summarize_case(result: dict) -> dict:
    """Counts of one ``run_case`` result: copies by kind and how many bytes-mismatched."""
    c = result["copies"]
    by = lambda pred: [x for x in c if pred(x)]  # noqa: E731
    kinds = {"conv_in_place": by(lambda x: x["kind"] == "conv" and x["in_place"]),
             "conv_between_blocks": by(lambda x: x["kind"] == "conv" and not x["in_place"]),
             "ssm": by(lambda x: x["kind"] == "ssm")}
    row = {f"{k}_copies": len(v) for k, v in kinds.items()}
    row.update({f"{k}_mismatch": sum(not x["match"] for x in v) for k, v in kinds.items()})
    row["states_mismatch"] = sum(not x for x in result["states_equal"])
    for key in ("accepted_out_equal", "accepted_in_equal"):
        if key in result:
            row[key] = result[key]
    return row


def agreement_table(module: Any, device: Any = "cuda", *, geometries: dict | None = None,
                    cases: int = 20, n_reqs: int = 64, seed: int = 0) -> list[dict]:
    """One row per (geometry, kernel, idx-mapping variant): summed ``summarize_case`` counts."""
    rows = []
    for key, geo in (geometries or GEOMETRIES).items():
        variants = [("postprocess", False), ("precopy", True)] + \
            ([("postprocess", True)] if key == "tiny" else [])
        for kind, mapping in variants:
            total: dict = {"geometry": key, "kernel": kind, "has_idx_mapping": mapping, "cases": cases,
                           "row_bytes": geo.row_bytes, "layout": geo.layout}
            for i in range(cases):
                res = summarize_case(run_case(make_case(geo, n_reqs, seed + i, kind), module, device,
                                              mapping))
                for k, v in res.items():
                    if isinstance(v, bool):  # per-case equality flags become mismatch counts
                        k, v = k.replace("_equal", "_mismatch_cases"), int(not v)
                    total[k] = total.get(k, 0) + v
            rows.append(total)
    return rows


def agreement_on_device(device: str = "cuda", cases: int = 20, kernel_source: str | None = None) -> dict:
    """``{"rows": agreement_table(...)}`` for the installed vLLM's kernels on ``device`` ("cuda"),
    or for ``kernel_source`` (another build's ``mamba_utils.py``) under Triton's interpreter on the
    CPU (a shake-out: 8 requests a case)."""
    if device == "cuda" and kernel_source is None:
        from vllm.v1.worker import mamba_utils as module
    else:
        from statescope.gpu.racecheck import load_kernel_source

        if kernel_source is None:
            raise InputError(f"agreement_on_device: device {device!r} needs a kernel_source (a build's mamba_utils.py)")
        module = load_kernel_source(kernel_source)
    return {"rows": agreement_table(module, device, cases=cases, n_reqs=64 if device == "cuda" else 8)}
