"""A fake CUDA device for the pool's GPU data path on CPU
(``vllm_layerwise_patch.pool.worker.device.CudaOps``'s methods): streams
*queue* work and run it only when something waits for it - a host
``synchronize``, or another stream's queued ``wait`` - so a copy read before
it ran, a ring slot written again while a queued copy still reads it, or a
stream that does not wait for the event it must, gives wrong bytes, as it
would on a GPU.  Used by ``tests/test_pool_device_path.py`` and by the dry run
of ``check_pool_pipeline.py`` (never on a GPU)."""

from __future__ import annotations

import contextlib
import threading

import torch


class FakeEvent:
    def __init__(self, stream: FakeStream, index: int) -> None:
        self.stream, self.index = stream, index


class FakeStream:
    """A queue of operations; ``ran`` of them have run."""

    def __init__(self, device: FakeDevice, name: str) -> None:
        self.device, self.name = device, name
        self.ops: list[tuple[str, object, object]] = []  # (kind, callable, detail)
        self.ran = 0

    def run_to(self, index: int) -> None:
        while self.ran < index:
            kind, fn, _ = self.ops[self.ran]
            self.ran += 1
            fn()


class FakeDevice:
    """Stands in for :class:`.device.CudaOps` (same methods).  Nothing queued
    runs until waited for; ``host_syncs`` counts host waits, per stream."""

    def __init__(self, drop_waits: bool = False) -> None:
        self.lock = threading.RLock()
        self.compute = FakeStream(self, "compute")
        self.streams = [self.compute]
        self._local = threading.local()
        self.host_syncs: dict[str, int] = {}
        self.pinned_allocs: list[int] = []
        self.drop_waits = drop_waits  # negative controls: a stream that never waits

    def new_stream(self) -> FakeStream:
        with self.lock:
            s = FakeStream(self, f"copy{len(self.streams)}")
            self.streams.append(s)
            return s

    def current_stream(self) -> FakeStream:
        return getattr(self._local, "stream", self.compute)

    @contextlib.contextmanager
    def using(self, stream: FakeStream):
        prev = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = prev

    def record(self, stream: FakeStream) -> FakeEvent:
        with self.lock:
            return FakeEvent(stream, len(stream.ops))

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        with self.lock:
            fn = (lambda: None) if self.drop_waits else (lambda: event.stream.run_to(event.index))
            stream.ops.append(("wait", fn, event))

    def synchronize(self, event: FakeEvent) -> None:
        with self.lock:
            name = event.stream.name
            self.host_syncs[name] = self.host_syncs.get(name, 0) + 1
            event.stream.run_to(event.index)

    def done(self, event: FakeEvent) -> bool:
        return event.stream.ran >= event.index

    def enqueue(self, kind: str, fn, stream: FakeStream | None = None) -> None:
        with self.lock:
            (stream or self.current_stream()).ops.append((kind, fn, None))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.enqueue("copy", lambda: dst.copy_(src))

    def zero(self, dst: torch.Tensor) -> None:
        self.enqueue("zero", lambda: dst.zero_())

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.pinned_allocs.append(nbytes)
        return torch.full((nbytes,), 0xEE, dtype=torch.uint8)

    def run(self, *streams: FakeStream) -> None:
        """The device runs ``streams`` (default: every one, copies first)."""
        with self.lock:
            for s in streams or (self.streams[1:] + [self.compute]):
                s.run_to(len(s.ops))
