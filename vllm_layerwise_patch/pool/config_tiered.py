"""``kv_connector_extra_config.tiered``: the policy of the tiered backend
(``backend: "tiered"``, :mod:`.backends.tiered`) - an embedded LMDB pool as
the near tier (configured as for ``backend: "lmdb"``: ``path``,
``capacity``, ``shared_group``, ``preallocate``) in front of Mooncake Store
as the far tier (the ``mooncake`` section).  Kept apart from
:mod:`.config` so the tiered fields are one small block there."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TieredConfig(BaseModel):
    """``kv_connector_extra_config.tiered``: the near tier's policy."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    promote: bool = Field(
        default=True,
        description="a hit found only in the far tier (Mooncake) is copied into the near "
                    "tier (LMDB) once read, in the background and off the load's path: "
                    "whole blocks only, each value checked (length, checksum, namespace, "
                    "key) and written with its commit marker in one transaction, so the "
                    "next hit of that block is read from the near tier; `false`: the near "
                    "tier holds only what engines using it saved")
    near_saves: Literal["hot", "cold", "off"] = Field(
        default="hot",
        description="what a save writes into the near tier (every save goes to the far tier "
                    "first, so the near tier may drop anything): `hot`, the saved blocks as "
                    "its most recently used (a near tier larger than the engines' HBM prefix "
                    "caches); `cold`, as its least recently used - evicted before any block "
                    "read since (looked up, loaded or promoted), so a near tier smaller than "
                    "the HBM caches, which hold what was just saved, keeps the blocks that "
                    "came back; `off`, none (the near tier holds promoted far-tier hits)")
    promote_after_far_hits: int = Field(
        default=1, ge=1, le=16,
        description="promote a block on its this-many-th far-tier hit seen by the promoting "
                    "side (counted per block among the most recent 65536); `1`: on the "
                    "first. Higher keeps blocks read once from churning a near tier much "
                    "smaller than the working set")
    promote_pending_blocks: int = Field(
        default=64, ge=1, le=65536,
        description="blocks (of one kind and rank) whose far-tier values a process keeps "
                    "in memory at most while they wait for their pages (a load reads a "
                    "block's layers one at a time), and as many waiting for their write "
                    "into the near tier (in the background); past it, blocks are not "
                    "promoted (counted: `promotions_dropped`) and stay far-tier hits")

    @classmethod
    def markdown_table(cls) -> str:
        """docs/configuration.md's table of these fields (scripts/render_readme.py)."""
        from vllm_layerwise_patch.pool.config_doc import table

        return table(cls, "kv_connector_extra_config.tiered")
