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
from typing import Any

import torch

from ..copy_protocol import COPY_FOR_LAYER
from .config import PoolConfigError
from .keys import ATTN, STATE, group_of, layer_id, marker_key, page_key
from .layout import PoolLayout
from .pipeline import LayerwisePipeline, LoadItem, SaveQueue
from .scheduler import PoolMetadata, load_groups, owner_of

logger = logging.getLogger("vllm.layerwise_patch")

LAYERWISE_PATCHES = ("deferred-mamba-precopy", "gdn-layer-hooks")


def layerwise_patches_applied() -> tuple[bool, str]:
    try:
        from ..activation import registry

        reg = registry()
        missing = [p for p in LAYERWISE_PATCHES if not reg.is_applied(p)]
    except Exception as exc:  # pragma: no cover - defensive
        return False, f"overlay registry unavailable ({exc})"
    if missing:
        return False, "overlay patch(es) not applied in this process: " + ", ".join(missing)
    return True, "overlay patches applied"


def resolve_tp_rank(tp_size: int) -> int:
    """This worker's TP rank; with TP > 1 an unresolvable rank is a startup
    error (ranks would overwrite each other's pages)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception as exc:
        if tp_size > 1:
            raise PoolConfigError(
                f"LayerwisePoolConnector: cannot tell this worker's tensor-parallel rank "
                f"(TP size {tp_size}): {type(exc).__name__}: {exc}") from None
        return 0


class PoolWorker:
    def __init__(self, *, vllm_config: Any, layout: PoolLayout, backend: Any,
                 namespace: bytes, config: Any) -> None:
        self.backend = backend
        self.ns = namespace
        self.config = config
        self.layout = layout
        self.tp_rank = resolve_tp_rank(layout.tp_size)
        self.layer_group = layout.layer_group
        self.layer_kind = layout.layer_kind
        self.block_size = layout.block_size
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
        self._debug_failed = False
        self._warned: set[str] = set()
        from .stats import PoolStats

        self.stats = PoolStats()
        self._reported = {"bytes_loaded": 0, "wait_seconds": 0.0, "load_seconds": 0.0,
                          "bytes_saved": 0, "save_seconds": 0.0, "saves_skipped": 0,
                          "save_failures": 0, "evictions": 0}

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
                                          delay=self.config.debug_load_delay_ms / 1e3)
        self.saver = SaveQueue(self.backend, self.ns)
        self.device = next(iter(self.caches.values())).device if self.caches else None

    def page(self, layer: str, block_id: int) -> torch.Tensor:
        """The bytes of one (layer, block) page: the raw per-layer allocation V2
        hands over is a page array (attention K/V, or conv then ssm state)."""
        return self.caches[layer][block_id].reshape(-1).view(torch.uint8)

    # -- loads -----------------------------------------------------------------
    def _load_tasks(self, meta: PoolMetadata, bulk: bool) -> dict[str, list[LoadItem]]:
        """Per layer, the (key, destination pages) items of this step's loads;
        ``self._owners`` records which request each item belongs to."""
        tasks: dict[str, list[LoadItem]] = {}
        self._owners = {}
        rank = self.tp_rank
        if self.config.debug_load_tp_rank >= 0:  # negative control (tests)
            rank = self.config.debug_load_tp_rank
        for spec in meta.loads:
            for layer in self.order:
                g, kind = self.layer_group[layer], self.layer_kind[layer]
                idx = layer_id(layer)
                items = tasks.setdefault(layer, [])
                owners = self._owners.setdefault(layer, [])
                if kind == ATTN:
                    for h, bid in zip(spec.hashes, spec.attn_blocks.get(g, [])):
                        items.append((page_key(self.ns, ATTN, h, rank, idx),
                                      [self.page(layer, bid)]))
                        owners.append(spec.req_id)
                elif g in spec.mamba_blocks and not self.config.debug_skip_mamba_load:
                    dests = [self.page(layer, spec.mamba_blocks[g])]
                    running = spec.running_blocks.get(g)
                    if bulk and running is not None and running != spec.mamba_blocks[g]:
                        dests.append(self.page(layer, running))
                    items.append((page_key(self.ns, STATE, spec.hashes[-1], rank, idx),
                                  dests))
                    owners.append(spec.req_id)
        return tasks

    def begin_step(self, meta: PoolMetadata) -> None:
        self._meta = meta
        if meta.loads:
            self.stats.add(hit_tokens=sum(
                (s.end - s.start) * self.block_size for s in meta.loads))
        self._saved_layers = set()
        self._failed_reqs = set()
        if self.layerwise and meta.loads:
            self.pipeline.start(self._debug_fail(self._load_tasks(meta, bulk=False)),
                                tolerate_errors=self._tolerate(meta))

    def start_load_kv(self) -> None:
        if self._meta is not None and not self.layerwise and self._meta.loads:
            self.pipeline.load_all(self._debug_fail(self._load_tasks(self._meta, bulk=True)),
                                   tolerate_errors=self._tolerate(self._meta))

    @staticmethod
    def _tolerate(meta: PoolMetadata) -> bool:
        """Report failed loads to vLLM (the request recomputes) only when the
        scheduler process can take block load errors for this layout (the
        ``hybrid-load-recompute`` patch, announced in the metadata);
        otherwise a failed load raises: the forward must not run on a wrong
        state."""
        return bool(getattr(meta, "report_load_errors", False))

    def _debug_fail(self, tasks: dict[str, list[LoadItem]]) -> dict[str, list[LoadItem]]:
        """debug_fail_load_layer (tests): that layer's loads fail in the first
        step that loads it, as a pool entry removed between lookup and load
        would."""
        layer = self.config.debug_fail_load_layer
        if layer and layer in tasks and not self._debug_failed:
            self._debug_failed = True
            tasks[layer] = [(b"\0debug-missing/" + k, d) for k, d in tasks[layer]]
        return tasks

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(msg, *args)

    def _collect_failures(self) -> set[str]:
        """Requests whose loads failed this step (tolerant mode); the blocks
        behind a failed item are dropped from the pool (so they are saved
        again when recomputed)."""
        if self.pipeline is None or not self.pipeline.failures:
            return self._failed_reqs
        broken = set()
        for layer, i, key, exc in self.pipeline.failures:
            req = self._owners.get(layer, [])[i]
            if not key.startswith(b"\0"):  # (a debug_fail_load_layer key)
                broken.add(group_of(key))
            if req not in self._failed_reqs:
                self._failed_reqs.add(req)
                self.stats.add(load_failures=1)
                self._warn_once(
                    "load", "vllm-layerwise-patch pool: a load failed (%s: %s); request %s "
                    "is handed back to vLLM's kv_load_failure_policy (recompute or fail) "
                    "and its pages are not used (further failures are counted in the "
                    "metrics, not logged)", type(exc).__name__, exc, req)
        self.pipeline.failures = []
        if broken:
            try:
                self.backend.delete_groups(sorted(broken))
            except Exception:  # noqa: BLE001 - best effort; the lookup drops them too
                pass
        return self._failed_reqs

    def _release_pins(self, meta: PoolMetadata) -> None:
        """This rank has read what its loads needed: release the scheduler's
        pins on this rank's groups."""
        for spec in meta.loads:
            groups = load_groups(self.ns, spec.hashes, [self.tp_rank], self.layout.has_state)
            try:
                self.backend.unpin(groups, owner_of(spec.req_id))
            except Exception:  # noqa: BLE001 - pins expire after pin_seconds anyway
                pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Every block id (all groups) of this step's loads that failed: the
        patched scheduler maps them back to the requests holding them."""
        failed = self._collect_failures()
        if not failed or self._meta is None or self.config.debug_hide_load_errors:
            return set()
        out: set[int] = set()
        for spec in self._meta.loads:
            if spec.req_id in failed:
                for ids in spec.attn_blocks.values():
                    out.update(ids)
                out.update(spec.mamba_blocks.values())
        return out

    def wait_for_layer_load(self, layer: str) -> None:
        if not self.layerwise:
            return
        # A load that fails here (entry removed or damaged after the lookup
        # verified it) raises unless vLLM can take the error (tolerant mode:
        # zeroed pages, reported, the request recomputes): the forward must
        # not run on a wrong state.
        if self.config.debug_copy_before_wait and self._model_state is not None:
            # negative control (tests): copy the state before it has arrived
            getattr(self._model_state, COPY_FOR_LAYER)(layer)
        self.pipeline.wait(layer)
        if self._model_state is not None:
            getattr(self._model_state, COPY_FOR_LAYER)(layer)
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
        if not specs:
            return []
        g, kind = self.layer_group[layer], self.layer_kind[layer]
        idx = layer_id(layer)
        return [(page_key(self.ns, kind, h, self.tp_rank, idx), self.page(layer, ids[g]))
                for spec in specs
                for h, ids in (spec.attn if kind == ATTN else spec.mamba) if g in ids]

    def save_kv_layer(self, layer: str) -> None:
        if not self.layerwise or layer not in self.layer_group:
            return
        # the send thread copies the pages once the compute stream wrote them
        self.saver.submit(self._save_pages(layer), self.device)
        self._saved_layers.add(layer)

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None:
            return
        if self.layerwise:
            self.pipeline.drain()
        failed = self._collect_failures()
        if meta.loads:
            self._release_pins(meta)
        # a request whose load failed computed on zeroed pages: none of its
        # pages may reach the pool
        saves = [s for s in meta.saves if s.req_id not in failed]
        exclude = {key for layer in self.order
                   for key, _ in self._save_pages(layer, [s for s in meta.saves
                                                          if s.req_id in failed])}
        if not self.layerwise:
            for layer in self.order:
                self.saver.submit(self._save_pages(layer, saves), self.device)
            self._saved_layers = set(self.order)
        if meta.saves:
            markers, blocks_saved = [], 0
            for kind, blocks in ((ATTN, [b for s in saves for b in s.attn]),
                                 (STATE, [b for s in saves for b in s.mamba])):
                layers = [n for n in self.order if self.layer_kind[n] == kind]
                if not blocks or not all(n in self._saved_layers for n in layers):
                    continue  # incomplete: no marker, lookups never see it
                markers += [marker_key(self.ns, kind, h, self.tp_rank) for h, _ in blocks]
                blocks_saved += len(blocks)
            # final-layer drain: every queued page is written with its markers
            if self.saver.commit(markers, exclude=exclude):
                self.stats.add(blocks_saved=blocks_saved)
        if self.pipeline is not None:  # fold running totals in
            p, q = self.pipeline, self.saver
            now = {"bytes_loaded": p.bytes_loaded, "wait_seconds": p.wait_seconds,
                   "load_seconds": p.load_seconds, "bytes_saved": q.bytes_saved,
                   "save_seconds": q.seconds, "saves_skipped": q.skipped,
                   "save_failures": q.failures,
                   "evictions": getattr(self.backend, "evicted_groups", 0)}
            self.stats.add(**{k: now[k] - self._reported[k] for k in now})
            self._reported = now

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
        if self.pipeline is not None:
            self.pipeline.close()
        if self.saver is not None:
            self.saver.close()
