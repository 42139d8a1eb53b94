"""What the interpreter-start hook runs (``vllm_layerwise_patch.pth`` and the
opt-in ``sitecustomize``).  The ``.pth`` line itself only reads two
environment variables, so with the overlay off this module is never imported.

It must never break Python start-up: any error is printed as one line on
stderr and the interpreter carries on without the overlay.
"""

from __future__ import annotations

import os
import sys

from .envvars import CPU_TORCH_PRECOPY_ENV, CPU_TORCH_ZEROING_ENV, CPU_V2_ENV, ENV, flag, is_off

# site may process the same site-packages twice (a venv's lib64 -> lib link):
# boot once per process.
_booted = False


def boot() -> None:
    global _booted
    if _booted:
        return
    _booted = True
    try:
        if flag(CPU_V2_ENV):
            from .cpu_emulation.cpu_v2 import install_cpu_v2_shim

            install_cpu_v2_shim()
            if flag(CPU_TORCH_PRECOPY_ENV):
                from .cpu_emulation.torch_postprocess import install_on_import as install_post
                from .cpu_emulation.torch_precopy_install import install_on_import

                install_on_import()
                install_post()
            if flag(CPU_TORCH_ZEROING_ENV):
                from .cpu_emulation.torch_zeroing import install_on_import as install_zeroing

                install_zeroing()
        else:
            for name in (CPU_TORCH_PRECOPY_ENV, CPU_TORCH_ZEROING_ENV):
                if flag(name):
                    print(f"vllm-layerwise-patch: {name} ignored: it needs "
                          f"{CPU_V2_ENV}=1 (the CPU emulation)", file=sys.stderr)
        if not is_off(os.environ.get(ENV)):
            from .activation import activate

            activate()
    except Exception as exc:  # never break interpreter start
        print(
            f"vllm-layerwise-patch: bootstrap disabled in this process: "
            f"{type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
