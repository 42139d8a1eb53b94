"""The per-layer transfer pipeline: needs only torch, a backend and a
namespace - no vLLM objects - so it can be tested and benchmarked alone.

Loads: :meth:`LayerwisePipeline.start` takes, per layer, the (key,
destination page) pairs of one step and submits the first ``prefetch`` layers
(in forward order) to the load threads; :meth:`wait` blocks on one layer,
surfaces its error, and submits the next layer so that at most ``prefetch``
layers are in flight ahead of compute.  Every value is validated (length,
checksum, namespace, and the key it was written under: the digest in its
header) before its page is used: before a byte reaches the page,
or - a zero-copy read straight into registered host pages - in the page,
where a failure fails that load (:func:`read_items`).

Compute-start fence: :meth:`LayerwisePipeline.record_compute_start` records a
device event when the compute stream reaches a layer; loads submitted after it
synchronise on that event before writing pages, so prefetch follows the
stream, not the host.  On CPU there is no stream and no event.

Pages on a CUDA device (with ``staging_bytes``) take the GPU data path of
:mod:`.device`: each load thread stages values in its pinned ring and copies
them on its own stream, after the fence (the stream waits, not the thread);
:meth:`wait` makes the compute stream wait for the layer's event - the host
waits only for the thread to have queued the copies, and for the copies
themselves only when an item of the layer failed (its pages are zeroed on the
same stream).  A step's first loads wait for what the compute stream had
queued when the step began.  Host pages never take it: the CPU path is the
one above, unchanged.

Saves go through :mod:`.send_thread` (the send thread).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import torch

from ..backends.base import Backend
from .device import DeviceLanes, Lane
from .reads import LoadError, LoadItem, fill_page, read_items

__all__ = ["LayerwisePipeline", "LoadError", "LoadItem", "fill_page", "read_items"]


class LayerwisePipeline:
    def __init__(self, order: list[str], backend: Backend, namespace: bytes, *,
                 prefetch: int = 2, threads: int = 2, check_crc: bool = True,
                 delay: float = 0.0, fence_in_load_seconds: bool = False,
                 device=None, staging_bytes: int = 0, lanes: int = 0) -> None:
        self.order = list(order)
        self.pos = {name: i for i, name in enumerate(self.order)}
        self.backend = backend
        self.ns = namespace
        self.prefetch = max(1, prefetch)
        self.check_crc = check_crc
        self.delay = delay  # tests: every layer's load takes this long (seconds)
        self.fence_in_load_seconds = fence_in_load_seconds  # tests: the rule before the fix
        self.pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vlp-load")
        self._futures: dict[str, cf.Future] = {}
        self._tasks: dict[str, list[LoadItem]] = {}
        self._next = 0
        self._lock = threading.Lock()
        self.bytes_loaded = 0
        self.wait_seconds = 0.0
        self.load_seconds = 0.0
        self._gate = None  # device event: compute reached the latest layer
        self._tolerate = False
        #: (layer, item index, key, error) of this step's failed items (tolerant mode)
        self.failures: list[tuple[str, int, bytes, Exception]] = []
        # the GPU data path (module doc): ``device`` is a .device.CudaOps
        # (or a test's fake); ``lanes`` threads share ``staging_bytes``
        self.ops = device if staging_bytes > 0 else None
        self.lanes = (DeviceLanes(device, staging_bytes, lanes or threads)
                      if self.ops is not None else None)

    def _load_layer(self, layer: str, items: list[LoadItem], gate=None):
        if self.lanes is not None:
            return self._load_layer_staged(layer, items, gate)
        t0 = time.perf_counter()
        try:
            if gate is not None:
                gate.synchronize()  # do not write ahead of the compute stream
            if not self.fence_in_load_seconds:
                # load_seconds is the transfer alone: the wait for compute to
                # reach the layer is not the backend's (what the forward
                # itself waits for is wait_seconds)
                t0 = time.perf_counter()
            if self.delay:
                time.sleep(self.delay)
            return self._load_items(layer, items)
        finally:
            with self._lock:
                self.load_seconds += time.perf_counter() - t0

    def _load_layer_staged(self, layer: str, items: list[LoadItem], gate):
        """The GPU data path (module doc): (bytes, the event after the
        layer's copies)."""
        lane = self.lanes.lane()
        t0 = time.perf_counter()
        try:
            with lane.active(gate):  # the stream waits for the fence, not this thread
                lane.begin(sum(d[0].numel() for _, d in items))
                if self.delay:
                    time.sleep(self.delay)
                moved = self._load_items(layer, items, lane)
        finally:
            event = lane.finish()  # (also after an error: the ring's slots are fenced)
            with self._lock:
                self.load_seconds += time.perf_counter() - t0
        return moved, event

    def _fail(self, layer: str, i: int, key: bytes, dests: list[torch.Tensor],
              exc: Exception, lane: Lane | None = None) -> None:
        """Tolerant mode: the caller recomputes this item's request; its
        pages get zeros, not half-written bytes (a NaN pattern would reach
        this step's logits) - on a lane, after any copy into them."""
        if lane is not None:
            lane.zero(dests)
        else:
            with torch.inference_mode():
                for dest in dests:
                    dest.zero_()
        with self._lock:
            self.failures.append((layer, i, key, exc))

    def _load_items(self, layer: str, items: list[LoadItem], lane: Lane | None = None) -> int:
        on_fail = None
        if self._tolerate:
            def on_fail(i: int, key: bytes, dests: list[torch.Tensor], exc: Exception) -> None:
                self._fail(layer, i, key, dests, exc, lane)
        return read_items(self.backend, self.ns, items, check_crc=self.check_crc,
                          on_fail=on_fail, stage=lane)

    def _submit_until(self, limit: int) -> None:
        with self._lock:
            while self._next < min(limit, len(self.order)):
                layer = self.order[self._next]
                self._next += 1
                items = self._tasks.get(layer)
                if items:
                    self._futures[layer] = self.pool.submit(self._load_layer, layer, items,
                                                            self._gate)

    def register_memory(self, tensors) -> bool:
        """Offer the host memory behind ``tensors`` (the KV cache) to the
        backend for zero-copy loads (:meth:`.Backend.register_memory`)."""
        storages = {}
        for t in tensors:
            if t.device.type == "cpu":
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        register = getattr(self.backend, "register_memory", None)
        return bool(register) and any([register(p, n) for p, n in storages.items()])

    def record_compute_start(self, device: torch.device | None) -> None:
        """The compute stream has reached the current layer (see module doc)."""
        if self.ops is not None:
            if self._tasks:  # (no event in a step without loads: nothing waits for it)
                self._gate = self.ops.record(self.ops.current_stream())
        elif device is not None and device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._gate = ev

    def start(self, tasks: dict[str, list[LoadItem]], *, tolerate_errors: bool = False) -> None:
        """Begin a step's loads (``tasks``: layer -> items).

        With ``tolerate_errors`` a failed item does not raise from
        :meth:`wait`: its destination pages are zeroed and it is listed in
        :attr:`failures` (layer, item index, key, error) for the caller to report;
        otherwise the first failure raises from :meth:`wait`."""
        self.drain()
        self._gate = None
        if self.ops is not None and any(tasks.values()):
            # no page is written before the compute stream got here
            self._gate = self.ops.record(self.ops.current_stream())
        self._tolerate = tolerate_errors
        self.failures = []
        self._tasks = {k: v for k, v in tasks.items() if v}
        self._futures = {}
        self._next = 0
        plan = getattr(self.backend, "plan_loads", None)
        if plan is not None:  # (Mooncake: whole block objects, see mooncake.whole)
            try:
                plan(self._tasks)
            except Exception:  # noqa: BLE001 - the loads go on as ranges
                pass
        if self._tasks:
            self._submit_until(self.prefetch)

    @property
    def active(self) -> bool:
        return bool(self._tasks)

    def wait(self, layer: str) -> None:
        """Block until ``layer``'s loads are in place; raise on a failed load."""
        if not self._tasks:
            return
        i = self.pos.get(layer)
        if i is None:
            return
        self._submit_until(i + 1)  # in case the caller skipped ahead
        fut = self._futures.pop(layer, None)
        if fut is not None:
            t0 = time.perf_counter()
            try:
                self._landed(layer, fut.result())
            finally:
                self.wait_seconds += time.perf_counter() - t0
        self._submit_until(i + 1 + self.prefetch)

    def _landed(self, layer: str, result) -> None:
        """A layer's load was handed over (``result``: its bytes, or on the
        GPU path its bytes and event)."""
        if self.ops is None:
            self.bytes_loaded += result
            return
        moved, event = result
        self.bytes_loaded += moved
        with self._lock:
            failed = any(f[0] == layer for f in self.failures)
        if failed:  # its pages are zeroed on the lane: in place before we go on
            self.ops.synchronize(event)
        else:
            self.ops.wait(self.ops.current_stream(), event)

    def load_all(self, tasks: dict[str, list[LoadItem]], *, tolerate_errors: bool = False) -> None:
        """Synchronous load of every layer (the patch-free fallback)."""
        self.start(tasks, tolerate_errors=tolerate_errors)
        for layer in self.order:
            self.wait(layer)
        self._tasks = {}

    def drain(self) -> None:
        """Wait for any load still in flight (errors are dropped: the step that
        issued them has ended)."""
        for fut in list(self._futures.values()):
            try:
                result = fut.result()
            except Exception:
                continue
            if self.ops is not None:  # nothing later on the compute stream races it
                self.ops.wait(self.ops.current_stream(), result[1])
        self._futures = {}
        self._tasks = {}

    def close(self) -> None:
        self.drain()
        self.pool.shutdown(wait=True)
        if self.lanes is not None:
            self.lanes.close()
