"""The reads of block objects (:mod:`.mooncake.objects`, whose doc says why
they are what they are) that :class:`.mooncake.MooncakeBackend` hands to
:class:`RangeReads`: whole objects when every slot is asked for, else byte
ranges in a get session - one replica-list query per hit, not one per
layer.  Objects the step planned whole are served by the readers it is
given (:mod:`.mooncake.whole`, :mod:`.mooncake.staged`)."""

from __future__ import annotations

import threading
import time
from typing import Any

from ..base import HEADER_SIZE
from .staging import MISSING
from .staging import slot_value as _value

#: a get session's cached replica lists are dropped after this long (the
#: read lease they came with is ``lease_ttl_ms``, 10 s in mooncake-local)
SESSION_SECONDS = 5.0


class RangeReads:
    """Reads of located keys (``read``, ``direct``) and the get sessions
    open for them (``sessions``: object -> (start, slots left))."""

    def __init__(self, conn: Any, cfg: Any, calls: Any, whole: Any, staged: Any) -> None:
        self.conn, self.cfg, self.calls = conn, cfg, calls
        self.whole, self.staged = whole, staged
        self.sessions: dict[str, tuple[float, set[int]]] = {}
        self._session_lock = threading.Lock()

    def _end_sessions(self, store: Any, names: list[str]) -> None:
        if names:
            try:
                store.batch_get_session_end(names)
            except Exception:  # noqa: BLE001 - local: drops cached replica lists
                pass

    def _session(self, store: Any, want: dict[str, set[int]], n_slots: dict[str, int]
                 ) -> dict[str, int]:
        """Objects of ``want`` (object -> slots read now) in a get session:
        {object: 0} or the error code of a session start that failed."""
        now = time.monotonic()
        out: dict[str, int] = {}
        with self._session_lock:
            stale = [o for o, (t, _) in self.sessions.items() if now - t > SESSION_SECONDS]
            for o in stale:
                del self.sessions[o]
            self._end_sessions(store, stale)
            start = [o for o in want if o not in self.sessions]
            if start:
                rcs = store.batch_get_session_start(start)
                self.conn.check(rcs, "get")
                self.calls["get_sessions"] += 1
                for o, rc in zip(start, rcs):
                    if rc == 0:
                        self.sessions[o] = (now, set(range(n_slots[o])))
                    else:
                        out[o] = rc
            for o in want:
                out.setdefault(o, 0)
        return out

    def _done_reading(self, store: Any, read: dict[str, set[int]]) -> None:
        ended = []
        with self._session_lock:
            for o, slots in read.items():
                entry = self.sessions.get(o)
                if entry is not None:
                    entry[1].difference_update(slots)
                    if not entry[1]:
                        del self.sessions[o]
                        ended.append(o)
        self._end_sessions(store, ended)

    def read(self, store: Any, keys: list[bytes], where: dict[int, tuple],
             consume, sizes: list[int] | None) -> None:
        """Read the located keys ``where`` (index -> (layout, object, slot,
        slots)): whole objects when every slot is asked for, else ranges in a
        get session; ``consume(i, key, value or None)``."""
        by_obj: dict[str, list[int]] = {}
        for i, (_lay, obj, _slot, _n) in where.items():
            by_obj.setdefault(obj, []).append(i)
        whole = [o for o, idx in by_obj.items()
                 if len({where[i][2] for i in idx}) == where[idx[0]][3]]
        ranged = [o for o in by_obj if o not in set(whole)]
        if ranged and self.cfg.client_address:  # (no get sessions: mooncake.staged)
            left = self.staged.read(store, keys, where, consume, ranged, by_obj)
            by_obj.update(left)
            ranged = list(left)
        staging = self.conn.staging
        with staging.region() as region:
            if whole:
                total = [where[by_obj[o][0]][3] * where[by_obj[o][0]][0].slot for o in whole]
                for a, b, ptrs in staging.runs(region, total):
                    rcs = store.batch_get_into(whole[a:b], ptrs, total[a:b])
                    self.conn.check(rcs, "get")
                    for o, ptr, rc, size in zip(whole[a:b], ptrs, rcs, total[a:b]):
                        for i in by_obj[o]:
                            lay, slot = where[i][0], where[i][2]
                            if rc != size:
                                self.conn.failed(rc, keys[i])
                                consume(i, keys[i], None)
                            else:
                                consume(i, keys[i], _value(staging.view(ptr + slot * lay.slot,
                                                                        lay.slot)))
            if not ranged:
                return
            n_slots = {o: where[by_obj[o][0]][3] for o in ranged}
            want = {o: {where[i][2] for i in by_obj[o]} for o in ranged}
            if self.cfg.client_address:  # (a same-node client has no get sessions)
                self._plain_ranges(store, keys, where, consume, sizes, ranged, by_obj, region)
                return
            started = self._session(store, want, n_slots)
            for o in ranged:
                if started[o] != 0:
                    for i in by_obj[o]:
                        self.conn.failed(started[o], keys[i])
                        consume(i, keys[i], None)
            live = [o for o in ranged if started[o] == 0]
            flat = [i for o in live for i in by_obj[o]]
            lens = [min(where[i][0].slot, sizes[i] if sizes else where[i][0].slot)
                    for i in flat]
            for a, b, ptrs in staging.runs(region, lens):
                chunk = flat[a:b]
                objs = list(dict.fromkeys(where[i][1] for i in chunk))
                at = {i: (p, n) for i, p, n in zip(chunk, ptrs, lens[a:b])}
                groups = [[i for i in chunk if where[i][1] == o] for o in objs]
                rcs = store.batch_get_into_multi_buffer_ranges(
                    objs, [[at[i][0] for i in g] for g in groups],
                    [[at[i][1] for i in g] for g in groups],
                    [[where[i][2] * where[i][0].slot for i in g] for g in groups])
                self.conn.check(rcs, "get")
                self.calls["ranged_gets"] += 1
                for g, rc in zip(groups, rcs):
                    ok = rc == sum(at[i][1] for i in g)
                    for i in g:
                        if not ok:
                            self.conn.failed(rc, keys[i])
                        consume(i, keys[i], _value(staging.view(*at[i])) if ok else None)
        self._done_reading(store, want)

    def _plain_ranges(self, store: Any, keys: list[bytes], where: dict[int, tuple], consume,
                      sizes: list[int] | None, ranged: list[str], by_obj: dict[str, list[int]],
                      region: int) -> None:
        """Ranges without a get session (``get_into_ranges``: a same-node
        client, whose ``batch_get_session_start`` answers -600): the master is
        asked once per object and call."""
        staging = self.conn.staging
        flat = [i for o in ranged for i in by_obj[o]]
        lens = [min(where[i][0].slot, sizes[i] if sizes else where[i][0].slot) for i in flat]
        for a, b, ptrs in staging.runs(region, lens):
            chunk = flat[a:b]
            at = {i: (p, n) for i, p, n in zip(chunk, ptrs, lens[a:b])}
            objs = list(dict.fromkeys(where[i][1] for i in chunk))
            groups = [[i for i in chunk if where[i][1] == o] for o in objs]
            got = store.get_into_ranges(
                [region], [objs], [[[at[i][0] - region for i in g] for g in groups]],
                [[[where[i][2] * where[i][0].slot for i in g] for g in groups]],
                [[[at[i][1] for i in g] for g in groups]])[0]
            self.calls["ranged_gets"] += 1
            for g, rcs in zip(groups, got):
                self.conn.check(rcs, "get")
                for i, rc in zip(g, rcs):
                    ok = rc == at[i][1]
                    if not ok:
                        self.conn.failed(rc, keys[i])
                    consume(i, keys[i], _value(staging.view(*at[i])) if ok else None)

    def direct(self, store: Any, keys: list[bytes], where: list[tuple],
               ptrs: list[int], lengths: list[int]) -> list[bytes | None]:
        """Zero-copy ranges: each slot's header into the staging region, its
        payload straight into the page (in a get session)."""
        out: list[bytes | None] = [None] * len(keys)
        left = (self.whole.direct(store, keys, where, ptrs, out) if self.whole.plan
                else range(len(keys)))  # (whole objects: mooncake.whole)
        by_obj: dict[str, list[int]] = {}
        for i in left:
            by_obj.setdefault(where[i][1], []).append(i)
        want = {o: {where[i][2] for i in idx} for o, idx in by_obj.items()}
        started = (self._session(store, want, {o: where[idx[0]][3] for o, idx in by_obj.items()})
                   if by_obj else {})
        live = [o for o in by_obj if started[o] == 0]
        flat = [i for o in live for i in by_obj[o]]
        staging = self.conn.staging
        with staging.region() as region:
            for a, b, heads in staging.runs(region, [HEADER_SIZE] * len(flat)):
                chunk = flat[a:b]
                head = dict(zip(chunk, heads))
                objs = list(dict.fromkeys(where[i][1] for i in chunk))
                groups = [[i for i in chunk if where[i][1] == o] for o in objs]
                rcs = store.batch_get_into_multi_buffer_ranges(
                    objs, [[x for i in g for x in (head[i], ptrs[i])] for g in groups],
                    [[x for i in g for x in (HEADER_SIZE, lengths[i])] for g in groups],
                    [[x for i in g for x in (where[i][2] * where[i][0].slot,
                                             where[i][2] * where[i][0].slot + HEADER_SIZE)]
                     for g in groups])
                self.conn.check(rcs, "get")
                self.calls["ranged_gets"] += 1
                for g, rc in zip(groups, rcs):
                    ok = rc == sum(HEADER_SIZE + lengths[i] for i in g)
                    for i in g:
                        if ok:
                            out[i] = bytes(staging.view(head[i], HEADER_SIZE))
                        else:
                            self.conn.failed(rc, keys[i])
        for o in by_obj:
            if started[o] != 0 and started[o] != MISSING:
                for i in by_obj[o]:
                    self.conn.failed(started[o], keys[i])
        self._done_reading(store, want)
        return out

