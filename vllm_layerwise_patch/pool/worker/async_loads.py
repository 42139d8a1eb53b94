"""The worker's asynchronous loads (``load_async``).  :class:`.forward.PoolWorker`
holds one; it plans its loads and settles their failures through the
worker's :class:`.worker.loads.WorkerLoads`.

With ``load_async`` the scheduler answers a hit with ``load_async=True``:
vLLM allocates the request's blocks, parks it in ``WAITING_FOR_REMOTE_KVS``
and hands its load to the workers in that step's metadata
(``PoolMetadata.async_loads``).  ``start_load_kv`` - which Model Runner V2
calls after the step's forward, or in a step without one - submits each
such load to background threads: every layer of the hit, outside any
forward; attention pages into the hit's blocks, the boundary
linear-attention state into the block at the hit's end, where vLLM's own
prefix cache holds a state.  The request's later step is an ordinary
prefix-cache hit for vLLM (its own mamba pre-copy from that block); the
layerwise machinery finds nothing to load for it and only runs the
deferred pre-copy.  No forward touches those blocks meanwhile: they belong
to the parked request, and vLLM keeps an aborted request's blocks until
the load is reported finished.

``transfer_results`` (vLLM's ``get_transfer_results``, called every step
with or without a forward) reports the requests whose loads are done.  A
load with a failed item (an entry evicted or damaged after the lookup, a
backend error) is reported in ``failed_recving`` too - vLLM's per-request
load-failure channel, which takes hybrid layouts: under
``kv_load_failure_policy='recompute'`` the request starts again from token 0
(the scheduler then answers its lookup with 0), under ``'fail'`` it ends
with an error.  Its block ids are not reported through
``get_block_ids_with_load_errors``: vLLM 0.32 refuses block ids for layouts
with several KV cache groups (every hybrid model), and truncating a hybrid
request at a failed block cannot give it a linear-attention state there.
As for loads in a forward, the failed block leaves the pool, the failure is
counted and logged once, and this rank's pins are released once the load
is done, successful or not.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import TYPE_CHECKING

import torch

from ..keys import group_of
from ..metadata import LoadSpec, PoolMetadata
from .pipeline import LoadItem, read_items
from ..side import PoolSide
from .loads import WorkerLoads
from .pages import RankPages

if TYPE_CHECKING:  # (.stats imports vLLM)
    from ..stats import PoolStats

#: (bytes written, seconds, [(key, error)] of failed items)
_Outcome = tuple[int, float, list[tuple[bytes, Exception]]]


class AsyncLoads:
    def __init__(self, side: PoolSide, pages: RankPages, loads: WorkerLoads,
                 stats: PoolStats) -> None:
        self.backend = side.backend
        self.ns = side.ns
        self.config = side.config
        self.block_size = side.layout.block_size
        self.log = side.log
        self.faults = side.faults
        self.pages = pages
        self.loads = loads
        self.stats = stats  # the worker's, reported to vLLM
        self._pool: cf.ThreadPoolExecutor | None = None  # started by the first load
        # req_id -> load in flight, and the namespace it reads (the worker's
        # may change meanwhile: the weights changed)
        self._jobs: dict[str, tuple[LoadSpec, cf.Future, bytes]] = {}
        self._todo: list[LoadSpec] = []  # this step's, not started yet
        self._refused: set[str] = set()  # failed before they started (not reported yet)

    def note(self, meta: PoolMetadata, refused: set[str] = frozenset()) -> None:
        """This step's asynchronous loads (started by :meth:`start`); those of
        ``refused`` requests never start and are reported failed."""
        self._todo = [s for s in meta.async_loads if s.req_id not in refused]
        gone = [s for s in meta.async_loads if s.req_id in refused]
        if gone:
            self.loads.release_pins(gone)
            self.stats.add(load_failures=len(gone))
            self._refused |= {s.req_id for s in gone}
        if self._todo:
            self.stats.add(hit_tokens=sum((s.end - s.start) * self.block_size
                                          for s in self._todo))

    def start(self) -> None:
        todo, self._todo = self._todo, []
        for spec in todo:
            tasks, _ = self.loads.plan([spec], bulk=False)
            tasks = self.loads.debug_fail(tasks)
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(
                    max_workers=self.config.load_threads, thread_name_prefix="vlp-async-load")
            gate = None
            lanes = self.loads.pipeline.lanes if self.loads.pipeline is not None else None
            if lanes is not None:  # nothing is written before the compute stream got here
                gate = lanes.ops.record(lanes.ops.current_stream())
            self._jobs[spec.req_id] = (spec, self._pool.submit(self._load, tasks, self.ns,
                                                               gate), self.ns)

    def _load(self, tasks: dict[str, list[LoadItem]], ns: bytes, gate=None) -> _Outcome:
        """Every layer of one request's hit, in forward order; a failed item
        is recorded, not raised.  On the GPU data path (:mod:`.device`) the
        values go through this thread's lane, and the load is done when its
        copies are."""
        lanes = self.loads.pipeline.lanes if self.loads.pipeline is not None else None
        if lanes is not None:
            lane = lanes.lane()
            try:
                with lane.active(gate):
                    return self._read(tasks, ns, lane)
            finally:
                lanes.ops.synchronize(lane.finish())
        return self._read(tasks, ns)

    def _read(self, tasks: dict[str, list[LoadItem]], ns: bytes, lane=None) -> _Outcome:
        t0 = time.perf_counter()
        failures: list[tuple[bytes, Exception]] = []
        moved = 0
        delay = self.faults.load_delay_ms / 1e3
        on_fail = lambda i, key, dests, exc: failures.append((key, exc))  # noqa: E731
        for layer in self.pages.order:
            items = tasks.get(layer)
            if not items:
                continue
            if delay:
                time.sleep(delay)
            if lane is not None:
                lane.begin(sum(d[0].numel() for _, d in items))
            moved += read_items(self.backend, ns, items, on_fail=on_fail,
                                check_crc=not self.config.verify_on_lookup, stage=lane)
        device = self.pages.device
        if lane is None and device is not None and device.type == "cuda":
            # pageable host -> device copies may still be in flight on this
            # thread's stream: the request is computed only after "done"
            torch.cuda.current_stream(device).synchronize()
        return moved, time.perf_counter() - t0, failures

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(requests whose asynchronous loads are done, those of them that
        failed)."""
        failed, self._refused = self._refused, set()
        done = set(failed)
        for rid, (spec, fut, ns) in list(self._jobs.items()):
            if not fut.done():
                continue
            del self._jobs[rid]
            done.add(rid)
            try:
                moved, seconds, failures = fut.result()
            except Exception as exc:  # noqa: BLE001 - a load never stops the engine
                moved, seconds, failures = 0, 0.0, [(b"", exc)]
            self.stats.add(bytes_loaded=moved, load_seconds=seconds)
            self.loads.release_pins([spec], ns)
            if not failures:
                continue
            self.loads.drop_broken({group_of(k) for k, _ in failures
                                    if k and not k.startswith(b"\0")})  # (not debug keys)
            self.stats.add(load_failures=1)
            key, exc = failures[0]
            self.log.warning(
                "load", "vllm-layerwise-patch pool: a load failed (%s: %s); request %s "
                "is handed back to vLLM's kv_load_failure_policy (recompute or fail) "
                "and its pages are not used (further failures are counted in the "
                "metrics, not logged)", type(exc).__name__, exc, rid)
            if not self.faults.hide_load_errors:
                failed.add(rid)
        return done, failed

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
