"""The tiered backend (``backend: "tiered"``): an embedded LMDB pool as the
near tier (DRAM on /dev/shm, or NVMe) in front of Mooncake Store as the far
tier.  It composes the two backends; it changes neither, and every value
keeps the one format (:mod:`..base`) and the one key of either tier.

* Lookups (``exists_many``) ask the near tier first and the far tier only
  about what the near tier lacks: a request whose every block is near makes
  no Mooncake master request; one whose first blocks are near and later
  ones far gets a contiguous hit all the same (the lookup walks the
  answers in order).
* Reads (``read_many``): each key from the near tier when it holds it,
  else from the far tier - a hit spanning the tiers loads each block from
  where it is.  Every value is checked by its reader as with any backend
  (length, checksum, namespace, the key it was written under), whichever
  tier it came from.
* Promotion (``tiered.promote``, on by default): what is read from the far
  tier is copied into the near tier in the background, whole blocks only,
  checked first (:mod:`.promotion`).
* Saves are written through to both tiers, the far one first: the far
  tier stays complete, so the near tier may evict anything (its own LRU
  on whole blocks, :mod:`..lmdb.eviction`) without losing an entry the
  cluster does not hold.  ``tiered.near_saves`` says how the near tier
  takes them: ``hot`` (its most recently used), ``cold`` (its least:
  evicted before anything read since) or ``off`` (not at all).  A save
  that only one tier took is not a failed save (counted:
  ``far_save_failures``, ``near_save_failures``); when every tier it went
  to failed it fails as any save does.
* Pins and recency are the near tier's (Mooncake has its read leases);
  removals (a damaged entry's block) go to both tiers.
* Faults: a near tier that fails is a near miss (the far tier answers); a
  far tier that fails or is down (the master killed) is a far miss -
  near-tier hits go on; a value that fails its check fails that load, and
  the request recomputes.  Never a wrong token.

The hit cache's generation is both tiers' (:meth:`generation`), its
answers kept at most the far tier's ``hit_cache_seconds``."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable
from typing import Any

from ...faults import faults
from ...logs import LogOnce
from ..base import Backend, PoolFull, values_from_reads
from ..generation import Generation
from .promotion import Promoter

logger = logging.getLogger("vllm.layerwise_patch")

#: what :attr:`TieredBackend.tier_counts` reports (the pool's stats and metrics)
COUNTS = ("near_pages_loaded", "far_pages_loaded", "promoted_blocks", "promotions_dropped",
          "promotions_refused", "promotions_failed", "near_save_failures",
          "far_save_failures")


class _Counts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = collections.Counter({k: 0 for k in COUNTS})

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] += n


class _ConsumerError(Exception):
    """An exception of the caller's consumer, carried through the near
    tier's read so it is not taken for a near-tier fault."""

    def __init__(self, inner: BaseException) -> None:
        self.inner = inner


class TieredBackend(Backend):
    def __init__(self, near: Backend, far: Backend, *, promote: bool = True,
                 pending_blocks: int = 64, promote_after: int = 1,
                 near_saves: str = "hot") -> None:
        self.near, self.far = near, far
        self.near_saves = near_saves
        self.log = LogOnce()
        self.counts = _Counts()
        self.promote = promote
        self.promoter = Promoter(near, self.counts, pending_blocks, self.log, promote_after)
        self.closed = False

    # -- what the rest of the pool reads ------------------------------------------
    @property
    def path(self) -> str | None:
        """The near tier's directory (``pool`` command, who holds it)."""
        return getattr(self.near, "path", None)

    @property
    def tier_counts(self) -> dict[str, int]:
        return dict(self.counts.values)

    @property
    def hit_cache_cap(self) -> float:
        return float(getattr(self.far, "hit_cache_cap", 0.0))

    @property
    def evicted_groups(self) -> int:
        return int(getattr(self.near, "evicted_groups", 0))

    @property
    def put_skipped(self) -> int:
        return int(getattr(self.far, "put_skipped", 0))

    def __getattr__(self, name: str) -> Any:
        # the near tier's LMDB handles (the pool's fill: env, data, ...)
        if name in ("env", "data", "groups", "lru", "pins", "capacity"):
            return getattr(self.__dict__["near"], name)
        raise AttributeError(name)

    def generation(self) -> Generation | None:
        """Both tiers' counters in one: any store or removal of either moves
        it, an unsettled removal of either leaves it unsettled; None when
        either tier cannot tell (nothing is cached then)."""
        a, b = self.near.generation(), self.far.generation()
        if a is None or b is None:
            return None
        unsettled = not (a.removals_settled and b.removals_settled)
        return Generation(a.epoch * (1 << 32) + b.epoch, a.stores + b.stores,
                          2 * (a.removals + b.removals) + unsettled)

    def set_layout(self, ns: bytes, layout: Any) -> None:
        set_far = getattr(self.far, "set_layout", None)
        if set_far is not None:
            set_far(ns, layout)
            if getattr(self.far, "layouts", None) is not None and self.far.layouts.known:
                self.promoter.set_layout(ns, layout)

    def mount_segment(self) -> None:
        mount = getattr(self.far, "mount_segment", None)
        if mount is not None:
            mount()

    def register_memory(self, ptr: int, size: int, saves: bool = False) -> bool:
        """The far tier's zero-copy saves from the pack memory; loads are
        never zero-copy here (:meth:`read_direct` is the base's None)."""
        return bool(saves) and self.far.register_memory(ptr, size, saves)

    # -- reads -------------------------------------------------------------------
    def _near_blind(self) -> bool:
        return faults().tiered_near_blind

    def _warn(self, tier: str, exc: BaseException) -> None:
        if not getattr(exc, "announced", False):
            self.log.warning(f"{tier}-fault", "vllm-layerwise-patch pool: the %s tier failed "
                             "(%s); its entries are misses meanwhile (further %s-tier "
                             "faults are not logged)", tier, exc, tier)

    def exists_many(self, keys: Iterable[bytes]) -> list[bool]:
        keys = list(keys)
        found = [False] * len(keys)
        if keys and not self._near_blind():
            try:
                found = list(self.near.exists_many(keys))
            except Exception as exc:  # noqa: BLE001 - a near fault is a near miss
                self._warn("near", exc)
        rest = [i for i, f in enumerate(found) if not f]
        if rest:
            try:
                far = self.far.exists_many([keys[i] for i in rest])
            except Exception as exc:  # noqa: BLE001 - the master down: a far miss
                self._warn("far", exc)
                far = [False] * len(rest)
            for i, f in zip(rest, far):
                found[i] = bool(f)
        return found

    def read_many(self, keys: list[bytes], consume, sizes: list[int] | None = None) -> None:
        if not keys:
            return
        got: set[int] = set()
        if not self._near_blind():
            def near(i: int, key: bytes, value: Any) -> None:
                if value is None:
                    return
                got.add(i)
                try:
                    consume(i, key, value)
                except BaseException as exc:
                    raise _ConsumerError(exc) from exc

            try:
                self.near.read_many(keys, near, sizes)
            except _ConsumerError as err:
                raise err.inner from None
            except Exception as exc:  # noqa: BLE001 - a near fault: read the rest far
                self._warn("near", exc)
            self.counts.add("near_pages_loaded", len(got))
        rest = [i for i in range(len(keys)) if i not in got]
        if not rest:
            return
        offer = self.promote and bool(self.promoter.layouts)

        def far(j: int, key: bytes, value: Any) -> None:
            if value is not None:
                self.counts.add("far_pages_loaded")
                if offer:
                    self.promoter.offer(key, value)
            consume(rest[j], key, value)

        self.far.read_many([keys[i] for i in rest], far,
                           None if sizes is None else [sizes[i] for i in rest])

    def get_many(self, keys: list[bytes], sizes: list[int] | None = None) -> list[bytes | None]:
        return values_from_reads(self, keys, sizes)

    # -- writes ------------------------------------------------------------------
    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """Write-through: the far tier, then the near tier (as
        ``near_saves`` says)."""
        if not items:
            return
        errors = {}
        tiers = [("far", self.far, {})]
        if self.near_saves != "off":
            tiers.append(("near", self.near, {"cold": True} if self.near_saves == "cold" else {}))
        for tier, backend, kw in tiers:
            try:
                backend.put_many(items, **kw)
            except Exception as exc:  # noqa: BLE001 - the other tier may take it
                errors[tier] = exc
                self.counts.add(f"{tier}_save_failures")
                if isinstance(exc, PoolFull):  # no room for this batch: not a tier fault
                    self.log.warning(f"{tier}-full", "vllm-layerwise-patch pool: the %s tier "
                                     "skipped a save (%s); the other tier holds those "
                                     "blocks (further skips are not logged)", tier, exc)
                else:
                    self._warn(tier, exc)
        if len(errors) == len(tiers):
            raise errors["far"]

    def touch(self, groups: Iterable[bytes]) -> None:
        self.near.touch(groups)

    def pin(self, groups: Iterable[bytes], seconds: float, owner: bytes = b"") -> None:
        self.near.pin(groups, seconds, owner)

    def unpin(self, groups: Iterable[bytes], owner: bytes = b"") -> None:
        self.near.unpin(groups, owner)

    def _both(self, op: str, arg: list) -> None:
        first = None
        for backend in (self.near, self.far):
            try:
                getattr(backend, op)(arg)
            except Exception as exc:  # noqa: BLE001 - the other tier still drops it
                first = first or exc
        if first is not None:
            raise first

    def delete(self, keys: Iterable[bytes]) -> None:
        self._both("delete", list(keys))

    def delete_groups(self, groups: Iterable[bytes]) -> None:
        self._both("delete_groups", list(groups))

    def stats(self) -> dict[str, int]:
        near = {f"near_{k}": v for k, v in self.near.stats().items()}
        far = {f"far_{k}": v for k, v in self.far.stats().items()}
        return near | far | self.tier_counts

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.promoter.close()
        for backend in (self.near, self.far):
            try:
                backend.close()
            except Exception:  # noqa: BLE001 - closing the other tier all the same
                logger.exception("vllm-layerwise-patch pool: closing a tier failed")
