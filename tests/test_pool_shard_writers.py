"""A sharded pool's put never waits on a busy shard while another shard it
writes is free (pool/backends/lmdb/sharded.py, backend.py ``_writer``), on
real LMDB with a second process holding one shard's writer turn.

Negative control: the put waits for each shard in order (``try_put_many``
made blocking) - the free shard is not written while the busy one is held,
and the test catches it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time

import pytest

from vllm_layerwise_patch.pool.backends.base import pack
from vllm_layerwise_patch.pool.backends.lmdb.sharded import open_shared
from vllm_layerwise_patch.pool.backends.lmdb.shards import shard_name, shard_of
from vllm_layerwise_patch.pool.keys import ATTN, marker_key, page_key

NS = b"\x22" * 16
MiB = 1 << 20

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


def _block(i: int) -> list[tuple[bytes, bytes]]:
    h = hashlib.sha256(i.to_bytes(8, "big")).digest()  # (a sharded pool routes by its head)
    keys = [page_key(NS, ATTN, h, 0, "0"), marker_key(NS, ATTN, h, 0)]
    return [(k, pack(NS, k, b"x" * 100)) for k in keys]


def _two_blocks_in_two_shards(n: int) -> tuple[int, int, list, list]:
    homes: dict[int, int] = {}
    for i in range(1000):
        homes.setdefault(shard_of(_block(i)[0][0], n), i)
        if len(homes) == 2:
            (busy, a), (free, b) = homes.items()
            return busy, free, _block(a), _block(b)
    raise AssertionError("no two shards")


@pytest.mark.parametrize("blocking", [False, True], ids=["fixed", "control-in-order"])
def test_a_put_writes_its_free_shards_while_another_process_holds_one(tmp_path, monkeypatch,
                                                                      blocking):
    path = str(tmp_path / "pool")
    be = open_shared(path, 64 * MiB, shards=4)
    try:
        busy, free, busy_items, free_items = _two_blocks_in_two_shards(be.n)
        if blocking:  # (the control: every shard waited for in turn)
            for s in be.shards:
                monkeypatch.setattr(s, "try_put_many", lambda items, cold=False, s=s: (
                    s.put_many(items, cold=cold), True)[1])
        be._turn = busy - 1  # (the busy shard is first in the put's order)
        holder = subprocess.Popen([sys.executable, "-c", HOLD,
                                   os.path.join(path, shard_name(busy))],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            put = threading.Thread(target=be.put_many, args=(busy_items + free_items,))
            put.start()
            deadline = time.monotonic() + 10
            while (not all(be.exists_many([k for k, _ in free_items]))
                   and time.monotonic() < deadline and not blocking):
                time.sleep(0.01)
            time.sleep(0.3 if blocking else 0.0)
            free_written = all(be.exists_many([k for k, _ in free_items]))
            busy_written = any(be.exists_many([k for k, _ in busy_items]))
            assert put.is_alive() and not busy_written  # (it waits for the held shard)
        finally:
            holder.communicate("\n", timeout=30)
        put.join(timeout=30)
        assert not put.is_alive()
        assert all(be.exists_many([k for k, _ in busy_items + free_items]))
        waited = be.shards[busy].writer_wait_seconds
        if blocking:
            assert not free_written
        else:
            assert free_written and waited > 0
            assert be.writer_wait_seconds == pytest.approx(waited)
    finally:
        be.close()
