"""One module per patch; each exports ``PATCH`` (a :class:`~..registry.Patch`).

Importing a patch module must not import vLLM: targets are touched only when
the registry applies the patch, from a post-import hook of the target module.
"""

from __future__ import annotations

import importlib

from ..registry import Patch

#: Module names under this package, in application order.
PATCH_MODULES = (
    "hybrid_block_size",
    "deferred_mamba_precopy",
    "gdn_layer_hooks",
)


def all_patches() -> list[Patch]:
    return [
        importlib.import_module(f"{__name__}.{name}").PATCH for name in PATCH_MODULES
    ]
