"""Keys that are no block object's page, one Mooncake object each: the
per-layer layout's pages (``block_objects: false``, or a namespace whose
layout the backend was not told) and its commit markers, and any other
small key.  :class:`PlainValues`, which :class:`.mooncake.MooncakeBackend`
holds; block objects are :mod:`.mooncake.objects`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..base import HEADER_SIZE, BackendError, PoolFull
from .staging import MISSING, NO_SPACE, TOO_SMALL, describe


class PlainValues:
    """Reads and writes of whole values through the staging buffer of
    ``conn`` (a value's payload straight into its page where that page is
    registered: :meth:`direct`)."""

    def __init__(self, conn: Any, cfg: Any) -> None:
        self.conn, self.cfg = conn, cfg

    def read(self, store: Any, keys: list[bytes], consume: Callable,
             sizes: list[int] | None) -> None:
        """``consume(i, key, value)``: a view into the staging region, None
        when missing (or failed), ``b""`` when larger than the page it
        should hold."""
        names = [k.decode() for k in keys]
        if sizes is None:  # (callers pass them: the page size is known)
            sizes = [max(store.get_size(k), 1) for k in names]
        staging = self.conn.staging
        with staging.region() as region:
            for i, j, ptrs in staging.runs(region, sizes):  # one call per region-full
                rcs = store.batch_get_into(names[i:j], ptrs, sizes[i:j])
                self.conn.check(rcs, "get")
                for n, ptr, rc in zip(range(i, j), ptrs, rcs):
                    if rc >= 0:
                        consume(n, keys[n], staging.view(ptr, rc))
                    else:
                        self.conn.failed(rc, keys[n])
                        # bigger than the page it should hold: not ours
                        consume(n, keys[n], b"" if rc == TOO_SMALL else None)

    def direct(self, store: Any, keys: list[bytes], ptrs: list[int], lengths: list[int]
               ) -> list[bytes | None]:
        """Headers into the staging region, payloads straight into the pages
        (one ``batch_get_into_multi_buffers`` call per region-full)."""
        names = [k.decode() for k in keys]
        out: list[bytes | None] = []
        staging = self.conn.staging
        with staging.region() as region:
            for i, j, heads in staging.runs(region, [HEADER_SIZE] * len(keys)):
                rcs = store.batch_get_into_multi_buffers(
                    names[i:j], [[h, p] for h, p in zip(heads, ptrs[i:j])],
                    [[HEADER_SIZE, n] for n in lengths[i:j]])
                self.conn.check(rcs, "get")
                for n, head, rc in zip(range(i, j), heads, rcs):
                    if rc == HEADER_SIZE + lengths[n]:
                        out.append(bytes(staging.view(head, HEADER_SIZE)))
                    else:  # missing, or a value of another size: not this page's
                        self.conn.failed(rc, keys[n])
                        out.append(None if rc == MISSING else b"")
        return out

    def upsert(self, store: Any, items: list[tuple[bytes, bytes]]) -> None:
        """Write ``items`` (an existing key takes the new value), a staging
        region's worth per ``batch_upsert_from``."""
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = self.cfg.replica_num
        if self.conn.local_segment:  # (Mooncake falls back to other segments when full)
            config.preferred_segment = self.conn.local_segment
        staging = self.conn.staging
        with staging.region() as region:
            for i, j, ptrs in staging.runs(region, [len(v) for _, v in items], PoolFull):
                for (_, v), ptr in zip(items[i:j], ptrs):
                    staging.view(ptr, len(v))[:] = v
                batch = items[i:j]
                rcs = store.batch_upsert_from([k.decode() for k, _ in batch], ptrs,
                                              [len(v) for _, v in batch], config)
                self.conn.check(rcs, "put")
                bad = [(k, rc) for (k, _), rc in zip(batch, rcs) if rc != 0]
                if bad:
                    key, rc = bad[0]
                    if rc == NO_SPACE:
                        raise PoolFull(f"Mooncake put of {key!r}: {describe(rc)}")
                    raise BackendError(f"Mooncake put of {key!r}: {describe(rc)}")
