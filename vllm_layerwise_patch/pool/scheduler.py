"""Scheduler side of the pool connector (engine-core process): hit lookup,
load/save planning, per-step connector metadata.

A hybrid hit of ``k`` blocks needs, for every TP rank, the attention pages of
blocks ``local..k-1`` and the linear-attention state at the end of block
``k-1`` (DESIGN §7-§8).  The lookup walks the request's pool blocks (named as
in :mod:`.layout`) while the attention commit marker exists, then takes the
longest prefix of that run whose last block has a boundary-state marker; it is
capped at ``(num_tokens - 1) // block`` so one token is always computed.  With
``verify_on_lookup`` the entries behind a hit are read and checked (length,
checksum, namespace) before the hit is reported: a damaged or missing page
shortens the hit and drops its whole block (pages and marker) from the pool,
so that block is saved again when it is next computed.

A reported hit pins (and refreshes) every group its load reads, per request:
eviction never takes them while the load is pending.  Each worker releases
its own rank's pins once its load has finished; the scheduler releases any
left when the request finishes; ``pin_seconds`` bounds a pin if an engine
dies.

With speculative decoding configured (MTP/EAGLE) the final block of every
hit is trimmed: the drafter's KV at a hit's last position depends on the
token after the hit.

Any backend error during a lookup is a miss (logged once); during save
planning the step's saves are skipped.  A request whose load failed is not
served from the pool again (it recomputes; a backend that answers lookups
but fails every read cannot make it loop).  The engine never stops for the
pool.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .backends.base import HEADER_SIZE, CorruptEntry, unpack
from .keys import ATTN, STATE, group_key, marker_key, page_key
from .layout import PoolLayout

logger = logging.getLogger("vllm.layerwise_patch")


@dataclasses.dataclass
class LoadSpec:
    req_id: str
    start: int  # first block to load (the block-aligned local hit)
    end: int  # blocks [start, end) are loaded; the state at end-1
    hashes: list[bytes]  # pool block hashes of [start, end)
    attn_blocks: dict[int, list[int]]  # attention group -> block ids of [start, end)
    mamba_blocks: dict[int, int]  # state group -> block id of column end-1
    running_blocks: dict[int, int]  # state group -> block id of this step's running column


@dataclasses.dataclass
class SaveSpec:
    req_id: str
    attn: list[tuple[bytes, dict[int, int]]]  # (block hash, attention group -> block id)
    mamba: list[tuple[bytes, dict[int, int]]]  # (block hash, state group -> block id)


class PoolMetadata(KVConnectorMetadata):
    def __init__(self, loads: list[LoadSpec], saves: list[SaveSpec],
                 report_load_errors: bool = False) -> None:
        self.loads = loads
        self.saves = saves
        # the scheduler can take block load errors for this layout: a failed
        # load is reported (the request recomputes) instead of raised
        self.report_load_errors = report_load_errors


@dataclasses.dataclass
class _Tracked:
    request: Any
    blocks: list[list[int]]  # per group, as the worker's block table holds them
    loaded_end: int = 0


def owner_of(req_id: str) -> bytes:
    """Pin owner of a request's pending load."""
    return req_id.encode()


def load_groups(ns: bytes, hashes: list[bytes], tp_ranks: range | list[int],
                has_state: bool) -> list[bytes]:
    """Every group a load of ``hashes`` (state at the last one) reads."""
    out = [group_key(ns, ATTN, h, tp) for h in hashes for tp in tp_ranks]
    if has_state and hashes:
        out += [group_key(ns, STATE, hashes[-1], tp) for tp in tp_ranks]
    return out


class PoolScheduler:
    def __init__(self, *, vllm_config: Any, layout: PoolLayout, backend: Any,
                 namespace: bytes, config: Any) -> None:
        self.backend = backend
        self.ns = namespace
        self.config = config
        self.layout = layout
        self.block_size = layout.block_size
        # MTP/EAGLE: the drafter's KV at a hit's last position depends on the
        # token after the hit: trim one block off every external hit.
        self.trim_blocks = 1 if getattr(vllm_config, "speculative_config", None) else 0
        self.tp_size = layout.tp_size
        self.layers = {ATTN: layout.layer_ids(ATTN), STATE: layout.layer_ids(STATE)}
        self._pending: dict[str, int] = {}  # req_id -> hit blocks (lookup -> alloc)
        self._pinned: dict[str, list[bytes]] = {}  # req_id -> groups pinned for its load
        self._issued: dict[str, set[int]] = {}  # req_id -> block ids its loads fill
        self._load_failed: set[str] = set()  # requests recomputing after a failed load
        self._loads: list[LoadSpec] = []
        self._tracked: dict[str, _Tracked] = {}
        self._warned: set[str] = set()
        self._report_errors: bool | None = None
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        self.failure_policy = getattr(ktc, "kv_load_failure_policy", None) or "fail"
        self.stats = {"lookups": 0, "query_tokens": 0, "hit_tokens": 0}

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(msg, *args)

    # -- lookup ----------------------------------------------------------------
    def _present(self, kind: str, hashes: list[bytes]) -> list[bool]:
        keys = [marker_key(self.ns, kind, h, tp) for h in hashes for tp in range(self.tp_size)]
        found = self.backend.exists_many(keys)
        t = self.tp_size
        return [all(found[i * t:(i + 1) * t]) for i in range(len(hashes))]

    def _verify(self, hashes: list[bytes], local: int, run: int,
                state_ok: list[bool]) -> tuple[list[bool], list[bool]]:
        """Read and check every entry a hit inside blocks ``[local, run)`` could
        load, in one batch: attention pages of each block and the boundary
        state of each block that has a marker.  Returns per block (attention
        sound, boundary state sound).  A damaged or missing page drops its
        whole group (the block's pages of that kind and its marker), so the
        block is saved again when next computed; damage is logged once per
        kind."""
        keys: list[tuple[int, str, int, bytes]] = []
        for i in range(local, run):
            for tp in range(self.tp_size):
                keys += [(i, ATTN, tp, page_key(self.ns, ATTN, hashes[i], tp, layer))
                         for layer in self.layers[ATTN]]
                if state_ok[i]:
                    keys += [(i, STATE, tp, page_key(self.ns, STATE, hashes[i], tp, layer))
                             for layer in self.layers[STATE]]
        sound = {ATTN: [True] * run, STATE: list(state_ok)}
        broken: set[bytes] = set()

        def check(j: int, key: bytes, value: Any) -> None:
            i, kind, tp, _ = keys[j]
            try:
                if value is None:
                    raise CorruptEntry("missing", key, "evicted or never stored")
                unpack(key, value, self.ns)
            except CorruptEntry as err:
                if err.kind == "missing":
                    self._warn_once("missing", "vllm-layerwise-patch pool: %s; its block is "
                                    "dropped and recomputed (further missing pages are "
                                    "not logged)", err)
                else:
                    self._warn_once(err.kind, "vllm-layerwise-patch pool: %s; the entry "
                                    "is dropped and those blocks are recomputed (further "
                                    "'%s' entries are not logged)", err, err.kind)
                broken.add(group_key(self.ns, kind, hashes[i], tp))
                sound[kind][i] = False

        self.backend.read_many([k for *_, k in keys], check,
                               [HEADER_SIZE + self.layout.page_bytes] * len(keys))
        if broken:
            self.backend.delete_groups(sorted(broken))
        return sound[ATTN], sound[STATE]

    def lookup(self, request: Any, num_computed_tokens: int) -> int:
        """Hit length in pool blocks (0 when the pool cannot beat the local hit)."""
        L, B = self.layout, self.block_size
        hashes = request.block_hashes
        if not L.hashes_match(hashes, request.num_tokens):
            self._warn_once(
                "granularity", "vllm-layerwise-patch pool: request %s has %d prefix hashes "
                "for %d tokens, not one per %d tokens as the pool layout says; it is not "
                "looked up (further mismatches are not logged)", request.request_id,
                len(hashes), request.num_tokens, L.hash_block_size)
            return 0
        n = min(L.num_blocks(hashes), max(0, (request.num_tokens - 1) // B))
        local = num_computed_tokens // B
        if n <= local:
            return 0
        blocks = L.block_hashes(hashes, 0, n)
        attn_ok = self._present(ATTN, blocks[local:n])
        run = local + next((i for i, ok in enumerate(attn_ok) if not ok), n - local)
        state_ok = [False] * local + (self._present(STATE, blocks[local:run])
                                      if L.has_state else [True] * (run - local))
        if self.config.verify_on_lookup and run > local:
            attn_sound, state_ok = self._verify(blocks, local, run, state_ok)
            run = next((i for i in range(local, run) if not attn_sound[i]), run)
        k = run - self.trim_blocks
        while k > local and not state_ok[k - 1]:
            k -= 1
        return k if k > local else 0

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        self.stats["lookups"] += 1
        self.stats["query_tokens"] += max(0, request.num_tokens - num_computed_tokens)
        rid = request.request_id
        tracked = self._tracked.setdefault(rid, _Tracked(request, []))
        tracked.loaded_end = 0  # (again, after a preemption)
        self._pending.pop(rid, None)
        if rid in self._load_failed:
            return 0, False
        try:
            k = self.lookup(request, num_computed_tokens)
            groups = []
            if k:
                B, L = self.block_size, self.layout
                hashes = L.block_hashes(request.block_hashes, num_computed_tokens // B, k)
                groups = load_groups(self.ns, hashes, range(self.tp_size), L.has_state)
                self.backend.pin(groups, self.config.pin_seconds, owner_of(rid))
            stale = set(self._pinned.pop(rid, [])) - set(groups)
            if stale:
                self.backend.unpin(sorted(stale), owner_of(rid))
            if groups:
                self._pinned[rid] = groups
        except Exception as exc:  # noqa: BLE001 - the pool never stops the engine
            self._warn_once("lookup-error", "vllm-layerwise-patch pool: a lookup failed "
                            "(%s: %s); treated as a miss, the request is computed (further "
                            "lookup errors are not logged)", type(exc).__name__, exc)
            return 0, False
        if k == 0:
            return 0, False
        self._pending[rid] = k
        # load_async=False: loads must start before this step's forward.
        return k * self.block_size - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        k = self._pending.pop(request.request_id, 0)
        if num_external_tokens <= 0 or k == 0:
            return
        B = self.block_size
        start = k - num_external_tokens // B
        block_ids = blocks.get_block_ids()
        hashes = self.layout.block_hashes(request.block_hashes, start, k)
        kinds = self.layout.kinds
        attn = {g: list(ids[start:k]) for g, ids in enumerate(block_ids) if kinds[g] == ATTN}
        mamba = {g: ids[k - 1] for g, ids in enumerate(block_ids) if kinds[g] == STATE}
        self._loads.append(LoadSpec(request.request_id, start, k, hashes, attn, mamba, {}))
        self._issued[request.request_id] = {b for ids in attn.values() for b in ids} | set(
            mamba.values())
        self.stats["hit_tokens"] += num_external_tokens
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request, []))
        tracked.loaded_end = k

    # -- per-step metadata -----------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> PoolMetadata:
        B = self.block_size
        steps: list[tuple[str, int, int]] = []  # (req_id, computed before, scheduled)
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is None:
                continue
            t.blocks = [list(ids) for ids in new.block_ids]
            steps.append((new.req_id, new.num_computed_tokens,
                          scheduler_output.num_scheduled_tokens.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    t.blocks = [list(ids) for ids in new_ids]
                else:
                    for g, ids in enumerate(new_ids):
                        t.blocks[g].extend(ids)
            steps.append((req_id, cached.num_computed_tokens[i],
                          scheduler_output.num_scheduled_tokens.get(req_id, 0)))
        loads, self._loads = self._loads, []
        scheduled = dict((r, (c, n)) for r, c, n in steps)
        for spec in loads:  # this step's running column, for the bulk fallback
            before, n = scheduled.get(spec.req_id, (spec.end * B, 0))
            col = (before + n + B - 1) // B - 1
            t = self._tracked[spec.req_id]
            spec.running_blocks = {g: t.blocks[g][col] for g in spec.mamba_blocks
                                   if col < len(t.blocks[g])}
        try:
            saves = self._plan_saves(steps)
        except Exception as exc:  # noqa: BLE001 - a missed save only costs a hit
            self._warn_once("save-plan-error", "vllm-layerwise-patch pool: planning saves "
                            "failed (%s: %s); this step's blocks are not stored (further "
                            "errors are not logged)", type(exc).__name__, exc)
            saves = []
        return PoolMetadata(loads, saves, self.report_load_errors())

    def _plan_saves(self, steps: list[tuple[str, int, int]]) -> list[SaveSpec]:
        B, L = self.block_size, self.layout
        saves = []
        for req_id, before, n in steps:
            if n <= 0:
                continue
            t = self._tracked[req_id]
            hashes = t.request.block_hashes
            nblocks = L.num_blocks(hashes)
            after = before + n
            first = max(before // B, t.loaded_end)
            done = [j for j in range(first, after // B) if j < nblocks]
            attn, mamba = [], []
            if done:
                names = [L.block_hash(hashes, j) for j in done]
                for j, h, present in zip(done, names, self._present(ATTN, names)):
                    if not present:
                        attn.append((h, self._ids(t, j, ATTN)))
            if after % B == 0 and L.has_state:
                j = after // B - 1
                ids = self._ids(t, j, STATE) if j < nblocks else {}
                # block 0 is vLLM's null block: no state lives there
                if j >= t.loaded_end and ids and 0 not in ids.values():
                    h = L.block_hash(hashes, j)
                    if not self._present(STATE, [h])[0]:
                        mamba.append((h, ids))
            if attn or mamba:
                saves.append(SaveSpec(req_id, attn, mamba))
        return saves

    def report_load_errors(self) -> bool:
        """vLLM takes block load errors itself for one KV cache group; for
        hybrid layouts only with the ``hybrid-load-recompute`` patch applied
        in this (the scheduler's) process.  Decided once, logged once."""
        if self._report_errors is None:
            if len(self.layout.kinds) <= 1:
                self._report_errors = True
            else:
                try:
                    from ..activation import registry

                    self._report_errors = registry().is_applied("hybrid-load-recompute")
                except Exception:  # pragma: no cover - defensive
                    self._report_errors = False
                if self._report_errors:
                    logger.info(
                        "vllm-layerwise-patch pool: a failed load is handed to vLLM's "
                        "kv_load_failure_policy=%r (hybrid-load-recompute)%s",
                        self.failure_policy,
                        "" if self.failure_policy == "recompute" else
                        "; set kv_transfer_config.kv_load_failure_policy='recompute' to "
                        "recompute such requests instead of failing them")
                else:
                    logger.warning(
                        "vllm-layerwise-patch pool: hybrid-load-recompute is not applied; "
                        "a load that fails after a verified lookup stops the engine "
                        "rather than serve tokens from a wrong state")
        return self._report_errors

    def update_connector_output(self, connector_output: Any) -> None:
        """Requests whose loads the workers reported failed recompute without
        the pool."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        for rid, ids in self._issued.items():
            if ids & invalid and rid not in self._load_failed:
                self._load_failed.add(rid)
                logger.info("vllm-layerwise-patch pool: request %s recomputes without the "
                            "pool after a failed load", rid)

    def _ids(self, t: _Tracked, col: int, kind: str) -> dict[int, int]:
        return {g: t.blocks[g][col] for g in self.layout.groups(kind)
                if col < len(t.blocks[g])}

    def request_finished(self, request: Any) -> None:
        rid = request.request_id
        self._tracked.pop(rid, None)
        self._pending.pop(rid, None)
        self._issued.pop(rid, None)
        self._load_failed.discard(rid)
        groups = self._pinned.pop(rid, None)
        if groups:
            try:
                self.backend.unpin(groups, owner_of(rid))
            except Exception:  # noqa: BLE001 - pins expire after pin_seconds anyway
                pass
