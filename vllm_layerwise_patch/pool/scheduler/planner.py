"""Scheduler side of the pool connector (engine-core process): the hit lookup
(:mod:`.lookup`), pins, load/save planning, per-step connector metadata.

A hit pins every group its load could read before they are verified
(:mod:`.pins`): eviction never takes them while the load is pending.

vLLM may schedule asynchronously (the GPU default): step N+1 is planned
before step N's output arrives here, so a failed load of step N is learnt a
step late; the workers keep what was planned meanwhile out of the pool
(:mod:`.worker.quarantine`), and each step's metadata tells them which failures
the scheduler has seen (``failures_seen``).

With ``load_async`` a hit is answered ``load_async=True``: vLLM parks the
request until the workers report its load done (:mod:`.worker.async_loads`); its
pins are refreshed while the load is in flight and outlive the request if it
ends first (vLLM keeps its blocks until then too).  A failed asynchronous load
comes back in ``failed_recving``.

``kv_role`` (vLLM's kv_transfer_config): ``kv_consumer`` only loads (no save
is planned), ``kv_producer`` only saves (every lookup answers 0 without
asking the pool), ``kv_both`` - and a scheduler without a kv_transfer_config
(unit tests) - does both.

Any backend error during a lookup is a miss (logged once); during save
planning the step's saves are skipped.  A request whose load failed is not
served from the pool again (it recomputes; a backend that answers lookups
but fails every read cannot make it loop).  The engine never stops for the
pool.
"""

from __future__ import annotations

import logging
from typing import Any

from ..faults import pause_here
from ..identity.adapters import adapter_of
from ..keys import ATTN, STATE, group_key
from ..layout import PoolLayout
from ..metadata import LoadSpec, PoolMetadata, load_groups
from ..side import PoolSide, kv_roles
from .admission import policy_of, within_budget
from .failures import StepRecords, steps_in_flight
from .inflight import InflightLoads
from .lookup import PoolLookup
from .pins import Pins
from .saves import SavePlanner, Tracked

logger = logging.getLogger("vllm.layerwise_patch")


class PoolScheduler:
    def __init__(self, *, vllm_config: Any, layout: PoolLayout, backend: Any,
                 namespace: bytes, config: Any) -> None:
        side = PoolSide.open(layout=layout, backend=backend, namespace=namespace, config=config)
        self.hits = PoolLookup(side)  # the hit lookup (its cache, the backend generation)
        self.ns, self.layout, self.log, self.faults = namespace, layout, side.log, side.faults
        self.block_size, self.tp_size = layout.block_size, layout.tp_size
        self._pending: dict[str, int] = {}  # req_id -> hit blocks (lookup -> alloc)
        self.pins = Pins(backend, config.pin_seconds)
        self._failures_seen: list[str] = []  # for the workers (PoolMetadata)
        # the loads of the steps whose outputs are pending, the tables of
        # requests that ended meanwhile (a failure reported later still maps)
        self.records = StepRecords(steps_in_flight(vllm_config),
                                   forget_ended_at_once=self.faults.forget_ended_at_once)
        self._load_failed: set[str] = set()  # requests recomputing after a failed load
        self._retired: set[str] = set()  # known before the weights changed: no pool
        self._loads: list[LoadSpec] = []
        self._tracked: dict[str, Tracked] = {}
        self.saves = SavePlanner(layout, self.hits, self.faults)
        self.admission = policy_of(config, layout)  # which planned saves go on (.admission)
        self.save_budget = 0 if self.faults.save_budget_ignored else config.save_budget_blocks
        self._report_errors: bool | None = None
        ktc, self.loads_on, self.saves_on = kv_roles(vllm_config)
        # vLLM plans step N+1 before it processes step N's output: a failed
        # load of step N is learnt after N+1's saves were planned (the
        # workers keep those out of the pool, see worker.quarantine)
        self.async_scheduling = bool(getattr(getattr(vllm_config, "scheduler_config", None),
                                             "async_scheduling", False))
        self.failure_policy = getattr(ktc, "kv_load_failure_policy", None) or "fail"
        self.load_async = bool(config.load_async) and self.loads_on
        self._async_loads: list[LoadSpec] = []
        self._inflight: set[str] = set()  # asynchronous loads not reported done
        self._orphans: set[str] = set()  # ... whose requests have finished
        self.shared_loads = InflightLoads(layout, config.share_loads_seconds)  # (.inflight)
        logger.info("vllm-layerwise-patch pool: kv_role %s: %s", getattr(ktc, "kv_role", None)
                    or "kv_both", {(True, True): "loads and saves",
                                   (True, False): "loads only (no saves)",
                                   (False, True): "saves only (no lookups)",
                                   (False, False): "neither loads nor saves"}[
                                       (self.loads_on, self.saves_on)]
                    + (", loads asynchronous" if self.load_async else "")
                    + "; async_scheduling=%s" % self.async_scheduling)
        self.stats = {"lookups": 0, "query_tokens": 0, "hit_tokens": 0, "load_failures": 0,
                      "not_admitted": 0, "over_budget": 0}

    def _pin_candidates(self, rid: str):
        """What :meth:`lookup` calls before it verifies a hit's entries: pin
        what the hit will load - every attention group of the run and the
        last boundary state in it - so what is verified stays until the load
        has read it (an eviction between the verification and the pin would
        otherwise take exactly the verified prefix).  Earlier boundary
        states are left alone: pinning refreshes, and a state the hit does
        not load must not outlive other blocks (a verification that shortens
        the hit pins its state afterwards)."""
        def pin(hashes: list[bytes], state_ok: list[bool]) -> None:
            tp = range(self.tp_size)
            groups = [group_key(self.ns, ATTN, h, r) for h in hashes for r in tp]
            last = next((h for h, ok in zip(reversed(hashes), reversed(state_ok)) if ok), None)
            if last is not None and self.layout.has_state:
                groups += [group_key(self.ns, STATE, last, r) for r in tp]
            pause_here(self.faults.pause_before_pin)
            self.pins.pin(rid, groups)
        return None if self.faults.pin_after_verify else pin

    @staticmethod
    def _reads_cache(request: Any) -> bool:
        """vLLM serves this request from cached KV (not with prompt logprobs
        or ``skip_reading_prefix_cache``: it computes every prompt token),
        and the pool may load it (``pool_reads``: .identity.adapters)."""
        if getattr(request, "skip_reading_prefix_cache", False) \
                or not getattr(request, "pool_reads", True):
            return False
        sp = getattr(request, "sampling_params", None)
        return getattr(sp, "prompt_logprobs", None) is None

    def set_namespace(self, ns: bytes | None) -> None:
        """New requests use ``ns``; None: the pool is off (.weight_changes).
        Every weights change turns it off first, before the workers change
        anything: every request known then is retired - no lookup, no save
        for the rest of its life, its pages may mix two weights.  Loads
        already planned or in flight finish under the old namespace."""
        if ns is None:
            self._retired |= set(self._tracked)
        self.ns = self.hits.ns = ns
        if ns is not None:
            # (no request waits for a load of the old namespace)
            self.shared_loads = InflightLoads(self.layout, self.shared_loads.wait_seconds)
            set_layout = getattr(self.hits.backend, "set_layout", None)
            if set_layout is not None:  # (Mooncake: this namespace's block objects)
                set_layout(ns, self.layout)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        if request.request_id in self._retired or self.ns is None:
            self._tracked.setdefault(request.request_id, Tracked(request, []))
            self.pins.release(request.request_id)
            return 0, False  # (no pool: the weights changed, or cannot be named)
        if (self.load_async and request.request_id not in self._load_failed
                and self._reads_cache(request)
                and self.shared_loads.should_wait(request, num_computed_tokens)):
            return None, False  # another request loads its blocks: ask again later
        self.stats["lookups"] += 1
        self.stats["query_tokens"] += max(0, request.num_tokens - num_computed_tokens)
        rid = request.request_id
        self._tracked.setdefault(rid, Tracked(request, [])).looked_up()
        self._pending.pop(rid, None)
        self.admission.see(request)
        if rid in self._load_failed or not self.loads_on or not self._reads_cache(request):
            self.pins.release(rid)
            return 0, False
        try:
            k = self.hits.lookup(request, num_computed_tokens, self._pin_candidates(rid))
            groups = []
            if k:
                B, L = self.block_size, self.layout
                hashes = L.block_hashes(request.block_hashes, num_computed_tokens // B, k)
                groups = load_groups(self.ns, hashes, range(self.tp_size), L.has_state)
            if self.faults.pin_after_verify:  # (the order before the fix: tests)
                pause_here(self.faults.pause_before_pin)
            self.pins.pin(rid, groups)
        except Exception as exc:  # noqa: BLE001 - the pool never stops the engine
            self.log.warning("lookup-error", "vllm-layerwise-patch pool: a lookup failed "
                            "(%s: %s); treated as a miss, the request is computed (further "
                            "lookup errors are not logged)", type(exc).__name__, exc)
            return 0, False
        if k == 0:
            return 0, False
        self._pending[rid] = k
        # load_async: vLLM parks the request until the workers report the
        # load done; otherwise layerwise loads start before this step's forward
        return k * self.block_size - num_computed_tokens, self.load_async

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
        tokens = ([self.hits.next_token(request, i) for i in range(start, k)]
                  if self.hits.drafter else [])
        spec = LoadSpec(request.request_id, start, k, hashes, attn, mamba, {}, tokens,
                        adapter_of(request))
        if self.load_async:
            self._async_loads.append(spec)
            self._inflight.add(request.request_id)
            self.shared_loads.started(request.request_id, hashes)
        else:
            self._loads.append(spec)
            # each worker releases its rank's pins once this load has read the
            # pool: a later lookup of the request (after a preemption) pins anew
            self.pins.handed_over(request.request_id)
        self.records.load_issued(request.request_id, {b for ids in attn.values()
                                                      for b in ids} | set(mamba.values()))
        self.stats["hit_tokens"] += num_external_tokens
        tracked = self._tracked.setdefault(request.request_id, Tracked(request, []))
        tracked.loaded_end = k

    # -- per-step metadata -----------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> PoolMetadata:
        self.records.next_step()
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
        try:
            if self.saves_on and self.ns is not None:
                self.hits.note_generation()
                for rid, _, _ in steps:  # blocks a decode completed: seen now
                    self.admission.see(self._tracked[rid].request)
                saves = self.saves.plan(steps, self._tracked, self.records.step,
                                        skip=self._retired)
                saves, dropped = self.admission.filter(saves)
                self.stats["not_admitted"] += dropped
                saves, dropped = within_budget(saves, self.save_budget, self.layout.has_state)
                self.stats["over_budget"] += dropped
        except Exception as exc:  # noqa: BLE001 - a missed save only costs a hit
            self.log.warning("save-plan-error", "vllm-layerwise-patch pool: planning saves "
                            "failed (%s: %s); this step's blocks are not stored (further "
                            "errors are not logged)", type(exc).__name__, exc)
        async_loads, self._async_loads = self._async_loads, []
        self._refresh_pins()
        seen, self._failures_seen = self._failures_seen, []
        return PoolMetadata(loads, saves, self.report_load_errors(), async_loads, seen,
                            namespace=self.ns)

    def _refresh_pins(self) -> None:
        """Pins of asynchronous loads in flight last until they are done."""
        for rid in self._inflight:
            self.records.still_loading(rid)
            try:
                self.pins.refresh(rid)
            except Exception:  # noqa: BLE001 - pins expire after pin_seconds anyway
                pass

    def report_load_errors(self) -> bool:
        """vLLM takes block load errors itself for one KV cache group; for
        hybrid layouts only with the ``hybrid-load-recompute`` patch applied
        in this (the scheduler's) process.  Decided once, logged once."""
        if self._report_errors is None:
            if len(self.layout.kinds) <= 1:
                self._report_errors = True
            else:
                try:
                    from ...registry import process_is_applied

                    self._report_errors = process_is_applied("hybrid-load-recompute")
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
                # (otherwise the connector loads asynchronously: connector.avoid_engine_stop)
        return self._report_errors

    def update_connector_output(self, connector_output: Any) -> None:
        """Requests whose loads the workers reported failed recompute without
        the pool; finished asynchronous loads release what they held."""
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._inflight.discard(rid)
            self.shared_loads.ended(rid)
            if rid in self._orphans:  # its request ended while loading
                self._orphans.discard(rid)
                self.pins.release(rid)
            elif not self.faults.async_pins_kept:  # the workers released them (.pins)
                self.pins.handed_over(rid)
        reported = set(getattr(connector_output, "failed_recving", None) or ())
        failed = {rid for rid in reported if rid in self._tracked}
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            failed |= self.records.failed_requests(set(invalid))
        self._failures_seen += sorted(failed)
        self.stats["load_failures"] += len((failed | reported) - self._load_failed)
        for rid in failed:
            self.shared_loads.ended(rid)
        for rid in sorted(failed - self._load_failed):
            self._load_failed.add(rid)
            logger.info("vllm-layerwise-patch pool: request %s recomputes without the "
                        "pool after a failed load", rid)

    def blocks_to_evict(self, invalid_block_ids: set[int]) -> set[int]:
        """The blocks of failed loads and every block computed from them, by
        running and ended requests alike (``hybrid-load-recompute`` evicts
        them from vLLM's prefix cache)."""
        return self.records.derived_blocks(
            invalid_block_ids, {rid: t.blocks for rid, t in self._tracked.items()})

    def request_finished(self, request: Any) -> None:
        rid = request.request_id
        t = self._tracked.pop(rid, None)
        if t is not None:
            self.records.request_ended(rid, t.blocks)
        self._pending.pop(rid, None)
        self._load_failed.discard(rid)
        self._retired.discard(rid)
        self.shared_loads.forget(rid)
        self.admission.forget(rid)
        if rid in self._inflight:  # its load still reads the pool: keep the pins
            self._orphans.add(rid)
            return
        self.pins.release(rid)
