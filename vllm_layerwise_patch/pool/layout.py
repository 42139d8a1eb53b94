"""The pool's view of vLLM's KV cache layout, built once from vLLM's config and
shared by the scheduler and the worker sides, so they cannot disagree.

* **groups**: each KV cache group is ``attn`` (attention K/V pages) or
  ``state`` (a linear-attention group: conv + ssm state pages); the layer
  names of each group and their forward order.
* **pool block**: every group's block size (vLLM aligns them for hybrid
  models, 640 tokens for the tiny test model); one page per (layer, block).
* **hash granularity**: vLLM computes ``request.block_hashes`` every
  ``hash_block_size`` tokens - ``cache_config.prefix_match_unit`` when set (its
  option for finer hybrid hits), else the gcd of the groups' block sizes.
  Each hash chains the whole prefix.  Pool block ``i`` is named by the hash
  that covers exactly tokens ``[0, (i+1)*block)``: the hash at that block's
  last unit, ``hashes[(i+1)*r - 1]`` with ``r = block // hash_block_size``.
  Reading ``hashes[i]`` instead would serve another prompt's pages as soon as
  the unit is finer than the block.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from .config import PoolConfigError
from .keys import (ATTN, MAX_ROUTE_SPAN, ROUTE_BYTES, STATE, block_name, check_unique_ids,
                   forward_order, layer_id)


def _group_spec(group: Any) -> Any:
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if isinstance(inner, dict) and inner:
        return next(iter(inner.values()))
    return spec


def _kind(spec: Any) -> str:
    from vllm.v1.kv_cache_interface import MambaSpec

    return STATE if isinstance(spec, MambaSpec) else ATTN


def resolve_hash_block_size(vllm_config: Any, kv_cache_config: Any, block_size: int) -> int:
    """Tokens per ``request.block_hashes`` entry, where this vLLM keeps it:
    ``KVCacheConfig.hash_block_size`` (set by the engine core on the configs
    of the scheduler and the workers, 0.32+), else vLLM's own resolver, else
    (releases without finer prefix hashing) the block size."""
    hbs = getattr(kv_cache_config, "hash_block_size", None)
    if hbs is None:
        try:
            from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        except ImportError:
            resolve_kv_cache_block_sizes = None
        if resolve_kv_cache_block_sizes is not None:
            _, hbs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    unit = getattr(vllm_config.cache_config, "prefix_match_unit", None)
    if hbs is None:
        if unit not in (None, block_size):
            raise PoolConfigError(
                f"cache_config.prefix_match_unit={unit}: this vLLM does not say at "
                "which granularity it hashes prefixes, so pool keys cannot be "
                "mapped; unset prefix_match_unit")
        hbs = block_size
    hbs = int(hbs)
    if hbs <= 0 or block_size % hbs:
        raise PoolConfigError(
            f"cache_config.prefix_match_unit={unit}: prefix hashes every {hbs} tokens "
            f"do not divide the pool block of {block_size} tokens, so a block's "
            "hash cannot be named; choose a divisor of the block size")
    return hbs


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    kinds: tuple[str, ...]  # per KV cache group
    group_layers: tuple[tuple[str, ...], ...]  # layer names per group
    block_size: int  # tokens per pool block (every group's block size)
    hash_block_size: int  # tokens per request.block_hashes entry
    tp_size: int = 1
    pp_size: int = 1
    page_bytes: int = 0  # the largest page of any group (an upper bound for reads)

    def __post_init__(self) -> None:
        check_unique_ids(n for names in self.group_layers for n in names)
        if self.block_size % self.hash_block_size:
            raise ValueError("hash_block_size must divide block_size")

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any) -> PoolLayout:
        specs = [_group_spec(g) for g in kv_cache_config.kv_cache_groups]
        sizes = sorted({int(s.block_size) for s in specs})
        if len(sizes) != 1:
            raise PoolConfigError(
                f"LayerwisePoolConnector: KV cache groups use block sizes {sizes}; "
                "the pool needs one block size for every group (hybrid alignment)")
        block = sizes[0]
        pc = vllm_config.parallel_config
        try:
            return cls(kinds=tuple(_kind(s) for s in specs),
                       group_layers=tuple(tuple(g.layer_names)
                                          for g in kv_cache_config.kv_cache_groups),
                       block_size=block,
                       hash_block_size=resolve_hash_block_size(vllm_config, kv_cache_config,
                                                               block),
                       tp_size=int(pc.tensor_parallel_size),
                       pp_size=int(pc.pipeline_parallel_size),
                       page_bytes=max(int(s.page_size_bytes) for s in specs))
        except ValueError as exc:
            if isinstance(exc, PoolConfigError):
                raise
            raise PoolConfigError(f"LayerwisePoolConnector: {exc}") from None

    # -- layers ----------------------------------------------------------------
    @functools.cached_property
    def layer_group(self) -> dict[str, int]:
        return {n: g for g, names in enumerate(self.group_layers) for n in names}

    @functools.cached_property
    def layer_kind(self) -> dict[str, str]:
        return {n: self.kinds[g] for n, g in self.layer_group.items()}

    @functools.cached_property
    def order(self) -> tuple[str, ...]:
        """Every layer name in forward order."""
        return tuple(sorted(self.layer_group, key=forward_order))

    def layers(self, kind: str) -> tuple[str, ...]:
        return tuple(n for n in self.order if self.layer_kind[n] == kind)

    def layer_ids(self, kind: str) -> tuple[str, ...]:
        return tuple(layer_id(n) for n in self.layers(kind))

    @functools.cached_property
    def drafter_layers(self) -> frozenset[str]:
        """Attention layers of a speculative drafter (MTP/EAGLE): the layers
        outside the target model's numbered ``layers.N``."""
        return frozenset(n for n in self.layers(ATTN) if not layer_id(n).isdigit())

    def groups(self, kind: str) -> tuple[int, ...]:
        return tuple(g for g, k in enumerate(self.kinds) if k == kind)

    @property
    def has_state(self) -> bool:
        return STATE in self.kinds

    # -- block hashes ------------------------------------------------------------
    @property
    def hashes_per_block(self) -> int:
        return self.block_size // self.hash_block_size

    def num_blocks(self, hashes: Sequence[Any]) -> int:
        """Full pool blocks covered by ``hashes``."""
        return len(hashes) // self.hashes_per_block

    @functools.cached_property
    def route_span(self) -> int:
        """Pool blocks per routing run (:func:`.keys.block_name`): a power of
        two, as many blocks as fit :data:`.keys.ROUTE_BYTES` on one rank (1
        when a block alone fills it, :data:`.keys.MAX_ROUTE_SPAN` at most; 1
        when the page size is not known)."""
        block = self.page_bytes * len(self.layer_group)
        if block <= 0:
            return 1
        fit = max(1, min(MAX_ROUTE_SPAN, ROUTE_BYTES // block))
        return 1 << (fit.bit_length() - 1)

    def block_hash(self, hashes: Sequence[Any], i: int) -> bytes:
        """The name of pool block ``i`` in pool keys: the hash that covers
        tokens ``[0, (i+1)*block)`` exactly; in runs of several blocks
        (``route_span`` > 1) after its run's route tag
        (:func:`.keys.block_name`)."""
        r, span = self.hashes_per_block, self.route_span
        own = hashes[(i + 1) * r - 1]
        if span == 1:
            return bytes(own)
        return block_name(hashes[(i - i % span + 1) * r - 1], own)

    def block_hashes(self, hashes: Sequence[Any], start: int, end: int) -> list[bytes]:
        return [self.block_hash(hashes, i) for i in range(start, end)]

    def hit_span(self, hashes: Sequence[Any], num_tokens: int,
                 num_computed_tokens: int) -> tuple[int, int]:
        """Pool blocks ``[local, n)`` a hit could load: past the local hit,
        up to the last full block before the prompt's last token (one token
        is always computed).  Empty when ``n <= local``."""
        n = min(self.num_blocks(hashes), max(0, (num_tokens - 1) // self.block_size))
        return num_computed_tokens // self.block_size, n

    def hashes_match(self, hashes: Sequence[Any], num_tokens: int) -> bool:
        """vLLM hashed this request at the granularity the layout assumes."""
        return len(hashes) == num_tokens // self.hash_block_size

    def describe(self) -> dict[str, Any]:
        return {"kinds": list(self.kinds), "layers": [list(x) for x in self.group_layers],
                "block_size": self.block_size, "hash_block_size": self.hash_block_size,
                "tp_size": self.tp_size, "pp_size": self.pp_size}
