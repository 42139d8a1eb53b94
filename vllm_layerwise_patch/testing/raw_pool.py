"""Tests' direct access to an embedded pool's LMDB data, whatever its layout
(one environment, or the shards of a sharded pool: :mod:`..pool.backends.
lmdb.shards`): to read what engines stored and to damage it on purpose, as
a bad disk or another program would, outside the backend."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import lmdb

from ..pool.backends.lmdb.shards import RECORD, shard_name, shard_of


def shard_count(path: str) -> int:
    """The shard count the pool at ``path`` records (1: one environment)."""
    try:
        with open(os.path.join(path, RECORD)) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return 1


def environments(path: str) -> list[str]:
    """The directories of the pool's LMDB environments, in shard order."""
    n = shard_count(path)
    return [path] if n == 1 else [os.path.join(path, shard_name(i)) for i in range(n)]


class RawTxn:
    """The pool's ``data`` databases as one: a write transaction in each
    environment; keys go to their shard."""

    def __init__(self, txns: list) -> None:
        self.txns = txns

    def _of(self, key: bytes):
        return self.txns[shard_of(key, len(self.txns))]

    def cursor(self) -> Iterator[tuple[bytes, bytes]]:
        for txn in self.txns:
            for k, v in txn.cursor():
                yield bytes(k), bytes(v)

    def get(self, key: bytes) -> bytes | None:
        v = self._of(key).get(key)
        return None if v is None else bytes(v)

    def put(self, key: bytes, value: bytes) -> bool:
        return self._of(key).put(key, value)

    def delete(self, key: bytes) -> bool:
        return self._of(key).delete(key)


@contextlib.contextmanager
def raw_data(path: str, write: bool = True) -> Iterator[RawTxn]:
    """Every environment of the pool at ``path`` opened by LMDB itself (no
    backend), its ``data`` database in one transaction each (committed
    together at the end)."""
    with contextlib.ExitStack() as stack:
        txns = []
        for d in environments(path):
            env = lmdb.open(d, max_dbs=4, subdir=True, readonly=not write, lock=write)
            stack.callback(env.close)
            db = env.open_db(b"data", create=False)
            txns.append(stack.enter_context(env.begin(write=write, db=db)))
        yield RawTxn(txns)
