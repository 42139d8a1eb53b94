"""One module per patch; each exports ``PATCH`` (a :class:`~..registry.Patch`),
or ``PATCHES`` when one behaviour needs separate patches per target module
(a patch applies once all its target modules are imported).

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
    "kda_layer_hooks",
    "bytewise_precopy_kernel",
    "multi_connector_layer_copy",
    "hybrid_load_recompute",
    "mamba_external_hit_blocks",
    "weights_digest_during_load",
    "weight_update_namespace",
    "lora_digest_at_load",
)


def all_patches() -> list[Patch]:
    out: list[Patch] = []
    for name in PATCH_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        out.extend(getattr(module, "PATCHES", None) or (module.PATCH,))
    return out
