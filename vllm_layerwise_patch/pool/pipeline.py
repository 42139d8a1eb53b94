"""The per-layer transfer pipeline: needs only torch, a backend and a
namespace - no vLLM objects - so it can be tested and benchmarked alone.

Loads: :meth:`LayerwisePipeline.start` takes, per layer, the (key,
destination page) pairs of one step and submits the first ``prefetch`` layers
(in forward order) to the load threads; :meth:`wait` blocks on one layer,
surfaces its error, and submits the next layer so that at most ``prefetch``
layers are in flight ahead of compute.  Every value is validated (length,
checksum, namespace) before a byte reaches a page.

Compute-start fence: :meth:`LayerwisePipeline.record_compute_start` records a
device event when the compute stream reaches a layer; loads submitted after it
synchronise on that event before writing pages, so prefetch follows the
stream, not the host.  On CPU there is no stream and no event.

Saves: :class:`SaveQueue` - ``save_kv_layer`` enqueues a layer's pages with an
event recorded on the compute stream; a send thread waits for the event,
copies the pages to host bytes and packs them while later layers compute;
:meth:`SaveQueue.commit` (once per step) waits for the queue to drain and
writes the pages and their commit markers in one transaction.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable

import torch

from .backends.base import HEADER_SIZE, Backend, PoolFull, header, pack, unpack

logger = logging.getLogger("vllm.layerwise_patch")

# torch.frombuffer warns on read-only buffers; we only read from them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class LoadError(RuntimeError):
    pass


def fill_page(dest: torch.Tensor, payload: memoryview) -> None:
    src = torch.frombuffer(payload, dtype=torch.uint8)
    # vLLM allocates KV caches as inference tensors; load threads are not in
    # the engine's inference mode
    with torch.inference_mode():
        dest.copy_(src)


LoadItem = tuple[bytes, list[torch.Tensor]]  # key -> every page it fills


class LayerwisePipeline:
    def __init__(self, order: list[str], backend: Backend, namespace: bytes, *,
                 prefetch: int = 2, threads: int = 2, check_crc: bool = True,
                 delay: float = 0.0) -> None:
        self.order = list(order)
        self.pos = {name: i for i, name in enumerate(self.order)}
        self.backend = backend
        self.ns = namespace
        self.prefetch = max(1, prefetch)
        self.check_crc = check_crc
        self.delay = delay  # tests: every layer's load takes this long (seconds)
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
        moved = [0]
        tolerate = self._tolerate
        done: set[int] = set()

        def consume(i: int, key: bytes, value) -> None:
            dests = items[i][1]
            done.add(i)
            try:
                if value is None:
                    raise LoadError(f"pool entry {key!r} vanished between lookup and load")
                payload = unpack(key, value, self.ns, expected_length=dests[0].numel(),
                                 check_crc=self.check_crc)
                for dest in dests:
                    fill_page(dest, payload)
                    moved[0] += dest.numel()
            except Exception as exc:
                if not tolerate:
                    raise
                self._fail(layer, i, key, dests, exc)

        try:
            self.backend.read_many([k for k, _ in items], consume,
                                   [HEADER_SIZE + d[0].numel() for _, d in items])
        except Exception as exc:
            if not tolerate:
                raise
            # the backend itself failed: every item it did not deliver fails
            for i, (key, dests) in enumerate(items):
                if i not in done:
                    self._fail(layer, i, key, dests, exc)
        return moved[0]

    def _submit_until(self, limit: int) -> None:
        with self._lock:
            while self._next < min(limit, len(self.order)):
                layer = self.order[self._next]
                self._next += 1
                items = self._tasks.get(layer)
                if items:
                    self._futures[layer] = self.pool.submit(self._load_layer, layer, items,
                                                            self._gate)

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


PageFn = Callable[[str, int], torch.Tensor]


class PackArena:
    """Host memory the send thread packs values into: each value is its
    header followed by one copy of the page (device -> host on a GPU), the
    checksum read from that copy in place.  Chunks are allocated once,
    pre-faulted (first touch costs 5-20x a copy) and pinned when CUDA is
    there, and reused every step; values are views, valid until
    :meth:`reset` (after the step's write)."""

    CHUNK = 64 << 20

    def __init__(self, namespace: bytes) -> None:
        self.ns = namespace
        self._chunks: list[torch.Tensor] = []
        self._chunk = 0
        self._off = 0

    def _new_chunk(self, size: int) -> torch.Tensor:
        pin = torch.cuda.is_available()
        t = torch.empty(max(size, self.CHUNK), dtype=torch.uint8, pin_memory=pin)
        t.zero_()  # pre-fault
        return t

    def _alloc(self, n: int) -> torch.Tensor:
        while True:
            if self._chunk == len(self._chunks):
                self._chunks.append(self._new_chunk(n))
            buf = self._chunks[self._chunk]
            if self._off + n <= buf.numel():
                view = buf[self._off:self._off + n]
                self._off += (n + 63) & ~63  # keep payloads cache-line aligned
                return view
            if self._off == 0:  # a value larger than a chunk: give it its own
                self._chunks[self._chunk] = self._new_chunk(n)
                continue
            self._chunk, self._off = self._chunk + 1, 0

    def pack(self, page: torch.Tensor) -> memoryview:
        n = page.numel()
        value = self._alloc(HEADER_SIZE + n)
        value[HEADER_SIZE:].copy_(page.reshape(-1).view(torch.uint8))
        host = value.numpy()
        host[:HEADER_SIZE] = memoryview(header(self.ns, host[HEADER_SIZE:]))
        return memoryview(host)

    def reset(self) -> None:
        self._chunk, self._off = 0, 0


def _record_event(device: torch.device | None):
    if device is not None and device.type == "cuda":
        ev = torch.cuda.Event()
        ev.record()
        return ev
    return None


class SaveQueue:
    """The send thread of the save path (see module doc).  Save failures are
    logged once and counted, never raised into the forward: a missed save
    only costs a future hit.  A pool with no room (pinned entries fill it, or
    its filesystem is full) skips the save: counted in ``skipped``, logged
    once."""

    def __init__(self, backend: Backend, namespace: bytes) -> None:
        self.backend = backend
        self.ns = namespace
        self._q: queue.Queue = queue.Queue()
        self._items: list[tuple[bytes, memoryview]] = []
        self._arena = PackArena(namespace)
        self.bytes_saved = 0
        self.seconds = 0.0
        self.failures = 0
        self.skipped = 0
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="vlp-send", daemon=True)
        self._thread.start()

    def submit(self, pages: list[tuple[bytes, torch.Tensor]], device=None) -> None:
        if pages:
            self._q.put(("pages", _record_event(device), pages))

    def commit(self, markers: list[bytes], exclude: frozenset[bytes] | set[bytes] = frozenset()) -> bool:
        """Wait for every queued page, then write pages + ``markers`` (empty
        values) atomically, leaving out pages whose key is in ``exclude``.
        Returns False when the write failed."""
        done: list = []
        ev = threading.Event()
        self._q.put(("commit", (markers, exclude), (done, ev)))
        ev.wait()
        return bool(done and done[0])

    def close(self) -> None:
        self._q.put(("stop", None, None))
        self._thread.join(timeout=30)

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                kind, a, b = self._q.get()
                if kind == "stop":
                    return
                if kind == "pages":
                    t0 = time.perf_counter()
                    try:
                        if a is not None:
                            a.synchronize()
                        for key, page in b:
                            self._items.append((key, self._arena.pack(page)))
                    except Exception as exc:  # keep the thread alive
                        self._fail(exc)
                    self.seconds += time.perf_counter() - t0
                    continue
                done, ev = b
                markers, exclude = a
                t0 = time.perf_counter()
                ok = False
                try:
                    if exclude:
                        self._items = [(k, v) for k, v in self._items if k not in exclude]
                    if self._items or markers:
                        items = self._items + [(m, pack(self.ns, b"")) for m in markers]
                        self.backend.put_many(items)
                        self.bytes_saved += sum(len(v) for _, v in self._items)
                    ok = True
                except PoolFull as exc:
                    self.skipped += 1
                    self._warn("full", "vllm-layerwise-patch pool: no room for this step's "
                               "saves (%s); they are skipped, outputs are unaffected "
                               "(further skips are counted as 'Saves skipped', not "
                               "logged)", exc)
                except Exception as exc:
                    self._fail(exc)
                finally:
                    self._items = []
                    self._arena.reset()
                    self.seconds += time.perf_counter() - t0
                    done.append(ok)
                    ev.set()

    def _warn(self, kind: str, msg: str, *args) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(msg, *args)

    def _fail(self, exc: Exception) -> None:
        self.failures += 1
        self._warn("fail", "vllm-layerwise-patch pool: a save failed (%s: %s); those "
                   "blocks are not stored (further failures are counted, not logged)",
                   type(exc).__name__, exc)
