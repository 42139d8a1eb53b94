"""Loads from the Mooncake backend through the real LayerwisePipeline, against
a loopback ``mooncake_master`` and segment holder: zero-copy loads into
registered host pages (a client of its own), the staging path (a same-node
client), and the rule that a page whose value fails its check is never
served - its load fails and the request recomputes."""

from __future__ import annotations

import pytest
import torch

from vllm_layerwise_patch.mooncake_local import LocalMooncake, free_port
from vllm_layerwise_patch.pool.backends.base import HEADER_SIZE, pack
from vllm_layerwise_patch.pool.config import PoolConfig
from vllm_layerwise_patch.pool.worker.pipeline import LayerwisePipeline, LoadError

NS = b"N" * 16
PAGE = 4096


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    lm = LocalMooncake(tmp_path_factory.mktemp("mooncake"), rpc_port=free_port(),
                       metrics_port=free_port(), holder=64 << 20,
                       holder_port=free_port()).start()
    yield lm
    lm.stop()


def backend(cluster, shm: bool, **kw):
    from vllm_layerwise_patch.pool.backends.mooncake.backend import MooncakeBackend

    mc = {"master_address": cluster.master_address, "global_segment_size": 0,
          "local_buffer_size": "8MiB", "zero_copy_loads": True, **kw}  # opt-in
    if shm:
        mc["client_address"] = cluster.holder_address
    return MooncakeBackend(PoolConfig.from_extra({"backend": "mooncake",
                                                  "mooncake": mc}).mooncake)


def values(tag: str) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """Keys, payloads and stored values: 0 sound, 1 a flipped payload byte
    (checksum), 2 another namespace, 3 a value of another size, 4 a sound
    value of another key (key 0's), 5 missing."""
    keys = [f"{tag}/g{i}/L0".encode() for i in range(6)]
    payloads = [bytes([i + 1]) * PAGE for i in range(6)]
    stored = [pack(NS, keys[0], payloads[0]), bytearray(pack(NS, keys[1], payloads[1])),
              pack(b"X" * 16, keys[2], payloads[2]), pack(NS, keys[3], payloads[3] + b"!"),
              pack(NS, keys[0], payloads[4])]
    stored[1][HEADER_SIZE + 7] ^= 0xFF
    return keys, payloads, [bytes(v) for v in stored]


@pytest.mark.parametrize("shm", [False, True], ids=["own-client", "same-node-shm"])
@pytest.mark.parametrize("register", [True, False], ids=["registered", "unregistered"])
def test_only_sound_pages_are_served(cluster, shm, register):
    be = backend(cluster, shm)
    keys, payloads, stored = values(f"sound-{shm}-{register}")
    be.put_many(list(zip(keys, stored)))
    pages = torch.full((6, PAGE), 0xEE, dtype=torch.uint8)
    pipe = LayerwisePipeline(["L0"], be, NS, threads=1, check_crc=True)
    # zero-copy needs the pages registered; a same-node client cannot register them
    if register:
        assert pipe.register_memory([pages]) == (not shm)
    pipe.load_all({"L0": [(k, [pages[i]]) for i, k in enumerate(keys)]},
                  tolerate_errors=True)
    assert bytes(pages[0].numpy()) == payloads[0]
    failed = sorted(i for _, i, _, _ in pipe.failures)
    assert failed == [1, 2, 3, 4, 5]
    assert not pages[1:].any()  # failed pages are zeroed, never half-served
    # without tolerance a failed page raises: the forward must not run on it
    with pytest.raises((LoadError, ValueError)):
        pipe.load_all({"L0": [(keys[1], [pages[1]])]})
    pipe.close()
    be.close()


def test_zero_copy_writes_the_page_before_the_check_so_the_check_decides(cluster):
    """Negative control: a direct read does put a corrupted payload into the
    page; only the check (and the failure path behind it) keeps it from use."""
    be = backend(cluster, shm=False)
    keys, payloads, stored = values("control")
    be.put_many(list(zip(keys, stored)))
    pages = torch.zeros((2, PAGE), dtype=torch.uint8)
    assert be.register_memory(pages.data_ptr(), pages.numel())
    heads = be.read_direct(keys[:2], [pages[0].data_ptr(), pages[1].data_ptr()], [PAGE] * 2)
    assert [len(h) for h in heads] == [HEADER_SIZE] * 2
    assert bytes(pages[1].numpy()) == bytes(stored[1][HEADER_SIZE:]) != payloads[1]
    # memory the backend was not given falls back to the staging path
    other = torch.zeros(PAGE, dtype=torch.uint8)
    assert be.read_direct(keys[:1], [other.data_ptr()], [PAGE]) is None
    be.close()
    # zero_copy_loads=false (the default) registers nothing
    assert PoolConfig.from_extra({"backend": "mooncake", "mooncake": {
        "master_address": cluster.master_address}}).mooncake.zero_copy_loads is False
    be = backend(cluster, shm=False, zero_copy_loads=False)
    assert not be.register_memory(pages.data_ptr(), pages.numel())
    assert be.read_direct(keys[:1], [pages[0].data_ptr()], [PAGE]) is None
    be.close()


def test_several_destinations_take_the_staging_path(cluster):
    """A key filling two pages (a shared prefix, the running mamba column)
    is read once into staging and copied into both."""
    be = backend(cluster, shm=False)
    keys, payloads, stored = values("multi")
    be.put_many(list(zip(keys[:1], stored[:1])))
    pages = torch.zeros((2, PAGE), dtype=torch.uint8)
    pipe = LayerwisePipeline(["L0"], be, NS, threads=1)
    assert pipe.register_memory([pages])
    pipe.load_all({"L0": [(keys[0], [pages[0], pages[1]])]})
    assert bytes(pages[0].numpy()) == bytes(pages[1].numpy()) == payloads[0]
    pipe.close()
    be.close()
