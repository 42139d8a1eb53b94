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
request is computed (:mod:`.worker_async`); saves are unchanged.

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

from ..copy_protocol import COPY_ALL, COPY_FOR_LAYER, deferred_copy
from .keys import ATTN, STATE, draft_marker_key, draft_page_key, layer_id, marker_key, page_key
from .layout import PoolLayout
from .pipeline import LayerwisePipeline
from .saving import SaveQueue
from .side import PoolSide, kv_roles
from .worker_async import WorkerAsyncLoads
from .worker_taint import Quarantine, agree_on_failures
from .worker_loads import WorkerLoads
from .worker_env import layerwise_patches_applied, resolve_tp_rank
from .metadata import PoolMetadata

logger = logging.getLogger("vllm.layerwise_patch")


class PoolWorker(WorkerAsyncLoads, WorkerLoads, PoolSide):
    def __init__(self, *, vllm_config: Any, layout: PoolLayout, backend: Any,
                 namespace: bytes, config: Any) -> None:
        super().__init__(layout=layout, backend=backend, namespace=namespace, config=config)
        self.tp_rank = resolve_tp_rank(layout.tp_size)
        self.saves_on = kv_roles(vllm_config)[2]
        self.layer_group = layout.layer_group
        self.layer_kind = layout.layer_kind
        self.caches: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        self.layerwise = False
        self.pipeline: LayerwisePipeline | None = None
        self.saver: SaveQueue | None = None
        self.device: torch.device | None = None
        self._meta: PoolMetadata | None = None
        self._model_state: Any = None
        self._saved_layers: set[str] = set()
        self._owners: dict[str, list[str]] = {}
        self._failed_reqs: set[str] = set()
        self.quarantine = Quarantine()  # what failed loads keep out of the pool
        self._debug_failed = False
        self._init_async()
        from .stats import PoolStats

        self.stats = PoolStats()
        self._reported: dict[str, float] = {}  # running totals already added to stats
        self._hook_seconds = 0.0  # the forward thread's time in the save hooks
        self._precopy_seconds = 0.0  # ... in the deferred mamba pre-copies

    # -- layout ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.caches = {n: t for n, t in kv_caches.items() if n in self.layer_group}
        self.order = [n for n in self.layout.order if n in self.caches]
        for name in self.order:  # fail at startup, not mid-request
            page = self.caches[name][0]
            if not page.is_contiguous():
                raise ValueError(f"layer {name}: a page is not contiguous "
                                 f"(shape {tuple(page.shape)}, stride {page.stride()})")
        self.layerwise, why = layerwise_patches_applied()
        if self.layerwise:
            logger.info("vllm-layerwise-patch pool: layerwise loads and saves (%s)", why)
        else:
            logger.warning(
                "vllm-layerwise-patch pool: %s; using the bulk path (all pages "
                "loaded before the forward, boundary state also written to the "
                "running column): correct, without layer overlap", why)
        self.pipeline = LayerwisePipeline(self.order, self.backend, self.ns,
                                          prefetch=self.config.prefetch_layers,
                                          threads=self.config.load_threads,
                                          # the lookup already checked every
                                          # checksum a hit relies on
                                          check_crc=not self.config.verify_on_lookup,
                                          delay=self.faults.load_delay_ms / 1e3)
        self.pipeline.register_memory(self.caches.values())  # zero-copy loads where possible
        self._events: list | None = [] if self.faults.event_log else None
        self._flushed = 0
        self.saver = SaveQueue(self.backend, self.ns, events=self._events)
        if self.saves_on:  # pre-fault the pack memory now, not in the first request
            self.saver.reserve()
        self.device = next(iter(self.caches.values())).device if self.caches else None

    def page(self, layer: str, block_id: int) -> torch.Tensor:
        """The bytes of one (layer, block) page: the raw per-layer allocation V2
        hands over is a page array (attention K/V, or conv then ssm state)."""
        return self.caches[layer][block_id].reshape(-1).view(torch.uint8)

    # -- loads -----------------------------------------------------------------
    def begin_step(self, meta: PoolMetadata) -> None:
        # a deferred final-layer save of the previous step completes before
        # this step loads or saves anything (and before its forward may
        # overwrite pages that save still reads)
        self.saver.drain()
        if self._events is not None:
            self._events.append(("step-begin", self.saver._step))
        self._meta = meta
        if self.faults.forget_failures:  # the rule before the fix (tests)
            self.quarantine = Quarantine()
        self.quarantine.seen(meta.failures_seen)
        self._note_async(meta)
        if meta.loads:
            self.stats.add(hit_tokens=sum(
                (s.end - s.start) * self.block_size for s in meta.loads))
        self._saved_layers = set()
        self._failed_reqs = set()
        if self.layerwise and meta.loads:
            self.pipeline.start(self._debug_fail(self._load_tasks(meta, bulk=False)),
                                tolerate_errors=self._tolerate(meta))
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

    def start_load_kv(self) -> None:
        # asynchronous loads start here: after the forward (or in a step
        # without one), off the forward's critical path
        self._start_async()
        if self._meta is not None and not self.layerwise and self._meta.loads:
            self.pipeline.load_all(self._debug_fail(self._load_tasks(self._meta, bulk=True)),
                                   tolerate_errors=self._tolerate(self._meta))

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
        self.pipeline.wait(layer)
        if self._model_state is not None and layer != self.faults.skip_copy_layer:
            t0 = time.perf_counter()
            getattr(self._model_state, COPY_FOR_LAYER)(layer)
            self._precopy_seconds += time.perf_counter() - t0
        # attention layers get no separate fence call from vLLM: their compute
        # starts right after this wait
        self.pipeline.record_compute_start(self.device)

    def on_layer_compute_start(self, layer: str) -> None:
        if self.layerwise:
            self.pipeline.record_compute_start(self.device)

    # -- copy protocol ---------------------------------------------------------
    def prepare_mamba_state_copy(self, model_state: Any) -> bool:
        if not self.layerwise:
            return False
        self._model_state = model_state
        return True

    def finish_mamba_state_copy(self) -> None:
        self._model_state = None

    # -- saves -----------------------------------------------------------------
    def _save_pages(self, layer: str, specs=None) -> list[tuple[bytes, torch.Tensor]]:
        meta = self._meta
        if specs is None:
            specs = meta.saves if meta is not None else []
        g, kind = self.layer_group[layer], self.layer_kind[layer]
        idx, draft = layer_id(layer), layer in self.layout.drafter_layers
        out = []
        for spec in specs:
            if kind == STATE:
                out += [(page_key(self.ns, STATE, h, self.tp_rank, idx), self.page(layer, ids[g]))
                        for h, ids in spec.mamba if g in ids]
                continue
            for a in spec.attn:
                if g not in a.ids:
                    continue
                if draft and a.token is not None:
                    out.append((draft_page_key(self.ns, a.hash, self.tp_rank, idx, a.token),
                                self.page(layer, a.ids[g])))
                elif not draft and not a.draft_only:
                    out.append((page_key(self.ns, ATTN, a.hash, self.tp_rank, idx),
                                self.page(layer, a.ids[g])))
        return out

    def _markers(self, saves) -> tuple[list[bytes], int]:
        """Commit markers of what this step saved completely (every layer of
        the kind), and the number of blocks they commit."""
        done = lambda names: all(n in self._saved_layers for n in names)  # noqa: E731
        drafter = self.layout.drafter_layers
        target = [n for n in self.layout.layers(ATTN) if n not in drafter]
        attn = [a for s in saves for a in s.attn]
        state = [b for s in saves for b in s.mamba]
        rank, markers, blocks = self.tp_rank, [], 0
        if attn and done(target):
            full = [a for a in attn if not a.draft_only]
            markers += [marker_key(self.ns, ATTN, a.hash, rank) for a in full]
            blocks += len(full)
        if attn and drafter and done(drafter):
            markers += [draft_marker_key(self.ns, a.hash, rank, a.token)
                        for a in attn if a.token is not None]
        if state and done(self.layout.layers(STATE)):
            markers += [marker_key(self.ns, STATE, h, rank) for h, _ in state]
            blocks += len(state)
        return markers, blocks

    def save_kv_layer(self, layer: str) -> None:
        if not self.layerwise or layer not in self.layer_group:
            return
        # the send thread copies the pages once the compute stream wrote them
        t0 = time.perf_counter()
        self.saver.submit(self._save_pages(layer), self.device)
        self._saved_layers.add(layer)
        self._hook_seconds += time.perf_counter() - t0

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None:
            return
        if self.layerwise:
            self.pipeline.drain()
        t0 = time.perf_counter()
        failed = agree_on_failures(meta, self._collect_failures(), self.layout.tp_size,
                                   self.log)
        self._failed_reqs |= failed  # (what get_block_ids_with_load_errors reports)
        if meta.loads:
            self._release_pins(meta.loads)
            self.quarantine.failed(meta.loads, failed)
        # nothing computed from a failed load's pages reaches the pool: not
        # this step's, nor a later step's that vLLM planned before it learnt
        # of the failure (asynchronous scheduling), nor another request's
        # that read those pages (worker_taint)
        saves, tainted = self.quarantine.split(meta.saves)
        if self._copy_missing():
            saves, tainted = [], meta.saves
        exclude = {key for layer in self.order
                   for key, _ in self._save_pages(layer, tainted)}
        if not self.layerwise:
            for layer in self.order:
                self.saver.submit(self._save_pages(layer, saves), self.device)
            self._saved_layers = set(self.order)
        if meta.saves:
            # incomplete kinds get no marker: lookups never see them
            markers, blocks_saved = self._markers(saves)
            # final-layer drain: every queued page is written with its markers
            # (now, or - deferred - before the next step's loads and saves)
            step = self.saver._step
            self.saver.commit(markers, exclude=exclude, blocks=blocks_saved,
                              wait=not self.config.defer_last_save)
            if self._events is not None:  # the forward thread goes on from here
                self._events.append(("committed", step))
        self._hook_seconds += time.perf_counter() - t0
        if self._events is not None:
            self._flush_events()
        if self.pipeline is not None:  # fold running totals in
            p, q = self.pipeline, self.saver
            now = {"bytes_loaded": p.bytes_loaded, "wait_seconds": p.wait_seconds,
                   "load_seconds": p.load_seconds, "bytes_saved": q.bytes_saved,
                   "blocks_saved": q.blocks_saved,
                   "save_seconds": q.seconds, "saves_skipped": q.skipped,
                   "save_failures": q.failures, "save_write_seconds": q.write_seconds,
                   "save_cpu_seconds": q.cpu_seconds, "save_hook_seconds": self._hook_seconds,
                   "precopy_seconds": self._precopy_seconds,
                   "evictions": getattr(self.backend, "evicted_groups", 0),
                   "put_skipped": getattr(self.backend, "put_skipped", 0)}
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

    def _flush_events(self) -> None:
        import json

        new = self._events[self._flushed:]  # (the send thread only appends)
        self._flushed += len(new)
        with open(self.faults.event_log, "a") as f:
            f.writelines(json.dumps(e) + "\n" for e in new)

    def take_stats(self):
        """Stats since the last call (vLLM polls once per step), or None."""
        if self.stats.is_empty():
            return None
        from .stats import PoolStats

        out, self.stats = self.stats, PoolStats()
        return out

    def clear(self) -> None:
        self._meta = None

    def close(self) -> None:
        self._close_async()
        if self.pipeline is not None:
            self.pipeline.close()
        if self.saver is not None:
            self.saver.close()
            if self._events is not None:
                self._flush_events()
