"""The per-layer transfer pipeline: needs only torch, a backend and a
namespace - no vLLM objects - so it can be tested and benchmarked alone.

Loads: :meth:`LayerwisePipeline.start` takes, per layer, the (key,
destination page) pairs of one step and submits the first ``prefetch`` layers
(in forward order) to the load threads; :meth:`wait` blocks on one layer,
surfaces its error, and submits the next layer so that at most ``prefetch``
layers are in flight ahead of compute.  Every value is validated (length,
checksum, namespace) before a byte reaches a page.

Saves: :func:`page_bytes` copies a page to host bytes (device -> host on an
accelerator: ``Tensor.to("cpu")`` orders after the compute stream's writes).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import warnings
from collections.abc import Callable

import torch

from .backends.base import Backend, unpack

# torch.frombuffer warns on read-only buffers; we only read from them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class LoadError(RuntimeError):
    pass


def page_bytes(page: torch.Tensor) -> bytes:
    return page.to("cpu").numpy().tobytes()


def fill_page(dest: torch.Tensor, payload: memoryview) -> None:
    src = torch.frombuffer(payload, dtype=torch.uint8)
    # vLLM allocates KV caches as inference tensors; load threads are not in
    # the engine's inference mode
    with torch.inference_mode():
        dest.copy_(src)


LoadItem = tuple[bytes, list[torch.Tensor]]  # key -> every page it fills


class LayerwisePipeline:
    def __init__(self, order: list[str], backend: Backend, namespace: bytes, *,
                 prefetch: int = 2, threads: int = 2) -> None:
        self.order = list(order)
        self.pos = {name: i for i, name in enumerate(self.order)}
        self.backend = backend
        self.ns = namespace
        self.prefetch = max(1, prefetch)
        self.pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vlp-load")
        self._futures: dict[str, cf.Future] = {}
        self._tasks: dict[str, list[LoadItem]] = {}
        self._next = 0
        self._lock = threading.Lock()
        self.bytes_loaded = 0
        self.wait_seconds = 0.0
        self.load_seconds = 0.0

    def _load_layer(self, layer: str, items: list[LoadItem]) -> int:
        t0 = time.perf_counter()
        try:
            return self._load_items(items)
        finally:
            with self._lock:
                self.load_seconds += time.perf_counter() - t0

    def _load_items(self, items: list[LoadItem]) -> int:
        keys = [k for k, _ in items]
        values = self.backend.get_many(keys)
        moved = 0
        for (key, dests), value in zip(items, values):
            if value is None:
                raise LoadError(f"pool entry {key!r} vanished between lookup and load")
            payload = unpack(key, value, self.ns, expected_length=dests[0].numel())
            for dest in dests:
                fill_page(dest, payload)
                moved += dest.numel()
        return moved

    def _submit_until(self, limit: int) -> None:
        with self._lock:
            while self._next < min(limit, len(self.order)):
                layer = self.order[self._next]
                self._next += 1
                items = self._tasks.get(layer)
                if items:
                    self._futures[layer] = self.pool.submit(self._load_layer, layer, items)

    def start(self, tasks: dict[str, list[LoadItem]]) -> None:
        """Begin a step's loads (``tasks``: layer -> items)."""
        self.drain()
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

    def load_all(self, tasks: dict[str, list[LoadItem]]) -> None:
        """Synchronous load of every layer (the patch-free fallback)."""
        self.start(tasks)
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
