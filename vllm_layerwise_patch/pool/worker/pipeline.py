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

Saves go through :mod:`.send_thread` (the send thread).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import warnings

import numpy as np
import torch

from ..backends.base import HEADER_SIZE, Backend, unpack, verify

# torch.frombuffer warns on read-only buffers; we only read from them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class LoadError(RuntimeError):
    pass


def fill_page(dest: torch.Tensor, payload: memoryview) -> None:
    if dest.device.type == "cpu" and dest.dtype == torch.uint8 and dest.is_contiguous():
        # a plain memcpy: torch's copy_ of one page costs several times more
        np.copyto(dest.view(-1).numpy(), np.frombuffer(payload, dtype=np.uint8))
        return
    src = torch.frombuffer(payload, dtype=torch.uint8)
    # vLLM allocates KV caches as inference tensors; load threads are not in
    # the engine's inference mode
    with torch.inference_mode():
        dest.copy_(src)


LoadItem = tuple[bytes, list[torch.Tensor]]  # key -> every page it fills


def _direct_ptrs(items: list[LoadItem]) -> list[int] | None:
    """The page addresses of ``items`` when each fills one contiguous host
    page (what a zero-copy read needs), else None."""
    ptrs = []
    for _, dests in items:
        if len(dests) != 1:
            return None
        d = dests[0]
        if d.device.type != "cpu" or d.dtype != torch.uint8 or not d.is_contiguous():
            return None
        ptrs.append(d.data_ptr())
    return ptrs


def read_items(backend: Backend, ns: bytes, items: list[LoadItem], *, check_crc: bool = True,
               on_fail=None) -> int:
    """Read ``items`` (key -> the pages it fills) from ``backend`` and fill
    the pages, each value validated; returns the bytes written.  A failed
    item raises, or - with ``on_fail(i, key, dests, exc)`` - is handed to it
    (also every item a failing backend did not deliver).

    Where the backend can (:meth:`.Backend.read_direct`: host pages in
    registered memory) the payload lands in the page itself and is validated
    there; a page that fails is handed to ``on_fail`` (which zeroes it and
    fails the request's load: it recomputes) or raises, as any failed item."""
    moved = [0]
    done: set[int] = set()

    def fail(i: int, key: bytes, dests: list[torch.Tensor], exc: Exception) -> None:
        if on_fail is None:
            raise exc
        on_fail(i, key, dests, exc)

    def consume(i: int, key: bytes, value) -> None:
        dests = items[i][1]
        done.add(i)
        try:
            if value is None:
                raise LoadError(f"pool entry {key!r} vanished between lookup and load")
            payload = unpack(key, value, ns, expected_length=dests[0].numel(),
                             check_crc=check_crc)
            for dest in dests:
                fill_page(dest, payload)
                moved[0] += dest.numel()
        except Exception as exc:
            fail(i, key, dests, exc)

    try:
        keys = [k for k, _ in items]
        ptrs = _direct_ptrs(items) if hasattr(backend, "read_direct") else None
        heads = None if ptrs is None else backend.read_direct(
            keys, ptrs, [d[0].numel() for _, d in items])
        if heads is None:
            backend.read_many(keys, consume, [HEADER_SIZE + d[0].numel() for _, d in items])
        for i, head in enumerate(heads or ()):
            key, dests = items[i]
            done.add(i)
            try:
                if head is None:
                    raise LoadError(f"pool entry {key!r} vanished between lookup and load")
                page = dests[0].view(-1).numpy().data
                if len(head) < HEADER_SIZE:
                    unpack(key, head, ns)  # raises: not a value of this page's size
                verify(key, head, page, ns, dests[0].numel(), check_crc)
                moved[0] += dests[0].numel()
            except Exception as exc:
                fail(i, key, dests, exc)
    except Exception as exc:
        if on_fail is None:
            raise
        # the backend itself failed: every item it did not deliver fails
        for i, (key, dests) in enumerate(items):
            if i not in done:
                on_fail(i, key, dests, exc)
    return moved[0]


class LayerwisePipeline:
    def __init__(self, order: list[str], backend: Backend, namespace: bytes, *,
                 prefetch: int = 2, threads: int = 2, check_crc: bool = True,
                 delay: float = 0.0, fence_in_load_seconds: bool = False) -> None:
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

    def _load_layer(self, layer: str, items: list[LoadItem], gate=None) -> int:
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

    def _fail(self, layer: str, i: int, key: bytes, dests: list[torch.Tensor],
              exc: Exception) -> None:
        """Tolerant mode: the caller recomputes this item's request; its
        pages get zeros, not half-written bytes (a NaN pattern would reach
        this step's logits)."""
        with torch.inference_mode():
            for dest in dests:
                dest.zero_()
        with self._lock:
            self.failures.append((layer, i, key, exc))

    def _load_items(self, layer: str, items: list[LoadItem]) -> int:
        on_fail = None
        if self._tolerate:
            def on_fail(i: int, key: bytes, dests: list[torch.Tensor], exc: Exception) -> None:
                self._fail(layer, i, key, dests, exc)
        return read_items(self.backend, self.ns, items, check_crc=self.check_crc,
                          on_fail=on_fail)

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
        if device is not None and device.type == "cuda":
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
                self.bytes_loaded += fut.result()
            finally:
                self.wait_seconds += time.perf_counter() - t0
        self._submit_until(i + 1 + self.prefetch)

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
                fut.result()
            except Exception:
                pass
        self._futures = {}
        self._tasks = {}

    def close(self) -> None:
        self.drain()
        self.pool.shutdown(wait=True)
