"""Reading one batch of load items - (key, the pages its value fills) - from
a backend into their pages, every value validated (length, checksum,
namespace, and the key it was written under) before a byte of it reaches a
page, or - a zero-copy read straight into registered host pages - in the
page, where a failure fails that item.  On the GPU data path a value goes
through a load thread's pinned ring (:mod:`.device`).  Used by the layerwise
pipeline (:mod:`.pipeline`) and the asynchronous loads."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ..backends.base import HEADER_SIZE, Backend, unpack, verify
from .device import Lane

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
               on_fail=None, stage: Lane | None = None) -> int:
    """Read ``items`` (key -> the pages it fills) from ``backend`` and fill
    the pages, each value validated; returns the bytes written.  A failed
    item raises, or - with ``on_fail(i, key, dests, exc)`` - is handed to it
    (also every item a failing backend did not deliver).

    Where the backend can (:meth:`.Backend.read_direct`: host pages in
    registered memory) the payload lands in the page itself and is validated
    there; a page that fails is handed to ``on_fail`` (which zeroes it and
    fails the request's load: it recomputes) or raises, as any failed item.

    ``stage`` (device pages, :mod:`.device`): each validated payload is
    copied into that lane's pinned ring and from there to its pages on the
    lane's stream; no zero-copy read."""
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
            if stage is not None:
                stage.fill(dests, payload)
                moved[0] += dests[0].numel() * len(dests)
                return
            for dest in dests:
                fill_page(dest, payload)
                moved[0] += dest.numel()
        except Exception as exc:
            fail(i, key, dests, exc)

    try:
        keys = [k for k, _ in items]
        direct = stage is None and hasattr(backend, "read_direct")
        ptrs = _direct_ptrs(items) if direct else None
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
