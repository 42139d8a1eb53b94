"""Scheduler side of the pool connector (engine-core process): hit lookup,
load/save planning, per-step connector metadata.

With speculative decoding configured (MTP/EAGLE) the final block of every
hit is trimmed (a conservative rule until finer MTP rules exist).

A hybrid hit of ``k`` blocks needs, for every TP rank, the attention pages of
blocks ``0..k-1`` and the linear-attention state at the end of block ``k-1``
(DESIGN §7-§8).  The lookup walks the request's block hashes while the
attention commit marker exists, then takes the longest prefix of that run
whose last block has a boundary-state marker; it is capped at
``(num_tokens - 1) // block`` so one token is always computed.  With
``verify_on_lookup`` the entries behind a hit are read and checked (length,
checksum, namespace) before the hit is reported, so a corrupted entry
shortens the hit (those blocks are recomputed) instead of reaching the model.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .backends.base import CorruptEntry, unpack
from .keys import ATTN, MAMBA, check_unique_ids, group_kinds, layer_id, marker_key, page_key

logger = logging.getLogger("vllm.layerwise_patch")


@dataclasses.dataclass
class LoadSpec:
    req_id: str
    start: int  # first block to load (the block-aligned local hit)
    end: int  # blocks [start, end) are loaded; the state at end-1
    hashes: list[bytes]  # block hashes of [start, end)
    attn_blocks: dict[int, list[int]]  # attention group -> block ids of [start, end)
    mamba_blocks: dict[int, int]  # mamba group -> block id of column end-1
    running_blocks: dict[int, int]  # mamba group -> block id of this step's running column


@dataclasses.dataclass
class SaveSpec:
    req_id: str
    attn: list[tuple[bytes, dict[int, int]]]  # (hash, attention group -> block id)
    mamba: list[tuple[bytes, dict[int, int]]]  # (hash, mamba group -> block id)


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


class PoolScheduler:
    def __init__(self, *, vllm_config: Any, kv_cache_config: Any, backend: Any,
                 namespace: bytes, config: Any) -> None:
        self.backend = backend
        self.ns = namespace
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        # MTP/EAGLE drafts rewrite state in the final block of a hit; until a
        # finer rule exists, trim one block off every external hit.
        self.trim_blocks = 1 if getattr(vllm_config, "speculative_config", None) else 0
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.kinds = group_kinds(kv_cache_config)
        self.groups = kv_cache_config.kv_cache_groups
        self.layers: dict[str, list[str]] = {ATTN: [], MAMBA: []}  # layer ids per kind
        names = {ATTN: [], MAMBA: []}
        for kind, group in zip(self.kinds, self.groups):
            names[kind] += list(group.layer_names)
        for kind, layer_names in names.items():
            check_unique_ids(layer_names)
            self.layers[kind] = [layer_id(n) for n in layer_names]
        self.page_sizes = {kind: None for kind in (ATTN, MAMBA)}
        self._pending: dict[str, int] = {}  # req_id -> hit blocks (lookup -> alloc)
        self._loads: list[LoadSpec] = []
        self._tracked: dict[str, _Tracked] = {}
        self._warned: set[str] = set()
        self._report_errors: bool | None = None
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        self.failure_policy = getattr(ktc, "kv_load_failure_policy", None) or "fail"
        self.stats = {"lookups": 0, "query_tokens": 0, "hit_tokens": 0}

    # -- lookup ----------------------------------------------------------------
    def _present(self, kind: str, hashes: list[bytes]) -> list[bool]:
        keys = [marker_key(self.ns, kind, h, tp) for h in hashes for tp in range(self.tp_size)]
        found = self.backend.exists_all(keys)
        t = self.tp_size
        return [all(found[i * t:(i + 1) * t]) for i in range(len(hashes))]

    def _warn_corrupt(self, err: CorruptEntry) -> None:
        if err.kind not in self._warned:
            self._warned.add(err.kind)
            logger.warning(
                "vllm-layerwise-patch pool: %s; the entry is dropped and those "
                "blocks are recomputed (further '%s' entries are not logged)",
                err, err.kind)

    def _verify(self, hashes: list[bytes], local: int, run: int,
                state_ok: list[bool]) -> tuple[list[bool], list[bool]]:
        """Read and check every entry a hit inside blocks ``[local, run)`` could
        load, in one batch: attention pages of each block and the boundary
        state of each block that has a marker.  Returns per block
        (attention sound, boundary state sound); corrupt entries are dropped
        from the pool and logged once per kind."""
        keys: list[tuple[int, str, bytes]] = []
        for i in range(local, run):
            for tp in range(self.tp_size):
                keys += [(i, ATTN, page_key(self.ns, ATTN, hashes[i], tp, layer))
                         for layer in self.layers[ATTN]]
                if state_ok[i]:
                    keys += [(i, MAMBA, page_key(self.ns, MAMBA, hashes[i], tp, layer))
                             for layer in self.layers[MAMBA]]
        values = self.backend.get_many([key for _, _, key in keys])
        attn_sound = [True] * run
        state_sound = list(state_ok)
        for (i, kind, key), value in zip(keys, values):
            try:
                if value is None:
                    raise CorruptEntry("missing", key, "evicted or never committed")
                unpack(key, value, self.ns)
            except CorruptEntry as err:
                if err.kind != "missing":
                    self._warn_corrupt(err)
                    self._drop(hashes[i], kind, key)
                if kind == ATTN:
                    attn_sound[i] = False
                else:
                    state_sound[i] = False
        return attn_sound, state_sound

    def _drop(self, block_hash: bytes, kind: str, key: bytes) -> None:
        self.backend.delete([key] + [marker_key(self.ns, kind, block_hash, tp)
                                     for tp in range(self.tp_size)])

    def lookup(self, request: Any, num_computed_tokens: int) -> int:
        """Hit length in blocks (0 when the pool cannot beat the local hit)."""
        B = self.block_size
        hashes = list(request.block_hashes)
        n = min(len(hashes), max(0, (request.num_tokens - 1) // B))
        local = num_computed_tokens // B
        if n <= local:
            return 0
        attn_ok = self._present(ATTN, hashes[:n])
        run = next((i for i, ok in enumerate(attn_ok) if not ok), n)
        state_ok = self._present(MAMBA, hashes[:run]) if self.layers[MAMBA] else [True] * run
        if self.config.verify_on_lookup and run > local:
            attn_sound, state_ok = self._verify(hashes, local, run, state_ok)
            run = next((i for i in range(local, run) if not attn_sound[i]), run)
        k = run - self.trim_blocks
        while k > local and not state_ok[k - 1]:
            k -= 1
        if k <= local:
            return 0
        self.backend.touch(
            [marker_key(self.ns, kind, hashes[i], tp) for kind in (ATTN, MAMBA)
             for i in range(local, k) for tp in range(self.tp_size)])
        return k

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        self.stats["lookups"] += 1
        self.stats["query_tokens"] += max(0, request.num_tokens - num_computed_tokens)
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request, []))
        tracked.loaded_end = 0  # (again, after a preemption)
        k = self.lookup(request, num_computed_tokens)
        if k == 0:
            self._pending.pop(request.request_id, None)
            return 0, False
        self._pending[request.request_id] = k
        # load_async=False: loads must start before this step's forward.
        return k * self.block_size - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        k = self._pending.pop(request.request_id, 0)
        if num_external_tokens <= 0 or k == 0:
            return
        B = self.block_size
        start = k - num_external_tokens // B
        block_ids = blocks.get_block_ids()
        hashes = [bytes(h) for h in request.block_hashes[start:k]]
        attn = {g: list(ids[start:k]) for g, ids in enumerate(block_ids) if self.kinds[g] == ATTN}
        mamba = {g: ids[k - 1] for g, ids in enumerate(block_ids) if self.kinds[g] == MAMBA}
        self._loads.append(LoadSpec(request.request_id, start, k, hashes, attn, mamba, {}))
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
        saves = []
        for req_id, before, n in steps:
            if n <= 0:
                continue
            t = self._tracked[req_id]
            hashes = t.request.block_hashes
            after = before + n
            first = max(before // B, t.loaded_end)
            done = [j for j in range(first, after // B) if j < len(hashes)]
            attn, mamba = [], []
            if done:
                have = self._present(ATTN, [hashes[j] for j in done])
                for j, present in zip(done, have):
                    if not present:
                        attn.append((bytes(hashes[j]), self._ids(t, j, ATTN)))
            if after % B == 0 and self.layers[MAMBA]:
                j = after // B - 1
                ids = self._ids(t, j, MAMBA) if j < len(hashes) else {}
                # block 0 is vLLM's null block: no state lives there
                if (j >= t.loaded_end and ids and 0 not in ids.values()
                        and not self._present(MAMBA, [hashes[j]])[0]):
                    mamba.append((bytes(hashes[j]), ids))
            if attn or mamba:
                saves.append(SaveSpec(req_id, attn, mamba))
        return PoolMetadata(loads, saves, self.report_load_errors())

    def report_load_errors(self) -> bool:
        """vLLM takes block load errors itself for one KV cache group; for
        hybrid layouts only with the ``hybrid-load-recompute`` patch applied
        in this (the scheduler's) process.  Decided once, logged once."""
        if self._report_errors is None:
            if len(self.groups) <= 1:
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

    def _ids(self, t: _Tracked, col: int, kind: str) -> dict[int, int]:
        return {g: t.blocks[g][col] for g in range(len(self.kinds))
                if self.kinds[g] == kind and col < len(t.blocks[g])}

    def request_finished(self, request: Any) -> None:
        self._tracked.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
