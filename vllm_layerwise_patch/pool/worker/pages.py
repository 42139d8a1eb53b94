"""This worker's KV pages: its tensor-parallel rank and the raw per-layer
allocations vLLM registered, in forward order.  The loads and the saves
both address pages through it."""

from __future__ import annotations

import torch

from ..layout import PoolLayout


class RankPages:
    def __init__(self, layout: PoolLayout, tp_rank: int) -> None:
        self.layout = layout
        self.tp_rank = tp_rank
        self.group = layout.layer_group  # layer -> KV cache group
        self.kind = layout.layer_kind  # layer -> ATTN or STATE
        self.caches: dict[str, torch.Tensor] = {}
        self.order: list[str] = []  # the pool's layers here, in forward order
        self.device: torch.device | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.caches = {n: t for n, t in kv_caches.items() if n in self.group}
        self.order = [n for n in self.layout.order if n in self.caches]
        for name in self.order:  # fail at startup, not mid-request
            page = self.caches[name][0]
            if not page.is_contiguous():
                raise ValueError(f"layer {name}: a page is not contiguous "
                                 f"(shape {tuple(page.shape)}, stride {page.stride()})")
        self.device = next(iter(self.caches.values())).device if self.caches else None

    def page(self, layer: str, block_id: int) -> torch.Tensor:
        """The bytes of one (layer, block) page: the raw per-layer allocation V2
        hands over is a page array (attention K/V, or conv then ssm state)."""
        return self.caches[layer][block_id].reshape(-1).view(torch.uint8)
