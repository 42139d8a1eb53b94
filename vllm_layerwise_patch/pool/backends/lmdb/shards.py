"""How a sharded embedded pool is laid out: which shard a key lives in, and
the shard count the pool records.

A pool path holds either one LMDB environment (``data.mdb`` in the pool
directory: every pool written before sharding, and a pool of one shard) or
``N`` of them, ``shard-00`` .. ``shard-<N-1>``, each a pool directory of its
own (:mod:`.backend`: its own writer, eviction, generation).  The count is
written once, when the pool is created, into the file ``shards`` of the
pool directory, and every engine follows what the pool records, whatever it
is configured with: routing never depends on an engine's configuration, so
two engines can never look for one block in two shards.

Routing: a key ``<ns>/<kind>/<name>/tp<r>/...`` (and its group
``<ns>/<kind>/<name>/tp<r>``) lives in shard ``crc32(<tag>) % N``, ``<tag>``
the first 8 hex digits of the block's name: its route tag, the same for a
run of consecutive small blocks of a prefix (:func:`..keys.block_name`), or
the first bytes of its hash (a block that is a run of its own).  So a
block's groups of every kind (attention pages, boundary states, drafter
pages) on every TP rank, and their commit markers, share one shard - one
block is stored in one write transaction and evicted as a whole - and so
do the blocks of a run: a step's save of a prompt's consecutive blocks is
one transaction, not one per block's shard.  Other keys (the namespace
description ``<ns>/meta/namespace``) route with their group, by their
first two components.
"""

from __future__ import annotations

import logging
import os
import zlib

from ...keys import TAG_BYTES


logger = logging.getLogger("vllm.layerwise_patch")

#: the file of the pool directory that records the shard count
RECORD = "shards"
#: a shard is at least this big: a pool of capacity C gets min(shards, C //
#: MIN_SHARD_BYTES) shards, at least one (a shard must hold a step's saves
#: of its blocks with room to evict)
MIN_SHARD_BYTES = 8 << 20
#: the most shards a pool can have (two digits in the directory names)
MAX_SHARDS = 64


def shard_name(i: int) -> str:
    return f"shard-{i:02d}"


def route(key: bytes, by_key: bool = False) -> bytes:
    """What a key is routed by: the first 8 hex digits of its block's name
    (the third ``/`` component of a block's key or group, which have four
    or more: its route tag); any other key and its group by their first two
    components (``<ns>/meta/namespace`` and its group ``<ns>/meta`` alike).
    ``by_key`` (the tests' ``shard_by_key`` fault) routes by the whole key
    instead: a block's groups, and a group's pages and marker, then spread
    over shards."""
    key = bytes(key)
    if by_key:
        return key
    parts = key.split(b"/", 3)
    return parts[2][:2 * TAG_BYTES] if len(parts) > 3 else b"/".join(parts[:2])


def shard_of(key: bytes, n: int, by_key: bool = False) -> int:
    """The shard of a key or group of a pool of ``n`` shards."""
    return 0 if n <= 1 else zlib.crc32(route(key, by_key)) % n


def shard_count(capacity: int, configured: int) -> int:
    """The count a new pool of ``capacity`` bytes is created with."""
    return max(1, min(configured, capacity // MIN_SHARD_BYTES))


def read_record(pool) -> int | None:
    """The shard count the pool directory (a :class:`..directory.PoolDir`)
    records; None when it records none (a new pool, or one written before
    sharding)."""
    if pool.existing(RECORD) is None:
        return None
    fd = pool.open(RECORD, create=False)
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if not text.isdigit() or not 1 <= int(text) <= MAX_SHARDS:
        from ..base import PoolUnusable

        raise PoolUnusable(f"{os.path.join(pool.path, RECORD)} does not record a shard count "
                           f"(it holds {text[:20]!r})")
    return int(text)


def write_record(pool, n: int) -> None:
    fd = pool.open(RECORD)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{n}\n".encode(), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def decide(pool, capacity: int, configured: int) -> int:
    """The shard count of the pool directory ``pool``: what it records; 1
    for a pool written before sharding (``data.mdb`` at its top, no
    record); for a new pool, ``configured`` (within :func:`shard_count`),
    recorded now.  The caller holds the pool's open lock."""
    recorded = read_record(pool)
    if recorded is not None and recorded > 1 and pool.existing("data.mdb") is not None:
        logger.warning("vllm-layerwise-patch pool: %s holds a data.mdb beside its %d shards "
                       "(a build before sharding opened it as one environment): its entries "
                       "are never read here", pool.path, recorded)
    if recorded is not None:
        if recorded != configured and recorded != shard_count(capacity, configured):
            logger.warning("vllm-layerwise-patch pool: %s was created with %d shard(s); this "
                           "engine is configured with shards=%d and follows the pool (the "
                           "count is fixed when a pool is created)", pool.path, recorded,
                           configured)
        return recorded
    if pool.existing("data.mdb") is not None:
        if configured > 1:
            logger.info("vllm-layerwise-patch pool: %s was written before sharding (one "
                        "LMDB environment); it is opened as it is, one shard (a new pool "
                        "path is created with %d shards)", pool.path, configured)
        return 1
    n = shard_count(capacity, configured)
    write_record(pool, n)
    if n != configured:
        logger.info("vllm-layerwise-patch pool: %s created with %d shard(s), not %d: a "
                    "shard holds at least %d MiB", pool.path, n, configured,
                    MIN_SHARD_BYTES >> 20)
    return n
