"""The pool's GPU data path (``pool/worker/device.py``: pinned staging rings,
copy streams, events; the send thread's copy stream) exercised on CPU
against ``FakeDevice`` (``tests/gpu/fake_device.py``): a fake CUDA device
whose streams *queue* work and run it only when something waits for it - a
host ``synchronize``, or another stream's queued ``wait`` - so a copy that is
read before it ran, a ring slot written again while a queued copy still
reads it, or a stream that does not wait for the event it must, gives wrong
bytes here as it would on a GPU.
Each ordering test has a negative control: the same run with one wait
removed fails.

The real CUDA calls (``CudaOps``) are not run here (no GPU); the GPU check
(``tests/gpu/check_pool_pipeline.py``) runs them."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_layerwise_patch.pool.backends.base import pack, unpack
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.config import PoolConfig, PoolConfigError
from vllm_layerwise_patch.pool.worker import device as dv
from vllm_layerwise_patch.pool.worker.pipeline import LayerwisePipeline, LoadError
from vllm_layerwise_patch.pool.worker.send_thread import SaveQueue

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from fake_device import FakeDevice  # noqa: E402

NS = b"device-path-test"


class BrokenRing(dv.StagingRing):
    """Negative control: writes a slot without waiting for the copies that
    still read it."""

    def _wait(self, event) -> None:
        pass


# -- the staging ring -------------------------------------------------------------------

def test_ring_size_grows_to_the_need_within_the_limit():
    assert dv.ring_size(1, 1 << 30) == dv.MIN_RING
    assert dv.ring_size(dv.MIN_RING + 1, 1 << 30) == 2 * dv.MIN_RING
    assert dv.ring_size(3 << 20, 1 << 30) == 4 << 20
    assert dv.ring_size(3 << 20, 3 << 20) == 3 << 20  # the limit, not a power of two
    assert dv.ring_size(100 << 20, 8 << 20) == 8 << 20


def test_lane_ring_is_sized_from_the_step_kept_and_bounded():
    dev = FakeDevice()
    lane = dv.Lane(dev, 16 << 20)
    lane.begin(3 << 20)  # a layer of 3 MiB: room for it and the next
    assert lane.ring.capacity == 8 << 20 and dev.pinned_allocs == [8 << 20]
    buf = lane.ring.buf
    lane.begin(1 << 20)  # a smaller step reuses the ring: no new pinned memory
    assert lane.ring.buf is buf and dev.pinned_allocs == [8 << 20]
    lane.begin(100 << 20)  # larger than the share: capped
    assert lane.ring.capacity == 16 << 20 and lane.ring.grows == 2
    lanes = dv.DeviceLanes(dev, 64 << 20, 4)
    assert lanes.limit == 16 << 20
    assert dv.DeviceLanes(dev, 1 << 20, 32).limit == dv.MIN_RING
    # torch rounds pinned allocations up to a power of two: a share is one
    assert dv.DeviceLanes(dev, 256 << 20, 3).limit == 64 << 20


@pytest.mark.parametrize("ring", [dv.StagingRing, BrokenRing], ids=["ring", "broken-ring"])
def test_ring_slot_is_written_again_only_after_its_copies_ran(ring):
    # 24 payloads of 3 KiB through an 8 KiB ring, each copied to its own
    # destination on the (fake) copy stream, a fence every 2 payloads; the
    # copies run only when the ring waits for them or at the end.  Every
    # destination must hold its own payload; a ring that does not wait
    # (negative control) lets later payloads overwrite queued ones.
    dev = FakeDevice()
    stream = dev.new_stream()
    r = ring(dev, 8 << 10, stream)
    r.reserve(8 << 10)
    assert r.capacity == 8 << 10
    payloads = [torch.full((3 << 10,), i + 1, dtype=torch.uint8) for i in range(24)]
    dests = [torch.zeros(3 << 10, dtype=torch.uint8) for _ in payloads]
    with dev.using(stream):
        for i, (p, d) in enumerate(zip(payloads, dests)):
            slot = r.take(p.numel())
            slot.copy_(p)  # the host write
            dev.copy(d, slot)
            if i % 2:
                r.fence(dev.record(stream))
    r.quiesce()
    dev.run()
    same = [torch.equal(p, d) for p, d in zip(payloads, dests)]
    if ring is dv.StagingRing:
        assert all(same), same
        assert r.stalls > 0  # it did wait for queued copies
    else:
        assert not all(same)


def test_ring_fences_its_own_unfenced_copies_before_reusing_them():
    # One layer larger than the ring: the lane copies it in pieces and the
    # ring must fence (and wait for) copies queued since the last fence.
    dev = FakeDevice()
    lane = dv.Lane(dev, dv.MIN_RING)
    payload = torch.randint(0, 256, (5 * dv.MIN_RING // 2,), dtype=torch.uint8)
    dests = [torch.zeros_like(payload), torch.zeros_like(payload)]
    with lane.active():
        lane.begin(payload.numel())
        lane.fill(dests, memoryview(payload.numpy()))
    ev = lane.finish()
    dev.synchronize(ev)
    assert all(torch.equal(d, payload) for d in dests)
    assert lane.ring.capacity == dv.MIN_RING and lane.ring.stalls >= 1


# -- loads through the pipeline ---------------------------------------------------------

def _pool(tmp_path, layers=4, blocks=4, size=4096, seed=0):
    """A real LMDB pool holding a value per (layer, block 1 and 2); zeroed
    pages; the tasks loading each value into its block."""
    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    gen = torch.Generator().manual_seed(seed)
    caches = {f"model.layers.{i}.x": torch.zeros(blocks, size, dtype=torch.uint8)
              for i in range(layers)}
    tasks, expect = {}, {}
    for layer in caches:
        for b in (1, 2):
            key = f"{layer}/{b}".encode()
            data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
            be.put_many([(key, pack(NS, key, data.numpy().tobytes()))])
            tasks.setdefault(layer, []).append((key, [caches[layer][b]]))
            expect[(layer, b)] = data
    return be, caches, tasks, expect


def _forward(dev, pipe, caches, tasks, fence=True):
    """The forward as PoolWorker drives it: per layer wait_for_layer_load,
    the compute-start fence, then the layer's compute - a read of its pages,
    queued on the compute stream (what it sees is what the kernels would)."""
    seen = {}
    pipe.start(tasks)
    for layer in caches:
        pipe.wait(layer)
        if fence:
            pipe.record_compute_start(None)
        dev.enqueue("read", lambda n=layer: seen.__setitem__(n, caches[n].clone()),
                    dev.compute)
    return seen


def test_staged_loads_land_before_compute_reads_without_a_host_wait(tmp_path):
    be, caches, tasks, expect = _pool(tmp_path, size=48 << 10)
    dev = FakeDevice()
    pipe = LayerwisePipeline(list(caches), be, NS, prefetch=2, threads=2, device=dev,
                             staging_bytes=8 << 20)
    seen = _forward(dev, pipe, caches, tasks)
    pipe.drain()
    # the host handed each layer over without waiting for its copies: the
    # last layer's pages are not written yet, and the only host waits were a
    # ring's for its own slots (a lane that loaded a third layer this step)
    assert int(caches[list(caches)[-1]].sum()) == 0
    assert sum(dev.host_syncs.values()) == sum(lane.ring.stalls for lane in pipe.lanes.all)
    assert sum(kind == "wait" for kind, _, _ in dev.compute.ops) >= len(caches)
    dev.run(dev.compute)  # the device runs the forward
    for (layer, b), data in expect.items():
        assert torch.equal(seen[layer][b], data), (layer, b)
        assert int(seen[layer][0].sum()) == 0 and int(seen[layer][3].sum()) == 0
    assert pipe.bytes_loaded == len(expect) * (48 << 10)
    # each lane's ring: twice a layer (2 x 48 KiB), a power of two
    assert {lane.ring.capacity for lane in pipe.lanes.all} == {256 << 10}
    pipe.close()
    be.close()


@pytest.mark.parametrize("drop_waits", [False, True], ids=["waits", "no-waits"])
def test_compute_reads_loaded_pages_only_because_it_waits(tmp_path, drop_waits):
    # Negative control: a device whose streams ignore waits - the forward's
    # reads run before the copies and see zeros.
    be, caches, tasks, expect = _pool(tmp_path)
    dev = FakeDevice(drop_waits=drop_waits)
    pipe = LayerwisePipeline(list(caches), be, NS, device=dev, staging_bytes=1 << 20)
    seen = _forward(dev, pipe, caches, tasks)
    pipe.drain()
    dev.run(dev.compute)
    ok = all(torch.equal(seen[layer][b], data) for (layer, b), data in expect.items())
    assert ok is not drop_waits
    pipe.close()
    be.close()


@pytest.mark.parametrize("fence", [True, False], ids=["fence", "no-fence"])
def test_prefetched_copies_wait_for_the_compute_start_fence(tmp_path, fence):
    # Each layer's compute writes its own pages' block 0..3 (as a layer
    # using its KV does) - here: the previous occupant's bytes into the
    # pages a later layer loads, queued before the fence.  The device runs
    # the copies as early as it can (copy streams first): with the fence the
    # copies still land after that write; without it (negative control:
    # the forward never records it) the stale write wins for layers
    # prefetched after the step began.
    be, caches, tasks, expect = _pool(tmp_path, layers=6)
    dev = FakeDevice()
    pipe = LayerwisePipeline(list(caches), be, NS, prefetch=1, threads=1, device=dev,
                             staging_bytes=1 << 20)
    pipe.start(tasks)
    order = list(caches)
    for i, layer in enumerate(order):
        pipe.wait(layer)
        if i + 2 < len(order):  # compute of layer i still uses what layer i+2 will load into
            nxt = caches[order[i + 2]]
            dev.enqueue("stale", lambda t=nxt: t.fill_(0x5A), dev.compute)
        if fence:
            pipe.record_compute_start(None)
    pipe.drain()
    dev.run()  # copy streams first, then compute
    ok = [torch.equal(caches[layer][b], data) for (layer, b), data in expect.items()]
    if fence:
        assert all(ok), ok
    else:
        assert not all(ok)
    pipe.close()
    be.close()


def test_staged_path_is_byte_identical_to_the_host_path(tmp_path):
    # The same loads through the host path and the staged path: each value
    # fills two pages (block b and b + 2, as the bulk path's running column),
    # values of ~98 KiB through 64 KiB rings (copied in pieces, slots reused).
    be, caches, tasks, expect = _pool(tmp_path, blocks=5, size=100_000)
    host = {n: torch.zeros_like(t) for n, t in caches.items()}

    def both(pages):
        return {n: [(k, [pages[n][b], pages[n][b + 2]]) for k, b in
                    ((k, int(k.rsplit(b"/", 1)[1])) for k, _ in items)]
                for n, items in tasks.items()}

    p_host = LayerwisePipeline(list(caches), be, NS)
    p_host.load_all(both(host))
    dev = FakeDevice()
    p_dev = LayerwisePipeline(list(caches), be, NS, device=dev,
                              staging_bytes=2 * dv.MIN_RING, lanes=2)
    p_dev.load_all(both(caches))
    dev.run()
    for n in caches:
        assert torch.equal(caches[n], host[n]), n
        assert torch.equal(caches[n][3], expect[(n, 1)])
    assert p_dev.bytes_loaded == p_host.bytes_loaded == 4 * 2 * 2 * 100_000
    assert max(lane.ring.capacity for lane in p_dev.lanes.all) == dv.MIN_RING
    p_host.close()
    p_dev.close()
    be.close()


def test_failed_item_zeroes_its_pages_on_the_lane_and_the_host_waits(tmp_path):
    be, caches, tasks, expect = _pool(tmp_path, layers=2)
    order = list(caches)
    dev = FakeDevice()
    for layer in order:  # what a previous request left there, written by compute
        dev.enqueue("old", lambda t=caches[layer]: t.fill_(7), dev.compute)
    pipe = LayerwisePipeline(order, be, NS, device=dev, staging_bytes=1 << 20)
    bad = {order[0]: tasks[order[0]] + [(b"missing", [caches[order[0]][3]])],
           order[1]: tasks[order[1]]}
    pipe.start(bad, tolerate_errors=True)
    pipe.wait(order[0])
    # the failed layer: its copies and zeroing have run before wait returned
    assert int(caches[order[0]][3].sum()) == 0
    assert torch.equal(caches[order[0]][1], expect[(order[0], 1)])
    assert [(f[0], f[1]) for f in pipe.failures] == [(order[0], 2)]
    pipe.wait(order[1])  # a healthy layer: handed to the device, not waited for
    assert sum(dev.host_syncs.get(lane.stream.name, 0) for lane in pipe.lanes.all) == 1
    pipe.drain()
    dev.run()
    assert torch.equal(caches[order[1]][2], expect[(order[1], 2)])
    # strict mode raises, as on the host path
    pipe.start({order[0]: [(b"missing", [caches[order[0]][3]])]})
    with pytest.raises(LoadError, match="vanished"):
        pipe.wait(order[0])
    pipe.close()
    be.close()


# -- saves ------------------------------------------------------------------------------

@pytest.mark.parametrize("drop_waits", [False, True], ids=["waits", "no-waits"])
def test_saves_copy_after_the_layer_event_and_compute_never_waits(tmp_path, drop_waits):
    # The layer's compute (queued, not run) writes the pages it saves; the
    # send thread's stream must wait for the layer's event before copying.
    # Negative control: a device whose streams ignore waits saves the stale
    # bytes.
    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    dev = FakeDevice(drop_waits=drop_waits)
    q = SaveQueue(be, NS, device=dev)
    pages = torch.zeros(3, 70_000, dtype=torch.uint8)
    fresh = torch.randint(1, 256, (3, 70_000), dtype=torch.uint8)
    dev.enqueue("compute", lambda: pages.copy_(fresh), dev.compute)
    keys = [b"k/%d" % i for i in range(3)]
    q.submit(list(zip(keys, pages)), torch.device("cuda"))
    assert q.commit([b"m"]) is True
    assert not any(kind == "wait" for kind, _, _ in dev.compute.ops)  # compute never waits
    got = [bytes(unpack(k, v, NS, expected_length=70_000)) for k, v in
           zip(keys, be.get_many(keys))]
    same = [g == fresh[i].numpy().tobytes() for i, g in enumerate(got)]
    assert all(same) is not drop_waits
    assert be.exists_many([b"m"]) == [True]
    q.close()
    be.close()


def test_device_saves_equal_host_saves_byte_for_byte(tmp_path):
    # Same pages, same keys: the values the device path writes (pinned pack
    # memory, header from the copy) equal the host path's.
    pages = torch.randint(0, 256, (4, 33_333), dtype=torch.uint8)
    keys = [b"s/%d" % i for i in range(4)]
    out = {}
    for how in ("host", "device"):
        be = LmdbBackend(str(tmp_path / how), 64 << 20)
        dev = FakeDevice() if how == "device" else None
        q = SaveQueue(be, NS, device=dev)
        q.submit(list(zip(keys, pages[:2])), None if dev is None else torch.device("cuda"))
        q.submit(list(zip(keys[2:], pages[2:])), None if dev is None else torch.device("cuda"))
        assert q.commit([])
        out[how] = be.get_many(keys)
        q.close()
        be.close()
    assert out["host"] == out["device"] and all(v is not None for v in out["host"])


# -- configuration ----------------------------------------------------------------------

def test_pinned_staging_bytes_default_and_bounds():
    assert PoolConfig.from_extra(None).pinned_staging_bytes == 256 << 20
    assert PoolConfig.from_extra({"pinned_staging_bytes": "1GiB"}).pinned_staging_bytes == 1 << 30
    assert PoolConfig.from_extra({"pinned_staging_bytes": 0}).pinned_staging_bytes == 0
    assert PoolConfig.from_extra({"pinned_staging_bytes": "1MiB"}).pinned_staging_bytes == 1 << 20
    for bad in ("lots", -1, "512KiB", "65GiB", True, "4gb"):
        with pytest.raises(PoolConfigError,
                           match="kv_connector_extra_config.pinned_staging_bytes"):
            PoolConfig.from_extra({"pinned_staging_bytes": bad})


def test_host_pages_never_take_the_device_path(tmp_path):
    assert dv.device_ops(torch.device("cpu")) is None and dv.device_ops(None) is None
    be, caches, tasks, expect = _pool(tmp_path, layers=1)
    pipe = LayerwisePipeline(list(caches), be, NS, device=None, staging_bytes=256 << 20)
    assert pipe.lanes is None and pipe.ops is None
    pipe.load_all(tasks)
    assert all(torch.equal(caches[n][b], d) for (n, b), d in expect.items())
    pipe.close()
    be.close()


# -- the worker's wiring ----------------------------------------------------------------

def test_worker_builds_the_device_path_and_asynchronous_loads_use_its_lanes(tmp_path,
                                                                             monkeypatch):
    # PoolWorker over pages the fake device stands behind (device_ops is
    # what decides: CUDA pages get the ops, host pages None): the pipeline
    # gets lanes within pinned_staging_bytes, the send thread the ops, and an
    # asynchronous load goes through a lane and is done only once its copies
    # ran (the fake runs them when waited for).
    from vllm_layerwise_patch.pool.keys import ATTN, STATE, layer_id, page_key
    from vllm_layerwise_patch.pool.layout import PoolLayout
    from vllm_layerwise_patch.pool.metadata import LoadSpec, PoolMetadata
    from vllm_layerwise_patch.pool.worker import loads as loads_mod, saves as saves_mod
    from vllm_layerwise_patch.pool.worker.forward import PoolWorker

    fake = FakeDevice()
    monkeypatch.setattr(loads_mod, "device_ops", lambda device: fake)
    monkeypatch.setattr(saves_mod, "device_ops", lambda device: fake)
    layout = PoolLayout(kinds=("attn", "state"), block_size=4, hash_block_size=4,
                        group_layers=(("model.layers.0.x",), ("model.layers.1.x",)))
    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    worker = PoolWorker(vllm_config=None, layout=layout, namespace=NS, backend=be,
                        config=PoolConfig.from_extra({"load_async": True,
                                                      "pinned_staging_bytes": "4MiB"}))
    caches = {n: torch.zeros(8, 4096, dtype=torch.uint8) for n in layout.order}
    worker.pages.register(caches)
    worker.loads.open()
    worker.saves.open(reserve=False)
    pipe = worker.loads.pipeline
    assert pipe.ops is fake and pipe.lanes.limit == 1 << 20  # 4 MiB over 2 x 2 threads
    assert worker.saves.saver._ops is fake
    hashes = [b"a" * 8, b"b" * 8]
    gen = torch.Generator().manual_seed(3)
    want = {}
    for layer, kind, blocks in (("model.layers.0.x", ATTN, hashes),
                                ("model.layers.1.x", STATE, hashes[-1:])):
        for h in blocks:
            key = page_key(NS, kind, h, 0, layer_id(layer))
            want[key] = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
            be.put_many([(key, pack(NS, key, want[key].numpy().tobytes()))])
    spec = LoadSpec("r0", 0, 2, hashes, {0: [2, 3]}, {1: 5}, {})
    worker.async_loads.note(PoolMetadata([], [], async_loads=[spec]))
    worker.async_loads.start()
    done: set[str] = set()
    for _ in range(500):
        done, failed = worker.transfer_results()
        if done:
            break
        time.sleep(0.01)
    assert done == {"r0"} and not failed
    keys = list(want)
    assert torch.equal(caches["model.layers.0.x"][2], want[keys[0]])
    assert torch.equal(caches["model.layers.0.x"][3], want[keys[1]])
    assert torch.equal(caches["model.layers.1.x"][5], want[keys[2]])
    assert len(pipe.lanes.all) == 1 and pipe.lanes.all[0].ring.capacity > 0
    worker.close()
    be.close()
