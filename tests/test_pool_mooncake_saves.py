"""Saves of Mooncake block objects (:mod:`..backends.mooncake.objects`)
against a loopback ``mooncake_master`` and segment holder: with
``zero_copy_saves`` a client of its own puts each slot straight from the
save path's pack memory (:class:`..saving.PackArena`, registered chunk by
chunk), with the slot's padding zeroed there; a same-node client, or the
field off, copies into the staging buffer first.  Either way the stored
object is byte for byte the same."""

from __future__ import annotations

import threading

import pytest
import torch

from test_pool_mooncake_objects import LAYERS, NS, PAGE, STATES, backend
from test_pool_mooncake_objects import cluster  # noqa: F401 - the module's own master and holder
from vllm_layerwise_patch.pool.backends.base import HEADER_SIZE, header
from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key, page_key
from vllm_layerwise_patch.pool.worker.send_thread import SaveQueue

SLOT = (HEADER_SIZE + PAGE + 63) & ~63


def save(saver: SaveQueue, h: bytes) -> dict:
    """One step's save of block ``h`` (every layer of both kinds, random
    pages); its pages by (kind, layer)."""
    gen = torch.Generator().manual_seed(h[0])
    pages = {(kind, name): torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=gen)
             for kind, names in ((ATTN, LAYERS), (STATE, STATES)) for name in names}
    for (kind, name), page in pages.items():
        saver.submit([(page_key(NS, kind, h, 0, name.split(".")[2]), page)])
    assert saver.commit([marker_key(NS, ATTN, h, 0), marker_key(NS, STATE, h, 0)], blocks=1)
    return pages


@pytest.mark.parametrize("zero_copy, shm", [(True, False), (False, False), (True, True)])
def test_a_saved_object_is_the_same_whether_put_from_the_pack_memory_or_staged(
        cluster, zero_copy, shm):
    extra = {"client_address": cluster.holder_address} if shm else {}
    be = backend(cluster.master_address, zero_copy_saves=zero_copy, **extra)
    saver = SaveQueue(be, NS)
    saver.reserve()
    saver._arena._chunks[0].fill_(0xFF)  # (what an earlier step may leave in the padding)
    h = bytes([0xA0 + 2 * zero_copy + shm]) * 32
    pages = save(saver, h)
    direct = zero_copy and not shm
    assert be.calls["slots_from_pack"] == (len(pages) if direct else 0)
    for kind, names in ((ATTN, LAYERS), (STATE, STATES)):
        raw = be.conn.store.get(f"{NS.hex()}/{kind}/{h.hex()}/tp0/B")
        assert len(raw) == len(names) * SLOT
        for i, name in enumerate(names):
            page = pages[(kind, name)].numpy().tobytes()
            slot = raw[i * SLOT:(i + 1) * SLOT]
            key = page_key(NS, kind, h, 0, name.split(".")[2])
            assert slot[:HEADER_SIZE] == header(NS, key, page)  # (naming its key)
            assert slot[HEADER_SIZE:HEADER_SIZE + PAGE] == page
            assert slot[HEADER_SIZE + PAGE:] == bytes(SLOT - HEADER_SIZE - PAGE)  # zeroed
    saver.close()
    be.close()


def test_pack_memory_is_offered_without_waiting_and_registered_by_the_next_put(cluster):
    # a connect attempt in the background holds the connection (here the
    # test holds its lock): the pack memory offered meanwhile (by the
    # forward thread on CPU) is taken at once, and a put made meanwhile goes
    # through the staging buffer; the next put registers it and puts from it
    be = backend(cluster.master_address)
    saver = SaveQueue(be, NS)
    with be.conn.lock:
        offered = threading.Event()
        threading.Thread(target=lambda: (saver.reserve(), offered.set()), daemon=True).start()
        assert offered.wait(5), "offering the pack memory waited for the connection"
        save(saver, b"\xb0" * 32)
        assert be.calls["slots_from_pack"] == 0
    pages = save(saver, b"\xb1" * 32)
    assert be.calls["slots_from_pack"] == len(pages)
    saver.close()
    be.close()
