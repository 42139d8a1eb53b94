"""The scheduler's pins: per request, the pool groups its pending load reads
(:meth:`.backends.base.Backend.pin`, owner = the request), so that eviction
by any engine leaves them until the load has read them.

Each worker releases its own rank's pins once the load is done; the
scheduler releases whatever is left when the request finishes;
``pin_seconds`` bounds a pin if an engine dies.  A lookup pins every group
a hit could load *before* verifying them (what was verified then stays), and
vLLM asking again while the request waits for KV space costs no call.  After
a load has been handed to the workers (who release its pins) the request's
record is stale: a later lookup (a preemption) pins anew.  A load in a
forward is handed over when it is planned; an asynchronous one when the
workers report it done (until then the scheduler refreshes its pins).
"""

from __future__ import annotations

import time
from typing import Any

from ..metadata import owner_of


class Pins:
    def __init__(self, backend: Any, seconds: float) -> None:
        self.backend = backend
        self.seconds = seconds
        self.held: dict[str, tuple[list[bytes], float]] = {}  # rid -> (groups, when)

    def pin(self, rid: str, groups: list[bytes]) -> None:
        """Pin ``groups`` for ``rid``'s load, release what it no longer
        needs.  Groups already pinned (less than half the pin time ago) cost
        no call: the superset a lookup pinned before verifying stays while
        vLLM asks again."""
        old, at = self.held.pop(rid, ([], 0.0))
        now = time.monotonic()
        if groups and set(groups) <= set(old) and now - at <= self.seconds / 2:
            self.held[rid] = (old, at)
            return
        if groups:
            self.backend.pin(groups, self.seconds, owner_of(rid))
            at = now
        stale = set(old) - set(groups)
        if stale:
            self.backend.unpin(sorted(stale), owner_of(rid))
        if groups:
            self.held[rid] = (groups, at)

    def refresh(self, rid: str) -> None:
        """Pin ``rid``'s groups again once half the pin time has passed."""
        self.pin(rid, self.held.get(rid, ([], 0.0))[0])

    def handed_over(self, rid: str) -> None:
        """The workers now own these pins (they release them after loading):
        the next :meth:`pin` of ``rid`` calls the backend."""
        groups, _ = self.held.get(rid, ([], 0.0))
        if groups:
            self.held[rid] = (groups, float("-inf"))

    def release(self, rid: str) -> None:
        groups, _ = self.held.pop(rid, (None, 0))
        if groups:
            try:
                self.backend.unpin(groups, owner_of(rid))
            except Exception:  # noqa: BLE001 - pins expire after pin_seconds anyway
                pass
