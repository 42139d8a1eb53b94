"""The worker's loads in a forward: which keys fill which pages this step
(each key read once however many requests share it), the layerwise pipeline
that reads them, the test knob that makes a layer's load fail, and what a
failed load does - the request goes back to vLLM's load-failure policy, the
broken block leaves the pool - and the pins a finished load releases.
:class:`.forward.PoolWorker` holds one; the asynchronous loads
(:mod:`.worker.async_loads`) plan theirs and settle their failures through it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..keys import ATTN, STATE, draft_page_key, group_of, layer_id, page_key
from ..metadata import LoadSpec, PoolMetadata, load_groups, owner_of
from .device import device_ops
from .pipeline import LayerwisePipeline, LoadItem
from ..side import PoolSide
from .pages import RankPages
from .quarantine import agree_on_failures

if TYPE_CHECKING:  # (.stats imports vLLM)
    from ..stats import PoolStats


class WorkerLoads:
    def __init__(self, side: PoolSide, pages: RankPages, stats: PoolStats) -> None:
        self.backend = side.backend
        self.ns = side.ns
        self.config = side.config
        self.layout = side.layout
        self.log = side.log
        self.faults = side.faults
        self.pages = pages
        self.stats = stats  # the worker's, reported to vLLM
        self.pipeline: LayerwisePipeline | None = None  # once the caches are registered
        self.owners: dict[str, list[list[str]]] = {}  # per layer: who each item serves
        self.failed: set[str] = set()  # requests whose loads failed this step
        self.refused: set[str] = set()  # ... of which not even started
        self._debug_failed = False

    def open(self) -> None:
        """The layerwise pipeline over the registered caches (pages on a CUDA
        device: its GPU data path, :mod:`.device`, whose lanes the
        asynchronous loads' threads use too)."""
        faults, cfg = self.faults, self.config
        self.pipeline = LayerwisePipeline(self.pages.order, self.backend, self.ns,
                                          prefetch=cfg.prefetch_layers,
                                          threads=cfg.load_threads,
                                          # the lookup already checked every
                                          # checksum a hit relies on
                                          check_crc=not cfg.verify_on_lookup,
                                          delay=faults.load_delay_ms / 1e3,
                                          fence_in_load_seconds=faults.load_seconds_with_fence,
                                          device=device_ops(self.pages.device),
                                          staging_bytes=cfg.pinned_staging_bytes,
                                          lanes=cfg.load_threads * (2 if cfg.load_async else 1))
        # zero-copy loads where possible
        self.pipeline.register_memory(self.pages.caches.values())

    def set_namespace(self, ns: bytes) -> None:
        """Key loads (and pins) by ``ns`` from now on (between steps)."""
        self.ns = ns
        if self.pipeline is not None:
            self.pipeline.ns = ns

    def begin_step(self, meta: PoolMetadata, refused: set[str] = frozenset()) -> None:
        """``refused``: requests whose loads must not run (their adapter copy
        here is not the one named): failed loads from the start."""
        self.refused = {s.req_id for s in meta.loads} & set(refused)
        if meta.loads:
            self.stats.add(hit_tokens=sum((s.end - s.start) * self.layout.block_size
                                          for s in meta.loads if s.req_id not in self.refused))
        if self.refused:
            self.stats.add(load_failures=len(self.refused))
        self.failed = set(self.refused)

    def start(self, meta: PoolMetadata) -> None:
        """Layerwise: this step's loads start now, waited for layer by layer."""
        self.pipeline.start(self.debug_fail(self.tasks(meta, bulk=False)),
                            tolerate_errors=self.tolerate(meta))

    def load_all(self, meta: PoolMetadata) -> None:
        """Bulk: every page of this step's loads, before the forward."""
        self.pipeline.load_all(self.debug_fail(self.tasks(meta, bulk=True)),
                               tolerate_errors=self.tolerate(meta))

    def wait(self, layer: str) -> None:
        """Layerwise: block until ``layer``'s pages of this step are loaded
        (a failure raises unless the step tolerates it)."""
        self.pipeline.wait(layer)

    def compute_started(self, device: torch.device) -> None:
        """The compute stream reached the current layer: later layers' loads
        may overwrite the pages it no longer uses (the fence)."""
        self.pipeline.record_compute_start(device)

    def drain(self) -> None:
        """End of a layerwise step: every load of it finished."""
        self.pipeline.drain()

    @property
    def opened(self) -> bool:
        """Whether the caches were registered (the pipeline exists)."""
        return self.pipeline is not None

    def tasks(self, meta: PoolMetadata, bulk: bool) -> dict[str, list[LoadItem]]:
        """Per layer, the (key, destination pages) items of this step's loads,
        each key read once however many requests load it (requests sharing a
        prefix in one step); ``self.owners[layer][i]`` lists the requests
        item ``i`` serves."""
        tasks, self.owners = self.plan([s for s in meta.loads if s.req_id not in self.refused],
                                       bulk)
        return tasks

    def plan(self, loads: list[LoadSpec], bulk: bool
             ) -> tuple[dict[str, list[LoadItem]], dict[str, list[list[str]]]]:
        """Per layer, the items of ``loads`` and the requests each item serves."""
        tasks: dict[str, list[LoadItem]] = {}
        owners: dict[str, list[list[str]]] = {}
        pages = self.pages
        rank = pages.tp_rank
        if self.faults.load_tp_rank >= 0:  # negative control (tests)
            rank = self.faults.load_tp_rank
        for layer in pages.order:
            g, kind = pages.group[layer], pages.kind[layer]
            idx, draft = layer_id(layer), layer in self.layout.drafter_layers
            merged: dict[bytes, tuple[list[torch.Tensor], list[str]]] = {}

            def add(key: bytes, dests: list[torch.Tensor], req: str) -> None:
                d, reqs = merged.setdefault(key, ([], []))
                d += dests
                if req not in reqs:
                    reqs.append(req)

            for spec in loads:
                if kind == ATTN:
                    for i, (h, bid) in enumerate(zip(spec.hashes, spec.attn_blocks.get(g, []))):
                        key = (draft_page_key(self.ns, h, rank, idx, spec.next_tokens[i])
                               if draft else page_key(self.ns, ATTN, h, rank, idx))
                        add(key, [pages.page(layer, bid)], spec.req_id)
                elif g in spec.mamba_blocks and not self.faults.skip_mamba_load:
                    dests = [pages.page(layer, spec.mamba_blocks[g])]
                    running = spec.running_blocks.get(g)
                    if bulk and running is not None and running != spec.mamba_blocks[g]:
                        dests.append(pages.page(layer, running))
                    add(page_key(self.ns, STATE, spec.hashes[-1], rank, idx), dests,
                        spec.req_id)
            tasks[layer] = [(k, d) for k, (d, _) in merged.items()]
            owners[layer] = [o for _, o in merged.values()]
        return tasks, owners

    @staticmethod
    def tolerate(meta: PoolMetadata) -> bool:
        """Report failed loads to vLLM (the request recomputes) only when the
        scheduler process can take block load errors for this layout (the
        ``hybrid-load-recompute`` patch, announced in the metadata);
        otherwise a failed load raises: the forward must not run on a wrong
        state."""
        return bool(getattr(meta, "report_load_errors", False))

    def debug_fail(self, tasks: dict[str, list[LoadItem]]) -> dict[str, list[LoadItem]]:
        """debug_fail_load_layer (tests): that layer's loads fail in the first
        step that loads it, as a pool entry removed between lookup and load
        would."""
        layer = self.faults.fail_load_layer
        if layer and layer in tasks and not self._debug_failed:
            self._debug_failed = True
            tasks[layer] = [(b"\0debug-missing/" + k, d) for k, d in tasks[layer]]
        return tasks

    def collect_failures(self) -> set[str]:
        """Requests whose loads failed this step (tolerant mode); the blocks
        behind a failed item are dropped from the pool (so they are saved
        again when recomputed)."""
        if self.pipeline is None or not self.pipeline.failures:
            return self.failed
        broken = set()
        for layer, i, key, exc in self.pipeline.failures:
            if not key.startswith(b"\0"):  # (a debug_fail_load_layer key)
                broken.add(group_of(key))
            for req in self.owners.get(layer, [])[i]:
                if req in self.failed:
                    continue
                self.failed.add(req)
                self.stats.add(load_failures=1)
                self.log.warning(
                    "load", "vllm-layerwise-patch pool: a load failed (%s: %s); request %s "
                    "is handed back to vLLM's kv_load_failure_policy (recompute or fail) "
                    "and its pages are not used (further failures are counted in the "
                    "metrics, not logged)", type(exc).__name__, exc, req)
        self.pipeline.failures = []
        self.drop_broken(broken)
        return self.failed

    def settle(self, meta: PoolMetadata) -> set[str]:
        """At the end of the step: the requests whose loads failed on any TP
        rank; this rank's pins on the step's loads are released."""
        failed = agree_on_failures(meta, self.collect_failures(), self.layout.tp_size,
                                   self.log)
        self.failed |= failed  # (what block_ids_with_load_errors reports)
        if meta.loads:
            self.release_pins(meta.loads)
        return failed

    def drop_broken(self, groups: set[bytes]) -> None:
        """Remove the blocks behind failed loads from the pool (they are saved
        again when recomputed)."""
        if groups:
            try:
                self.backend.delete_groups(sorted(groups))
            except Exception:  # noqa: BLE001 - best effort; the lookup drops them too
                pass

    def release_pins(self, loads: list[LoadSpec], ns: bytes | None = None) -> None:
        """This rank has read what ``loads`` (named in ``ns``, default the
        current namespace) needed: release the scheduler's pins on this
        rank's groups."""
        for spec in loads:
            groups = load_groups(ns or self.ns, spec.hashes, [self.pages.tp_rank],
                                 self.layout.has_state)
            try:
                self.backend.unpin(groups, owner_of(spec.req_id))
            except Exception:  # noqa: BLE001 - pins expire after pin_seconds anyway
                pass

    def block_ids_with_load_errors(self, meta: PoolMetadata | None) -> set[int]:
        """Every block id (all groups) of this step's loads that failed: the
        patched scheduler maps them back to the requests holding them."""
        failed = self.collect_failures()
        if not failed or meta is None or self.faults.hide_load_errors:
            return set()
        out: set[int] = set()
        for spec in meta.loads:
            if spec.req_id in failed:
                for ids in spec.attn_blocks.values():
                    out.update(ids)
                out.update(spec.mamba_blocks.values())
        return out

    def totals(self) -> dict[str, float]:
        """Running totals of the layerwise pipeline (for the worker's stats)."""
        p = self.pipeline
        return {"bytes_loaded": p.bytes_loaded, "wait_seconds": p.wait_seconds,
                "load_seconds": p.load_seconds}

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
