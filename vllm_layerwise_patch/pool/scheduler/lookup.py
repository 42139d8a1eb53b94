"""The scheduler's hit lookup (engine-core process).

A hybrid hit of ``k`` blocks needs, for every TP rank, the attention pages of
blocks ``local..k-1`` and the linear-attention state at the end of block
``k-1`` (DESIGN §7-§8).  The lookup walks the request's pool blocks (named as
in :mod:`.layout`) while the attention commit marker exists, then takes the
longest prefix of that run whose last block has a boundary-state marker; it is
capped at ``(num_tokens - 1) // block`` so one token is always computed.

With speculative decoding (MTP/EAGLE) the drafter's pages of a block are
keyed by the token that followed the block (:mod:`.keys`): the walk also
needs, for each block, the drafter marker of the request's own next token.
Inside a shared chain that token is the same for every request, so only the
hit's last block can miss it (the request continues differently): the hit
is then one block shorter - where the old rule trimmed every hit.

With ``verify_on_lookup`` the entries behind a hit are read and checked
(length, checksum, namespace, the key each was written under) before the
hit is reported: a damaged or
missing page shortens the hit and drops its whole block (pages and marker)
from the pool, so that block is saved again when it is next computed.

Markers and verifications go through the :class:`.hit_cache.HitCache`: a
repeated lookup of a cached prefix makes no backend call, and no answer
outlives a store or removal by any process.
"""

from __future__ import annotations

from typing import Any

from ..backends.base import HEADER_SIZE, CorruptEntry, unpack
from .hit_cache import HitCache
from ..keys import (ATTN, STATE, draft_marker_key, draft_page_key, group_key, layer_id,
                   marker_key, page_key)
from ..side import PoolSide


class PoolLookup:
    """The scheduler's hit lookup (:class:`.planner.PoolScheduler` holds
    one); it owns the hit cache and the backend generation its answers are
    valid for."""

    def __init__(self, side: PoolSide) -> None:
        layout, config = side.layout, side.config
        self.backend = side.backend
        self.ns = side.ns
        self.config = config
        self.layout = layout
        self.block_size = layout.block_size
        self.log = side.log
        self.faults = side.faults
        self.tp_size = layout.tp_size
        self.target = {ATTN: [layer_id(n) for n in layout.layers(ATTN)
                              if n not in layout.drafter_layers],
                       STATE: list(layout.layer_ids(STATE))}
        self.drafter = sorted(layer_id(n) for n in layout.drafter_layers)
        # (Mooncake: a cap, its stores and evictions elsewhere are not seen)
        ttl = min(config.hit_cache_ttl,
                  getattr(self.backend, "hit_cache_cap", config.hit_cache_ttl))
        self.cache = HitCache(ttl, config.hit_cache_size)
        self._gen: Any = None  # the backend's generation (None: nothing is cached)

    def next_token(self, request: Any, block: int) -> int | str | None:
        """The token after pool block ``block`` (what its drafter pages
        depend on), or None while it is not known."""
        if self.faults.draft_token_blind or self.config.draft_hit_rule == "trim":
            return "any"  # (trim: the last block is never loaded; the others share it)
        pos = (block + 1) * self.block_size
        tokens = request.all_token_ids
        return int(tokens[pos]) if pos < len(tokens) else None

    def note_generation(self) -> None:
        """Note the backend's generation before asking it anything."""
        self._gen = self.backend.generation()

    # -- markers -----------------------------------------------------------------
    def _all_ranks(self, keys_of) -> Any:
        def present(items: list) -> list[bool]:
            keys = [k for item in items for k in keys_of(item)]
            found = self.cache.presence(keys, self._gen, self.backend.exists_many)
            t = self.tp_size
            return [all(found[i * t:(i + 1) * t]) for i in range(len(items))]
        return present

    def present(self, kind: str, hashes: list[bytes]) -> list[bool]:
        """Per block: committed on every TP rank."""
        return self._all_ranks(lambda h: [marker_key(self.ns, kind, h, tp)
                                          for tp in range(self.tp_size)])(hashes)

    def draft_present(self, blocks: list[tuple[bytes, Any]]) -> list[bool]:
        """Per (block hash, next token): the drafter's pages committed."""
        return self._all_ranks(lambda b: [draft_marker_key(self.ns, b[0], tp, b[1])
                                          for tp in range(self.tp_size)])(blocks)

    # -- verification -------------------------------------------------------------
    def _page_keys(self, kind: str, h: bytes, tp: int, token: Any) -> list[bytes]:
        keys = [page_key(self.ns, kind, h, tp, layer) for layer in self.target[kind]]
        if kind == ATTN and token is not None:
            keys += [draft_page_key(self.ns, h, tp, layer, token) for layer in self.drafter]
        return keys

    def _verify(self, hashes: list[bytes], tokens: list[Any], local: int, run: int,
                state_ok: list[bool]) -> tuple[list[bool], list[bool]]:
        """Read and check every entry a hit inside blocks ``[local, run)`` could
        load that was not verified since the last removal: attention pages
        (and drafter pages) of each block and the boundary state of each block
        that has a marker.  Returns per block (attention sound, boundary state
        sound).  A damaged or missing page drops its whole group (pages and
        marker), so the block is saved again when next computed; damage is
        logged once per kind."""
        keys: list[tuple[int, str, bytes, bytes]] = []  # (block, kind, group, key)
        for i in range(local, run):
            for tp in range(self.tp_size):
                for kind in (ATTN, STATE) if state_ok[i] else (ATTN,):
                    group = group_key(self.ns, kind, hashes[i], tp)
                    if not self.cache.verified(group, self._gen):
                        keys += [(i, kind, group, k) for k in
                                 self._page_keys(kind, hashes[i], tp, tokens[i - local])]
        sound = {ATTN: [True] * run, STATE: list(state_ok)}
        broken: set[bytes] = set()

        def check(j: int, key: bytes, value: Any) -> None:
            i, kind, group, _ = keys[j]
            try:
                if value is None:
                    raise CorruptEntry("missing", key, "evicted or never stored")
                unpack(key, value, self.ns)
            except CorruptEntry as err:
                if err.kind == "missing":
                    self.log.warning("missing", "vllm-layerwise-patch pool: %s; its block is "
                                     "dropped and recomputed (further missing pages are "
                                     "not logged)", err)
                else:
                    self.log.warning(err.kind, "vllm-layerwise-patch pool: %s; the entry "
                                     "is dropped and those blocks are recomputed (further "
                                     "'%s' entries are not logged)", err, err.kind)
                broken.add(group)
                sound[kind][i] = False

        if keys:
            self.backend.read_many([k for *_, k in keys], check,
                                   [HEADER_SIZE + self.layout.page_bytes] * len(keys))
        self.cache.mark_verified(sorted({g for *_, g, _ in keys} - broken), self._gen)
        if broken:  # (the removal moves the generation: no cached answer survives it)
            self.backend.delete_groups(sorted(broken))
        return sound[ATTN], sound[STATE]

    # -- the walk ------------------------------------------------------------------
    def lookup(self, request: Any, num_computed_tokens: int, pin=None) -> int:
        """Hit length in pool blocks (0 when the pool cannot beat the local hit).
        ``pin(hashes, state_ok)``, when given, is called with the blocks a
        hit could load (and which of them have a boundary state) before
        their entries are verified: what is verified is then pinned."""
        L = self.layout
        hashes = request.block_hashes
        if not L.hashes_match(hashes, request.num_tokens):
            self.log.warning(
                "granularity", "vllm-layerwise-patch pool: request %s has %d prefix hashes "
                "for %d tokens, not one per %d tokens as the pool layout says; it is not "
                "looked up (further mismatches are not logged)", request.request_id,
                len(hashes), request.num_tokens, L.hash_block_size)
            return 0
        local, n = L.hit_span(hashes, request.num_tokens, num_computed_tokens)
        if n <= local:
            return 0
        self.note_generation()
        blocks = L.block_hashes(hashes, 0, n)
        ok = self.present(ATTN, blocks[local:n])
        tokens: list[Any] = [None] * (n - local)
        if self.drafter:  # the drafter's pages of each block, for its next token
            tokens = [self.next_token(request, i) for i in range(local, n)]
            ok = [a and t is not None for a, t in zip(ok, tokens)]
            run = local + next((i for i, a in enumerate(ok) if not a), n - local)
            drafts = self.draft_present(list(zip(blocks[local:run], tokens[:run - local])))
            ok = drafts + [False] * (n - run)
        run = local + next((i for i, a in enumerate(ok) if not a), n - local)
        state_ok = [False] * local + (self.present(STATE, blocks[local:run])
                                      if L.has_state else [True] * (run - local))
        if pin is not None and run > local:
            pin(blocks[local:run], state_ok[local:run])
            # a removal between the walk and the pin must not be answered
            # from the cache: the verification asks with the generation now
            self.note_generation()
        if self.config.verify_on_lookup and run > local:
            attn_sound, state_ok = self._verify(blocks, tokens, local, run, state_ok)
            run = next((i for i in range(local, run) if not attn_sound[i]), run)
        elif pin is not None and run > local:
            # nothing is read: the markers, asked again under the generation
            # noted after the pin (a removal in between is not answered from
            # the hit cache), say they are still there
            if L.has_state:
                state_ok = state_ok[:local] + [a and b for a, b in zip(
                    state_ok[local:], self.present(STATE, blocks[local:run]))]
            still = self.present(ATTN, blocks[local:run])
            run = local + next((i for i, a in enumerate(still) if not a), run - local)
        k = run
        if self.drafter and self.config.draft_hit_rule == "trim":
            k -= 1
        while k > local and not state_ok[k - 1]:
            k -= 1
        return k if k > local else 0
