"""The save path's send thread: ``save_kv_layer`` enqueues a layer's pages with
an event recorded on the compute stream; the send thread waits for the event
and packs each page (header naming its key, checksum, one copy into reused host memory)
while later layers compute (host pages - a CPU "device" - are packed in the
calling thread instead, see :meth:`SaveQueue.submit`); :meth:`SaveQueue.commit`
(once per step) waits for the queue to drain and writes the pages and their commit markers in one
backend call (one transaction on LMDB).  Needs only torch and a backend.

With a device's ops (:mod:`.device`: pages on a CUDA device) the send
thread's own copy stream waits on the device for the layer's event, copies
the pages into pinned pack memory asynchronously, and the thread packs them
(header, checksum) once those copies completed: the compute stream never
waits for a save, and the thread waits only for its own copies."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import torch

from ..backends.base import HEADER_SIZE, VALUE_OFFSET, Backend, PoolFull, header, pack
from ..logs import LogOnce


class PackArena:
    """Host memory the send thread packs values into: each value is its
    header followed by one copy of the page (device -> host on a GPU), the
    checksum read from that copy in place.  Chunks are allocated once,
    pre-faulted (first touch costs 5-20x a copy) and pinned when CUDA is
    there, and reused every step; values are views, valid until
    :meth:`reset` (after the step's write).

    Each value is followed by zeros up to its next 64 bytes, which belong to
    it: a backend may store a value with that padding as one slot of a
    block object (:mod:`.backends.mooncake.objects`).  ``register(ptr,
    nbytes)``, when given, is called with every chunk (a backend's
    ``register_memory(..., saves=True)``); a chunk is never freed while the
    arena lives, so what was registered stays valid."""

    CHUNK = 64 << 20

    def __init__(self, namespace: bytes, register=None) -> None:
        self.ns = namespace
        self._register = register
        self._chunks: list[torch.Tensor] = []
        self._retired: list[torch.Tensor] = []  # (registered: kept alive)
        self._chunk = 0
        self._off = 0

    def _new_chunk(self, size: int) -> torch.Tensor:
        pin = torch.cuda.is_available()
        t = torch.empty(max(size, self.CHUNK), dtype=torch.uint8, pin_memory=pin)
        t.zero_()  # pre-fault
        if self._register is not None:
            self._register(t.data_ptr(), t.numel())
        return t

    def _alloc(self, n: int) -> torch.Tensor:
        """``n`` bytes and their padding to the next 64 (the view is that
        long; the next value starts past it)."""
        padded = (n + 63) & ~63
        while True:
            if self._chunk == len(self._chunks):
                self._chunks.append(self._new_chunk(VALUE_OFFSET + padded))
            buf = self._chunks[self._chunk]
            start = self._off + VALUE_OFFSET  # the payload on a cache line
            if start + padded <= buf.numel():
                self._off = (start + n + 63) & ~63
                return buf[start:start + padded]
            if self._off == 0:  # a value larger than a chunk: give it its own
                self._retired.append(self._chunks[self._chunk])
                self._chunks[self._chunk] = self._new_chunk(VALUE_OFFSET + padded)
                continue
            self._chunk, self._off = self._chunk + 1, 0

    def place(self, page: torch.Tensor, copy) -> tuple[torch.Tensor, int]:
        """Room for the value of ``page``, its payload queued by ``copy(dst,
        src)`` (an asynchronous device -> host copy); :meth:`seal` it once
        the copy completed.  Returns the value's buffer and its length."""
        raw = page.reshape(-1).view(torch.uint8)
        n = HEADER_SIZE + raw.numel()
        value = self._alloc(n)
        copy(value[HEADER_SIZE:n], raw)
        value.numpy()[n:] = 0  # (its padding: another step's bytes may lie there)
        return value, n

    def seal(self, key: bytes, value: torch.Tensor, n: int) -> memoryview:
        """The value of ``key`` placed in ``value``, its header written."""
        host = value.numpy()
        host[:HEADER_SIZE] = memoryview(header(self.ns, key, host[HEADER_SIZE:n]))
        return memoryview(host[:n])

    def pack(self, key: bytes, page: torch.Tensor) -> memoryview:
        """The value of ``key`` holding ``page`` (its header names the key)."""
        raw = page.reshape(-1).view(torch.uint8)
        n = HEADER_SIZE + raw.numel()
        value = self._alloc(n)
        host = value.numpy()
        if raw.device.type == "cpu":  # a plain memcpy: torch's copy_ costs ~6x here
            np.copyto(host[HEADER_SIZE:n], raw.numpy())
        else:
            value[HEADER_SIZE:n].copy_(raw)
        host[n:] = 0  # (its padding: another step's bytes may lie there)
        host[:HEADER_SIZE] = memoryview(header(self.ns, key, host[HEADER_SIZE:n]))
        return memoryview(host[:n])

    def reset(self) -> None:
        self._chunk, self._off = 0, 0

    def reserve(self) -> None:
        """Allocate (and pre-fault) the first chunk now."""
        if not self._chunks:
            self._chunks.append(self._new_chunk(self.CHUNK))


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
    once.

    ``commit(..., wait=False)`` leaves the step's write to the send thread
    (the deferred final-layer drain): it runs as soon as the queue reaches
    it, whether or not another step comes, and :meth:`drain` waits for it.
    The queue is first in, first out, and packing in the calling thread
    first waits for deferred writes, so a step's write always completes
    before the next step's pages are packed.  ``events`` (when a list) logs
    ``(what, step)`` in the order things happened (tests)."""

    def __init__(self, backend: Backend, namespace: bytes,
                 events: list | None = None, device=None) -> None:
        self.backend = backend
        self.ns = namespace
        self._ops = device  # a .device.CudaOps (or a test's fake): see module doc
        self._stream = None  # its copy stream (made by the send thread)
        self._q: queue.Queue = queue.Queue()
        self._items: list[tuple[bytes, memoryview]] = []
        register = getattr(backend, "register_memory", None)
        self._arena = PackArena(namespace, register and (
            lambda ptr, size: register(ptr, size, saves=True)))
        self._pending: list[threading.Event] = []
        self._step = 0
        self.events = events
        self.bytes_saved = 0
        self.blocks_saved = 0
        self.seconds = 0.0  # wall time packing and writing
        self.write_seconds = 0.0  # of which writing
        self.cpu_seconds = 0.0  # the send thread's CPU time (cores it takes)
        self.failures = 0
        self.skipped = 0
        self.log = LogOnce()
        self._thread = threading.Thread(target=self._run, name="vlp-send", daemon=True)
        self._thread.start()

    def reserve(self) -> None:
        """Pre-fault the pack memory at start-up (first touch of 64 MiB costs
        tens of milliseconds: not the first request's)."""
        self._arena.reserve()

    def _event(self, what: str, step: int) -> None:
        if self.events is not None:
            self.events.append((what, step))

    def submit(self, pages: list[tuple[bytes, torch.Tensor]], device=None) -> None:
        """Queue a layer's pages for this step's write.  Pages on a device
        are copied by the send thread once the compute stream's event has
        passed; host pages (a CPU "device") are packed here, in the calling
        thread: the copy is a host memcpy either way, and handing every
        layer's pages to another thread cost more than the copy (measured
        on 2 cores: ~40 ms of a pool hit's time to first token for ~1 MB
        of pages, ~0 inline)."""
        if not pages:
            return
        if self._ops is not None:
            ops = self._ops
            self._q.put(("pages", ops.record(ops.current_stream()), (self._step, pages)))
            return
        if device is None or device.type == "cpu":
            self.drain()  # a deferred write of the previous step may still use the arena
            self._pack(self._step, None, pages)
            return
        self._q.put(("pages", _record_event(device), (self._step, pages)))

    def commit(self, markers: list[bytes], exclude: frozenset[bytes] | set[bytes] = frozenset(),
               blocks: int = 0, wait: bool = True) -> bool | None:
        """After every queued page: write pages + ``markers`` (empty values)
        in one backend call, leaving out pages whose key is in ``exclude``;
        ``blocks`` is what the markers commit (counted in ``blocks_saved``).
        With ``wait``: returns False when the write failed; else returns at
        once (see the class doc)."""
        done: list = []
        ev = threading.Event()
        self._q.put(("commit", (markers, exclude, blocks, self._step), (done, ev)))
        self._step += 1
        if not wait:
            self._pending.append(ev)
            return None
        ev.wait()
        return bool(done and done[0])

    def drain(self) -> None:
        """Wait for every deferred write."""
        while self._pending:
            self._pending.pop(0).wait()

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
                    c0 = time.thread_time()
                    self._pack(b[0], a, b[1])
                    self.cpu_seconds += time.thread_time() - c0
                    continue
                self._write(a, b)

    def _pack(self, step: int, event, pages: list[tuple[bytes, torch.Tensor]]) -> None:
        self._event("pack", step)
        t0 = time.perf_counter()
        try:
            if self._ops is not None:
                self._pack_device(event, pages)
            else:
                if event is not None:
                    event.synchronize()
                for key, page in pages:
                    self._items.append((key, self._arena.pack(key, page)))
        except Exception as exc:  # never into the forward, keep the thread alive
            self._fail(exc)
        self.seconds += time.perf_counter() - t0

    def _pack_device(self, event, pages: list[tuple[bytes, torch.Tensor]]) -> None:
        """Device pages: copied on this thread's stream once the compute
        stream passed ``event`` (the device waits), packed once copied."""
        ops = self._ops
        if self._stream is None:
            self._stream = ops.new_stream()
        placed = []
        try:
            with ops.using(self._stream):
                ops.wait(self._stream, event)
                for key, page in pages:
                    placed.append((key, *self._arena.place(page, ops.copy)))
        finally:  # (also after an error: nothing may still write into the arena)
            ops.synchronize(ops.record(self._stream))
        for key, value, n in placed:
            self._items.append((key, self._arena.seal(key, value, n)))

    def _write(self, what, how) -> None:
        done, ev = how
        markers, exclude, blocks, step = what
        self._event("write-start", step)
        t0, c0 = time.perf_counter(), time.thread_time()
        ok = False
        try:
            if exclude:
                self._items = [(k, v) for k, v in self._items if k not in exclude]
            if self._items or markers:
                items = self._items + [(m, pack(self.ns, m, b"")) for m in markers]
                self.backend.put_many(items)
                self.bytes_saved += sum(len(v) for _, v in self._items)
            self.blocks_saved += blocks
            ok = True
        except PoolFull as exc:
            self.skipped += 1
            self.log.warning("full", "vllm-layerwise-patch pool: no room for this step's saves "
                             "(%s); they are skipped, outputs are unaffected (further skips "
                             "are counted as 'Saves skipped', not logged)", exc)
        except Exception as exc:
            self._fail(exc)
        finally:
            self._items = []
            self._arena.reset()
            took = time.perf_counter() - t0
            self.seconds += took
            self.write_seconds += took
            self.cpu_seconds += time.thread_time() - c0
            self._event("write-end", step)
            done.append(ok)
            ev.set()

    def _fail(self, exc: Exception) -> None:
        self.failures += 1
        self.log.warning("fail", "vllm-layerwise-patch pool: a save failed (%s: %s); those "
                         "blocks are not stored (further failures are counted, not logged)",
                         type(exc).__name__, exc)
