"""Asynchronous loads in flight, shared between the requests of one prefix
(scheduler side, ``load_async``).

vLLM parks a request whose hit loads asynchronously
(``WAITING_FOR_REMOTE_KVS``) and caches its blocks only when the load has
ended.  Requests arriving together on one stored prefix would each load the
whole prefix themselves: a burst of N reads the prefix N times.

Instead, while a request's load is in flight, the lookup of another request
whose hit would read any block of that load answers ``None`` - vLLM's
"ask again later" (``KVConnectorBase_V1.get_num_new_matched_tokens``: the
scheduler skips the request this step and asks again in the next).  When the
load ends vLLM caches its blocks; the waiting request then finds them in its
own prefix cache (its local hit) and the pool loads only what lies beyond.

A load stops holding others back on every path that ends it: done or failed
(``update_connector_output``), its request finished or aborted
(``request_finished``: its blocks are freed, not cached), or its request
looked up again (a preempted request starts over).  A request never waits
longer than ``share_loads_seconds`` in all: then it loads its own hit (logged
once).  ``share_loads_seconds = 0`` turns the sharing off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger("vllm.layerwise_patch")


class InflightLoads:
    def __init__(self, layout: Any, wait_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.layout = layout
        self.wait_seconds = wait_seconds
        self.clock = clock
        self._loads: dict[str, set[bytes]] = {}  # req_id -> pool block hashes it loads
        self._holders: dict[bytes, int] = {}  # block hash -> loads in flight reading it
        self._waiting: dict[str, float] = {}  # req_id -> when it first waited
        self._gave_up: set[str] = set()  # waited its longest: never waits again
        self._timeout_logged = False
        self.stats = {"waits": 0, "timeouts": 0}

    # -- loads ---------------------------------------------------------------
    def started(self, rid: str, hashes: Iterable[bytes]) -> None:
        """``rid``'s asynchronous load of these pool blocks is issued."""
        self.ended(rid)
        if self.wait_seconds <= 0:
            return
        held = set(hashes)
        self._loads[rid] = held
        for h in held:
            self._holders[h] = self._holders.get(h, 0) + 1

    def ended(self, rid: str) -> None:
        """``rid``'s load is over (done, failed, aborted or superseded)."""
        for h in self._loads.pop(rid, ()):
            n = self._holders.pop(h) - 1
            if n:
                self._holders[h] = n

    def loading(self, rid: str) -> bool:
        return rid in self._loads

    # -- requests that would read the same blocks --------------------------------
    def should_wait(self, request: Any, num_computed_tokens: int) -> bool:
        """True: another request's load in flight covers a block this
        request's hit would read - answer "ask again later".  The first
        False after waiting ends the wait (and its clock)."""
        rid = request.request_id
        self.ended(rid)  # looked up again: any load of its own is over
        if not self._holders or rid in self._gave_up:
            self._waiting.pop(rid, None)
            return False
        L = self.layout
        hashes = request.block_hashes
        if not L.hashes_match(hashes, request.num_tokens):
            return False  # (the lookup logs it)
        local, n = L.hit_span(hashes, request.num_tokens, num_computed_tokens)
        if n <= local or not any(h in self._holders
                                 for h in L.block_hashes(hashes, local, n)):
            self._waiting.pop(rid, None)
            return False
        now = self.clock()
        if rid not in self._waiting:
            self._waiting[rid] = now
            self.stats["waits"] += 1
        since = self._waiting[rid]
        if now - since > self.wait_seconds:
            self._waiting.pop(rid, None)
            self._gave_up.add(rid)
            self.stats["timeouts"] += 1
            if not self._timeout_logged:
                self._timeout_logged = True
                logger.warning("vllm-layerwise-patch pool: request %s waited %.1f s for "
                               "another request's load of its prefix; it loads its own hit "
                               "(share_loads_seconds; further timeouts are not logged)",
                               rid, now - since)
            return False
        return True

    def forget(self, rid: str) -> None:
        """``rid`` finished (or was aborted): it neither loads nor waits."""
        self.ended(rid)
        self._waiting.pop(rid, None)
        self._gave_up.discard(rid)

    def waiting(self, rid: str) -> bool:
        return rid in self._waiting
