"""Mooncake block objects (:mod:`..backends.mooncake.objects`) against a
loopback ``mooncake_master`` and segment holder: a same-node client reads a
step's objects whole, a staging region at a time (never per object and
layer); a put that fails with a transfer error (-800, by fault injection:
``mooncake_put_transfer_fails``) is retried once, and given up and counted
(``put_skipped``) when it fails again - that step's save fails."""

from __future__ import annotations

import pytest
import torch

from test_pool_mooncake_objects import LAYERS, NS, PAGE, backend, block
from test_pool_mooncake_objects import cluster  # noqa: F401 - the module's own master and holder
from vllm_layerwise_patch.pool.backends.base import BackendError, unpack
from vllm_layerwise_patch.pool.keys import ATTN, marker_key, page_key
from vllm_layerwise_patch.pool.worker.pipeline import LayerwisePipeline
from vllm_layerwise_patch.pool.worker.send_thread import SaveQueue


def test_a_same_node_step_larger_than_a_region_is_read_whole_in_batches(cluster):
    # a same-node client (no get sessions): a step's objects that do not fit
    # one staging region (1 MiB buffer: 256 KiB regions, 24 objects of
    # ~25 KiB) are read whole a region at a time - a few master queries,
    # never one per object and layer (get_into_ranges)
    be = backend(cluster.master_address, client_address=cluster.holder_address,
                 local_buffer_size="1MiB")
    hashes = [bytes([0x80 + i]) * 32 for i in range(24)]
    for h in hashes:
        be.put_many(block(h))
    kv = torch.zeros(6 * len(hashes) * PAGE, dtype=torch.uint8)
    pages = kv.view(6, len(hashes), PAGE)
    pipe = LayerwisePipeline(LAYERS, be, NS, prefetch=2, threads=2)
    before = cluster_requests(cluster)
    pipe.load_all({LAYERS[i]: [(page_key(NS, ATTN, h, 0, str(i)), [pages[i, j]])
                               for j, h in enumerate(hashes)] for i in range(6)})
    asked = cluster_requests(cluster) - before
    assert all(bool((pages[i] == i + 1).all()) for i in range(6))
    assert 3 <= be.calls["whole_gets"] <= 4 and be.calls["ranged_gets"] == 0
    assert asked <= 8, asked  # negative control below: 144 the per-layer way
    be.close()
    ranged = backend(cluster.master_address, client_address=cluster.holder_address,
                     local_buffer_size="1MiB")
    before = cluster_requests(cluster)
    keys = [page_key(NS, ATTN, h, 0, "0") for h in hashes]
    got = ranged.get_many(keys)
    assert all(bytes(unpack(k, v, NS)) == b"\x01" * PAGE for k, v in zip(keys, got))
    assert cluster_requests(cluster) - before >= len(hashes)  # (no plan: one per object)
    ranged.close()


def cluster_requests(cluster) -> float:
    """Requests the master has served (its metrics)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("master_") and "_requests_total" in line.split()[0]
               and "ping" not in line)


def _save_step(be, h: bytes) -> tuple[bool, SaveQueue]:
    """One step's save of a block's attention pages through the send thread."""
    q = SaveQueue(be, NS)
    for i in range(6):
        q.submit([(page_key(NS, ATTN, h, 0, str(i)), torch.full((PAGE,), i + 1,
                                                                 dtype=torch.uint8))])
    ok = q.commit([marker_key(NS, ATTN, h, 0)], blocks=1)
    q.close()
    return ok, q


@pytest.mark.parametrize("fails", [0, 1, 2])
def test_a_put_failing_with_a_transfer_error_is_retried_once(cluster, monkeypatch, fails):
    # fault injection: the process's first `fails` block-object puts report
    # -800 (TRANSFER_FAIL) without writing; one failure is retried and the
    # object stored, two give the object up: counted, the step's save fails
    from vllm_layerwise_patch.envvars import TEST_FAULTS_ENV

    monkeypatch.setenv(TEST_FAULTS_ENV, f'{{"mooncake_put_transfer_fails": {fails}}}')
    be = backend(cluster.master_address)
    h = bytes([0xA0 + fails]) * 32
    ok, q = _save_step(be, h)
    stored = be.exists_many([marker_key(NS, ATTN, h, 0)]) == [True]
    assert (ok, stored, be.put_skipped, q.failures) == (
        (True, True, 0, 0) if fails < 2 else (False, False, 1, 1))
    assert be.calls["put_objects"] == 1 + (fails > 0)
    if fails == 2:  # the next step's put is not affected
        ok, _ = _save_step(be, h)
        assert ok and be.exists_many([marker_key(NS, ATTN, h, 0)]) == [True]
    else:
        key = page_key(NS, ATTN, h, 0, "3")
        assert bytes(unpack(key, be.get_many([key])[0], NS)) == b"\x04" * PAGE
    be.close()


def test_an_object_that_fails_otherwise_is_not_retried(cluster, monkeypatch):
    # negative control: a put rejected for another reason (no space) is not
    # retried and not counted as given up
    be = backend(cluster.master_address)
    h = b"\xb0" * 32

    def no_space(_store, names, *_a):
        return [-200] * len(names)

    monkeypatch.setattr(be.writes, "_put_batch", no_space)
    with pytest.raises(BackendError):
        be.put_many(block(h))
    assert be.put_skipped == 0 and be.calls["put_objects"] == 1
    be.close()
