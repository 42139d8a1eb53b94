"""The pool's GPU data path: pinned staging, copy streams and events (CUDA
pages only; host pages - a CPU "device" - never come here).

Loads: each load thread has a *lane* (:class:`Lane`): its own copy stream
and a ring of pinned host memory (:class:`StagingRing`).  A value read from
the backend (an LMDB map view, a Mooncake staging region) is validated, then
copied by the thread into the ring, and from there to its pages with
asynchronous host -> device copies on the lane's stream; an event recorded
after a layer's copies is what the compute stream waits for
(``wait_event``: the device waits, not the host).  A ring slot is written
again only once the copies that read it have completed (the host waits for
that event on the load thread, never on the forward's).  The ring grows with
the step's pages (twice the largest layer's bytes a thread loads, rounded up
to a power of two), is kept across steps, and never exceeds its share of
``pinned_staging_bytes``; a value larger than the ring is copied in pieces.

Saves use the send thread's copy stream (:mod:`.send_thread`): it waits on
the device for the layer's compute event, copies the pages into pinned pack
memory, and the send thread packs them once those copies completed.

Every CUDA call goes through :class:`CudaOps`, one small object, so the
ordering logic runs on CPU against a fake with deferred execution in the
tests (``tests/test_pool_device_path.py``)."""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any

import numpy as np
import torch

#: the smallest ring (and lane share) the loads use
MIN_RING = 64 << 10


class CudaOps:
    """The CUDA calls of the data path, on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def using(self, stream: Any):
        """``stream`` is the current stream inside (copies and zeroing go to it)."""
        return torch.cuda.stream(stream)

    def record(self, stream: Any) -> Any:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream: Any, event: Any) -> None:
        """``stream`` waits for ``event`` on the device (the host goes on)."""
        stream.wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def done(self, event: Any) -> bool:
        return event.query()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """An asynchronous copy on the current stream (pinned host memory on
        one side)."""
        dst.copy_(src, non_blocking=True)

    def zero(self, dst: torch.Tensor) -> None:
        dst.zero_()

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def device_ops(device: torch.device | None) -> CudaOps | None:
    """The ops of a CUDA device; None for host pages (the host path)."""
    if device is not None and device.type == "cuda":
        return CudaOps(device)
    return None


def ring_size(need: int, limit: int) -> int:
    """The ring for ``need`` bytes: the next power of two (at least
    :data:`MIN_RING`), at most ``limit``."""
    size = MIN_RING
    while size < need:
        size <<= 1
    return max(1, min(size, limit))


class StagingRing:
    """A ring of pinned host memory on one copy stream.

    :meth:`take` hands out ``n`` bytes for a host write; the copies that read
    them are queued on ``stream`` next; :meth:`fence` closes everything
    taken since the last fence with an event recorded after those copies.
    Positions count up without wrapping (``pos % capacity`` is the
    address): a new slot ``[start, end)`` may be written once every fenced
    segment starting before ``end - capacity`` has completed - those are
    the only ones that can share its bytes.  ``stalls`` counts the waits
    for a copy still running."""

    def __init__(self, ops: Any, limit: int, stream: Any) -> None:
        self.ops = ops
        self.limit = max(1, limit)
        self.stream = stream
        self.buf: torch.Tensor | None = None
        self.capacity = 0
        self._pos = 0
        self._live: collections.deque = collections.deque()  # (start, end, event)
        self._open: int | None = None  # start of what was taken since the last fence
        self.stalls = 0
        self.grows = 0

    def reserve(self, need: int) -> None:
        """Grow (never shrink) to hold ``need`` bytes, within the limit."""
        want = ring_size(need, self.limit)
        if want <= self.capacity:
            return
        self.quiesce()  # nothing may still read the old buffer
        self.buf = self.ops.pinned(want)
        self.capacity = want
        self._pos = 0
        self.grows += 1

    def take(self, n: int) -> torch.Tensor:
        """``n`` bytes (1 <= n <= capacity) free for a host write."""
        if self.buf is None:
            self.reserve(n)
        if not 0 < n <= self.capacity:
            raise ValueError(f"a {n}-byte slot does not fit a ring of {self.capacity}")
        at = self._pos % self.capacity
        if at + n > self.capacity:  # a slot never wraps: start again at 0
            self._pos += self.capacity - at
            at = 0
        start, end = self._pos, self._pos + n
        if self._open is not None and self._open < end - self.capacity:
            # copies queued since the last fence may still read the slot
            self.fence(self.ops.record(self.stream))
        while self._live and self._live[0][0] < end - self.capacity:
            self._wait(self._live.popleft()[2])
        if self._open is None:
            self._open = start
        self._pos = end
        return self.buf[at:at + n]

    def fence(self, event: Any) -> Any:
        """``event`` (recorded after the copies of what was taken since the
        last fence) frees those bytes once it completes."""
        if self._open is not None:
            self._live.append((self._open, self._pos, event))
            self._open = None
        return event

    def quiesce(self) -> None:
        """Wait until no copy reads the ring."""
        if self._open is not None:
            self.fence(self.ops.record(self.stream))
        while self._live:
            self._wait(self._live.popleft()[2])

    def _wait(self, event: Any) -> None:
        if not self.ops.done(event):
            self.stalls += 1
            self.ops.synchronize(event)


class Lane:
    """One load thread's copy stream and staging ring (see module doc)."""

    def __init__(self, ops: Any, limit: int) -> None:
        self.ops = ops
        self.stream = ops.new_stream()
        self.ring = StagingRing(ops, limit, self.stream)

    @contextlib.contextmanager
    def active(self, gate: Any = None):
        """Copies inside go to this lane's stream, after ``gate`` (an event
        of the compute stream: nothing is written before compute got there)."""
        # vLLM allocates KV caches as inference tensors; load threads are not
        # in the engine's inference mode
        with torch.inference_mode(), self.ops.using(self.stream):
            if gate is not None:
                self.ops.wait(self.stream, gate)
            yield self

    def begin(self, nbytes: int) -> None:
        """A layer of ``nbytes`` payload bytes follows: room for it and the next."""
        self.ring.reserve(2 * nbytes)

    def fill(self, dests: list[torch.Tensor], payload: Any) -> None:
        """Copy a validated payload into the ring and from there into each of
        its pages (in pieces when it is larger than the ring)."""
        src = np.frombuffer(payload, dtype=np.uint8)
        n, off = src.size, 0
        while off < n:
            if self.ring.buf is None:
                self.ring.reserve(n - off)
            k = min(n - off, self.ring.capacity)
            slot = self.ring.take(k)
            np.copyto(slot.numpy(), src[off:off + k])
            for dest in dests:
                self.ops.copy(dest[off:off + k], slot)
            off += k

    def zero(self, dests: list[torch.Tensor]) -> None:
        """A failed item's pages get zeros, ordered after any copy into them."""
        for dest in dests:
            self.ops.zero(dest)

    def finish(self) -> Any:
        """The event after everything queued so far (the layer's copies)."""
        return self.ring.fence(self.ops.record(self.stream))

    def close(self) -> None:
        self.ring.quiesce()


class DeviceLanes:
    """The lanes of one pipeline, one per thread that loads (made on its first
    load); their rings share ``total_bytes`` among ``lanes`` threads, each at
    most the largest power of two within its share (torch's pinned memory
    allocator rounds a request up to one)."""

    def __init__(self, ops: Any, total_bytes: int, lanes: int) -> None:
        self.ops = ops
        share = max(MIN_RING, total_bytes // max(1, lanes))
        self.limit = 1 << (share.bit_length() - 1)
        self._local = threading.local()
        self._lock = threading.Lock()
        self.all: list[Lane] = []

    def lane(self) -> Lane:
        lane = getattr(self._local, "lane", None)
        if lane is None:
            lane = self._local.lane = Lane(self.ops, self.limit)
            with self._lock:
                self.all.append(lane)
        return lane

    def pinned_bytes(self) -> int:
        return sum(lane.ring.capacity for lane in self.all)

    def stalls(self) -> int:
        return sum(lane.ring.stalls for lane in self.all)

    def close(self) -> None:
        for lane in self.all:
            lane.close()
