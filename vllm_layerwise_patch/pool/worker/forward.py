"""Worker side of the pool connector: raw-page layout, per-layer loads and
saves, the mamba copy protocol.

Two modes, chosen once per process and logged once:

* **layerwise** (the overlay's ``deferred-mamba-precopy`` and
  ``gdn-layer-hooks`` are applied here): loads start when the step's metadata
  is bound and are waited for layer by layer from ``wait_for_layer_load``,
  which then launches that layer's deferred mamba pre-copy; pages are copied
  out in ``save_kv_layer`` as each layer finishes;
* **bulk** (patches off or unverified): everything is loaded in
  ``start_load_kv`` before the forward, the boundary state also into this
  step's running column (vLLM's pre-copy has already run from the not yet
  loaded column, so the running column is written directly); pages are saved
  after the forward in ``wait_for_save``.  Correct, without overlap.

With ``load_async`` hits are loaded in the background instead, before the
request is computed (:mod:`.worker.async_loads`); saves are unchanged.

The worker holds its parts, each with the state it owns: this rank's pages
(:mod:`.worker.pages`), the loads in a forward (:mod:`.worker.loads`), the
asynchronous loads (:mod:`.worker.async_loads`), the saves (:mod:`.worker.saves`);
it runs the step across them, the copy protocol, and what a failed load
keeps out of the pool (:mod:`.worker.quarantine`).

Saved pages go through a send thread (``SaveQueue``) that copies them to
host memory while later layers compute; at the end of the step
(``wait_for_save``) the queue is drained and the pages and their commit
markers are written in one backend transaction.  A block whose layers were
not all saved gets no marker, so lookups never see it.

Faults: a load that fails (a backend error, an entry evicted or damaged
after the lookup) takes vLLM's load-failure path (the request recomputes) and
drops that block from the pool; a save that fails or finds the pool full of
pinned entries is skipped and counted.  Once a step's loads are done, this
rank releases the pins the scheduler took for them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ...copy_protocol import COPY_ALL, COPY_FOR_LAYER, deferred_copy
from ..layout import PoolLayout
from ..identity import loaded_adapters
from ..metadata import AdapterReport, PoolMetadata
from ..side import PoolSide, kv_roles
from .async_loads import AsyncLoads
from .process import layerwise_patches_applied, resolve_tp_rank
from .loads import WorkerLoads
from .pages import RankPages
from .saves import WorkerSaves
from .quarantine import Quarantine

logger = logging.getLogger("vllm.layerwise_patch")


class PoolWorker:
    def __init__(self, *, vllm_config: Any, layout: PoolLayout, backend: Any,
                 namespace: bytes, config: Any) -> None:
        from ..stats import PoolStats

        side = PoolSide.open(layout=layout, backend=backend, namespace=namespace, config=config)
        self.backend, self.ns, self.layout = backend, namespace, layout
        self.log = side.log
        self.faults = side.faults
        self.pages = RankPages(layout, resolve_tp_rank(layout.tp_size))
        self.saves_on = kv_roles(vllm_config)[2]
        self.layerwise = False
        self.stats = PoolStats()  # since vLLM last polled (take_stats)
        self.loads = WorkerLoads(side, self.pages, self.stats)
        self.async_loads = AsyncLoads(side, self.pages, self.loads, self.stats)
        self.saves = WorkerSaves(side, self.pages)
        self._meta: PoolMetadata | None = None
        # this step's requests whose adapter copy here is not the one they are
        # named by (identity.adapters): no load, no save; and the step's saves
        self._foreign: set[str] = set()
        self._saves: list = []
        self._model_state: Any = None
        self.quarantine = Quarantine()  # what failed loads keep out of the pool
        self._reported: dict[str, float] = {}  # running totals already added to stats
        self._hook_seconds = 0.0  # the forward thread's time in the save hooks
        self._precopy_seconds = 0.0  # ... in the deferred mamba pre-copies

    # -- layout ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.pages.register(kv_caches)
        self.layerwise, why = layerwise_patches_applied()
        if self.layerwise:
            logger.info("vllm-layerwise-patch pool: layerwise loads and saves (%s)", why)
        else:
            logger.warning(
                "vllm-layerwise-patch pool: %s; using the bulk path (all pages "
                "loaded before the forward, boundary state also written to the "
                "running column): correct, without layer overlap", why)
        self.loads.open()
        self.saves.open(reserve=self.saves_on)

    # -- loads -----------------------------------------------------------------
    def begin_step(self, meta: PoolMetadata) -> None:
        self.saves.begin_step()
        if getattr(meta, "namespace", None) not in (None, self.ns):
            self.use_namespace(meta.namespace)
        self._meta = meta
        if self.faults.forget_failures:  # the rule before the fix (tests)
            self.quarantine = Quarantine()
        self.quarantine.seen(meta.failures_seen)
        self._foreign = self._foreign_adapters(meta)
        self._saves = [s for s in meta.saves if s.req_id not in self._foreign]
        self.async_loads.note(meta, refused=self._foreign)
        self.loads.begin_step(meta, refused=self._foreign)
        if self.layerwise and meta.loads:
            self.loads.start(meta)
        elif self._model_state is not None:
            # nothing loads this step (decode): the deferred pre-copy in one
            # bulk launch, as vLLM runs it, not one per layer
            t0 = time.perf_counter()
            handle = deferred_copy(self._model_state)
            if self.faults.skip_bulk_precopy and handle is not None:
                handle.pending.clear()  # negative control (tests): no copy at all
            else:
                getattr(self._model_state, COPY_ALL, lambda: False)()
            self._precopy_seconds += time.perf_counter() - t0

    def use_namespace(self, ns: bytes) -> None:
        """The scheduler names loads and saves in another namespace from this
        step on (the weights changed: .scheduler.weight_changes).  Nothing of
        the old one is pending: the last step's saves are written
        (:meth:`begin_step` drained them), its loads are done; asynchronous
        loads in flight finish under the namespace they started in."""
        self.ns = ns
        self.loads.set_namespace(ns)
        self.async_loads.ns = ns
        self.saves.set_namespace(ns)
        set_layout = getattr(self.backend, "set_layout", None)
        if set_layout is not None:  # (Mooncake: this namespace's block objects)
            set_layout(ns, self.layout)
        logger.info("vllm-layerwise-patch pool (worker): namespace %s from this step on "
                    "(the weights changed)", ns.hex())

    def _foreign_adapters(self, meta: PoolMetadata) -> set[str]:
        """Requests of this step named by an adapter digest that is not the
        digest of the copy this worker computes them with (the adapter was
        loaded again from changed files, or here without a digest)."""
        specs = [s for s in (*meta.loads, *meta.async_loads, *meta.saves)
                 if getattr(s, "adapter", None) is not None]
        if not specs or self.faults.adapter_digest_at_lookup:  # (tests: the old rule)
            return set()
        held = loaded_adapters.held()
        out = {s.req_id for s in specs if held.get(s.adapter[0]) != s.adapter[1]}
        if out:
            self.log.warning("adapter", "vllm-layerwise-patch pool: request %s runs a LoRA "
                             "adapter whose copy in this worker is not the one the scheduler "
                             "named its blocks by (loaded again from changed files): its load "
                             "goes to vLLM's kv_load_failure_policy and its pages are not "
                             "stored (further cases are not logged)", sorted(out)[0])
        return out

    def adapter_report(self) -> AdapterReport | None:
        """The adapters this worker holds, for the scheduler (every step;
        None while it neither checks nor holds any: nothing to say)."""
        checked, held = loaded_adapters.checked(), loaded_adapters.held()
        return AdapterReport(checked, held) if checked or held else None

    def start_load_kv(self) -> None:
        # asynchronous loads start here: after the forward (or in a step
        # without one), off the forward's critical path
        self.async_loads.start()
        if self._meta is not None and not self.layerwise and self._meta.loads:
            self.loads.load_all(self._meta)

    def wait_for_layer_load(self, layer: str) -> None:
        if not self.layerwise:
            return
        # A load that fails here (entry removed or damaged after the lookup
        # verified it) raises unless vLLM can take the error (tolerant mode:
        # zeroed pages, reported, the request recomputes): the forward must
        # not run on a wrong state.
        if self.faults.copy_before_wait and self._model_state is not None:
            # negative control (tests): copy the state before it has arrived
            getattr(self._model_state, COPY_FOR_LAYER)(layer)
        self.loads.wait(layer)
        if self._model_state is not None and layer != self.faults.skip_copy_layer:
            t0 = time.perf_counter()
            getattr(self._model_state, COPY_FOR_LAYER)(layer)
            self._precopy_seconds += time.perf_counter() - t0
        # attention layers get no separate fence call from vLLM: their compute
        # starts right after this wait
        self.loads.compute_started(self.pages.device)

    def on_layer_compute_start(self, layer: str) -> None:
        if self.layerwise:
            self.loads.compute_started(self.pages.device)

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(requests whose asynchronous loads are done, those that failed)."""
        return self.async_loads.transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loads.block_ids_with_load_errors(self._meta)

    # -- copy protocol ---------------------------------------------------------
    def prepare_mamba_state_copy(self, model_state: Any) -> bool:
        if not self.layerwise:
            return False
        self._model_state = model_state
        return True

    def finish_mamba_state_copy(self) -> None:
        self._model_state = None

    # -- saves -----------------------------------------------------------------
    def save_kv_layer(self, layer: str) -> None:
        if not self.layerwise or layer not in self.pages.group:
            return
        t0 = time.perf_counter()
        self.saves.save_layer(layer, self._saves if self._meta is not None else [])
        self._hook_seconds += time.perf_counter() - t0

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None:
            return
        if self.layerwise:
            self.loads.drain()
        t0 = time.perf_counter()
        failed = self.loads.settle(meta)
        if meta.loads:
            self.quarantine.failed(meta.loads, failed)
        # nothing computed from a failed load's pages reaches the pool: not
        # this step's, nor a later step's that vLLM planned before it learnt
        # of the failure (asynchronous scheduling), nor another request's
        # that read those pages (worker.quarantine)
        saves, tainted = self.quarantine.split(self._saves)
        tainted += [s for s in meta.saves if s.req_id in self._foreign]
        if self._copy_missing():
            saves, tainted = [], meta.saves
        if tainted:
            self.stats.add(saves_tainted=sum(len(s.attn) + len(s.mamba) for s in tainted))
        self.saves.finish_step(meta, saves, tainted, bulk=not self.layerwise)
        self._hook_seconds += time.perf_counter() - t0
        self.saves.flush_events()
        if self.loads.opened:  # fold running totals in
            now = {**self.loads.totals(), **self.saves.totals(),
                   "save_hook_seconds": self._hook_seconds,
                   "precopy_seconds": self._precopy_seconds,
                   "evictions": getattr(self.backend, "evicted_groups", 0),
                   "put_skipped": getattr(self.backend, "put_skipped", 0),
                   **getattr(self.backend, "tier_counts", {})}  # (backend tiered)
            self.stats.add(**{k: now[k] - self._reported.get(k, 0) for k in now})
            self._reported = now

    def _copy_missing(self) -> bool:
        """A layer whose deferred state copy never ran this step computed on
        the wrong state: the step's saves are not committed (vLLM's next
        ``preprocess_state`` then stops the engine, naming the layer)."""
        handle = deferred_copy(self._model_state) if self._model_state is not None else None
        if not self.layerwise or handle is None or not handle.pending:
            return False
        if self.faults.late_copy_check:  # the order before the fix (tests)
            return False
        logger.error("vllm-layerwise-patch pool: the deferred state copy of %s did not "
                     "run this step; its saves are not stored", sorted(handle.pending))
        return True

    def take_stats(self):
        """Stats since the last call (vLLM polls once per step), or None;
        the figures per request on TP rank 0 only (``stats.worker_share``)."""
        if self.stats.is_empty():
            return None
        from ..stats import PoolStats, worker_share

        # (the parts hold this object: its counts are handed over, not it)
        out = PoolStats(data=worker_share(self.stats.data, self.pages.tp_rank,
                                          self.faults.stats_every_rank))
        self.stats.reset()
        return None if out.is_empty() else out

    def clear(self) -> None:
        self._meta = None

    def close(self) -> None:
        self.async_loads.close()
        self.loads.close()
        self.saves.close()
