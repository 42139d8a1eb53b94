"""Pool key format.

One value per (namespace, kind, block-hash chain, TP rank, layer), and one
commit marker per (namespace, kind, block hash, TP rank)::

    <ns>/attn/<hash>/tp<r>/L<layer>     attention K/V page of a block
    <ns>/state/<hash>/tp<r>/L<layer>    linear-attention state (conv + ssm)
                                        at the block's end
    <ns>/attn/<hash>/tp<r>/commit       every attention page of the block saved
    <ns>/state/<hash>/tp<r>/commit      every boundary-state page saved

With speculative decoding the drafter's (MTP/EAGLE) attention pages of a
block depend on the token *after* the block, which its hash does not cover,
so they also name that token ``<t>``::

    <ns>/attn/<hash>/tp<r>/L<layer>@<t>   a drafter layer's page of a block
    <ns>/attn/<hash>/tp<r>/commit@<t>     every drafter page of the block saved

``<hash>`` is the block's *name*: vLLM's prefix hash that covers exactly
the block's tokens and everything before them (see :mod:`.layout`), after a
4-byte route tag when the layout's blocks are small (:func:`block_name`);
``<ns>`` is the namespace fingerprint (:mod:`.identity`).  A sharded pool
routes a key by the first 4 bytes of its name (:mod:`.backends.lmdb.shards`).
The tag is the same for a run of consecutive blocks of a prefix (the
layout's ``route_span``: blocks ``[k*span, (k+1)*span)``; the crc32 of the
hash of the run's first block), so a step's save of a prompt's consecutive
small blocks, and a lookup of its hit, touch one shard or two rather than
one per block.  Blocks of :data:`ROUTE_BYTES` or more (a span of one) are
named by their hash alone, routed by its own first bytes.  The tag is a
function of the prefix, like the hash, and the span one of the layout,
which the namespace covers: every engine of a namespace names a block
alike.  Everything before the last ``/`` is the entry's *group* - one
block's pages of one kind on one rank plus their marker: the unit of
eviction, recency and pinning, so a block is never half-evicted.
Lookups check markers; a marker is written in the same transaction as the
pages it covers.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from typing import Any

#: the key layout's version (6: block names carry a route tag; 5: Mooncake
#: keeps a block's pages of one kind on one rank as one object,
#: :mod:`.backends.mooncake.objects`; entries of earlier versions are under
#: other namespaces and never read)
KEY_VERSION = 6
#: bytes of one rank's pages a routing run of blocks holds (at most): runs of
#: tiny blocks are long, so their saves and lookups cost one shard
#: transaction; a block that alone fills it is a run of its own
ROUTE_BYTES = 16 << 20
#: the most blocks of a routing run
MAX_ROUTE_SPAN = 64
#: bytes of a name's route tag
TAG_BYTES = 4
ATTN, STATE = "attn", "state"
KINDS = (ATTN, STATE)
COMMIT = "commit"
_COMMIT = COMMIT.encode()

_LAYER = re.compile(r"^(.*?)layers\.(\d+)\.")


def layer_id(name: str) -> str:
    """The layer's id in pool keys: ``"N"`` for the target model's
    ``model.layers.N.*`` (and any ``layers.N.*`` at the top), otherwise the
    module prefix and the number (``mtp.layers.0.*`` -> ``"mtp.0"``), so a
    drafter layer never shares keys with a target layer.  Unnumbered layers
    keep their full name."""
    m = _LAYER.match(name)
    if m is None:
        return name
    prefix = m.group(1).rstrip(".")
    if prefix in ("", "model", "model.model", "language_model.model"):
        return m.group(2)
    return f"{prefix}.{m.group(2)}"


def forward_order(name: str) -> tuple[int, int, str]:
    """Sort key: target-model layers by number, then drafter and other layers
    (which run after the target forward)."""
    lid = layer_id(name)
    if lid.isdigit():
        return (0, int(lid), name)
    m = _LAYER.match(name)
    return (1, int(m.group(2)) if m else 0, name)


def check_unique_ids(names: Iterable[str]) -> None:
    seen: dict[str, str] = {}
    for n in names:
        other = seen.setdefault(layer_id(n), n)
        if other != n:
            raise ValueError(f"layers {other!r} and {n!r} map to the same pool key "
                             f"id {layer_id(n)!r}")


def block_name(head: Any, block_hash: Any) -> bytes:
    """A block's name in pool keys: the route tag of its run (the crc32 of
    ``head``, the hash of the run's first block), then its own hash."""
    return zlib.crc32(bytes(head)).to_bytes(TAG_BYTES, "big") + bytes(block_hash)


def hash_hex(block_hash: Any) -> str:
    return bytes(block_hash).hex()


def group_key(ns: bytes, kind: str, block_hash: Any, tp: int) -> bytes:
    """The eviction unit of a block's pages of one kind on one TP rank."""
    return f"{ns.hex()}/{kind}/{hash_hex(block_hash)}/tp{tp}".encode()


def page_key(ns: bytes, kind: str, block_hash: Any, tp: int, layer: str) -> bytes:
    return group_key(ns, kind, block_hash, tp) + f"/L{layer}".encode()


def marker_key(ns: bytes, kind: str, block_hash: Any, tp: int) -> bytes:
    return group_key(ns, kind, block_hash, tp) + f"/{COMMIT}".encode()


def draft_page_key(ns: bytes, block_hash: Any, tp: int, layer: str, token: int | str) -> bytes:
    return page_key(ns, ATTN, block_hash, tp, layer) + f"@{token}".encode()


def draft_marker_key(ns: bytes, block_hash: Any, tp: int, token: int | str) -> bytes:
    return marker_key(ns, ATTN, block_hash, tp) + f"@{token}".encode()


def is_marker(key: bytes) -> bool:
    """A commit marker: ``.../commit`` or a drafter's ``.../commit@<t>``."""
    last = bytes(key).rpartition(b"/")[2]
    return last == _COMMIT or last.startswith(_COMMIT + b"@")


def group_of(key: bytes) -> bytes:
    """The group of an entry key (a key without ``/`` is its own group)."""
    head, sep, _ = bytes(key).rpartition(b"/")
    return head if sep else bytes(key)


def namespace_key(ns: bytes) -> bytes:
    """Where the namespace's description (JSON) is kept, for people reading
    a dump of the pool."""
    return f"{ns.hex()}/meta/namespace".encode()
