"""Block objects on Mooncake (key format 5, :mod:`..backends.mooncake.objects`)
against a loopback ``mooncake_master`` and segment holder: a block's pages of
one kind on one rank are one object, its existence the commit; layers are
read as byte ranges in one get session (one master query per hit), or whole;
an incomplete block is never stored; a writer killed during its puts never
leaves a partial object that a lookup would take for a hit."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from vllm_layerwise_patch.mooncake_local import LocalMooncake, free_port
from vllm_layerwise_patch.pool.backends.base import HEADER_SIZE, pack, unpack
from vllm_layerwise_patch.pool.config import PoolConfig
from vllm_layerwise_patch.pool.keys import (ATTN, STATE, draft_marker_key, draft_page_key,
                                            marker_key, page_key)
from vllm_layerwise_patch.pool.worker.pipeline import LayerwisePipeline

NS = b"O" * 16
PAGE = 4096
LAYERS = [f"model.layers.{i}.attn" for i in range(6)]
STATES = [f"model.layers.{i}.linear_attn" for i in range(6, 8)]
DRAFT = ["mtp.layers.0.attn"]


class Layout(SimpleNamespace):
    def layers(self, kind):
        return tuple(LAYERS + DRAFT) if kind == ATTN else tuple(STATES)


LAYOUT = Layout(drafter_layers=frozenset(DRAFT), page_bytes=PAGE)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    lm = LocalMooncake(tmp_path_factory.mktemp("mooncake"), rpc_port=free_port(),
                       metrics_port=free_port(), holder=128 << 20,
                       holder_port=free_port()).start()
    yield lm
    lm.stop()


def backend(address, layout=True, **kw):
    from vllm_layerwise_patch.pool.backends.mooncake.backend import MooncakeBackend

    mc = {"master_address": address, "global_segment_size": 0,
          "local_buffer_size": "8MiB", **kw}
    be = MooncakeBackend(PoolConfig.from_extra({"backend": "mooncake",
                                                "mooncake": mc}).mooncake)
    if layout:
        be.set_layout(NS, LAYOUT)
    return be


def block(h: bytes, tp: int = 0, token: int = 7) -> list[tuple[bytes, bytes]]:
    """A block's pages of both kinds, the drafter's and their markers."""
    ids = [str(i) for i in range(6)]
    items = [(page_key(NS, ATTN, h, tp, i), bytes([int(i) + 1]) * PAGE) for i in ids]
    items += [(page_key(NS, STATE, h, tp, i), bytes([int(i) + 9]) * PAGE)
              for i in ("6", "7")]
    items += [(draft_page_key(NS, h, tp, "mtp.0", token), b"\x42" * PAGE)]
    items += [(marker_key(NS, ATTN, h, tp), b""), (marker_key(NS, STATE, h, tp), b""),
              (draft_marker_key(NS, h, tp, token), b"")]
    return [(k, pack(NS, k, v)) for k, v in items]


def test_a_block_is_one_object_read_whole_or_by_layer_ranges(cluster):
    be = backend(cluster.master_address)
    h = b"\x01" * 32
    be.put_many(block(h))
    assert be.calls["put_objects"] == 1  # three objects, one call
    names = be.conn.store  # the objects themselves: no per-layer keys, no markers
    base = f"{NS.hex()}/attn/{h.hex()}/tp0"
    assert names.batch_is_exist([base + "/B", base + "/B@7", base + "/L0", base + "/commit",
                                 f"{NS.hex()}/state/{h.hex()}/tp0/B"]) == [1, 1, 0, 0, 1]
    assert be.exists_many([marker_key(NS, ATTN, h, 0), marker_key(NS, STATE, h, 0),
                           draft_marker_key(NS, h, 0, 7), draft_marker_key(NS, h, 0, 8)]
                          ) == [True, True, True, False]
    # every slot at once (the lookup's verification): whole objects
    keys = [k for k, _ in block(h) if b"/commit" not in k]
    got = be.get_many(keys, [HEADER_SIZE + PAGE] * len(keys))
    assert [bytes(unpack(k, v, NS)) for k, v in zip(keys, got)] == \
        [bytes(unpack(k, v, NS)) for k, v in block(h)[:len(keys)]]
    assert be.calls["get_sessions"] == 0
    # layer by layer (the load pipeline): ranges, one session for the object
    for i in range(6):
        key = page_key(NS, ATTN, h, 0, str(i))
        v = be.get_many([key], [HEADER_SIZE + PAGE])[0]
        assert bytes(unpack(key, v, NS)) == bytes([i + 1]) * PAGE
    assert be.calls["get_sessions"] == 1 and be.calls["ranged_gets"] == 6
    assert not be.ranges.sessions  # every slot read: the session ended
    # a page of a block never stored: missing, never another block's bytes
    assert be.get_many([page_key(NS, ATTN, b"\x09" * 32, 0, "0")]) == [None]
    be.delete_groups([f"{NS.hex()}/attn/{h.hex()}/tp0".encode()])
    assert be.exists_many([marker_key(NS, ATTN, h, 0), draft_marker_key(NS, h, 0, 7),
                           marker_key(NS, STATE, h, 0)]) == [False, False, True]
    be.close()


def test_an_incomplete_block_is_not_stored(cluster):
    be = backend(cluster.master_address)
    h, g = b"\x02" * 32, b"\x12" * 32
    # the marker says every layer was saved, one page is not there
    be.put_many([kv for kv in block(h) if kv[0] != page_key(NS, ATTN, h, 0, "3")])
    # every page, no marker (a kind not saved completely this step)
    be.put_many([kv for kv in block(g) if kv[0] != marker_key(NS, STATE, g, 0)])
    assert be.exists_many([marker_key(NS, ATTN, h, 0), marker_key(NS, STATE, g, 0)]
                          ) == [False, False]
    # negative control: the other objects of those batches were complete
    assert be.exists_many([marker_key(NS, STATE, h, 0), marker_key(NS, ATTN, g, 0)]
                          ) == [True, True]
    be.close()


def test_old_format_entries_are_never_read_as_block_objects(cluster):
    # a build of key format 4 (per-layer objects and markers, no layout here)
    # under the same names: the block-object backend does not see them
    old = backend(cluster.master_address, layout=False)
    h = b"\x03" * 32
    old.put_many(block(h))
    assert old.exists_many([marker_key(NS, ATTN, h, 0)]) == [True]
    new = backend(cluster.master_address)
    assert new.exists_many([marker_key(NS, ATTN, h, 0)]) == [False]
    assert new.get_many([page_key(NS, ATTN, h, 0, "0")]) == [None]
    old.close()
    new.close()


@pytest.mark.parametrize("register, shm, own", [(True, False, False), (False, False, False),
                                               (False, True, False), (True, False, True)])
def test_the_pipeline_loads_layer_ranges_in_one_session(cluster, register, shm, own):
    # (a worker holding a segment reads whole objects into the pages; a
    # same-node client has no get sessions: it reads the step's objects whole
    # into a staging region once, and the layers copy from there)
    extra = {"client_address": cluster.holder_address} if shm else {}
    if own:
        extra["global_segment_size"] = "16MiB"
    be = backend(cluster.master_address, zero_copy_loads=True, **extra)
    if own:
        be.mount_segment()
    hashes = [bytes([0x40 + i]) * 32 for i in range(3)]
    for h in hashes:
        be.put_many(block(h))
    kv = torch.zeros(6 * 3 * PAGE, dtype=torch.uint8)
    pipe = LayerwisePipeline(LAYERS, be, NS, prefetch=2, threads=2)
    if register:
        assert pipe.register_memory([kv])
    pages = kv.view(6, 3, PAGE)
    pipe.start({LAYERS[i]: [(page_key(NS, ATTN, h, 0, str(i)), [pages[i, j]])
                            for j, h in enumerate(hashes)] for i in range(6)})
    for layer in LAYERS:
        pipe.wait(layer)
    assert all(bool((pages[i] == i + 1).all()) for i in range(6))
    if own or shm:
        assert be.calls["whole_gets"] == 1 and be.calls["ranged_gets"] == 0
    else:
        assert be.calls["get_sessions"] == 1 and be.calls["ranged_gets"] == 6
    pipe.close()
    be.close()


def _writer(address: str, first: int, ready) -> None:
    be = backend(address)
    ready.set()
    n = first
    while True:  # until killed, in the middle of some put
        be.put_many(block(n.to_bytes(32, "big")))
        n += 1


def test_a_writer_killed_mid_put_leaves_no_partial_object(cluster):
    # a block object is readable only once its put completed: whatever
    # exists after the writer was killed reads whole and sound
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_writer, args=(cluster.master_address, 1000, ready))
    proc.start()
    assert ready.wait(60)
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    be = backend(cluster.master_address)
    hashes = [n.to_bytes(32, "big") for n in range(1000, 100000)]
    found = be.exists_many([marker_key(NS, STATE, h, 0) for h in hashes[:5000]])
    stored = [h for h, f in zip(hashes, found) if f]
    assert stored, "the writer stored nothing in a second"
    last = hashes[len(stored)]  # the block it was writing: not a hit
    assert be.exists_many([marker_key(NS, STATE, last, 0)]) == [False]
    keys = [page_key(NS, STATE, h, 0, i) for h in stored for i in ("6", "7")]
    got = be.get_many(keys, [HEADER_SIZE + PAGE] * len(keys))
    assert all(v is not None for v in got)
    for k, v in zip(keys, got):
        unpack(k, v, NS)  # raises on a torn value
    be.close()


def test_the_hit_cache_holds_until_this_process_writes_or_the_cap(cluster):
    from vllm_layerwise_patch.pool.scheduler.hit_cache import HitCache

    now = [0.0]
    be = backend(cluster.master_address, hit_cache_seconds=2)
    other = backend(cluster.master_address)
    cache = HitCache(min(30.0, be.hit_cache_cap), 1000, clock=lambda: now[0])
    asked = []

    def present(keys):
        asked.append(len(keys))
        return be.exists_many(keys)

    h, g = b"\x05" * 32, b"\x06" * 32
    keys = [marker_key(NS, STATE, h, 0), marker_key(NS, STATE, g, 0)]
    be.put_many(block(h))
    assert cache.presence(keys, be.generation(), present) == [True, False]
    assert cache.presence(keys, be.generation(), present) == [True, False]
    assert asked == [2]  # the second answer came from the cache
    # this process stores: the cached miss is asked again
    be.put_many(block(g))
    assert cache.presence(keys, be.generation(), present) == [True, True]
    # this process removes: the cached hit is asked again
    be.delete_groups([f"{NS.hex()}/state/{h.hex()}/tp0".encode()])
    assert cache.presence(keys, be.generation(), present) == [False, True]
    # another client's store is not seen until the cap has passed (documented)
    other.put_many(block(h))
    assert cache.presence(keys, be.generation(), present) == [False, True]
    now[0] += 2.5
    assert cache.presence(keys, be.generation(), present) == [True, True]
    # no block objects (or a cap of 0): nothing is cached
    for off in (backend(cluster.master_address, layout=False),
                backend(cluster.master_address, hit_cache_seconds=0)):
        assert off.generation() is None
        off.close()
    other.close()
    # the master went away: a new epoch, nothing cached survives
    gen = be.generation()
    be.conn.mark_down("test")
    assert be.epoch == gen.epoch + 1
    be.close()


def test_a_holder_killed_mid_put_never_yields_a_partial_object(tmp_path):
    # the holder of every object dies while a writer puts block after block
    # (large objects: a put is in flight when it dies): whatever a lookup
    # still finds reads whole and sound, or its read fails (the load-failure
    # path) - never a value cut short or mixed
    import threading

    lm = LocalMooncake(tmp_path, rpc_port=free_port(), metrics_port=free_port(),
                       holder=256 << 20, holder_port=free_port()).start()
    big = Layout(drafter_layers=frozenset(), page_bytes=256 << 10)
    try:
        be = backend(lm.master_address, local_buffer_size="64MiB")
        be.set_layout(NS, big)
        stop, tried = threading.Event(), []

        def write() -> None:
            n = 0
            while not stop.is_set():
                h = (5000 + n).to_bytes(32, "big")
                tried.append(h)
                n += 1
                try:
                    items = [(page_key(NS, STATE, h, 0, i), bytes([n % 251]) * (256 << 10))
                             for i in ("6", "7")] + [(marker_key(NS, STATE, h, 0), b"")]
                    be.put_many([(k, pack(NS, k, v)) for k, v in items])
                except Exception:  # noqa: BLE001 - the holder is gone
                    pass

        t = threading.Thread(target=write)
        t.start()
        time.sleep(1.0)
        lm.kill("holder")
        time.sleep(0.5)
        stop.set()
        t.join(30)
        found = be.exists_many([marker_key(NS, STATE, h, 0) for h in tried])
        keys = [page_key(NS, STATE, h, 0, i) for h, f in zip(tried, found) if f
                for i in ("6", "7")]
        for k, v in zip(keys, be.get_many(keys)):
            if v is not None:
                unpack(k, v, NS)  # raises on a torn value
        assert len(tried) > 3
        be.close()
    finally:
        lm.stop()


def client(cluster, own: bool, shm: bool):
    """A reading client: one of its own (zero-copy ranges), one holding a
    segment (whole reads into the pages) or a same-node one (staging)."""
    extra = {"global_segment_size": "16MiB"} if own else {}
    if shm:
        extra["client_address"] = cluster.holder_address
    be = backend(cluster.master_address, zero_copy_loads=True, **extra)
    if own:
        be.mount_segment()
    return be


@pytest.mark.parametrize("own, shm", [(False, False), (True, False), (False, True)])
def test_a_damaged_slot_fails_its_load_and_the_others_load(cluster, own, shm):
    # one layer's value in a block object is damaged (a payload byte flipped
    # after its checksum was taken): that layer's load fails (its page is
    # zeroed, the request recomputes), the other layers load - by ranges or
    # by a whole-object read straight into the pages
    be = client(cluster, own, shm)
    h = bytes([0x60 + own + 2 * shm]) * 32
    items = block(h)
    bad = bytearray(items[2][1])
    bad[-1] ^= 1
    items[2] = (items[2][0], bytes(bad))
    be.put_many(items)
    kv = torch.full((6, PAGE), 0xEE, dtype=torch.uint8)
    pipe = LayerwisePipeline(LAYERS, be, NS, prefetch=2, threads=2)
    assert pipe.register_memory([kv]) is not shm
    pipe.start({LAYERS[i]: [(page_key(NS, ATTN, h, 0, str(i)), [kv[i]])] for i in range(6)},
               tolerate_errors=True)
    for layer in LAYERS:
        pipe.wait(layer)
    assert [f[0] for f in pipe.failures] == [LAYERS[2]]
    assert [bool((kv[i] == (0 if i == 2 else i + 1)).all()) for i in range(6)] == [True] * 6
    assert be.calls["whole_gets" if own or shm else "get_sessions"] == 1
    pipe.close()
    be.close()


@pytest.mark.parametrize("own, shm", [(False, False), (True, False), (False, True)])
def test_an_object_gone_before_its_load_fails_only_its_pages(cluster, own, shm):
    # one of a step's two block objects is gone between the lookup and the
    # load (evicted, say): every layer's page of that block fails (zeroed,
    # the request recomputes), the other block loads - by ranges, by a
    # whole read straight into the pages, or through the staging buffer
    be = client(cluster, own, shm)
    hashes = [bytes([0x70 + own + 2 * shm + 4 * j]) * 32 for j in range(2)]
    for h in hashes:
        be.put_many(block(h))
    be.delete([page_key(NS, ATTN, hashes[1], 0, "0")])  # (the whole object)
    kv = torch.full((6, 2, PAGE), 0xEE, dtype=torch.uint8)
    pipe = LayerwisePipeline(LAYERS, be, NS, prefetch=2, threads=2)
    assert pipe.register_memory([kv]) is not shm
    pipe.start({LAYERS[i]: [(page_key(NS, ATTN, h, 0, str(i)), [kv[i, j]])
                            for j, h in enumerate(hashes)] for i in range(6)},
               tolerate_errors=True)
    for layer in LAYERS:
        pipe.wait(layer)
    assert sorted(f[:2] for f in pipe.failures) == [(layer, 1) for layer in LAYERS]
    assert all(bool((kv[i, 0] == i + 1).all()) and bool((kv[i, 1] == 0).all())
               for i in range(6))
    pipe.close()
    be.close()
